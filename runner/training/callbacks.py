"""Side effects of the training loop as callbacks: metrics files, MLflow and the progress line.

Owns: what is written after each step, each evaluation, each in-loop downstream scoring and at the
end of an attempt (metrics/train.jsonl, metrics/eval.jsonl, metrics/downstream.jsonl, MLflow metrics,
tags and the scorings' request files, quality targets' MLflow record, the progress bar or line on
stderr): the one delivery path of the loop's figures.
Never changes what is trained.
"""

from __future__ import annotations

import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tqdm import tqdm

from runner import progress
from runner.fsio import read_jsonl, repair_jsonl_tail
from runner.runs.recorded import EVAL_FIELDS, EVAL_REQUIRED, TRAIN_FIELDS, checked_rows
from runner.runs.steprecord import StepRecord
from runner.training import targets

#: a mixture-of-experts step's figures (runner.training.experts.RouterProbe.commit); absent for dense models
MOE_METRICS = (
    "router_aux_loss",
    "router_z_loss",
    "expert_load_imbalance",
    "expert_load_cv",
    "expert_idle_capacity",
)


@dataclass(frozen=True)
class DownstreamScoring:
    """One in-loop scoring of the downstream tasks (runner.training.inloop_downstream), as delivered."""

    step: int
    rows: list[dict]  #: metrics/downstream.jsonl's lines: one per task and metric, stamped where the run stood
    t_eval_seconds: float
    exposure_tokens: int
    requests: Path  #: its per-request log-likelihoods (downstream/requests-loop-step-NNNNNNN.jsonl.gz)


class Callback:
    """Side effects of the loop. Hooks run on every rank; sinks act only where they should
    (`on_downstream`: on the main process only, where the scoring's request file is written).

    `on_end` gets the attempt's summary and the accounting of its last committed step (after a
    non-finite stop: of the checkpoint the run was rolled back to)."""

    def on_step(self, record: StepRecord, counters: dict, ratios: dict) -> None: ...

    def on_eval(self, step: int, exposure_tokens: int, rows: list[dict]) -> None: ...

    def on_downstream(self, scoring: DownstreamScoring) -> None: ...

    def on_end(self, summary: dict, counters: dict, ratios: dict) -> None: ...


class MetricsFiles(Callback):
    """metrics/train.jsonl, metrics/eval.jsonl and metrics/downstream.jsonl (append-only; a resume
    continues them)."""

    def __init__(self, run_dir: Path, enabled: bool):
        self.dir = Path(run_dir) / "metrics"
        self.enabled = enabled
        if enabled:  # a SIGKILL may have torn the last line of an earlier attempt
            for name in ("train.jsonl", "eval.jsonl"):
                repair_jsonl_tail(self.dir / name)

    def _append(self, name: str, rows: list[dict]) -> None:
        if not self.enabled:
            return
        self.dir.mkdir(parents=True, exist_ok=True)
        with open(self.dir / name, "a") as f:
            for r in rows:
                f.write(json.dumps(r) + "\n")

    def on_step(self, record, counters, ratios):
        self._append("train.jsonl", [record.as_row()])

    def on_eval(self, step, exposure_tokens, rows):
        self._append("eval.jsonl", rows)

    def on_downstream(self, scoring):
        self._append("downstream.jsonl", scoring.rows)


class TrackingCallback(Callback):
    """MLflow metrics: loss, lr, throughput, MFU, the step's further figures, counters, realized
    ratios, validation.

    Per-step metrics go out every `log_interval_steps`, and always for the attempt's last committed
    step (end of the run or of an extension, hard stop, preemption): MLflow's latest values are the
    run's final ones. After a non-finite stop the run's lineage is rolled back to its last checkpoint;
    that accounting (counters, realized ratios) is logged at the step that failed."""

    STEP_KEYS = (
        "loss",
        "lr",
        "grad_norm",
        "step_seconds",
        "tokens_per_second",
        "tokens_per_second_useful",
        "mfu",
        "goodput_mfu",
        "hfu",
        *MOE_METRICS,
    )

    #: A step's figures that the run also states as a whole (`run.mfu`, the run's expert balance) go
    #: to MLflow as `step/<key>`, so its UI never shows the last step's MFU as the run's. The audit
    #: reads runs recorded before the rename, under the plain keys, too.
    STEP_NAMES = {
        k: f"step/{k}"
        for k in (
            "step_seconds",
            "tokens_per_second",
            "tokens_per_second_useful",
            "mfu",
            "goodput_mfu",
            "hfu",
            "expert_load_imbalance",
            "expert_load_cv",
            "expert_idle_capacity",
        )
    }

    def __init__(self, tracker, log_interval_steps: int):
        self.tracker = tracker
        self.every = max(1, log_interval_steps)
        self.newest: tuple[StepRecord, dict, dict] | None = None  # the attempt's newest step
        self.newest_logged = False

    @staticmethod
    def accounting(counters: dict, ratios: dict) -> dict:
        m = {}
        for d, c in counters.items():
            for name in ("processed", "exposure", "useful", "unique", "lost"):
                m[f"tokens.{d}.{name}"] = c[name]
        m.update({f"realized_ratio.{d}": r for d, r in ratios.items()})
        return m

    def _log_step(self, record: StepRecord, counters, ratios) -> None:
        row = record.as_row()
        keys = [*self.STEP_KEYS, *(k for k in record.figures if k not in self.STEP_KEYS)]
        m = {self.STEP_NAMES.get(k, k): row[k] for k in keys if row.get(k) is not None}
        m.update(self.accounting(counters, ratios))
        self.tracker.log_metrics(m, step=record.step)

    def on_step(self, record, counters, ratios):
        self.newest = (record, counters, ratios)
        self.newest_logged = record.step % self.every == 0
        if self.newest_logged:
            self._log_step(record, counters, ratios)

    def on_eval(self, step, exposure_tokens, rows):
        m = {}
        for r in rows:
            m[f"val_loss.{r['domain']}"] = r["loss_nats"]
            m[f"val_bpb.{r['domain']}"] = r["bpb"]
        # Where the run stood when the evaluation ended (what time-to-target is counted from), logged
        # by the attempt that evaluated: the audit compares the report's evaluation times with these.
        if rows:
            m.update({f"eval.{k}": rows[0][k] for k in targets.PROGRESS_FIELDS if rows[0].get(k) is not None})
        self.tracker.log_metrics(m, step=step)

    def on_downstream(self, scoring):
        """`downstream/<task>/<metric>`, `downstream/t_eval_seconds`, `downstream/exposure_tokens` and the
        stamp (`downstream/useful_tokens`, `downstream/wall_seconds`, `downstream/device_wall_seconds`:
        what time- and cost-to-target are counted from, where an edit of the run folder cannot reach it)
        at the step, each figure's convention record as a tag, the request file as an artifact."""
        rows = scoring.rows
        metrics = {f"downstream/{r['task']}/{r['metric']}": r["value"] for r in rows}
        metrics |= {
            "downstream/t_eval_seconds": scoring.t_eval_seconds,
            "downstream/exposure_tokens": scoring.exposure_tokens,
        }
        if rows:  # every row of a scoring carries the same stamp
            metrics |= {f"downstream/{k}": rows[0][k] for k in ("useful_tokens", "wall_seconds", "device_wall_seconds")}
        self.tracker.log_metrics(metrics, step=scoring.step)
        self.tracker.log_tags({f"downstream.{r['task']}.{r['metric']}.convention": r["convention"] for r in rows})
        self.tracker.log_artifacts(scoring.requests, "downstream")

    def on_end(self, summary, counters, ratios):
        committed = summary["committed_steps"]
        newest = self.newest[0].step if self.newest is not None else None
        if newest == committed:
            if not self.newest_logged and self.newest is not None:
                self._log_step(*self.newest)
        elif newest is not None and newest > committed:
            # A non-finite stop rolled the lineage back to the checkpoint at `committed`. Logged at the
            # step that failed (never logged before), so MLflow's latest values are the ledger's.
            self.tracker.log_metrics(self.accounting(counters, ratios), step=newest + 1)
        else:  # no step committed in this attempt: the accounting still says what was spent
            self.tracker.log_metrics(self.accounting(counters, ratios), step=committed)
        # The run's figures; one a step also logs (mfu, goodput_mfu, hfu) is `run.<key>`: at the last
        # step, one key would otherwise hold two values with two meanings.
        self.tracker.log_metrics(
            {
                (f"run.{k}" if k in self.STEP_KEYS else k): v
                for k, v in summary.items()
                if isinstance(v, (int, float)) and not isinstance(v, bool)
            },
            step=committed,
        )


#: steps the progress line's tokens/s and MFU are averaged over (exponentially): a single step's swing
#: on a shared CPU (0.7%-2.8% MFU) says nothing; run.json and train.jsonl keep every step's own figure
SMOOTHING_STEPS = 20


class TrainingProgress(Callback):
    """The training progress on stderr (main process only): step / total, exposure, loss, tokens/s,
    MFU, and the time left to the end of the segment and to the hard stop, as a bar on a terminal or
    a plain line every progress.LINE_INTERVAL_SECONDS (and at the attempt's first and last step) in a
    log file. The time left is extrapolated from this attempt's wall time per step, so evaluations
    and checkpoints are part of it."""

    def __init__(self, start_step: int, segment_end_step: int, hard_stop_step: int | None, stream=None):
        self.start_step, self.segment_end_step, self.hard_stop_step = start_step, segment_end_step, hard_stop_step
        self.stream = sys.stderr if stream is None else stream
        self.bar: Any = None  # a tqdm bar, on a terminal
        self.cadence = progress.LineCadence()
        self.first: tuple[int, float] | None = None  # (step, monotonic time) at this attempt's first step
        self.last_line: str | None = None
        self.last_printed = True
        self.smoothed: tuple[float, float] | None = None  # (tokens, seconds) of a step, exponentially averaged

    def _smoothed(self, record: StepRecord) -> tuple[float, float]:
        """(tokens/s, MFU) averaged over about the last SMOOTHING_STEPS steps: tokens and seconds are
        averaged apart (a rate of averages, not an average of rates), MFU scaled with tokens/s."""
        alpha = 2.0 / (SMOOTHING_STEPS + 1)
        tokens, seconds = record.tokens_per_second * record.step_seconds, record.step_seconds
        if self.smoothed is not None:
            tokens = alpha * tokens + (1 - alpha) * self.smoothed[0]
            seconds = alpha * seconds + (1 - alpha) * self.smoothed[1]
        self.smoothed = (tokens, seconds)
        if seconds <= 0 or record.tokens_per_second <= 0:
            return record.tokens_per_second, record.mfu
        rate = tokens / seconds
        return rate, record.mfu * rate / record.tokens_per_second

    def _seconds_per_step(self, record: StepRecord) -> float:
        now = time.monotonic()
        if self.first is None:
            self.first = (record.step, now - record.step_seconds)
        steps = record.step - self.first[0] + 1
        return (now - self.first[1]) / steps

    def fields(self, record: StepRecord) -> list[str]:
        """The parts of a progress line after the step count (shared by the bar and the log line)."""
        per_step = self._seconds_per_step(record)
        step = record.step
        rate, mfu = self._smoothed(record)
        parts = [
            f"exposure {record.exposure_tokens:,} tokens",
            f"loss {record.loss:.4f}",
            f"{rate:,.0f} tokens/s",
            f"MFU {mfu:.1%} (both smoothed, ~{SMOOTHING_STEPS} steps)",
            f"ETA segment end {progress.format_seconds(max(self.segment_end_step - step, 0) * per_step)}",
        ]
        if self.hard_stop_step is not None:
            eta = progress.format_seconds(max(self.hard_stop_step - step, 0) * per_step)
            parts.append(f"hard stop (step {self.hard_stop_step:,}) {eta}")
        return parts

    def on_step(self, record, counters, ratios):
        parts = self.fields(record)
        if progress.interactive(self.stream):
            if self.bar is None:
                self.bar = tqdm(
                    total=self.segment_end_step,
                    initial=self.start_step,
                    desc="train",
                    unit="step",
                    file=self.stream,
                    bar_format="{desc} {n_fmt}/{total_fmt} {percentage:3.0f}%|{bar}| {postfix}",
                )
            self.bar.set_postfix_str(" | ".join(parts), refresh=False)
            self.bar.update(record.step - self.bar.n)
            return
        total = self.segment_end_step
        self.last_line = f"train: step {record.step:,}/{total:,} ({record.step / total:.1%}) | " + " | ".join(parts)
        self.last_printed = self.cadence.due()
        if self.last_printed:
            print(self.last_line, file=self.stream, flush=True)

    def on_end(self, summary, counters, ratios):
        if self.bar is not None:
            self.bar.close()
        elif not self.last_printed and self.last_line:
            print(self.last_line, file=self.stream, flush=True)


class TargetsCallback(Callback):
    """Quality targets in MLflow (`target.<name>.*` metrics and tags, runner.training.targets): logged
    at the evaluation that first meets a target, and every target's outcome at the end of an attempt.
    Judged on the lineage's evaluations: those before the resumed step, then this attempt's."""

    def __init__(self, tracker, config, run_dir: Path, start_step: int, enabled: bool):
        self.tracker = tracker
        self.targets = targets.declared_targets(config)
        self.price = float(config.hardware.price_per_device_hour_usd)
        self.enabled = enabled and bool(self.targets)
        self.rows: dict[tuple[int, str], dict] = {}
        self.start_step = int(start_step)
        if self.enabled:
            # the lineage's rows as the report reads them: a row of another shape is one line at the start,
            # not int()'s traceback (`"step": "x"` stopped every tracked resume)
            evals, trains = Path(run_dir) / "metrics" / "eval.jsonl", Path(run_dir) / "metrics" / "train.jsonl"
            rows = checked_rows(read_jsonl(evals, skip_torn=True), EVAL_FIELDS, evals, required=EVAL_REQUIRED)
            earlier = [r for r in rows if r["step"] <= start_step]
            train = checked_rows(read_jsonl(trains, skip_torn=True), TRAIN_FIELDS, trains, required=("step",))
            for r in targets.complete_eval_rows(earlier, train):
                self.rows[(int(r["step"]), str(r["domain"]))] = r

    def _table(self, committed_steps: int):
        frame = targets.validation_frame(list(self.rows.values()))
        return targets.targets_table(self.targets, frame, committed_steps, self.price)

    def _log(self, table, only_met_at: int | None = None, after_step: int | None = None) -> None:
        for target in self.targets:
            rows = targets.outcome(table, target.name)
            if only_met_at is not None and rows.get("met", {}).get("step") != only_met_at:
                continue
            metrics, tags, step = targets.mlflow_record(target, rows)
            if after_step is not None and step <= after_step:
                # An outcome at a step an earlier attempt or segment evaluated: that attempt logged it
                # from what it measured; this one would re-log it from files (SPEC "Quality targets").
                metrics = {}
            self.tracker.log_metrics(metrics, step=step)
            self.tracker.log_tags(tags)

    def on_eval(self, step, exposure_tokens, rows):
        if not self.enabled:
            return
        self.rows.update({(int(r["step"]), str(r["domain"])): r for r in rows})
        self._log(self._table(step), only_met_at=step)

    def on_end(self, summary, counters, ratios):
        if self.enabled:
            self._log(self._table(int(summary["committed_steps"])), after_step=self.start_step)
