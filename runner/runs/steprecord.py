"""The record of one committed step, as the loop hands it to the callbacks (typed, like run.json).

`StepRecord.as_row()` is the line metrics/train.jsonl holds, key for key and in order (the report and
the audit read those lines); a callback reads the fields by name. Never computes a figure: the loop
fills it (runner.training.loop._metrics_record).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class StepRecord:
    step: int  #: committed steps so far (this step included)
    loss: float
    lr: float
    grad_norm: float
    step_seconds: float  #: the device's clock for this step
    data_wait_seconds: float  #: this attempt's time waiting for batches so far
    wall_seconds: float  #: the run clock's wall time so far
    devices: int  #: the world size that ran the step
    tokens_processed: int
    tokens_useful: int
    tokens_per_second: float
    tokens_per_second_useful: float
    mfu: float
    goodput_mfu: float
    exposure_tokens: int  #: the ledger's exposure after the step
    hfu: float | None = None  #: None when the run recomputes no activations (HFU = MFU): not written
    #: the step's further figures, by name (a mixture of experts' router figures, Options.step_figures'):
    #: train.jsonl's last keys, and each logged to MLflow at the step (runner.training.callbacks)
    figures: dict[str, float] = field(default_factory=dict)

    def as_row(self) -> dict[str, Any]:
        """metrics/train.jsonl's line: the fields in order, `hfu` only when measured, the figures last."""
        row = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name not in ("hfu", "figures")}
        if self.hfu is not None:
            row["hfu"] = self.hfu
        return row | self.figures
