"""Kill+resume identity (`runner smoke`): the resumed run's final weights against the uninterrupted run's.

Owns the comparison and the tolerance it states. On a CPU the two runs take the same kernels in the
same reduction order: the weights must be bit-identical, and any difference is a resume bug. On a GPU
(cuda, rocm) reductions whose order varies from run to run (atomics in the embedding's and
attention's backward, split-K matmuls, kernels that compile autotunes) change gradients in their last
bits, and training carries that forward; there the comparison allows a relative difference per tensor
of GPU_RELATIVE_TOLERANCE (||resumed - uninterrupted||_2 / ||uninterrupted||_2, the largest over
tensors). That bound is far above such noise (last-bit changes of fp32 gradients, ~1e-7 relative) and
far below what a resume bug leaves: one AdamW step missed or taken twice moves every weight by about
the learning rate (~1e-4 to 1e-3 against weights of ~0.02: 5e-3 and more). Unproven on a GPU so far.
Never moves a tensor onto a device (safetensors read to CPU memory).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file

from runner.fsio import sha256_file

GPU_RELATIVE_TOLERANCE = 1e-3  #: the largest ||a - b|| / ||a|| per tensor a GPU's kill+resume may leave


@dataclass(frozen=True)
class WeightIdentity:
    """How close a resumed run's final weights are to the uninterrupted run's."""

    device_type: str  # cpu | cuda | rocm: the accelerator both runs trained on
    bit_identical: bool
    max_relative_difference: float  # over tensors; inf when a tensor is missing or of another shape
    worst_tensor: str | None
    tolerance: float  # 0.0 on a CPU: bit-identical required

    @property
    def ok(self) -> bool:
        return self.bit_identical or (self.tolerance > 0 and self.max_relative_difference <= self.tolerance)

    def describe(self) -> str:
        """One phrase for the smoke's output: the verdict and the rule it was judged by."""
        rule = (
            f"allowed {self.tolerance:.0e} relative per tensor on {self.device_type}: GPU reductions are not "
            "bit-reproducible"
            if self.tolerance > 0
            else f"bit-identical required on {self.device_type}"
        )
        if self.bit_identical:
            return f"bit-identical ({rule})"
        verdict = "within tolerance" if self.ok else "DIFFERENT"
        return f"{verdict}: max relative difference {self.max_relative_difference:.2e} in {self.worst_tensor} ({rule})"


def tolerance_for(device_type: str) -> float:
    """0 (bit-identical) on a CPU; GPU_RELATIVE_TOLERANCE on a GPU."""
    return 0.0 if device_type == "cpu" else GPU_RELATIVE_TOLERANCE


def compare_weights(uninterrupted: Path, resumed: Path, device_type: str) -> WeightIdentity:
    """Compare two model.safetensors files under the rule for `device_type`; a missing file is DIFFERENT."""
    tolerance = tolerance_for(device_type)
    if not (uninterrupted.exists() and resumed.exists()):
        missing = uninterrupted if not uninterrupted.exists() else resumed
        return WeightIdentity(device_type, False, math.inf, f"{missing} (missing)", tolerance)
    if sha256_file(uninterrupted) == sha256_file(resumed):
        return WeightIdentity(device_type, True, 0.0, None, tolerance)
    a, b = load_file(str(uninterrupted)), load_file(str(resumed))
    worst, worst_name = 0.0, None
    for name in sorted(a.keys() | b.keys()):
        if name not in a or name not in b or a[name].shape != b[name].shape:
            return WeightIdentity(device_type, False, math.inf, name, tolerance)
        x, y = a[name].double(), b[name].double()
        norm = torch.linalg.vector_norm(x).item()
        diff = torch.linalg.vector_norm(x - y).item()
        rel = diff / norm if norm > 0 else (0.0 if diff == 0 else math.inf)
        if not math.isfinite(rel) or rel > worst:
            worst, worst_name = rel, name
    return WeightIdentity(device_type, False, worst, worst_name, tolerance)
