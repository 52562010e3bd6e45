"""The speed options as recipe keys: checked at load with `file: key: message`, and fingerprints that
move only when an option changes what the run means.

New keys hold today's behaviour by default and are left out of the fingerprint while they do, so every
shipped experiment (and every saved run) keeps its fingerprint (pinned in tests/config/test_recipe.py); the
operational ones never count."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from runner.config.load import load_experiment
from runner.errors import RunnerError


def _edit_experiment(project: Path, name: str, **sections) -> Path:
    path = project / "experiments" / name
    data = yaml.safe_load(path.read_text())
    for section, keys in sections.items():
        target = data.setdefault("overrides", {}) if section in ("model", "optim", "hardware") else data
        target.setdefault(section, {}).update(keys)
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def test_defaults_written_out_keep_the_fingerprint_and_other_values_move_it(project: Path):
    base = load_experiment(project / "experiments/cpu-tiny.yaml").fingerprint
    same = _edit_experiment(
        project,
        "cpu-tiny.yaml",
        model={"compile_scope": "model", "kernels": "none", "cross_entropy": "plain"},
        train={"micro_batch_policy": "fixed", "prefetch_batches": 3, "system_metrics_interval_seconds": 0.5},
    )
    assert load_experiment(same).fingerprint == base  # defaults, and operational keys
    for section, keys in (("model", {"cross_entropy": "chunked"}), ("train", {"micro_batch_policy": "auto"})):
        _edit_experiment(project, "cpu-tiny.yaml", **{section: keys})
        moved = load_experiment(project / "experiments/cpu-tiny.yaml").fingerprint
        assert moved != base, keys
        base = moved


@pytest.mark.parametrize(
    "sections, key, words",
    [
        ({"model": {"kernels": "liger"}}, "model.kernels", "need a CUDA or ROCm GPU"),
        ({"model": {"cross_entropy": "liger"}}, "model.cross_entropy", "cross_entropy: chunked is the runner's own"),
        ({"model": {"compile_scope": "regional"}}, "model.compile_scope", "only with model.compile: true"),
        ({"train": {"prefetch_batches": -1}}, "train.prefetch_batches", "must be >= 0"),
        (
            {"train": {"system_metrics_interval_seconds": -2.0}},
            "train.system_metrics_interval_seconds",
            "must be in [0, 86,400] (0 = off)",
        ),
    ],
)
def test_speed_options_that_cannot_work_are_refused_naming_the_key(project: Path, sections, key, words):
    path = _edit_experiment(project, "cpu-tiny.yaml", **sections)
    with pytest.raises(RunnerError) as err:
        load_experiment(path)
    line = next(x for x in str(err.value).splitlines() if key in x)
    assert line.split(": ")[0].endswith("experiments/cpu-tiny.yaml") and words in line, line


def test_a_misspelt_choice_names_the_recipe_file_and_a_guess(project: Path):
    recipe = project / "recipes/model/llama-tiny.yaml"
    recipe.write_text(recipe.read_text() + "cross_entropy: chunkd\n")
    with pytest.raises(RunnerError) as err:
        load_experiment(project / "experiments/cpu-tiny.yaml")
    assert "recipes/model/llama-tiny.yaml: cross_entropy: 'chunkd' is not one of plain, chunked, liger" in str(
        err.value
    )
    assert "did you mean 'chunked'" in str(err.value)


def test_gpu_smoke_is_the_1p3b_shape_on_the_builtin_corpus():
    repo = Path(__file__).resolve().parents[2]
    smoke = load_experiment(repo / "experiments/gpu-smoke.yaml", check_files=False).config
    big = load_experiment(repo / "experiments/1p3b.yaml", check_files=False).config
    for key in ("hidden_size", "n_layers", "n_heads", "n_kv_heads", "intermediate_size", "tie_embeddings"):
        assert getattr(smoke.model, key) == getattr(big.model, key), key
    assert smoke.train.seq_len == big.train.seq_len and smoke.hardware.precision == "bf16"
    assert smoke.tokenizer.vocab_size == 4096 and "vocab 4,096" in smoke.description
    assert (smoke.model.compile, smoke.model.compile_scope, smoke.model.cross_entropy) == (True, "regional", "chunked")
    assert smoke.train.micro_batch_policy == "auto" and smoke.hardware.device_name == "H200 SXM"


def test_liger_kernels_under_whole_model_compile_on_a_gpu_are_refused_with_the_measured_reason(project: Path):
    # 1p3b (whole-model compile on an H200) with Liger's kernels: the fake-tensor failure measured on the device
    path = _edit_experiment(project, "1p3b.yaml", model={"kernels": "liger", "cross_entropy": "liger"})
    with pytest.raises(RunnerError) as err:
        load_experiment(path, check_files=False)
    line = next(x for x in str(err.value).splitlines() if "model.kernels" in x)
    assert line.split(": ")[0].endswith("experiments/1p3b.yaml")
    assert "fail under whole-model compile" in line and "liger-kernel 0.8.5" in line and "47.6%" in line
    # regional compile + Liger (gpu-smoke-liger) runs on the device: loaded, its description says it is slower
    liger = load_experiment(project / "experiments/gpu-smoke-liger.yaml", check_files=False).config
    assert (liger.model.compile_scope, liger.model.kernels) == ("regional", "liger")
    assert "47.6% MFU" in liger.description and "not a speed option" in liger.description
    # Liger's loss alone under whole-model compile was not what failed (liger's SwiGLU did): not refused
    path = _edit_experiment(project, "1p3b.yaml", model={"kernels": "none", "cross_entropy": "liger"})
    assert load_experiment(path, check_files=False).config.model.cross_entropy == "liger"
