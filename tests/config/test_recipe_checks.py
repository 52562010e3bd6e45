"""Validation that stands alone: each recipe file on its own, an experiment's feasibility from the
pool sizes it pins (CI has no data), domains dropped through `base:`, small validation sets."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
import yaml
from trainfixtures import check_pr

from runner.cli import main
from runner.config.load import load_experiment
from runner.data.pin import pin_experiment
from runner.errors import RunnerError

BAD_MIXTURE = """\
name: x
version: 1
description: ratios summing to 1.1 and a cap below one epoch
domains:
  web: {target_ratio: 0.6, max_repetition_ratio: 0.5}
  code: {target_ratio: 0.5}
"""

BROKEN_ALONE = [
    # (recipe file, its text, every line expected)
    (
        "recipes/mixture/x.yaml",
        BAD_MIXTURE,
        [
            "recipes/mixture/x.yaml: domains.web.max_repetition_ratio: must be >= 1.0 (epochs), got 0.5",
            "recipes/mixture/x.yaml: domains: target ratios sum to 1.1, not 1",
        ],
    ),
    (
        "recipes/model/x.yaml",
        "name: x\nversion: 1\ndescription: d\nhidden_size: 100\nn_layers: 2\nn_heads: 3\nn_kv_heads: 2\n"
        "intermediate_size: 256\n",
        [
            "recipes/model/x.yaml: n_heads: hidden_size 100 is not divisible by n_heads 3",
            "recipes/model/x.yaml: n_kv_heads: n_heads 3 is not divisible by n_kv_heads 2",
        ],
    ),
    (
        "recipes/tokenizer/x.yaml",
        "name: x\nversion: 1\ndescription: d\npath: t.json\nsha256: null\nvocab_size: 70000\neos_id: 70000\n"
        "token_dtype: uint16\nhub: {repo: nobody, revision: main, files: ['*.json']}\n",
        [
            "recipes/tokenizer/x.yaml: token_dtype: uint16 holds ids below 65,536 but vocab_size is 70,000: use uint32",
            "recipes/tokenizer/x.yaml: eos_id: 70000 is outside the vocabulary (size 70000)",
            "recipes/tokenizer/x.yaml: hub.repo: 'nobody' must be a Hub repository id, owner/name",
            "recipes/tokenizer/x.yaml: hub.files: a tokenizer is one file, not ['*.json']",
        ],
    ),
    (
        "recipes/optim/x.yaml",
        "name: x\nversion: 1\ndescription: d\nlr: 0\nbetas: [0.9, 1.5]\n",
        [
            "recipes/optim/x.yaml: lr: must be > 0, got 0.0",
            "recipes/optim/x.yaml: betas: must be two numbers in [0, 1), got [0.9, 1.5]",
        ],
    ),
    (
        "recipes/mixture/y.yaml",
        "name: y\nversion: 1\ndescription: d\ndomains:\n  web:\n    target_ratio: 1.0\n"
        "    source: {repo: a/b, repo_type: space, revision: main, files: ['*.parquet'], local_dir: raw}\n",
        ["recipes/mixture/y.yaml: domains.web.source.repo_type: 'space' is not one of model, dataset"],
    ),
    (  # a domain names MLflow metrics, report columns and card rows: `co de/..` and `a|b` were taken
        "recipes/mixture/z.yaml",
        "name: z\nversion: 1\ndescription: d\ndomains:\n  'co de/..': {target_ratio: 0.5}\n"
        "  'a|b': {target_ratio: 0.5}\n",
        [
            "recipes/mixture/z.yaml: domains.co de/..: not a domain name (a letter or digit, then letters, "
            "digits, '_', '.' and '-'; at most 100)",
            "recipes/mixture/z.yaml: domains.a|b: not a domain name (a letter or digit, then letters, "
            "digits, '_', '.' and '-'; at most 100)",
        ],
    ),
    (
        "recipes/eval/x.yaml",
        "name: x\nversion: 1\ndescription: d\ninterval_steps: 0\nsamples_per_domain: 4\n",
        ["recipes/eval/x.yaml: interval_steps: must be >= 1, got 0"],
    ),
]


@pytest.mark.parametrize("rel, text, lines", BROKEN_ALONE, ids=[b[0] for b in BROKEN_ALONE])
def test_each_recipe_file_is_validated_on_its_own(project: Path, monkeypatch, capsys, rel, text, lines):
    (project / rel).write_text(text)
    monkeypatch.chdir(project)
    assert main(["validate", rel]) == 2
    assert capsys.readouterr().err.splitlines() == [f"error: {line}" for line in lines]


def _git(cwd: Path, *args: str) -> None:
    subprocess.run(
        ["git", "-c", "user.email=t@t", "-c", "user.name=t", *args], cwd=cwd, check=True, capture_output=True
    )


@pytest.mark.slow
def test_check_pr_refuses_a_bad_recipe_no_experiment_uses(project: Path):
    _git(project, "init", "-q", "-b", "main")
    _git(project, "add", "-A")
    _git(project, "commit", "-qm", "base")
    (project / "recipes/mixture/x.yaml").write_text(BAD_MIXTURE)
    out = check_pr(project)
    assert out.returncode == 2
    assert "error: recipes/mixture/x.yaml: domains: target ratios sum to 1.1, not 1" in out.stderr
    assert "error: recipes/mixture/x.yaml: domains.web.max_repetition_ratio: must be >= 1.0" in out.stderr


def test_validate_outside_a_checkout_is_one_line_and_exit_2(tmp_path: Path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert main(["validate"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [
        f"error: no recipes/ folder in {tmp_path.resolve()} or above: run inside a runner checkout, "
        "or name the files to validate"
    ]


def test_validate_checks_the_eval_task_files_present_here_against_their_pins(project: Path, monkeypatch, capsys):
    """As for the manifests: a task file on this machine hashes to its pin, one absent is a note."""
    monkeypatch.chdir(project)
    assert main(["validate", "experiments/cpu-tiny-tasks.yaml"]) == 0
    out = capsys.readouterr().out
    assert (
        "note: experiments/cpu-tiny-tasks.yaml: eval.tasks.arc_easy.sha256: data/tasks/arc_easy/rc_0shot/"
        "requests.jsonl.gz is not on this machine: checked at launch (`runner fetch` writes it)"
    ) in out
    task = project / "data/tasks/arc_easy/rc_0shot/requests.jsonl.gz"
    task.parent.mkdir(parents=True)
    task.write_bytes(b"not the pinned file")
    assert main(["validate", "experiments/cpu-tiny-tasks.yaml"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [
        "error: data/tasks/arc_easy/rc_0shot/requests.jsonl.gz: eval.tasks.arc_easy.sha256: file sha256 is "
        "a08d9e349848bd89daff2c27d89e8eb3529dc848e2c9db433a674b629dc65d71, the recipe pins "
        "1e1aad851f24e0a547840f932d813c3380cafa77c5c92a6997a2151024a8573c"
    ], err


def test_an_infeasible_cap_names_the_mixture_recipe_to_edit(project_with_data: Path, monkeypatch, capsys):
    recipe = project_with_data / "recipes/mixture/builtin-3dom.yaml"
    recipe.write_text(recipe.read_text().replace("max_repetition_ratio: 3.0}", "max_repetition_ratio: 1.0}"))
    monkeypatch.chdir(project_with_data)
    assert main(["validate", "experiments/cpu-tiny.yaml"]) == 2
    err = capsys.readouterr().err
    assert "experiments/cpu-tiny.yaml: mixture.domains.legal.max_repetition_ratio: mixture infeasible" in err
    assert "(the cap is set in recipes/mixture/builtin-3dom.yaml: domains.legal.max_repetition_ratio)" in err


@pytest.mark.slow
def test_pinned_pool_sizes_check_feasibility_without_the_data(project_with_data: Path, monkeypatch, capsys):
    """`runner pin` writes each pool's size next to its sha256 (out of the fingerprint: the sha256
    already pins it); with the data gone, as in CI, validate and check-pr still refuse an
    infeasible mixture."""
    root = project_with_data
    fingerprints = {
        e: load_experiment(root / f"experiments/{e}.yaml").fingerprint for e in ("cpu-tiny", "cpu-tiny-fsdp")
    }
    result = pin_experiment(root / "experiments/cpu-tiny.yaml")
    # cpu-tiny changed (its pins): its version is bumped, and the experiments built on it follow
    assert sorted(p.name for p in result.changes) == [
        "cpu-tiny-fsdp.yaml",
        "cpu-tiny-lr.yaml",
        "cpu-tiny-moe-ds.yaml",
        "cpu-tiny-moe-v3.yaml",
        "cpu-tiny-moe.yaml",
        "cpu-tiny-tasks.yaml",
        "cpu-tiny.yaml",
    ]
    pinned = yaml.safe_load((root / "experiments/cpu-tiny.yaml").read_text())
    assert pinned["version"] == 3 and pinned["data"]["manifests"]["legal"]["pool_tokens"] == 12744
    for derived in ("cpu-tiny-fsdp", "cpu-tiny-lr", "cpu-tiny-moe", "cpu-tiny-tasks"):
        assert yaml.safe_load((root / f"experiments/{derived}.yaml").read_text())["base"] == "cpu-tiny@3"
    for derived in ("cpu-tiny-moe-ds", "cpu-tiny-moe-v3"):  # built on cpu-tiny-moe, bumped in turn
        assert yaml.safe_load((root / f"experiments/{derived}.yaml").read_text())["base"] == "cpu-tiny-moe@2"
    assert "# built by `runner data builtin`" in (root / "experiments/cpu-tiny.yaml").read_text()
    for e, fp in fingerprints.items():
        assert load_experiment(root / f"experiments/{e}.yaml").fingerprint == fp

    shutil.rmtree(root / "data")  # CI: no data
    _git(root, "init", "-q", "-b", "main")
    _git(root, "add", "-A")
    _git(root, "commit", "-qm", "pinned")
    recipe = root / "recipes/mixture/builtin-3dom.yaml"
    recipe.write_text(
        recipe.read_text()
        .replace("version: 1", "version: 2")
        .replace("max_repetition_ratio: 3.0}", "max_repetition_ratio: 1.0}")
    )
    for e in ("cpu-tiny", "cpu-tiny-fsdp"):
        path = root / f"experiments/{e}.yaml"
        v = yaml.safe_load(path.read_text())["version"]
        path.write_text(
            path.read_text().replace("builtin-3dom@1", "builtin-3dom@2").replace(f"version: {v}", f"version: {v + 1}")
        )
    monkeypatch.chdir(root)
    assert main(["validate", "experiments/cpu-tiny.yaml"]) == 2
    assert "cpu-tiny.yaml: mixture.domains.legal.max_repetition_ratio: mixture infeasible" in capsys.readouterr().err
    out = check_pr(root)
    assert out.returncode == 2 and "mixture.domains.legal.max_repetition_ratio: mixture infeasible" in out.stderr


def test_a_pinned_pool_size_that_disagrees_with_its_manifest_is_refused(project_with_data: Path):
    path = project_with_data / "experiments/cpu-tiny.yaml"
    data = yaml.safe_load(path.read_text())
    data["data"]["manifests"]["legal"]["pool_tokens"] = 99
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    from runner.data.manifest import check_experiment_data

    with pytest.raises(
        RunnerError, match="data.manifests.legal.pool_tokens: pins 99 but .* has 12,744: run `runner pin"
    ):
        check_experiment_data(load_experiment(path))


DROPPED = """\
name: cpu-tiny-2dom
version: 1
description: cpu-tiny without the small legal domain.
base: cpu-tiny@2
overrides:
  mixture:
    domains:
      legal: null          # removes the domain and its manifest pin
      code: {target_ratio: 0.55}
      prose: {target_ratio: 0.45}
"""


def test_a_derived_experiment_drops_a_domain_like_one_written_in_full(project: Path):
    (project / "experiments/cpu-tiny-2dom.yaml").write_text(DROPPED)
    dropped = load_experiment(project / "experiments/cpu-tiny-2dom.yaml")
    assert sorted(dropped.config.mixture.domains) == ["code", "prose"]
    assert sorted(dropped.config.data.manifests) == ["code", "prose"]

    full = yaml.safe_load((project / "experiments/cpu-tiny.yaml").read_text())
    del full["data"]["manifests"]["legal"]
    full.update(name="cpu-tiny-full", recipes={**full["recipes"], "mixture": "two-dom@1"})
    (project / "experiments/cpu-tiny-full.yaml").write_text(yaml.safe_dump(full, sort_keys=False))
    (project / "recipes/mixture/two-dom.yaml").write_text(
        "name: two-dom\nversion: 1\ndescription: code and prose\ndomains:\n"
        "  code: {target_ratio: 0.55, max_repetition_ratio: 4.0}\n"
        "  prose: {target_ratio: 0.45, max_repetition_ratio: 4.0}\n"
    )
    assert load_experiment(project / "experiments/cpu-tiny-full.yaml").fingerprint == dropped.fingerprint


def test_dropping_a_domain_that_is_not_there_is_refused(project: Path):
    (project / "experiments/cpu-tiny-2dom.yaml").write_text(DROPPED.replace("legal: null", "leagl: null"))
    with pytest.raises(RunnerError) as err:
        load_experiment(project / "experiments/cpu-tiny-2dom.yaml")
    assert (
        "cpu-tiny-2dom.yaml: overrides.mixture.domains.leagl: null removes a domain, but there is no domain 'leagl'"
        in str(err.value)
    )


def test_small_validation_sets_are_warned_at_validate(project_with_data: Path, monkeypatch, capsys):
    monkeypatch.chdir(project_with_data)
    assert main(["validate", "experiments/cpu-tiny.yaml"]) == 0
    warnings = [line for line in capsys.readouterr().out.splitlines() if "warning:" in line]
    assert warnings == [
        "warning: experiments/cpu-tiny.yaml: data.manifests.legal: domain 'legal' is validated on 2 samples "
        "(256 tokens), fewer than 16: its validation loss is mostly noise (hold out more text: "
        "`runner data prepare --validation-fraction`)"
    ]


@pytest.mark.slow  # ~4 s: five whole `runner validate` runs
def test_a_recipe_is_checked_once_per_content_and_its_problems_said_wherever_it_is_used(
    project: Path, monkeypatch, capsys
):
    """`runner validate` composes each recipe into every experiment naming it; its values are checked
    once per content (runner.config.load._RECIPE_CHECKS), and what the check found counts each time, as
    if it ran each time (said once per validate): the output equals the uncached check's, a fix is seen
    at once, and the file is named as it is shown from the current folder."""
    from runner.config import load

    monkeypatch.setattr(load, "_RECIPE_CHECKS", {})
    calls: list[Path] = []
    check = load._check_values_of

    def counted(data, kind, path, problems, resources):
        calls.append(path)
        check(data, kind, path, problems, resources)

    monkeypatch.setattr(load, "_check_values_of", counted)
    monkeypatch.chdir(project)
    loads: list[Path] = []
    load_file = load.load_recipe_file
    monkeypatch.setattr(load, "load_recipe_file", lambda p, *a, **k: loads.append(p) or load_file(p, *a, **k))
    assert main(["validate"]) == 0
    capsys.readouterr()
    recipe_files = sorted(project.glob("recipes/*/*.yaml"))
    assert sorted(calls) == recipe_files  # each once
    assert len(loads) > 2 * len(recipe_files)  # the experiments composed them again

    model = project / "recipes/model/llama-tiny.yaml"
    good = model.read_text()
    model.write_text(good.replace("n_kv_heads: 2", "n_kv_heads: 3"))
    assert main(["validate"]) == 2
    cached = capsys.readouterr()
    line = "error: recipes/model/llama-tiny.yaml: n_kv_heads: n_heads 4 is not divisible by n_kv_heads 3"
    # found through the recipe itself, cpu-tiny and gpu-smoke-cpu (which name it) and the experiments built
    # on them, said once (it was said once per experiment: the same line six times); each one is invalid
    assert cached.err.splitlines().count(line) == 1, cached.err
    assert int(cached.out.strip().splitlines()[-1].split(", ")[1].split()[0]) >= 3, cached.out
    cached_check = load._check_recipe_values
    monkeypatch.setattr(load, "_check_recipe_values", lambda *a: check(*a))  # no cache
    assert main(["validate"]) == 2
    assert capsys.readouterr() == cached

    monkeypatch.setattr(load, "_check_recipe_values", cached_check)
    model.write_text(good)  # fixed: the same process sees it
    assert main(["validate", str(model)]) == 0
    model.write_text(good.replace("n_kv_heads: 2", "n_kv_heads: 3"))
    assert main(["validate", str(model)]) == 2
    assert capsys.readouterr().err.splitlines() == [line]
    monkeypatch.chdir(project / "experiments")  # outside the recipe's folder: shown as given
    assert main(["validate", str(model)]) == 2
    assert capsys.readouterr().err.splitlines() == [line.replace("recipes/model", str(model.parent))]
