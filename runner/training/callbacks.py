"""Side effects of the training loop as callbacks: metrics files and MLflow.

Owns: what is written after each step, each evaluation and at the end of an attempt
(metrics/train.jsonl, metrics/eval.jsonl, MLflow metrics). Never changes what is trained.
"""

from __future__ import annotations

import json
from pathlib import Path

from runner.fsio import repair_jsonl_tail

#: a mixture-of-experts step's figures (runner.training.experts.RouterProbe.commit); absent for dense models
MOE_METRICS = (
    "router_aux_loss",
    "router_z_loss",
    "expert_load_imbalance",
    "expert_load_cv",
    "expert_idle_capacity",
)


class Callback:
    """Side effects of the loop. Hooks run on every rank; sinks act only where they should."""

    def on_step(self, record: dict, counters: dict, ratios: dict) -> None: ...

    def on_eval(self, step: int, exposure_tokens: int, rows: list[dict]) -> None: ...

    def on_end(self, summary: dict) -> None: ...


class MetricsFiles(Callback):
    """metrics/train.jsonl and metrics/eval.jsonl (append-only; a resume continues them)."""

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
        self._append("train.jsonl", [record])

    def on_eval(self, step, exposure_tokens, rows):
        self._append("eval.jsonl", rows)


class TrackingCallback(Callback):
    """MLflow metrics: loss, lr, throughput, MFU, counters, realized ratios, validation."""

    def __init__(self, tracker, log_interval_steps: int):
        self.tracker = tracker
        self.every = max(1, int(log_interval_steps))

    def on_step(self, record, counters, ratios):
        if record["step"] % self.every:
            return
        m = {
            k: record[k]
            for k in (
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
            if record.get(k) is not None
        }
        for d, c in counters.items():
            for name in ("processed", "exposure", "useful", "unique", "lost"):
                m[f"tokens.{d}.{name}"] = c[name]
        m.update({f"realized_ratio.{d}": r for d, r in ratios.items()})
        self.tracker.log_metrics(m, step=record["step"])

    def on_eval(self, step, exposure_tokens, rows):
        m = {}
        for r in rows:
            m[f"val_loss.{r['domain']}"] = r["loss_nats"]
            m[f"val_bpb.{r['domain']}"] = r["bpb"]
        self.tracker.log_metrics(m, step=step)

    def on_end(self, summary):
        self.tracker.log_metrics(
            {k: v for k, v in summary.items() if isinstance(v, (int, float)) and not isinstance(v, bool)},
            step=summary["committed_steps"],
        )
