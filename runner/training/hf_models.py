"""transformers' model modules as the trainer imports them: the one door through which runner.training
loads transformers' Llama and OLMoE (runner.training.model, runner.training.moe.olmoe).

Owns what loading them costs before a launch's first step. transformers' object-detection losses,
which every model module imports through `transformers.loss.loss_utils`, import `scipy.optimize` at
module level when scipy is installed (0.3 s and about 320 modules on a CPU here, more on a fresh
host) for a Hungarian matcher no runner model has; while this module loads them, transformers'
scipy probe reads False, and the real probe is back before anything else runs. A transformers
module first imported inside that window keeps the False it bound (`from ..utils import
is_scipy_available`): in practice the detection losses, so their Hungarian matcher is missing in a
trainer's process, which no runner model calls; every module imported later, and the runner's own
scipy users (a forecast's fit), see scipy as it is.
tests/training/test_launch_imports.py holds the launch's imports to this.
Never: builds, configures or patches a model (runner.training.model does).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import transformers.utils as hf_utils


@contextlib.contextmanager
def _detection_losses_without_scipy() -> Iterator[None]:
    probe = hf_utils.is_scipy_available
    hf_utils.is_scipy_available = lambda: False
    try:
        yield
    finally:
        hf_utils.is_scipy_available = probe


with _detection_losses_without_scipy():
    from transformers import LlamaConfig, LlamaForCausalLM, OlmoeConfig, OlmoeForCausalLM, masking_utils
    from transformers.models.llama import modeling_llama
    from transformers.models.olmoe import modeling_olmoe

__all__ = [
    "LlamaConfig",
    "LlamaForCausalLM",
    "OlmoeConfig",
    "OlmoeForCausalLM",
    "masking_utils",
    "modeling_llama",
    "modeling_olmoe",
]
