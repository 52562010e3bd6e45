"""Every command in the README runs as written.

The convention, for whoever adds a command to README.md:

- Every line of a ```bash block is a command (a trailing backslash continues it on the next line);
  lines starting with `#` are comments.
- A command that cannot run on this project's CPU CI is marked, and is then listed but not run:
  end the command's line, or the comment line directly above it, with one of
      `# GPU`             it needs a GPU (or several),
      `# cluster`         it needs several nodes,
      `# needs internet`  it downloads something, or needs data only a download gives,
      `# long`            it runs for minutes on 2 CPU cores (a full training run beyond the first).
- A command whose purpose is to report a failure ends with `# exits N`, the status it must return.
  Every other command must exit 0.
- `<run_id>` in `runs/<experiment>/<run_id>` is the first run folder a README command created under
  `runs/<experiment>/`. Any other `<placeholder>` in an unmarked command is an error.

How they run: in order, from the root of ONE fresh copy of the project (its tracked and
untracked-but-not-ignored files; a git repository of one commit that is also `origin/main`, so
`check-pr --base origin/main` has a base), with MLflow's default store (no MLFLOW_TRACKING_URI), one
thread per process, and `./install.sh` replaced by `true`: the tree under test is installed already,
and installing the copy would repoint this environment at it. Nothing else is prepared: the built-in
corpus is built once, by the README's own `runner data builtin` in its first command.

A command that is `runner` and plain words (no shell syntax: no pipe, redirection, `&&`, variable,
glob or leading assignment) runs in this process, as `runner.cli.main(words)` with the same folder,
environment, captured output and exit status (trainfixtures.run_in_process): the seconds a process
spends importing torch, transformers and MLflow, paid ~40 times, are most of this test's time.
Every other command runs in its own `bash`, with `runner`, `python` and `torchrun` being this
interpreter (shims first on PATH). The first command (install, corpus, the main job) is always a
process, as a new user runs it.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import sqlite3
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
from timeouts import SUBPROCESS_TIMEOUT_S, TEST_TIMEOUT_S
from trainfixtures import run_in_process

REPO = Path(__file__).resolve().parents[2]
MARKERS = ("GPU", "cluster", "needs internet", "long")
_MARKER = re.compile(r"#\s*(" + "|".join(re.escape(m) for m in MARKERS) + r")\s*$")
_EXITS = re.compile(r"#\s*exits\s+(\d+)\s*$")
_PLACEHOLDER = re.compile(r"<[^<>\s]+(?: [^<>\s]+)*>")
_RUN_ID = re.compile(r"runs/([\w.-]+)/<run_id>")


@dataclass
class Command:
    text: str  # as written, continuation lines joined
    line: int  # README line where it starts
    skip: str | None  # the marker that excuses it
    exits: int = 0


def readme_commands(text: str) -> list[Command]:
    """The commands of every ```bash block of `text`, with their markers."""
    commands: list[Command] = []
    in_block, above, pending, start = False, "", "", 0
    for n, raw in enumerate(text.splitlines(), 1):
        line = raw.rstrip()
        if line.strip().startswith("```"):
            in_block, above = line.strip() == "```bash" and not in_block, ""
            continue
        if not in_block:
            continue
        if not pending and line.strip().startswith("#"):
            above = line
            continue
        if not pending:
            start = n
        pending += line[:-1] + " " if line.endswith("\\") else line
        if line.endswith("\\"):
            continue
        if pending.strip():
            marker = _MARKER.search(pending) or _MARKER.search(above)
            exits = _EXITS.search(pending)
            commands.append(
                Command(
                    " ".join(pending.split()),
                    start,
                    marker.group(1) if marker else None,
                    int(exits.group(1)) if exits else 0,
                )
            )
        pending, above = "", ""
    return commands


def test_the_convention_is_read_as_documented():
    text = """
```bash
runner validate                     # every recipe
# what CI runs  # long
python -m pytest
accelerate launch --config_file x.yaml \\
    -m runner launch y.yaml   # GPU
runner audit-claims c.yaml   # impossible figures  # exits 1
```

```
not bash: runner ignored
```
```bash
runner launch runs/cpu-tiny/<run_id>   # resume
```
"""
    got = [(c.text, c.line, c.skip, c.exits) for c in readme_commands(text)]
    assert got == [
        ("runner validate # every recipe", 3, None, 0),
        ("python -m pytest", 5, "long", 0),
        ("accelerate launch --config_file x.yaml -m runner launch y.yaml # GPU", 6, "GPU", 0),
        ("runner audit-claims c.yaml # impossible figures # exits 1", 8, None, 1),
        ("runner launch runs/cpu-tiny/<run_id> # resume", 15, None, 0),
    ]


def test_every_unmarked_readme_command_uses_only_placeholders_the_runner_knows():
    commands = readme_commands((REPO / "README.md").read_text())
    assert len([c for c in commands if c.skip is None]) >= 10, "the README lost its runnable commands?"
    for c in commands:
        if c.skip is None:
            unknown = [p for p in _PLACEHOLDER.findall(c.text.split("#", 1)[0]) if p != "<run_id>"]
            assert not unknown, (
                f"README.md:{c.line}: {c.text}: unknown placeholder {unknown} (mark it or make it runnable)"
            )


def _fresh_copy(dest: Path) -> None:
    files = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=REPO,
        capture_output=True,
        check=True,
        timeout=SUBPROCESS_TIMEOUT_S,
    ).stdout.split(b"\0")
    for name in filter(None, files):
        src = REPO / os.fsdecode(name)
        if src.is_file():
            (dest / os.fsdecode(name)).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / os.fsdecode(name))
    git = {"GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t", "GIT_COMMITTER_EMAIL": "t@t"}
    for cmd in (
        ["init", "-q"],
        ["add", "-A"],
        ["commit", "-qm", "readme test"],
        ["update-ref", "refs/remotes/origin/main", "HEAD"],
    ):
        subprocess.run(["git", *cmd], cwd=dest, check=True, env={**os.environ, **git}, timeout=SUBPROCESS_TIMEOUT_S)


def _shims(folder: Path) -> Path:
    folder.mkdir()
    for name, target in (("runner", "-m runner"), ("torchrun", "-m torch.distributed.run"), ("python", "")):
        shim = folder / name
        shim.write_text(f'#!/bin/sh\nexec "{sys.executable}" {target} "$@"\n')
        shim.chmod(0o755)
    return folder


_SHELL_WORD = re.compile(r"[$*?\[\]~`|&;<>(){}]")


def runner_words(command: str) -> list[str] | None:
    """The arguments of a command that is `runner` and plain words, else None (it needs a shell)."""
    lexer = shlex.shlex(command, posix=True, punctuation_chars=True)
    lexer.whitespace_split, lexer.commenters = True, "#"
    try:
        words = list(lexer)
    except ValueError:  # an unclosed quote: bash says what is wrong with it
        return None
    if len(words) < 2 or words[0] != "runner":
        return None
    quoted = set(re.findall(r'"([^"]*)"', command.split(" # ", 1)[0]))  # a quoted word is plain as it is
    if any(_SHELL_WORD.search(w) and w not in quoted for w in words):
        return None
    return words[1:]


def test_plain_runner_commands_run_in_process_and_shell_syntax_in_bash():
    assert runner_words("runner validate # every recipe") == ["validate"]
    assert runner_words('runner sample e --prompt "def main(" --max-new-tokens 24 # greedy') == [
        "sample",
        "e",
        "--prompt",
        "def main(",
        "--max-new-tokens",
        "24",
    ]
    for shell in (
        "runner audit-claims reports/claims/*.yaml # globbed",
        "runner audit-reports --tracking-uri sqlite:///$PWD/mlflow.db",
        "RUNNER_LOCK=file runner launch runs/x",
        "runner job e.yaml --slurm > job.sbatch",
        "runner data builtin && runner launch e.yaml",
        "python -m runner plan e.yaml",
        "runner validate | head",
    ):
        assert runner_words(shell) is None, shell


def _resolve(text: str, root: Path, first_runs: dict[str, str]) -> str:
    def run_id(match: re.Match) -> str:
        experiment = match.group(1)
        if experiment not in first_runs:
            found = sorted(
                (json.loads(p.read_text())["created_at"], p.parent.name)
                for p in (root / "runs" / experiment).glob("*/run.json")
            )
            if not found:
                raise AssertionError(f"no run folder under runs/{experiment}/ for {text!r}")
            first_runs[experiment] = found[0][1]
        return f"runs/{experiment}/{first_runs[experiment]}"

    return _RUN_ID.sub(run_id, text)


@pytest.mark.longest(6)
@pytest.mark.slow
@pytest.mark.timeout(4 * TEST_TIMEOUT_S)
def test_every_readme_command_runs_as_written(tmp_path):
    if not (REPO / ".git").exists():
        pytest.skip("not a git checkout: the README's copy is made from git's file list")
    root = tmp_path / "project"
    _fresh_copy(root)
    env = {k: v for k, v in os.environ.items() if k != "MLFLOW_TRACKING_URI"}
    env.update(
        PATH=f"{_shims(tmp_path / 'bin')}{os.pathsep}{env.get('PATH', '')}",
        OMP_NUM_THREADS="1",
        MKL_NUM_THREADS="1",
        TOKENIZERS_PARALLELISM="false",
        PYTHONUNBUFFERED="1",
    )
    first_runs: dict[str, str] = {}
    ran, skipped, failures = [], [], []
    commands = readme_commands((REPO / "README.md").read_text())
    main_job_checked = False
    for c in commands:
        if c.skip:
            skipped.append(f"README.md:{c.line} [{c.skip}] {c.text}")
            continue
        command = re.sub(r"(^|&&\s*)\./install\.sh(?=\s|$)", r"\1true", _resolve(c.text, root, first_runs))
        t0 = time.monotonic()
        words = runner_words(command) if c.line != commands[0].line else None
        if words is not None:
            proc = run_in_process(root, words, env)
        else:
            proc = subprocess.run(
                ["bash", "-c", command], cwd=root, env=env, capture_output=True, text=True, timeout=SUBPROCESS_TIMEOUT_S
            )
        ran.append(f"{time.monotonic() - t0:6.1f} s  {'in process' if words is not None else 'bash      '}  {command}")
        if not main_job_checked and c.line == commands[0].line and proc.returncode == 0:
            _check_main_job(root, proc, env, tmp_path / "elsewhere")
            main_job_checked = True
        if proc.returncode != c.exits:
            failures.append(
                f"README.md:{c.line}: `{command}` exited {proc.returncode} (expected {c.exits}):\n"
                + "\n".join((proc.stdout + proc.stderr).strip().splitlines()[-15:])
            )
    print("ran:\n  " + "\n  ".join(ran) + "\nskipped (marked):\n  " + "\n  ".join(skipped))
    assert not failures, "\n\n".join(failures)
    assert main_job_checked
    # `runner publish` put the main job's run beside the shipped ones, and the index names it.
    assert (root / "reports" / "cpu-tiny" / first_runs["cpu-tiny"] / "report.md").exists()
    assert f"| cpu-tiny | 2 | [{first_runs['cpu-tiny']}]" in (root / "reports" / "README.md").read_text()


def _check_main_job(root: Path, launch: subprocess.CompletedProcess, env: dict, elsewhere: Path) -> None:
    """What the README's first command must have made, figure by figure, before any later command
    (resume, extension) changes it: the CPU experiment on the built-in data, in MLflow's default store."""
    assert "Traceback" not in launch.stderr
    assert (
        "warning: experiments/cpu-tiny.yaml: data.manifests.legal: domain 'legal' is validated on 2 samples"
        in launch.stderr
    )
    assert "tokens: processed 307,200  exposure 307,200  useful 307,200" in launch.stdout
    (run_dir,) = (root / "runs" / "cpu-tiny").iterdir()
    info = json.loads((run_dir / "run.json").read_text())
    assert info["status"] == "finished" and info["committed_steps"] == 150
    assert info["conventions"]["peak_source"].startswith("theoretical: ")  # stable, unlike a matmul burst
    ledger = json.loads((run_dir / "ledger.json").read_text())["counters"]
    assert {d: c["exposure"] for d, c in ledger.items()} == {
        "code": 153_600,
        "prose": 122_880,
        "legal": 30_720,
        "total": 307_200,
    }
    assert ledger["legal"]["unique"] == ledger["legal"]["pool"]  # the small domain is repeated: every sample seen
    for name in ("report.md", "accounting.parquet", "accounting.csv", "validation.parquet", "loss_by_domain.png"):
        assert (run_dir / "report" / name).stat().st_size > 0

    con = sqlite3.connect(root / "mlflow.db")  # MLflow's default store, in the checkout
    metrics = dict(con.execute("select key, count(*) from metrics group by key").fetchall())
    tags = dict(con.execute("select key, value from tags").fetchall())
    artifacts_logged = con.execute("select artifact_uri from runs").fetchone()[0]
    con.close()
    assert metrics["loss"] == 150 // 10  # train.log_interval_steps: 10
    assert {"val_loss.code", "val_bpb.legal", "tokens.total.unique", "realized_ratio.prose", "step/mfu"} <= set(metrics)
    assert tags["fingerprint"] == info["fingerprint"] and tags["recipe.model"] == "llama-tiny@1"
    assert artifacts_logged

    # By MLflow run id, from the store launch wrote to; elsewhere, one line and no empty store made.
    run_id = info["mlflow"]["run_id"]
    for cwd, status in ((root, 0), (elsewhere, 2)):
        cwd.mkdir(exist_ok=True)
        out = run_in_process(cwd, ["audit", run_id], env)
        assert out.returncode == status, out.stdout + out.stderr
    assert out.stderr.startswith("error: no MLflow store at ") and "Traceback" not in out.stderr
    assert not (elsewhere / "mlflow.db").exists()


def test_the_1p3b_pin_error_names_the_tokenizer_recipe_and_the_readme_pin_command(project, monkeypatch, capsys):
    from runner.cli import main

    monkeypatch.chdir(project)
    assert main(["launch", "experiments/1p3b.yaml", "--no-tracking"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1
    assert err[0] == (
        "error: recipes/tokenizer/gpt-neox-20b.yaml: sha256: not pinned: `runner pin experiments/1p3b.yaml` "
        "writes the sha256 of data/tokenizers/gpt-neox-20b/tokenizer.json here"
    )
    assert "runner pin experiments/1p3b.yaml" in (REPO / "README.md").read_text()  # the flow the README gives
    assert not (project / "runs").exists()
