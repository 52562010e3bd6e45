"""A model vocabulary smaller than the ids its data holds is refused at `validate` (issue 27, item 8):
a recipe saying 4,096 ids over a tokenizer or manifests of more passed validate and crashed launch
with an IndexError (a device-side assert on a GPU). The shipped experiments still validate with their
data: tests/cli/test_newcomer_friction.py validates three of them over the built-in corpus."""

from __future__ import annotations

import pytest
from bad_input_helpers import one_error, run_cli


def _shrink_vocab(project, ids: int) -> None:
    recipe = project / "recipes" / "tokenizer" / "builtin-bpe-4k.yaml"
    recipe.write_text(recipe.read_text().replace("vocab_size: 4096", f"vocab_size: {ids}"))


@pytest.mark.slow
def test_a_vocab_below_the_tokenizers_ids_is_one_line_at_validate_and_launch(project, capsys, monkeypatch):
    monkeypatch.chdir(project)
    _shrink_vocab(project, 1000)
    line = one_error(*run_cli(capsys, "validate", "experiments/cpu-tiny.yaml")[::2])
    assert line.startswith(
        "error: recipes/tokenizer/builtin-bpe-4k.yaml: vocab_size: 1,000, but runner/builtin/assets/tokenizer.json "
        "has 4,096 ids"
    ), line
    assert "set vocab_size: 4096" in line
    # launch makes its Accelerator before the data's check: start from a clean accelerate state, as
    # tests/trainfixtures.run_in_process does (an earlier test in this process may have made another)
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    try:
        assert one_error(*run_cli(capsys, "launch", "experiments/cpu-tiny.yaml")[::2]) == line
    finally:
        AcceleratorState._reset_state(reset_partial_state=True)
        GradientState._reset_state()
    assert not (project / "runs").exists()


def test_a_vocab_below_the_manifests_ids_is_refused_where_the_tokenizer_file_is_absent(
    project_with_data, capsys, monkeypatch
):
    monkeypatch.chdir(project_with_data)
    _shrink_vocab(project_with_data, 1000)
    (project_with_data / "runner/builtin/assets/tokenizer.json").unlink()  # only the manifests tell
    line = one_error(*run_cli(capsys, "validate", "experiments/cpu-tiny.yaml")[::2])
    assert line.startswith("error: recipes/tokenizer/builtin-bpe-4k.yaml: vocab_size: 1,000, but data/builtin/"), line
    assert "manifest.json was tokenized with 4,096 ids" in line
