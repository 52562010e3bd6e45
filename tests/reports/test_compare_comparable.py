"""`runner compare` compares only what is comparable (issue 27, item 5): a 4,096-id run and a
74,096-id run, or runs over different validation sets, had their losses in nats, token counts and
"first in tokens" winners printed as equals. Losses in nats need the same tokenizer sha256 and the
same validation set (validation shards' sha256s, samples scored); bits per byte needs the same
validation documents; wall-clock figures from different machines are labelled."""

from __future__ import annotations

import json

import pytest
import yaml
from runfixtures import make_run

from runner.data.manifest import manifest_sha256
from runner.reports.compare import render
from runner.reports.compare import runs as cmp


def _compare(capsys, *runs) -> tuple[dict, str]:
    """What `runner compare RUNS --json` and `runner compare RUNS` print (read once, rendered twice)."""
    sources = [cmp.load_source(str(r)) for r in runs]
    cmp.assign_labels(sources)
    comp = cmp.compare(sources)
    return json.loads(json.dumps(render.to_json(comp))), render.render_markdown(comp)


def _edit_manifests(run, edit) -> None:
    for path in (run / "manifests").glob("*.json"):
        m = json.loads(path.read_text())
        edit(m)
        m["manifest_sha256"] = manifest_sha256({k: v for k, v in m.items() if k != "manifest_sha256"})
        path.write_text(json.dumps(m))


@pytest.fixture()
def runs(tmp_path):
    return make_run(tmp_path, run_id="a"), make_run(tmp_path, run_id="b")


def test_runs_of_different_tokenizers_compare_bits_per_byte_only(runs, capsys):
    a, b = runs
    cfg = yaml.safe_load((b / "experiment.yaml").read_text())
    cfg["tokenizer"].update(sha256="9f" * 32, vocab_size=74096, token_dtype="uint32")
    (b / "experiment.yaml").write_text(yaml.safe_dump(cfg, sort_keys=False))
    _edit_manifests(b, lambda m: m.update(tokenizer_sha256="9f" * 32, vocab_size=74096, token_dtype="uint32"))
    data, md = _compare(capsys, a, b)
    why = {(r["domain"], r["metric"]): r["why"] for r in data["not_comparable"]}
    assert set(why) == {(d, "loss_nats") for d in ("code", "math", "web", "mean")}
    assert (
        why[("code", "loss_nats")] == "tokenizers differ: sha256 abababababab (fixture/a) vs 9f9f9f9f9f9f (fixture/b)"
    )
    assert data["tokens_not_comparable"].startswith("tokenizers differ")
    for r in data["targets"]:
        assert not r["first_in_exposure_tokens"], r  # tokens of different tokenizers: no winner
        if r["target"] == "code-5":  # a loss_nats target: no winner by any measure
            assert not (r["first_in_wall_seconds"] or r["first_in_cost_usd"]), r
    assert "**NOT comparable** (shown, not to be compared):" in md
    assert "- code loss_nats: tokenizers differ: sha256 abababababab (fixture/a) vs 9f9f9f9f9f9f (fixture/b)" in md
    assert "- bits per byte is comparable for code, math, mean, web" in md
    assert "**Token counts NOT comparable**: tokenizers differ" in md
    assert "| not comparable | not comparable | not comparable |" in md  # code-5's first-in columns
    assert "not comparable (tokenizers differ)" in md


def test_runs_over_different_validation_sets_or_samples_compare_no_loss(runs, capsys):
    a, b = runs
    _edit_manifests(b, lambda m: m["validation_shards"][0].update(sha256="77" * 32))
    data, md = _compare(capsys, a, b)
    why = {(r["domain"], r["metric"]): r["why"] for r in data["not_comparable"]}
    assert (
        why[("web", "loss_nats")]
        == why[("web", "bpb")]
        == ("validation sets differ (the manifests' validation shard sha256s)")
    )
    assert "tokens_not_comparable" not in data  # one tokenizer: token counts are one unit
    assert "bits per byte is comparable" not in md
    _edit_manifests(b, lambda m: m["validation_shards"][0].update(sha256="ef" * 32))
    _edit_manifests(b, lambda m: m["sources"][0].update(sha256="34" * 32))  # other files, the same tokens scored
    assert "not_comparable" not in _compare(capsys, a, b)[0]
    _edit_manifests(b, lambda m: m.update(tokenizer_sha256="9f" * 32))  # ... by another tokenizer: other bytes
    cfg = yaml.safe_load((b / "experiment.yaml").read_text())
    cfg["tokenizer"]["sha256"] = "9f" * 32
    (b / "experiment.yaml").write_text(yaml.safe_dump(cfg, sort_keys=False))
    data, _ = _compare(capsys, a, b)
    why = {(r["domain"], r["metric"]): r["why"] for r in data["not_comparable"]}
    assert why[("code", "bpb")] == "validation documents differ (the manifests' sources or validation rule)"
    assert why[("mean", "bpb")] == "not comparable in code, math, web"


def test_wall_clock_across_machines_is_labelled_and_comparable_runs_say_nothing_new(runs, capsys):
    a, b = runs
    data, md = _compare(capsys, a, b)
    assert not {"not_comparable", "tokens_not_comparable", "wall_clock_machines"} & set(data)
    assert "NOT comparable" not in md and "different machines" not in md
    for run, host in ((a, "vm"), (b, "gpu-node-7")):
        info = json.loads((run / "run.json").read_text())
        info["system"] = {"nodes": {f"{host}#0": [0, 1]}}
        (run / "run.json").write_text(json.dumps(info))
    data, md = _compare(capsys, a, b)
    assert data["wall_clock_machines"] == {"fixture/a": "H200 SXM x 2 on vm", "fixture/b": "H200 SXM x 2 on gpu-node-7"}
    assert "**Wall-clock figures measured on different machines**" in md
    assert "(different machines)" in md
