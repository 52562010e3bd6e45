"""What a launch does to a run folder before the loop: resume only the experiment the folder trains,
and extend a finished run as a new segment after checking that its mixture is feasible.

The run folder's format (run.json, segments, the lock) is runner.runs; reading the newest valid
checkpoint's saved config, to name the keys of a refused edit, is the Checkpointer's. Never trains.
"""

from __future__ import annotations

from pathlib import Path

from runner.config.fingerprint import canonical_meaning, diff_keys
from runner.config.load import Experiment, experiment_from_dict, to_yaml
from runner.config.rules import global_batch_tokens
from runner.data.manifest import load_experiment_manifests, plan_experiment_mixture
from runner.errors import RunnerError
from runner.runs.folder import RunFolder, experiment_of_run, segment_record


def checked_experiment_of_run(run_dir: Path) -> Experiment:
    """The run folder's experiment, refused when its experiment.yaml was edited into another run.

    The file must resolve to the fingerprint of the run's current segment; operational keys
    (hard stop, checkpoint cadence, log interval) may change. The differing keys are found against
    the resolved config saved in the newest valid checkpoint."""
    exp = experiment_of_run(run_dir)
    recorded = RunFolder(run_dir).record().current_fingerprint()
    if not recorded or recorded == exp.fingerprint:
        return exp
    # torch, only to name the keys of a refusal: off the path of every launch, report and audit
    from runner.training.checkpoint import Checkpointer  # noqa: PLC0415

    ckpt = Checkpointer.reader(run_dir).latest_valid(report=lambda m: None)
    saved = ckpt.record.config if ckpt is not None else None
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


def check_mixture_feasible(exp: Experiment) -> None:
    """Before a folder is written: every pin present and matching, each pool made with the pinned
    tokenizer, and a mixture the budget and repetition caps allow."""
    manifests, _ = load_experiment_manifests(exp)
    plan_experiment_mixture(exp, manifests)


def extend_run(run_dir: Path, tokens: int, write: bool) -> Experiment:
    """A finished run's experiment with exposure and max_duration raised to `tokens` (a new segment)."""
    exp = checked_experiment_of_run(run_dir)
    folder = RunFolder(run_dir)
    info = folder.record()
    cfg = exp.config
    step_tokens = global_batch_tokens(cfg)
    if info.status != "finished":
        raise RunnerError(
            f"run status is {info.status!r}; only a finished run is extended (resume it first)",
            file=str(run_dir / "run.json"),
            key="status",
        )
    if tokens <= cfg.train.exposure_tokens or tokens % step_tokens:
        raise RunnerError(
            f"--extend-to {tokens} must exceed the current budget {cfg.train.exposure_tokens} "
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
        segments = info.segments + [segment_record(len(info.segments), int(info.committed_steps), new)]
        folder.update(segments=segments, fingerprint=new.fingerprint, status="running")
    return new
