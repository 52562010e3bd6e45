"""Recipes: every shipped file validates; each rule refuses a broken file naming its key."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from trainfixtures import check_pr, run_in_process

from runner.cli import default_targets, validate_one
from runner.config import load as config_load
from runner.config.rules import global_batch_tokens, grad_accum, model_vocab_size, total_steps
from runner.errors import RunnerError
from runner.planning.resources import load_experiment  # with the rules that need FLOPs and peaks, as the CLI

REPO = Path(__file__).resolve().parents[2]


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
    (
        "recipes/model/llama-tiny.yaml",
        _del("hidden_size"),
        "recipes/model/llama-tiny.yaml: hidden_size",
        "missing value",
    ),
    ("recipes/model/llama-tiny.yaml", _set("version", 2), "recipes.model", "names llama-tiny@1 but"),
    (
        "recipes/mixture/builtin-3dom.yaml",
        _set("domains", "legal", "target_ratio", 0.2),
        "recipes/mixture/builtin-3dom.yaml: domains",
        "sum to 1.1",
    ),
    ("recipes/tokenizer/builtin-bpe-4k.yaml", _set("sha256", "ab" * 32), "tokenizer.sha256", "the recipe pins"),
    (
        "recipes/tokenizer/builtin-bpe-4k.yaml",
        _set("vocab_size", 70_000),
        "builtin-bpe-4k.yaml: token_dtype",
        "use uint32",
    ),
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
    (  # a reference is a file name in its kind's folder, never a path (this one would load the same file)
        "experiments/cpu-tiny.yaml",
        _set("recipes", "model", "../model/llama-tiny@1"),
        "recipes.model",
        "NAME must be a file name in recipes/model/",
    ),
    ("experiments/cpu-tiny.yaml", _set("base", "../experiments/cpu-tiny@1"), "base", "file name in experiments/"),
    # a name becomes runs/<name>/ and reports/<name>/: '..' put them outside (caught before the file-name check)
    ("experiments/cpu-tiny.yaml", _set("name", ".."), "experiments/cpu-tiny.yaml: name", "'..' is not a name"),
    ("recipes/model/llama-tiny.yaml", _set("name", "a/b"), "llama-tiny.yaml: name", "'a/b' is not a name"),
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
        "recipes/mixture/builtin-3dom.yaml: domains.legal.max_repetition_ratio",
        ">= 1.0",
    ),
    ("recipes/hardware/cpu.yaml", _set("accelerator", "tpu"), "recipes/hardware/cpu.yaml: accelerator", "not one of"),
    ("recipes/optim/adamw-tiny.yaml", _set("betas", [0.9]), "recipes/optim/adamw-tiny.yaml: betas", "two numbers"),
    # values their type admits but nothing means (a fuzz of every key: each trained or planned silently)
    ("recipes/model/llama-tiny.yaml", _set("rope_theta", 0.0), "llama-tiny.yaml: rope_theta", "must be > 0"),
    ("recipes/model/llama-tiny.yaml", _set("rms_norm_eps", -1e-5), "llama-tiny.yaml: rms_norm_eps", "must be > 0"),
    ("recipes/model/llama-tiny.yaml", _set("init_std", 0.0), "llama-tiny.yaml: init_std", "must be in (0, 1]"),
    # 1e308: transformers' ValueError traceback at launch (initializer_range), after the run folder was made
    ("recipes/model/llama-tiny.yaml", _set("init_std", 1e308), "llama-tiny.yaml: init_std", "got 1e+308"),
    # 1e308: torch's RuntimeError traceback at launch (no float32 holds it), after the run folder was made
    ("recipes/optim/adamw-tiny.yaml", _set("lr", 1e308), "adamw-tiny.yaml: lr", "must be at most 1e+38"),
    ("recipes/optim/adamw-tiny.yaml", _set("eps", 0.0), "adamw-tiny.yaml: eps", "0 divides 0 by 0"),
    ("recipes/optim/adamw-tiny.yaml", _set("weight_decay", -0.1), "adamw-tiny.yaml: weight_decay", "grows the weights"),
    ("recipes/hardware/cpu.yaml", _set("memory_gib", -24.0), "cpu.yaml: memory_gib", "must be in (0, 1,000,000]"),
    ("recipes/hardware/cpu.yaml", _set("memory_gib", 1e308), "cpu.yaml: memory_gib", "got 1e+308"),
    ("recipes/hardware/cpu.yaml", _set("host_memory_gib", 0.0), "cpu.yaml: host_memory_gib", "must be in (0,"),
    (
        "recipes/hardware/cpu.yaml",
        _set("price_per_device_hour_usd", -1.0),
        "price_per_device_hour_usd",
        "[0, 1,000,000]",
    ),
    # 1e308 USD an hour planned a cost of `inf`
    ("recipes/hardware/cpu.yaml", _set("price_per_device_hour_usd", 1e308), "price_per_device_hour_usd", "got 1e+308"),
    ("recipes/hardware/cpu.yaml", _set("default_mfu", 3.0), "cpu.yaml: default_mfu", "must be in (0, 1]"),
    (
        "experiments/cpu-tiny.yaml",
        _set("plan", {"checkpoint_overhead_fraction": -0.9}),
        "plan.checkpoint_overhead_fraction",
        "must be in [0, 10] (a fraction of pure training time",
    ),
    (  # 1e308 was an OverflowError traceback from `runner job --slurm` (its time limit in whole seconds)
        "experiments/cpu-tiny.yaml",
        _set("plan", {"recovery_overhead_fraction": 1e308}),
        "plan.recovery_overhead_fraction",
        "must be in [0, 10]",
    ),
    ("experiments/cpu-tiny.yaml", _set("plan", {"raw_bytes_per_token": 0.0}), "plan.raw_bytes_per_token", "(0, 1,000]"),
    ("experiments/cpu-tiny.yaml", _set("plan", {"inference_tokens": -1.0}), "plan.inference_tokens", "[0, 1e+24]"),
    (  # went into the model card as it was: its metadata's `license` and a Markdown link in its Licence section
        "experiments/cpu-tiny.yaml",
        _set("export", {"license": "mit` and [free](http://evil.example) <b>x</b>"}),
        "export.license",
        "must be a Hub licence id",
    ),
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
    with pytest.raises(RunnerError, match="recipes/hardware/h200.yaml: device_name.*Z9000.*never another device"):
        load_experiment(project / "experiments/1p3b.yaml")


def test_a_model_whose_training_state_cannot_fit_is_refused_by_the_planning_rules(project: Path):
    edit(project / "recipes/hardware/h200.yaml", _set("memory_gib", 8))
    with pytest.raises(RunnerError, match=r"1p3b.yaml: model: 1,[0-9,]+ parameters need [0-9.,]+ GiB per device.*is 8"):
        load_experiment(project / "experiments/1p3b.yaml")
    # config's own loader judges what config alone can: FLOPs and peaks are planning's (config imports below it)
    assert config_load.load_experiment(project / "experiments/1p3b.yaml").config.hardware.memory_gib == 8
    # `runner pin` hands pin the same rules: it refuses before computing any pin
    from runner.data.pin import pin_experiment
    from runner.planning.resources import RULES

    with pytest.raises(RunnerError, match="parameters need"):
        pin_experiment(project / "experiments/1p3b.yaml", write=False, resources=RULES)


def test_cli_refuses_with_one_line_per_problem_and_exit_2(project: Path):
    edit(project / "experiments/cpu-tiny.yaml", _set("train", "exposure_tokens", 307_201))
    out = run_in_process(project, ["validate", "experiments/cpu-tiny.yaml"], dict(os.environ))
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


#: Fingerprints of the shipped experiments. A code change (schema defaults, loading, canonical form)
#: that moves one silently changes what every saved run of that experiment means; recipe edits are
#: check-pr's to catch, code edits this test's. (1p3b@2 names its Hub tokenizer and FineWeb-Edu source: what a run
#: reads is part of what it trains, so those five moved with that recipe change, not with code.)
SHIPPED_FINGERPRINTS = {
    "1p3b-1x8-ddp.yaml": "6db63a33a92b4436a72173dac935dead26a577ea59c6cdf7555277277eb7011f",
    "1p3b-1x8-fsdp.yaml": "a786c0f645e6d1adbcc95b029d13e025cb737a88aa87f63e5a8f124512f101fe",
    "1p3b-4x8-fsdp.yaml": "a9cddd971d065508584133b0ef2f3d6e40ea76dbae0a56f4bcfa75edbbfc613b",
    "1p3b-mi300x.yaml": "723e98c76a26ca595e5154f0cc85fab808443fe32d1ce53c10d61c2ad108051b",
    "1p3b.yaml": "d451b5bdd485a300fcc755b92193856231bba2a8e018c550a17aa886ce423ba4",
    "cpu-tiny-fsdp.yaml": "44dd4132a8054a99c8062b5cfc8e99da0992ca39819da950d5e2ae7c9ed7e355",
    "cpu-tiny.yaml": "4f70b16fe06fec74b7cd229c09683bf5eb96022517ab5cca3a4d29ac512799b4",
    "cpu-tiny-lr.yaml": "f2c4f6a7e9c445a4def58032699e185cef5cbd7e5f71cb57d8d09a174fc665f0",
    "cpu-tiny-moe.yaml": "9aa0f50c2f9affa70f230d470d754ec44c0cf4f6fd625268f5ff974b0a099125",
    "cpu-tiny-tasks.yaml": "4f70b16fe06fec74b7cd229c09683bf5eb96022517ab5cca3a4d29ac512799b4",  # cpu-tiny@2's: eval is operational
    "olmoe-1b-7b.yaml": "f278785c132e8cee8dacc5c9dac1dd0cab982769476f6b9d8f6a20db2264be5d",
    "gpu-smoke.yaml": "833fef114ea040d464aaf51bd36545cdc0c618c68e5d79c5f3df992c66aaf999",  # v2: 16 steps (issue 21)
    "gpu-smoke-cpu.yaml": "156e579cd9b8a3d9520ceccba9e92e402c9e1a875e4fe793454b7aa455fde944",  # v2: 16 steps
    "gpu-smoke-liger.yaml": "4fc59a335ee13b9ba91520b21abc253309b17ba11fed7f6a3a922d101ce315d4",  # gpu-smoke@2
    "cpu-tiny-moe-ds.yaml": "c1292048f4760920247ebfa03d742e8b012cc780c2814cf5da211c28303952cd",
    "cpu-tiny-moe-v3.yaml": "195f742582dad414fc57a2903131609dcb65e5f09efc11557230ce47f4fd249d",
    "moe-ds-1b.yaml": "030b1f17135b252390066e409c53ac56d7591dfac0ea1679f8ef8e5bd6be26ee",
}


@pytest.mark.parametrize("name", sorted(SHIPPED_FINGERPRINTS))
def test_shipped_experiment_fingerprints_are_unchanged(name):
    assert load_experiment(REPO / "experiments" / name).fingerprint == SHIPPED_FINGERPRINTS[name]


def test_shipped_1p3b_is_the_seed_run():
    exp = load_experiment(REPO / "experiments/1p3b.yaml")
    c = exp.config
    assert (c.model.hidden_size, c.model.n_layers, c.train.seq_len) == (2048, 24, 2048)
    assert abs(c.train.exposure_tokens - 26e9) < 1e-3 * 26e9
    assert total_steps(c) * global_batch_tokens(c) == c.train.exposure_tokens
    assert model_vocab_size(c) == 50304


def _git(cwd, *args):
    subprocess.run(["git", *args], cwd=cwd, check=True, capture_output=True)


def _version(path: Path) -> int:
    return yaml.safe_load(path.read_text())["version"]


def _base(path: Path) -> str | None:
    return yaml.safe_load(path.read_text()).get("base")


@pytest.mark.slow
def test_check_pr_requires_version_bumps_and_refuses_silent_meaning_changes(project: Path):
    _git(project, "init", "-q", "-b", "main")
    _git(project, "-c", "user.email=t@t", "-c", "user.name=t", "add", "-A")
    _git(project, "-c", "user.email=t@t", "-c", "user.name=t", "commit", "-qm", "base")
    assert check_pr(project).returncode == 0

    edit(project / "recipes/optim/adamw-tiny.yaml", _set("lr", 0.002))  # changed, not bumped
    out = check_pr(project)
    assert out.returncode == 2
    assert "recipes/optim/adamw-tiny.yaml: version: changed since main but its version was not bumped" in out.stderr

    edit(project / "recipes/optim/adamw-tiny.yaml", _set("version", 2))  # bumped: the experiment must follow
    out = check_pr(project)
    assert out.returncode == 2 and "experiments/cpu-tiny.yaml: recipes.optim: names adamw-tiny@1" in out.stderr

    edit(project / "experiments/cpu-tiny.yaml", _set("recipes", "optim", "adamw-tiny@2"))
    smoke = project / "experiments/gpu-smoke-cpu.yaml"  # the other experiment that names adamw-tiny
    edit(smoke, _set("recipes", "optim", "adamw-tiny@2"))
    edit(smoke, _set("version", _version(smoke) + 1))
    out = check_pr(project)
    assert out.returncode == 2 and "experiments/cpu-tiny.yaml: version: changed" in out.stderr

    v = _version(project / "experiments/cpu-tiny.yaml")
    edit(project / "experiments/cpu-tiny.yaml", _set("version", v + 1))  # its dependants must follow in turn
    out = check_pr(project)
    assert out.returncode == 2
    assert (
        f"experiments/cpu-tiny-fsdp.yaml: base: names cpu-tiny@{v} but experiments/cpu-tiny.yaml is version {v + 1}"
        in out.stderr
    )

    dependants = [p for p in sorted((project / "experiments").glob("*.yaml")) if _base(p) == f"cpu-tiny@{v}"]
    assert {p.stem for p in dependants} >= {"cpu-tiny-fsdp", "cpu-tiny-lr", "cpu-tiny-moe"}
    bumped = {f"cpu-tiny@{v}": f"cpu-tiny@{v + 1}"}
    while dependants:  # and the experiments built on those, in turn (cpu-tiny-moe-ds on cpu-tiny-moe)
        following = {}
        for path in dependants:
            was = _version(path)
            edit(path, _set("base", bumped[_base(path)]))
            edit(path, _set("version", was + 1))
            following[f"{path.stem}@{was}"] = f"{path.stem}@{was + 1}"
        bumped = following
        dependants = [p for p in sorted((project / "experiments").glob("*.yaml")) if _base(p) in bumped]
    out = check_pr(project)
    assert out.returncode == 0, out.stderr
    assert "meaning changed: experiments/cpu-tiny.yaml" in out.stdout
    assert "meaning changed: experiments/cpu-tiny-fsdp.yaml" in out.stdout


@pytest.mark.slow
def test_check_pr_catches_meaning_change_through_a_base_experiment(project: Path):
    _git(project, "init", "-q", "-b", "main")
    _git(project, "-c", "user.email=t@t", "-c", "user.name=t", "add", "-A")
    _git(project, "-c", "user.email=t@t", "-c", "user.name=t", "commit", "-qm", "base")
    edit(
        project / "experiments/1p3b.yaml",
        lambda d: (d.update(version=3), d["train"].update(log_interval_steps=5), d.update(seed=7)),
    )
    edit(project / "experiments/1p3b-mi300x.yaml", _set("base", "1p3b@3"))
    out = check_pr(project)
    assert "experiments/1p3b-mi300x.yaml: version: changed" in out.stderr


@pytest.mark.slow
def test_check_pr_and_validate_cover_pilot_experiments_in_subfolders(project: Path):
    pilots = project / "experiments/pilots"
    pilots.mkdir()
    v = _version(project / "experiments/cpu-tiny.yaml")
    (pilots / "cpu-tiny-pilot-a.yaml").write_text(
        f"name: cpu-tiny-pilot-a\nversion: 1\ndescription: a pilot\nbase: cpu-tiny@{v}\n"
        "train: {exposure_tokens: 40960, max_duration_tokens: 40960}\n"
    )
    assert pilots / "cpu-tiny-pilot-a.yaml" in default_targets(project)
    _git(project, "init", "-q", "-b", "main")
    _git(project, "-c", "user.email=t@t", "-c", "user.name=t", "add", "-A")
    _git(project, "-c", "user.email=t@t", "-c", "user.name=t", "commit", "-qm", "base")
    edit(pilots / "cpu-tiny-pilot-a.yaml", _set("train", "exposure_tokens", 81920))  # changed, not bumped
    out = check_pr(project)
    assert out.returncode == 2
    assert (
        "experiments/pilots/cpu-tiny-pilot-a.yaml: version: changed since main but its version was not bumped"
        in out.stderr
    )
    edit(pilots / "cpu-tiny-pilot-a.yaml", _set("version", 2))
    edit(project / "experiments/cpu-tiny.yaml", _set("version", v + 1))  # the pilot's base moves on under it
    out = check_pr(project)
    assert out.returncode == 2
    assert f"experiments/pilots/cpu-tiny-pilot-a.yaml: base: names cpu-tiny@{v} but" in out.stderr


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


def test_a_recipe_section_at_the_top_of_an_experiment_says_where_it_goes(project: Path):
    edit(project / "experiments/cpu-tiny.yaml", lambda d: d.update(eval={"interval_steps": 5}, evall=1))
    with pytest.raises(RunnerError) as err:
        load_experiment(project / "experiments/cpu-tiny.yaml")
    lines = str(err.value).splitlines()
    assert any(
        "eval: a recipe section, not an experiment key: name its recipe under 'recipes: {eval: ...}', or put "
        "changes under 'overrides: {eval: ...}'" in l
        for l in lines
    ), lines
    assert not any("did you mean 'eval'?) (" in l for l in lines)  # it suggested the key it refused
    assert any("evall: unknown key (did you mean 'eval'?)" in l for l in lines), lines


def test_a_hash_yaml_reads_as_a_number_is_told_to_be_quoted(project: Path):
    path = project / "experiments/cpu-tiny.yaml"
    text = path.read_text()
    pinned = yaml.safe_load(text)["data"]["manifests"]["code"]["sha256"]
    path.write_text(text.replace(pinned, "1" * 64))
    with pytest.raises(RunnerError, match=r"data.manifests.code.sha256: must be a string, got 1+ \(quote it"):
        load_experiment(path)


def test_a_number_yaml_reads_as_text_is_told_how_to_write_it_and_a_long_value_is_cut(project: Path):
    """YAML 1.1 (PyYAML) reads `3e-4` and `1e9` as text (a float needs a dot and a signed exponent): the
    line says so, for a number and an integer; a 3,000-character value is shown cut, with its length."""
    edit(project / "experiments/cpu-tiny.yaml", _set("overrides", {"optim": {"lr": "3e-4"}}))
    edit(project / "experiments/cpu-tiny.yaml", _set("train", "exposure_tokens", "1e9"))
    edit(project / "experiments/cpu-tiny.yaml", _set("train", "log_interval_steps", "x" * 3000))
    with pytest.raises(RunnerError) as err:
        load_experiment(project / "experiments/cpu-tiny.yaml")
    lines = str(err.value).splitlines()
    assert any("optim.lr: must be a number, got '3e-4'" in l and "3.0e-4" in l for l in lines), lines
    assert any("exposure_tokens: must be an integer, got '1e9'" in l and "in full" in l for l in lines), lines
    (long,) = [l for l in lines if "log_interval_steps" in l]
    assert "(3,002 characters)" in long and len(long.split("log_interval_steps: ")[1]) < 150, long


def test_experiment_name_must_match_its_file(project: Path):
    edit(project / "experiments/cpu-tiny.yaml", _set("name", "cpu-small"))
    with pytest.raises(RunnerError, match="experiments/cpu-tiny.yaml: name: 'cpu-small' differs from the file name"):
        load_experiment(project / "experiments/cpu-tiny.yaml")


def _validate(project: Path, *paths: str) -> subprocess.CompletedProcess:
    return run_in_process(project, ["validate", *paths], dict(os.environ))


@pytest.mark.slow
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


@pytest.mark.slow
def test_validate_refuses_an_infeasible_mixture(project_with_data: Path):
    edit(project_with_data / "recipes/mixture/builtin-3dom.yaml", _set("domains", "legal", "max_repetition_ratio", 1.0))
    out = _validate(project_with_data, "experiments/cpu-tiny.yaml")
    assert out.returncode == 2
    assert "experiments/cpu-tiny.yaml: mixture.domains.legal.max_repetition_ratio: mixture infeasible" in out.stderr


def test_the_config_is_typed_frozen_and_saves_as_before():
    from dataclasses import FrozenInstanceError

    from runner.config.data_recipes import DomainRecipe
    from runner.config.load import experiment_from_dict, to_yaml
    from runner.config.schema import ExperimentSchema, ModelRecipe

    exp = load_experiment(REPO / "experiments/cpu-tiny.yaml")
    cfg = exp.config
    assert isinstance(cfg, ExperimentSchema) and isinstance(cfg.model, ModelRecipe)
    assert isinstance(cfg.mixture.domains["code"], DomainRecipe)
    assert isinstance(cfg.model.rope_theta, float) and isinstance(cfg.train.seq_len, int)
    with pytest.raises(FrozenInstanceError):
        cfg.train.seq_len = 64  # type: ignore[misc]
    # What a run folder saves (experiment.yaml) reads back to the same config and fingerprint.
    saved = exp.to_container()
    assert list(saved) == ["name", "version", "description", "seed", "recipes", "tokenizer", "mixture", "model"] + [
        "optim",
        "hardware",
        "eval",
        "train",
        "data",
        "plan",
        "export",  # operational (issue 23): saved with the run, never in the fingerprint
    ]
    again = experiment_from_dict(yaml.safe_load(to_yaml(cfg)))
    assert again.config == cfg and again.fingerprint == exp.fingerprint == SHIPPED_FINGERPRINTS["cpu-tiny.yaml"]


def test_a_saved_config_typed_once_per_process_reads_back_as_if_typed_anew(monkeypatch):
    """experiment_from_dict remembers what it typed (a run's readers type one experiment.yaml many
    times): every read gives what typing it anew gives, its own copy, and a config that does not fit
    is refused on every read. 1 and True are equal and hash alike, and domain order is kept (the
    report lists domains in it): a key blind to either returns another config's typing."""
    import copy
    import dataclasses

    from runner.config.load import _TYPED_SAVED, experiment_from_dict

    saved = load_experiment(REPO / "experiments/cpu-tiny.yaml").to_container()
    reordered = copy.deepcopy(saved)
    reordered["mixture"]["domains"] = dict(reversed(list(saved["mixture"]["domains"].items())))
    variants = [saved, {**saved, "seed": True}, {**saved, "seed": "1"}, reordered, {**saved, "seed": 1.0}]

    def typed_anew(resolved):
        monkeypatch.setattr(config_load, "_TYPED_SAVED", {})
        try:
            got = experiment_from_dict(copy.deepcopy(resolved))
            return dataclasses.asdict(got.config), list(got.config.mixture.domains), got.fingerprint
        except RunnerError as e:
            return str(e)
        finally:
            monkeypatch.setattr(config_load, "_TYPED_SAVED", _TYPED_SAVED)

    want = [typed_anew(v) for v in variants]
    assert isinstance(want[1], str) and "seed" in want[1] and isinstance(want[4], str)  # True, 1.0: no int seed
    assert want[3][1] == ["legal", "prose", "code"] and want[3][2] == want[0][2]  # same fingerprint, its order
    _TYPED_SAVED.clear()
    for _ in range(2):  # the second pass reads from the memo
        for v, w in zip(variants, want):
            try:
                got = experiment_from_dict(copy.deepcopy(v))
                assert (dataclasses.asdict(got.config), list(got.config.mixture.domains), got.fingerprint) == w
            except RunnerError as e:
                assert str(e) == w
    assert len(_TYPED_SAVED) == 3  # saved, "1" and reordered; no refusal remembered
    one, two = experiment_from_dict(saved), experiment_from_dict(saved)
    assert one.config == two.config and one.config is not two.config
    one.config.mixture.domains.pop("code")  # a reader that changes its copy changes no later read
    assert "code" in experiment_from_dict(saved).config.mixture.domains


def test_published_reports_read_back_through_the_schema_to_their_recorded_fingerprint():
    from runner.config.load import load_saved_experiment

    saved = sorted(REPO.glob("reports/*/*/experiment.yaml"))
    assert saved
    for path in saved:
        recorded = json.loads((path.parent / "run.json").read_text())["fingerprint"]
        assert load_saved_experiment(path).fingerprint == recorded, path


def test_a_choice_is_refused_where_recipe_and_overrides_meet(project: Path):
    edit(project / "experiments/cpu-tiny.yaml", _set("overrides", {"optim": {"schedule": "cosin"}}))
    with pytest.raises(RunnerError) as err:
        load_experiment(project / "experiments/cpu-tiny.yaml")
    assert str(err.value).endswith(
        "experiments/cpu-tiny.yaml: optim.schedule: 'cosin' is not one of cosine, wsd, constant (did you mean 'cosine'?)"
    )
    assert "\n" not in str(err.value)


def test_each_section_validates_its_own_values_naming_the_key():
    from runner.config.schema import HardwareRecipe, ModelRecipe, TrainSection
    from runner.errors import Problems

    problems = Problems()
    ModelRecipe(version=1, hidden_size=64, n_layers=2, n_heads=4, n_kv_heads=3, intermediate_size=128).validate(
        problems, "m.yaml", "model"
    )
    HardwareRecipe(version=1, accelerator="cpu", precision="bf16", peak_tflops=None).validate(
        problems, "m.yaml", "hardware"
    )
    TrainSection(
        seq_len=16, global_batch_sequences=4, micro_batch_sequences=2, exposure_tokens=640, hard_stop_tokens=1024
    ).validate(problems, "m.yaml", "train")
    assert problems.lines == [
        "m.yaml: model.n_kv_heads: n_heads 4 is not divisible by n_kv_heads 3",
        "m.yaml: hardware.cpu_peak: a CPU has no datasheet peak: state peak_tflops, or set cpu_peak: theoretical | measured",
        "m.yaml: hardware.precision: CPU training runs in fp32",
        "m.yaml: train.hard_stop_tokens: must be in (0, exposure_tokens], got 1,024",
    ]


@pytest.mark.parametrize("licence", ["apache-2.0", "mit", "cc-by-nc-sa-4.0", "openrail++", "llama3.1", "other"])
def test_the_hubs_licence_ids_are_export_licences(licence):
    from runner.config.schema import ExportSection
    from runner.errors import Problems

    problems = Problems()
    ExportSection(license=licence).validate(problems, "e.yaml", "export")
    assert problems.lines == []
    ExportSection(license=licence.upper() + " x").validate(problems, "e.yaml", "export")
    assert len(problems.lines) == 1 and "export.license: must be a Hub licence id" in problems.lines[0]


def test_a_reader_that_stops_early_gets_no_traceback():
    # `runner show experiments/x.yaml | head -1`: the pipe closes before runner has written.
    proc = subprocess.Popen(
        [sys.executable, "-m", "runner", "show", "experiments/1p3b.yaml"],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    assert proc.stdout is not None and proc.stderr is not None
    proc.stdout.close()
    err = proc.stderr.read().decode()
    assert proc.wait() == 0 and err == "", err
