"""What an audit reads (`AuditInput`: the report tables, the saved experiment, run.json, the manifests, the
tables rebuilt from a run folder) and the sampler's recount of the committed steps (`Replay`).

Their own module so that the audit's parts (audit_tracked, audit_eval, evidence) name what they are
handed without importing runner.reports.audit.run, which imports them. Plain records: reading them is
runner.reports.audit.run's `load_input` and `replay_input`.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd

from runner.config.load import Experiment
from runner.config.schema import ExperimentSchema
from runner.runs.runjson import RunJson, as_record


@dataclass
class AuditInput:
    """What an audit reads: the report tables and the inputs needed to recount them."""

    source: str
    tables: dict[str, pd.DataFrame]
    cfg: dict  # experiment.yaml as read (plain data, for the report builder's helpers)
    run: dict  # run.json as read ({} when the report has none); `record` is it typed
    manifests: dict[str, dict]
    exp: Experiment  # the Experiment experiment.yaml resolves to (typed config, recomputed fingerprint)
    rebuilt: dict[str, pd.DataFrame] | None = None  # tables rebuilt from a run folder's raw files
    report_dir: Path | None = None  # the report folder the tables were read from (holds the CSV copies)
    run_dir: Path | None = None  # the run folder, when the audit can see it (checkpoints, fingerprint.txt)
    cfg_file: Path | None = None  # the experiment.yaml the tables go with
    rebuild_error: str = ""  # why the run folder next to the report could not be rebuilt

    @property
    def config(self) -> ExperimentSchema:
        return self.exp.config

    @property
    def has_run_json(self) -> bool:
        return bool(self.run)

    @functools.cached_property
    def record(self) -> RunJson:
        """run.json typed (runner.runs.runjson: the older formats' defaults); empty when there is none."""
        return as_record(self.run) if self.run else RunJson()

    def steps(self) -> int:
        """Committed steps: run.json's record when there is one, else the summary's own claim."""
        if self.record.has("committed_steps"):
            return int(self.record.committed_steps)
        return int(self.tables["run_summary"].iloc[0]["steps"])


@dataclass
class Replay:
    """Recount of the committed steps from the sampler alone."""

    domains: list[str]
    exposure_samples: dict[str, int]
    seen: dict[str, np.ndarray]  # times each sample was drawn
    mixture_violations: list[str]  # invariant 5 at every step
    # committed step -> {domain: (samples drawn, distinct samples drawn)} at the steps asked for
    snapshots: dict[int, dict[str, tuple[int, int]]]

    def histogram(self, d: str) -> dict[int, int]:
        values, counts = np.unique(self.seen[d], return_counts=True)
        return {int(v): int(c) for v, c in zip(values, counts)}
