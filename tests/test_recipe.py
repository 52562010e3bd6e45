"""Recipes: every shipped file validates; each rule refuses a broken file naming its key."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from runner.cli import default_targets, validate_one
from runner.config.load import load_experiment
from runner.config.rules import global_batch_tokens, grad_accum, model_vocab_size, total_steps
from runner.errors import RunnerError

REPO = Path(__file__).resolve().parents[1]


def test_every_shipped_recipe_and_experiment_validates():
    targets = default_targets(REPO)
    assert len(targets) >= 15
    for path in targets:
        validate_one(path)  # raises on any problem


def edit(path: Path, fn) -> None:
    data = yaml.safe_load(path.read_text())
    fn(data)
    path.write_text(yaml.safe_dump(data, sort_keys=False))


def _set(*keys_value):
    *keys, value = keys_value

    def fn(d):
        for k in keys[:-1]:
            d = d[k]
        d[keys[-1]] = value

    return fn


def _del(*keys):
    def fn(d):
        for k in keys[:-1]:
            d = d[k]
        del d[keys[-1]]

    return fn


BROKEN = [
    # (file to edit, edit, key expected in the message, words expected)
    ("recipes/model/llama-tiny.yaml", _set("hiden_size", 64), "hiden_size", "did you mean 'hidden_size'"),
    ("recipes/model/llama-tiny.yaml", _set("n_layers", "two"), "n_layers", "must be an integer"),
    ("recipes/model/llama-tiny.yaml", _del("hidden_size"), "model.hidden_size", "missing value"),
    ("recipes/model/llama-tiny.yaml", _set("version", 2), "recipes.model", "names llama-tiny@1 but"),
    (
        "recipes/mixture/builtin-3dom.yaml",
        _set("domains", "legal", "target_ratio", 0.2),
        "mixture.domains",
        "sum to 1.1",
    ),
    ("recipes/tokenizer/builtin-bpe-4k.yaml", _set("sha256", "ab" * 32), "tokenizer.sha256", "the recipe pins"),
    ("recipes/tokenizer/builtin-bpe-4k.yaml", _set("vocab_size", 70_000), "tokenizer.token_dtype", "use uint32"),
    (
        "experiments/cpu-tiny.yaml",
        _set("train", "micro_batch_sequences", 5),
        "train.micro_batch_sequences",
        "does not divide",
    ),
    (
        "experiments/cpu-tiny.yaml",
        _set("train", "exposure_tokens", 307_201),
        "train.exposure_tokens",
        "not a whole number of global batches",
    ),
    ("experiments/cpu-tiny.yaml", _set("sed", 1), "sed", "did you mean 'seed'"),
    (
        "experiments/cpu-tiny.yaml",
        _set("recipes", "model", "llama-tiyn@1"),
        "recipes.model",
        "did you mean 'llama-tiny'",
    ),
    ("experiments/cpu-tiny.yaml", _set("recipes", "model", "llama-tiny"), "recipes.model", "NAME@VERSION"),
    (
        "experiments/cpu-tiny.yaml",
        _set("overrides", {"optim": {"lr": "${oc.env:LR}"}}),
        "overrides.optim.lr",
        "resolver",
    ),
    ("experiments/cpu-tiny.yaml", _set("overrides", {"model": {"_target_": "x.Y"}}), "_target_", "object paths"),
    ("experiments/cpu-tiny.yaml", _set("overrides", {"model": {"n_heads": 3}}), "model.n_heads", "not divisible"),
    (
        "experiments/cpu-tiny.yaml",
        _set("data", "manifests", "leagl", {"path": "x", "sha256": "0" * 64}),
        "data.manifests.leagl",
        "did you mean 'legal'",
    ),
    (
        "recipes/mixture/builtin-3dom.yaml",
        _set("domains", "legal", "max_repetition_ratio", 0.5),
        "max_repetition_ratio",
        ">= 1.0",
    ),
    ("recipes/hardware/cpu.yaml", _set("accelerator", "tpu"), "hardware.accelerator", "not one of"),
    ("recipes/optim/adamw-tiny.yaml", _set("betas", [0.9]), "optim.betas", "two numbers"),
]


@pytest.mark.parametrize("rel, change, key, words", BROKEN, ids=[f"{b[2]}-{i}" for i, b in enumerate(BROKEN)])
def test_broken_recipe_is_refused_naming_the_key(project: Path, rel, change, key, words):
    edit(project / rel, change)
    with pytest.raises(RunnerError) as err:
        load_experiment(project / "experiments/cpu-tiny.yaml")
    msg = str(err.value)
    assert key in msg and words in msg, msg
    first = next(l for l in msg.splitlines() if key in l)
    assert first.split(": ")[0].endswith(".yaml"), first  # file first, then key


def test_unknown_device_without_peak_is_refused(project: Path):
    edit(project / "recipes/hardware/h200.yaml", _set("device_name", "Z9000"))
    with pytest.raises(RunnerError, match="hardware.device_name.*Z9000.*never another device"):
        load_experiment(project / "experiments/1p3b.yaml")


def test_cli_refuses_with_one_line_per_problem_and_exit_2(project: Path):
    edit(project / "experiments/cpu-tiny.yaml", _set("train", "exposure_tokens", 307_201))
    out = subprocess.run(
        [sys.executable, "-m", "runner", "validate", "experiments/cpu-tiny.yaml"],
        cwd=project,
        capture_output=True,
        text=True,
    )
    assert out.returncode == 2
    assert "Traceback" not in out.stderr
    assert out.stderr.strip() == (
        "error: experiments/cpu-tiny.yaml: train.exposure_tokens: 307,201 is not a whole "
        "number of global batches of 2,048 tokens (16 x 128): use 307,200 or 309,248"
    )


def test_fingerprint_ignores_key_order_and_labels_but_not_values(project: Path):
    base = load_experiment(project / "experiments/cpu-tiny.yaml").fingerprint
    path = project / "recipes/model/llama-tiny.yaml"
    data = yaml.safe_load(path.read_text())
    path.write_text(yaml.safe_dump(dict(reversed(list(data.items()))), sort_keys=False))
    assert load_experiment(project / "experiments/cpu-tiny.yaml").fingerprint == base
    edit(project / "experiments/cpu-tiny.yaml", _set("description", "reworded"))
    assert load_experiment(project / "experiments/cpu-tiny.yaml").fingerprint == base
    edit(project / "experiments/cpu-tiny.yaml", _set("overrides", {"optim": {"lr": 0.001}}))
    assert load_experiment(project / "experiments/cpu-tiny.yaml").fingerprint != base


def test_two_files_resolving_to_the_same_config_share_the_fingerprint(project: Path):
    a = load_experiment(project / "experiments/cpu-tiny.yaml")
    data = yaml.safe_load((project / "experiments/cpu-tiny.yaml").read_text())
    data["name"] = "cpu-tiny-copy"
    data["overrides"] = {
        "model": {"n_layers": a.config.model.n_layers},
        "eval": {"micro_batch_sequences": "${train.global_batch_sequences}"},
    }
    assert a.config.eval.micro_batch_sequences == a.config.train.global_batch_sequences
    (project / "experiments/cpu-tiny-copy.yaml").write_text(yaml.safe_dump(data))
    assert load_experiment(project / "experiments/cpu-tiny-copy.yaml").fingerprint == a.fingerprint


def test_base_experiment_composes(project: Path):
    exp = load_experiment(project / "experiments/1p3b-mi300x.yaml")
    base = load_experiment(project / "experiments/1p3b.yaml")
    assert exp.config.hardware.device_name == "MI300X"
    assert exp.config.train.micro_batch_sequences == 16
    assert exp.config.model == base.config.model
    assert exp.fingerprint != base.fingerprint
    assert grad_accum(exp.config) == 32


def test_shipped_1p3b_is_the_seed_run():
    exp = load_experiment(REPO / "experiments/1p3b.yaml")
    c = exp.config
    assert (c.model.hidden_size, c.model.n_layers, c.train.seq_len) == (2048, 24, 2048)
    assert abs(c.train.exposure_tokens - 26e9) < 1e-3 * 26e9
    assert total_steps(c) * global_batch_tokens(c) == c.train.exposure_tokens
    assert model_vocab_size(c) == 50304


def _git(cwd, *args):
    subprocess.run(["git", *args], cwd=cwd, check=True, capture_output=True)


def _check_pr(cwd):
    return subprocess.run(
        [sys.executable, "-m", "runner", "check-pr", "--base", "main"], cwd=cwd, capture_output=True, text=True
    )


def test_check_pr_requires_version_bumps_and_refuses_silent_meaning_changes(project: Path):
    _git(project, "init", "-q", "-b", "main")
    _git(project, "-c", "user.email=t@t", "-c", "user.name=t", "add", "-A")
    _git(project, "-c", "user.email=t@t", "-c", "user.name=t", "commit", "-qm", "base")
    assert _check_pr(project).returncode == 0

    edit(project / "recipes/optim/adamw-tiny.yaml", _set("lr", 0.002))  # changed, not bumped
    out = _check_pr(project)
    assert out.returncode == 2
    assert "recipes/optim/adamw-tiny.yaml: version: changed since main but its version was not bumped" in out.stderr

    edit(project / "recipes/optim/adamw-tiny.yaml", _set("version", 2))  # bumped: the experiment must follow
    out = _check_pr(project)
    assert out.returncode == 2 and "experiments/cpu-tiny.yaml: recipes.optim: names adamw-tiny@1" in out.stderr

    edit(project / "experiments/cpu-tiny.yaml", _set("recipes", "optim", "adamw-tiny@2"))
    out = _check_pr(project)
    assert out.returncode == 2 and "experiments/cpu-tiny.yaml: version: changed" in out.stderr

    edit(project / "experiments/cpu-tiny.yaml", _set("version", 2))  # its dependants must follow in turn
    out = _check_pr(project)
    assert out.returncode == 2
    assert (
        "experiments/cpu-tiny-fsdp.yaml: base: names cpu-tiny@1 but experiments/cpu-tiny.yaml is version 2"
        in out.stderr
    )

    for dependant in ("cpu-tiny-fsdp", "cpu-tiny-moe"):
        edit(project / f"experiments/{dependant}.yaml", _set("base", "cpu-tiny@2"))
        edit(project / f"experiments/{dependant}.yaml", _set("version", 2))
    out = _check_pr(project)
    assert out.returncode == 0, out.stderr
    assert "meaning changed: experiments/cpu-tiny.yaml" in out.stdout
    assert "meaning changed: experiments/cpu-tiny-fsdp.yaml" in out.stdout


def test_check_pr_catches_meaning_change_through_a_base_experiment(project: Path):
    _git(project, "init", "-q", "-b", "main")
    _git(project, "-c", "user.email=t@t", "-c", "user.name=t", "add", "-A")
    _git(project, "-c", "user.email=t@t", "-c", "user.name=t", "commit", "-qm", "base")
    edit(
        project / "experiments/1p3b.yaml",
        lambda d: (d.update(version=2), d["train"].update(log_interval_steps=5), d.update(seed=7)),
    )
    edit(project / "experiments/1p3b-mi300x.yaml", _set("base", "1p3b@2"))
    out = _check_pr(project)
    assert "experiments/1p3b-mi300x.yaml: version: changed" in out.stderr


def test_check_pr_and_validate_cover_pilot_experiments_in_subfolders(project: Path):
    pilots = project / "experiments/pilots"
    pilots.mkdir()
    (pilots / "cpu-tiny-pilot-a.yaml").write_text(
        "name: cpu-tiny-pilot-a\nversion: 1\ndescription: a pilot\nbase: cpu-tiny@1\n"
        "train: {exposure_tokens: 40960, max_duration_tokens: 40960}\n"
    )
    assert pilots / "cpu-tiny-pilot-a.yaml" in default_targets(project)
    _git(project, "init", "-q", "-b", "main")
    _git(project, "-c", "user.email=t@t", "-c", "user.name=t", "add", "-A")
    _git(project, "-c", "user.email=t@t", "-c", "user.name=t", "commit", "-qm", "base")
    edit(pilots / "cpu-tiny-pilot-a.yaml", _set("train", "exposure_tokens", 81920))  # changed, not bumped
    out = _check_pr(project)
    assert out.returncode == 2
    assert (
        "experiments/pilots/cpu-tiny-pilot-a.yaml: version: changed since main but its version was not bumped"
        in out.stderr
    )
    edit(pilots / "cpu-tiny-pilot-a.yaml", _set("version", 2))
    edit(project / "experiments/cpu-tiny.yaml", _set("version", 2))  # the pilot's base moves on under it
    out = _check_pr(project)
    assert out.returncode == 2
    assert "experiments/pilots/cpu-tiny-pilot-a.yaml: base: names cpu-tiny@1 but" in out.stderr


def test_every_problem_in_a_file_is_listed_at_once(project: Path):
    edit(
        project / "experiments/cpu-tiny.yaml",
        lambda d: d["train"].update(seq_len="abc", global_batch_sequences=16.5, exposur_tokens=1),
    )
    with pytest.raises(RunnerError) as err:
        load_experiment(project / "experiments/cpu-tiny.yaml")
    lines = str(err.value).splitlines()
    assert any("train.seq_len: must be an integer, got 'abc'" in l for l in lines)
    assert any("train.global_batch_sequences: must be an integer, got 16.5" in l for l in lines)
    assert any("train.exposur_tokens: unknown key (did you mean 'exposure_tokens'?)" in l for l in lines)


def test_a_hash_yaml_reads_as_a_number_is_told_to_be_quoted(project: Path):
    path = project / "experiments/cpu-tiny.yaml"
    text = path.read_text()
    pinned = yaml.safe_load(text)["data"]["manifests"]["code"]["sha256"]
    path.write_text(text.replace(pinned, "1" * 64))
    with pytest.raises(RunnerError, match=r"data.manifests.code.sha256: must be a string, got 1+ \(quote it"):
        load_experiment(path)


def test_experiment_name_must_match_its_file(project: Path):
    edit(project / "experiments/cpu-tiny.yaml", _set("name", "cpu-small"))
    with pytest.raises(RunnerError, match="experiments/cpu-tiny.yaml: name: 'cpu-small' differs from the file name"):
        load_experiment(project / "experiments/cpu-tiny.yaml")


def _validate(project: Path, *paths: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "runner", "validate", *paths],
        cwd=project,
        capture_output=True,
        text=True,
        env={**__import__("os").environ, "PYTHONPATH": str(REPO)},
    )


def test_validate_checks_data_pins_present_on_this_machine(project_with_data: Path):
    assert _validate(project_with_data, "experiments/cpu-tiny.yaml").returncode == 0
    edit(project_with_data / "experiments/cpu-tiny.yaml", _set("data", "manifests", "prose", "sha256", "ab" * 32))
    out = _validate(project_with_data, "experiments/cpu-tiny.yaml")
    assert out.returncode == 2
    assert "data/builtin/prose/manifest.json: data.manifests.prose.sha256: manifest sha256 is" in out.stderr


def test_validate_refuses_a_manifest_made_with_another_tokenizer(project_with_data: Path):
    from runner.data.manifest import write_manifest

    mpath = project_with_data / "data/builtin/legal/manifest.json"
    fields = json.loads(mpath.read_text())
    fields["tokenizer_sha256"] = "cd" * 32
    sha = write_manifest(mpath, fields)
    edit(project_with_data / "experiments/cpu-tiny.yaml", _set("data", "manifests", "legal", "sha256", sha))
    out = _validate(project_with_data, "experiments/cpu-tiny.yaml")
    assert (
        out.returncode == 2
        and "experiments/cpu-tiny.yaml: data.manifests.legal: data/builtin/legal/manifest.json was tokenized with tokenizer cdcdcdcdcdcd"
        in out.stderr
    )


def test_validate_refuses_an_infeasible_mixture(project_with_data: Path):
    edit(project_with_data / "recipes/mixture/builtin-3dom.yaml", _set("domains", "legal", "max_repetition_ratio", 1.0))
    out = _validate(project_with_data, "experiments/cpu-tiny.yaml")
    assert out.returncode == 2
    assert "experiments/cpu-tiny.yaml: mixture.domains.legal.max_repetition_ratio: mixture infeasible" in out.stderr
