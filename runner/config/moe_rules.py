"""The DeepSeek-style keys of a mixture-of-experts model recipe: how they combine.

Owns: the rules of `model.moe`'s router, balancing, shared-expert, dense-layer, hash-layer and clip
keys (ranges, and the combinations that cannot run), each broken rule one problem naming its key.
Called by runner.config.schema's `MoeSection.validate` and `ModelRecipe` (kept beside it so the
schema stays a list of fields). Imports nothing but the standard library and runner.errors.
"""

from __future__ import annotations

import math
from typing import Any

from runner.errors import Problems, join_key

#: the schema's default of bias_update_rate (DeepSeek-V3's gamma), restated only to tell "set" from "left"
DEFAULT_BIAS_UPDATE_RATE = 0.001


def _positive_finite(value: Any) -> bool:
    return not isinstance(value, bool) and isinstance(value, (int, float)) and math.isfinite(value) and value > 0


def validate_deepseek_keys(moe: Any, problems: Problems, file: Any, prefix: str) -> None:
    """The keys of one `moe` section on their own (MoeSection)."""

    def bad(key: str, message: str) -> None:
        problems.add(file, join_key(prefix, key), message)

    if not _positive_finite(moe.bias_update_rate):
        bad("bias_update_rate", f"must be a finite number > 0, got {moe.bias_update_rate}")
    elif moe.balancing != "aux_free" and moe.bias_update_rate != DEFAULT_BIAS_UPDATE_RATE:
        bad("bias_update_rate", f"applies only with balancing: aux_free (this recipe balances by {moe.balancing})")
    if moe.balancing == "aux_free" and moe.router_aux_loss_coef > 0:
        bad(
            "router_aux_loss_coef",
            f"balancing aux_free balances without the auxiliary loss: set router_aux_loss_coef: 0, not "
            f"{moe.router_aux_loss_coef} (or balancing: aux_loss)",
        )
    for key in ("shared_experts", "first_dense_layers", "hash_layers"):
        if getattr(moe, key) < 0:
            bad(key, f"must be an integer >= 0, got {getattr(moe, key)}")
    size = moe.shared_expert_intermediate_size
    if size is not None:
        if size < 1:
            bad("shared_expert_intermediate_size", f"must be >= 1, got {size}")
        elif moe.shared_experts == 0:
            bad("shared_expert_intermediate_size", "set, but shared_experts is 0: there is no shared expert to size")
    if not _positive_finite(moe.routed_scaling_factor):
        bad("routed_scaling_factor", f"must be a finite number > 0, got {moe.routed_scaling_factor}")
    if moe.swiglu_limit is not None and not _positive_finite(moe.swiglu_limit):
        bad("swiglu_limit", f"must be a finite number > 0 or null (no clip), got {moe.swiglu_limit}")


def validate_moe_layers(model: Any, problems: Problems, file: Any, prefix: str) -> None:
    """The layer counts of `model.moe` against the model's `n_layers` (ModelRecipe, arch olmoe)."""
    moe = model.moe
    key = join_key(prefix, "moe")
    if moe.first_dense_layers >= model.n_layers >= 1:
        problems.add(
            file,
            join_key(key, "first_dense_layers"),
            f"{moe.first_dense_layers} dense first layers leave no mixture-of-experts layer of n_layers {model.n_layers}",
        )
        return
    moe_layers = model.n_layers - moe.first_dense_layers
    if moe.hash_layers > moe_layers:
        problems.add(
            file,
            join_key(key, "hash_layers"),
            f"{moe.hash_layers} hash-routed layers but only {moe_layers} mixture-of-experts layers "
            f"(n_layers {model.n_layers} - first_dense_layers {moe.first_dense_layers})",
        )
