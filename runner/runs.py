"""Run folders: creating one, reading back the experiment it trains, refusing a different one,
and extending a finished run as a new segment.

Owns the lifecycle records of a run folder (experiment.yaml, fingerprint.txt, run.json segments,
manifest copies). Never trains, tracks or reports.
"""

from __future__ import annotations

import datetime as dt
import shutil
from pathlib import Path

import numpy as np

from runner.errors import Problems, RunnerError
from runner.fsio import atomic_write_json, read_json, read_jsonl, read_yaml, repair_jsonl_tail


def _now() -> str:
    return dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")


def _segment(index: int, start_step: int, exp) -> dict:
    """run.json's record of one segment: the budget and fingerprint the run trains under from `start_step`."""
    from runner.config.rules import max_duration_tokens

    return {
        "index": index,
        "start_step": start_step,
        "max_duration_tokens": max_duration_tokens(exp.config),
        "exposure_tokens": int(exp.config.train.exposure_tokens),
        "fingerprint": exp.fingerprint,
        "started_at": _now(),
    }


# ---- run folders --------------------------------------------------------------------------------


class RunFolder:
    """run.json and the journal of one run folder (DESIGN.md layout). Only rank 0 writes."""

    def __init__(self, path: Path, writer: bool = True):
        self.path = Path(path)
        self.writer = writer

    @property
    def run_json(self) -> Path:
        return self.path / "run.json"

    def read(self) -> dict:
        return read_json(self.run_json)

    def update(self, **fields) -> dict:
        info = self.read()
        info.update(fields)
        if self.writer:
            atomic_write_json(self.run_json, info)
        return info

    def journal_path(self) -> Path:
        return self.path / "journal" / "processed.jsonl"

    def journal_entries(self) -> list[dict]:
        # A line torn by a kill mid-write is skipped; repair_journal drops it before appending.
        return read_jsonl(self.journal_path(), skip_torn=True)

    def repair_journal(self) -> None:
        if self.writer:
            repair_jsonl_tail(self.journal_path())


def write_ledger_json(run_dir: Path, ledger) -> None:
    """ledger.json: counters, repetition histogram and realized ratios (plain JSON for report/audit)."""

    def plain(x):
        if isinstance(x, dict):
            return {str(k): plain(v) for k, v in x.items()}
        if isinstance(x, (np.integer,)):
            return int(x)
        if isinstance(x, (np.floating,)):
            return float(x)
        return x

    atomic_write_json(
        Path(run_dir) / "ledger.json",
        {
            "counters": plain(ledger.counters()),
            "histogram": plain(ledger.histogram()),
            "realized_ratios": plain(ledger.realized_ratios()),
        },
    )


def is_run_dir(path: Path) -> bool:
    return (Path(path) / "run.json").exists() and (Path(path) / "experiment.yaml").exists()


def experiment_of_run(run_dir: Path):
    """The resolved experiment a run folder trains (its own copy, not the file in experiments/)."""
    from runner.config.load import experiment_from_dict, find_project_root
    from runner.config.rules import check_targets

    resolved = read_yaml(run_dir / "experiment.yaml")
    info = read_json(run_dir / "run.json")
    root = Path(info.get("project_root") or find_project_root(Path.cwd()))
    exp = experiment_from_dict(resolved, project_root=root, path=run_dir / "experiment.yaml")
    # Operational keys of a run's copy may be edited between attempts; quality targets are checked again.
    problems = Problems()
    check_targets(exp.config, run_dir / "experiment.yaml", problems)
    problems.raise_if_any()
    return exp


def checked_experiment_of_run(run_dir: Path):
    """The run folder's experiment, refused when its experiment.yaml was edited into another run.

    The file must resolve to the fingerprint of the run's current segment; operational keys
    (hard stop, checkpoint cadence, log interval) may change. The differing keys are found against
    the resolved config saved in the newest valid checkpoint."""
    from runner.config.fingerprint import canonical_meaning, diff_keys
    from runner.training.checkpoint import Checkpointer

    exp = experiment_of_run(run_dir)
    info = read_json(run_dir / "run.json")
    segments = info.get("segments") or []
    recorded = segments[-1].get("fingerprint") if segments else info.get("fingerprint")
    if not recorded or recorded == exp.fingerprint:
        return exp
    ckpt = Checkpointer(run_dir, 0, 0, 1).latest_valid(report=lambda m: None)
    saved = ckpt.state.get("config") if ckpt is not None else None
    if saved is not None:
        keys = diff_keys(canonical_meaning(saved), canonical_meaning(exp.config))
        what = f"differing keys: {', '.join(keys) or '(none)'}"
    else:
        what = "no checkpoint holds the resolved config to name the differing keys"
    raise RunnerError(
        f"edited: resolves to fingerprint {exp.fingerprint[:12]}, the run's current segment has "
        f"{recorded[:12]}; {what}; refusing to resume (restore the file, or start a new run)",
        file=str(run_dir / "experiment.yaml"),
    )


def check_same_experiment(exp, run_dir: Path) -> None:
    """Refuse to resume a run folder with a different experiment, naming the differing keys."""
    from runner.config.fingerprint import canonical_meaning, diff_keys

    saved = experiment_of_run(run_dir)
    if saved.fingerprint == exp.fingerprint:
        return
    keys = diff_keys(canonical_meaning(saved.config), canonical_meaning(exp.config))
    raise RunnerError(
        f"{exp.path} resolves to fingerprint {exp.fingerprint[:12]}, the run has "
        f"{saved.fingerprint[:12]}; differing keys: {', '.join(keys) or '(none)'}; refusing to resume",
        file=str(run_dir),
    )


def check_mixture_feasible(exp) -> None:
    """Before a folder is written: every pin present and matching, each pool made with the pinned
    tokenizer, and a mixture the budget and repetition caps allow."""
    from runner.data.manifest import load_experiment_manifests, plan_experiment_mixture

    manifests, _ = load_experiment_manifests(exp)
    plan_experiment_mixture(exp, manifests)


def create_run_folder(exp, run_dir: Path, run_id: str) -> None:
    from runner.config.load import to_yaml

    run_dir.mkdir(parents=True, exist_ok=True)
    for sub in ("checkpoints", "journal", "metrics", "manifests"):
        (run_dir / sub).mkdir(exist_ok=True)
    (run_dir / "experiment.yaml").write_text(to_yaml(exp.config))
    (run_dir / "fingerprint.txt").write_text(exp.fingerprint + "\n")
    for d, pin in exp.config.data.manifests.items():
        shutil.copy2(exp.resolve_path(pin.path), run_dir / "manifests" / f"{d}.json")
    atomic_write_json(
        run_dir / "run.json",
        {
            "run_id": run_id,
            "experiment": str(exp.config.name),
            "fingerprint": exp.fingerprint,
            "experiment_file": str(exp.path) if exp.path else None,
            "project_root": str(exp.project_root),
            "mlflow": {"tracking_uri": None, "experiment_id": None, "run_id": None},
            "segments": [_segment(0, 0, exp)],
            "status": "created",
            "committed_steps": 0,
            "conventions": None,
            "created_at": _now(),
        },
    )


def extend_run(run_dir: Path, tokens: int, write: bool):
    """A finished run's experiment with exposure and max_duration raised to `tokens` (a new segment)."""
    from runner.config.load import experiment_from_dict, to_yaml
    from runner.config.rules import global_batch_tokens

    exp = checked_experiment_of_run(run_dir)
    info = read_json(run_dir / "run.json")
    cfg = exp.config
    step_tokens = global_batch_tokens(cfg)
    if info.get("status") != "finished":
        raise RunnerError(
            f"run status is {info.get('status')!r}; only a finished run is extended (resume it first)",
            file=str(run_dir / "run.json"),
            key="status",
        )
    if tokens <= int(cfg.train.exposure_tokens) or tokens % step_tokens:
        raise RunnerError(
            f"--extend-to {tokens} must exceed the current budget {int(cfg.train.exposure_tokens)} "
            f"and be a whole number of global batches ({step_tokens} tokens)",
            key="train.exposure_tokens",
        )
    resolved = exp.to_container()
    resolved["train"]["exposure_tokens"] = tokens
    resolved["train"]["max_duration_tokens"] = tokens
    new = experiment_from_dict(resolved, project_root=exp.project_root, path=exp.path)
    check_mixture_feasible(new)
    if write:
        (run_dir / "experiment.yaml").write_text(to_yaml(new.config))
        (run_dir / "fingerprint.txt").write_text(new.fingerprint + "\n")
        segments = info.get("segments", [])
        segments.append(_segment(len(segments), int(info.get("committed_steps", 0)), new))
        info.update(segments=segments, fingerprint=new.fingerprint, status="running")
        atomic_write_json(run_dir / "run.json", info)
    return new
