"""What one optimizer step of an attempt is: its geometry (sequences, micro batches, the schedule's
and the attempt's last steps) and the FLOPs and peak every MFU figure of it divides by.

Both are fixed before the first step (`_setup` and `_conventions` of runner.training.loop); the loop,
the run folder's records and the in-loop evaluation read them. Torch-free.
"""

from __future__ import annotations

from dataclasses import dataclass

from runner.planning.hardware import Peak


@dataclass
class StepPlan:
    global_batch: int  # sequences per optimizer step, all ranks
    seq_len: int
    micro: int  # sequences per forward/backward on one rank
    accum: int  # micro steps per optimizer step on one rank
    schedule_steps: int  # the learning-rate schedule's length (the exposure budget's steps)
    warmup_steps: int
    natural_end: int  # the run's last step; end_step may stop short (--max-steps, a hard stop)
    end_step: int

    @property
    def tokens(self) -> int:
        """Tokens per optimizer step, all ranks."""
        return self.global_batch * self.seq_len


@dataclass
class FlopsBasis:
    """The numerator's FLOPs per token (MFU: recomputation never counted; HFU: counted, or None
    without activation checkpointing) and the peak of one device, the denominator."""

    flops_per_token: float
    hfu_flops_per_token: float | None
    peak: Peak

    @property
    def peak_tflops(self) -> float:
        return self.peak.peak_tflops
