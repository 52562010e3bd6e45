"""`runner export`: a run's checkpoint as a folder transformers alone loads, verified, with its card.

Two tiny runs trained once per module (a tied Llama that also scores a downstream task, an untied
OLMoE) serve every case; the reference each export is compared with here is the runner's own model
with the checkpoint's weights (build_model + the checkpoint's state), not anything the export wrote.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch
import yaml
from datafixtures import arc_easy_task
from huggingface_hub import ModelCard
from safetensors import safe_open
from tokenizers import Tokenizer
from trainfixtures import env, launch, make_project, run_in_process
from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

from runner.config.load import experiment_from_dict, load_experiment
from runner.errors import RunnerError
from runner.export import folder as folder_mod
from runner.export import source as source_mod
from runner.export.export import export_run
from runner.export.source import open_source
from runner.export.verify import BF16_ATOL
from runner.fsio import read_jsonl, sha256_file
from runner.reports.tables import read_tables
from runner.runs.checkpoints import dirname
from runner.training.checkpoint import Checkpoint
from runner.training.model import build_model

STEPS, SEQ_LEN, BATCH = 4, 16, 8
PROMPTS = ["def main(", "the"]  #: llama_run's export.samples
#: llama_run's downstream targets: one met at the first scoring, one never
TASK_TARGETS = {
    "any": {"task": "aggregate", "metric": "mean_centered", "at_least": -1.0},
    "sure": {"task": "arc_easy", "metric": "acc", "at_least": 1.0},
}


def strict_json(path: Path):
    """JSON as strict readers take it: NaN and Infinity are refused."""

    def refuse(token: str):
        raise AssertionError(f"{path}: {token} is not JSON")

    return json.loads(path.read_text(), parse_constant=refuse)


def _tasks() -> dict:
    """llama_run's eval keys: a downstream task whose answers fit the 16-position context, scored at
    steps 2 and 4, and TASK_TARGETS."""
    return {
        "tasks": {"arc_easy": arc_easy_task(3, ["acc", "centered_acc", "bpb"])},
        "downstream_interval_steps": 2,
        "targets": TASK_TARGETS,
    }


MOE = {
    "arch": "olmoe",
    "intermediate_size": 32,
    "tie_embeddings": False,
    "moe": {"n_experts": 4, "experts_per_token": 2, "expert_intermediate_size": 32},
}


def _train(root: Path, export: dict | None = None, eval_extra: dict | None = None, **model_extra) -> Path:
    exp = make_project(
        root,
        steps=STEPS,
        seq_len=SEQ_LEN,
        global_batch=BATCH,
        checkpoint_every=2,
        eval_every=2,
        model_extra=model_extra,
    )
    if export:
        exp.write_text(yaml.safe_dump({**yaml.safe_load(exp.read_text()), "export": export}, sort_keys=False))
    if eval_extra:
        recipe = root / "recipes/eval/e.yaml"
        recipe.write_text(yaml.safe_dump({**yaml.safe_load(recipe.read_text()), **eval_extra}))
    proc = launch(root, exp, "--run-dir", "runs/r")
    (root / "launch.txt").write_text(proc.stdout)
    return root / "runs" / "r"


@pytest.fixture(scope="module")
def llama_run(tmp_path_factory) -> Path:
    """The tied Llama (make_project's model), scoring _tasks(), exporting itself at its end (`export.at_end`)."""
    samples = {"prompts": PROMPTS, "max_new_tokens": 5}
    return _train(
        tmp_path_factory.mktemp("llama"),
        export={"at_end": "exports", "license": "apache-2.0", "samples": samples},
        eval_extra=_tasks(),
    )


@pytest.fixture(scope="module")
def moe_run(tmp_path_factory) -> Path:
    return _train(tmp_path_factory.mktemp("moe"), **MOE)


@pytest.fixture(scope="module")
def llama_fp32(llama_run, tmp_path_factory) -> Path:
    """The tied Llama exported in fp32 through the CLI (in this process), and the run's hashes before."""
    before = _tree_hashes(llama_run)
    out = tmp_path_factory.mktemp("exports") / "llama-fp32"
    proc = run_in_process(
        llama_run.parents[1],
        ["export", str(llama_run), "--out", str(out), "--dtype", "fp32"],
        env(llama_run.parents[1]),
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "verified: logits within 1e-05" in proc.stdout
    assert _tree_hashes(llama_run) == before, "export changed the run folder"
    records = [json.loads(p.read_text()) for p in (llama_run / "exports").glob("*.json")]
    assert any(r["out"] == str(out.resolve()) and r["files"] == _tree_hashes(out) for r in records)
    return out


def _tree_hashes(folder: Path) -> dict[str, str]:
    """Every file's sha256, but the lock and the records of exports (RUN/exports/: the one thing an
    export adds to a run folder)."""
    return {
        str(p.relative_to(folder)): sha256_file(p)
        for p in sorted(folder.rglob("*"))
        if p.is_file() and p.name != "lock" and p.relative_to(folder).parts[0] != "exports"
    }


def _reference(run: Path, step: int) -> torch.nn.Module:
    state = json.loads((run / "checkpoints" / dirname(step) / "state.json").read_text())
    model = build_model(experiment_from_dict(state["config"]).config)
    model.load_state_dict(Checkpoint(run / "checkpoints" / dirname(step), step, state).model_state())
    return model.eval()


def _validation_ids(run: Path) -> torch.Tensor:
    """The first validation window of each domain, as the trainer's pools hold them."""
    root = run.parents[1]
    rows = []
    for d in ("a", "b"):
        tokens = np.fromfile(root / "data" / d / "validation-00000.bin", dtype=np.uint16)[:SEQ_LEN]
        rows.append(torch.from_numpy(tokens.astype(np.int64)))
    return torch.stack(rows)


# ---- item 1 and 2: the folder, loaded by transformers alone, equal to the run's model ----------


def test_fp32_folder_loads_with_transformers_alone_and_equals_the_runs_model(llama_run, llama_fp32):
    config = json.loads((llama_fp32 / "config.json").read_text())
    exp = load_experiment(llama_run.parents[1] / "experiments" / "t.yaml")
    m = exp.config.model
    assert config["architectures"] == ["LlamaForCausalLM"] and config["model_type"] == "llama"
    assert config["dtype"] == config["torch_dtype"] == "float32"
    assert (config["hidden_size"], config["num_hidden_layers"], config["num_attention_heads"]) == (
        m.hidden_size,
        m.n_layers,
        m.n_heads,
    )
    assert (config["num_key_value_heads"], config["intermediate_size"]) == (m.n_kv_heads, m.intermediate_size)
    assert config["rope_theta"] == config["rope_parameters"]["rope_theta"] == m.rope_theta
    assert config["rms_norm_eps"] == m.rms_norm_eps and config["vocab_size"] == exp.config.tokenizer.vocab_size
    assert config["max_position_embeddings"] == SEQ_LEN and config["tie_word_embeddings"] is True
    assert (config["bos_token_id"], config["eos_token_id"], config["pad_token_id"]) == (None, 0, 0)
    generation = GenerationConfig.from_pretrained(llama_fp32)
    assert generation.eos_token_id == 0 and generation.pad_token_id == 0 and generation.bos_token_id is None
    assert json.loads((llama_fp32 / "generation_config.json").read_text())["do_sample"] is False  # pipelines: greedy
    with safe_open(str(llama_fp32 / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
    assert "lm_head.weight" not in keys and "model.embed_tokens.weight" in keys  # tied: stored once

    loaded = AutoModelForCausalLM.from_pretrained(llama_fp32).eval()
    assert type(loaded).__name__ == "LlamaForCausalLM"
    assert loaded.lm_head.weight.data_ptr() == loaded.model.embed_tokens.weight.data_ptr()
    ids = _validation_ids(llama_run)
    with torch.no_grad():
        want = _reference(llama_run, STEPS)(input_ids=ids).logits
        got = loaded(input_ids=ids).logits
    assert float((got - want).abs().max()) <= 1e-5
    record = json.loads((llama_fp32 / "export.json").read_text())
    assert record["step"] == STEPS and record["verification"]["model"]["max_abs_logit_diff"] <= 1e-5


def test_the_plans_export_estimate_is_the_folders_weight_bytes(llama_run, llama_fp32):
    """`runner plan`'s export section: the folder holds every parameter once (the tied head once)."""
    from runner.planning.plan import build_plan  # noqa: PLC0415 (this test alone plans)

    exp = experiment_from_dict(yaml.safe_load((llama_run / "experiment.yaml").read_text()))
    stored = 0
    for name in (p for p in llama_fp32.iterdir() if p.suffix == ".safetensors"):
        with safe_open(str(name), framework="pt") as f:
            stored += sum(int(np.prod(f.get_slice(k).get_shape())) * 4 for k in f.keys())  # noqa: SIM118 (safe_open is not iterable)
    plan = build_plan(exp.config, root=llama_run)
    assert plan["export"]["dtype"] == "bf16"  # the recipe's export.dtype; this folder was written in fp32
    assert stored == 2 * plan["export"]["weights_bytes"]


def test_autotokenizer_gives_the_ids_the_run_trained_on(llama_run, llama_fp32):
    exp = load_experiment(llama_run.parents[1] / "experiments" / "t.yaml")
    pinned = Tokenizer.from_file(str(exp.resolve_path(exp.config.tokenizer.path)))
    pinned.encode_special_tokens = True  # how runner data prepare encodes documents
    assert sha256_file(llama_fp32 / "tokenizer.json") == exp.config.tokenizer.sha256  # the pinned file itself
    tok = AutoTokenizer.from_pretrained(llama_fp32)
    text = "def f(x):\n    return x  # <|endoftext|> is text inside a document\n"
    assert tok(text)["input_ids"] == pinned.encode(text, add_special_tokens=False).ids
    assert tok.eos_token_id == 0 and tok.bos_token is None and tok.model_max_length == SEQ_LEN
    tok_config = json.loads((llama_fp32 / "tokenizer_config.json").read_text())
    assert tok_config["tokenizer_class"] == "PreTrainedTokenizerFast" and tok_config["split_special_tokens"] is True


def test_the_card_carries_the_audited_reports_figures(llama_run, llama_fp32):
    card = ModelCard.load(llama_fp32 / "README.md")
    assert card.data.library_name == "transformers" and card.data.license == "apache-2.0"  # export.license
    assert "runner" in card.data.tags and "llama" in card.data.tags
    tables = read_tables(llama_run / "report")
    exp = load_experiment(llama_run.parents[1] / "experiments" / "t.yaml")
    accounting = strict_json(llama_fp32 / "accounting.json")  # jq and JavaScript read it: no NaN
    assert accounting["experiment"]["fingerprint"] == exp.fingerprint and exp.fingerprint in card.text
    by_domain = {r["domain"]: r for r in accounting["accounting"]}
    for row in tables["accounting"].to_dict("records"):
        mine = by_domain[row["domain"]]
        for k in ("pool_tokens", "unique_tokens", "exposure_tokens", "useful_tokens"):
            assert mine[k] == row[k] and f"{row[k]:,}" in card.text
        assert mine["epochs"] == pytest.approx(row["epochs"]) and mine["realized_ratio"] == pytest.approx(
            row["realized_ratio"]
        )
        assert mine["manifest_sha256"] == exp.config.data.manifests[row["domain"]].sha256 in card.text
    last = read_jsonl(llama_run / "metrics" / "eval.jsonl")[-2:]
    assert accounting["validation"]["step"] == STEPS
    for r in last:
        mine = next(v for v in accounting["validation"]["domains"] if v["domain"] == r["domain"])
        assert mine["loss_nats"] == pytest.approx(r["loss_nats"]) and f"{r['loss_nats']:.4g}" in card.text
    summary = tables["run_summary"].iloc[0]
    assert accounting["compute"]["mfu"] == pytest.approx(summary["mfu"])
    assert accounting["compute"]["convention"]["flops_formula"] == summary["flops_formula"]
    assert accounting["compute"]["device_hours"] == pytest.approx(summary["device_wall_seconds"] / 3600)
    assert accounting["audit"]["verdict"] in ("PASS", "UNVERIFIED") and accounting["audit"]["verdict"] in card.text
    assert (
        f"runner launch experiments/{exp.config.name}.yaml --run-name r   # fingerprint {exp.fingerprint[:12]}"
        in card.text
    )
    saved = yaml.safe_load((llama_fp32 / "experiment.yaml").read_text())
    assert experiment_from_dict(saved).fingerprint == exp.fingerprint


def _card_table(card: str, heading: str) -> list[dict[str, str]]:
    """The Markdown table of the card's section `heading`, parsed: every row as wide as the header."""
    section = card[card.index(heading) :]
    section = section[: section.index("\n## ", len(heading))]
    rows = [line for line in section.splitlines() if line.startswith("|")]
    header = [c.strip() for c in rows[0].strip("|").split("|")]
    assert set(rows[1].replace("|", "")) == {"-"} and rows[1].count("|") == len(header) + 1
    cells = [[c.strip() for c in r.strip("|").split("|")] for r in rows[2:]]
    assert all(len(c) == len(header) for c in cells), section
    return [dict(zip(header, c)) for c in cells]


def _check_downstream_section(folder: Path, report: Path, step: int) -> list[dict[str, str]]:
    """The card's downstream section and accounting.json's `downstream` against the report's figures
    at `step` (every source) and the downstream targets judged on the loop's scorings up to it."""
    from runner.reports.downstream.report import numbered_records
    from runner.training.task_targets import TaskTarget, task_targets_table

    card = (folder / "README.md").read_text()
    got = strict_json(folder / "accounting.json")["downstream"]
    tables = read_tables(report)
    want = tables["downstream"][tables["downstream"]["step"] == step].reset_index(drop=True)
    assert len(want) == 4 and got["step"] == step  # arc_easy acc, centered_acc, bpb; the aggregate
    heading = f"## Downstream tasks (step {step})"
    rows = _card_table(card, heading)
    numbers, records = numbered_records(want["convention"])
    assert len(rows) == len(got["figures"]) == len(want)
    for shown, mine, (_, r), n in zip(rows, got["figures"], want.iterrows(), numbers):
        key = (r["source"], r["task"], r["metric"])
        assert (
            (shown["source"], shown["task"], shown["metric"]) == key == (mine["source"], mine["task"], mine["metric"])
        )
        assert mine["value"] == r["value"] and float(shown["value"]) == pytest.approx(r["value"], rel=1e-5, abs=1e-6)
        assert int(shown["documents"]) == mine["documents"] == r["documents"] == 3
        assert int(shown["record"]) == mine["record"] == n
        assert mine["convention"] == json.loads(r["convention"])
        if r["task"] == "aggregate" or r["metric"] == "bpb":  # no random baseline to speak of
            assert shown["random baseline"] == shown["centered"] == "" and mine["random_baseline"] is None
        else:
            b = r["random_baseline"]
            assert float(shown["random baseline"]) == pytest.approx(b) and mine["random_baseline"] == b
        if r["metric"] == "acc":
            centered = (r["value"] - r["random_baseline"]) / (1 - r["random_baseline"])
            assert mine["centered"] == pytest.approx(centered) and float(shown["centered"]) == pytest.approx(centered)
    section = card[card.index(heading) : card.index("## Compute")]
    for i, record in enumerate(records, start=1):  # each record once, numbered, below the table
        assert section.count(f"{i}. `{record}`") == 1
    assert "nan" not in section and "{" not in "".join(line for line in section.splitlines() if line.startswith("|"))
    # The downstream targets as they stood at this step: the loop's scorings up to it, never later ones.
    declared = [TaskTarget(k, v["task"], v["metric"], v["at_least"]) for k, v in sorted(TASK_TARGETS.items())]
    price = float(tables["run_summary"]["price_per_device_hour"].iloc[0])
    judged = task_targets_table(declared, tables["downstream"], step, price)
    assert got["targets"] == judged.to_dict("records") and all(t["step"] <= step for t in got["targets"])
    shown_targets = _card_table(card, "## Downstream targets")
    assert [(t["target"], t["point"], int(t["step"])) for t in shown_targets] == [
        (t["target"], t["point"], t["step"]) for t in got["targets"]
    ]
    assert f"in-loop scorings up to this checkpoint (step {step})" in section
    assert "`any` (aggregate mean_centered >= -1): met at the first evaluation, step 2" in section
    return rows


def test_the_cards_downstream_section_is_a_table_of_the_final_steps_figures(llama_run, llama_fp32):
    rows = _check_downstream_section(llama_fp32, llama_run / "report", STEPS)
    assert {r["source"] for r in rows} == {"loop"}
    tables = read_tables(llama_run / "report")
    assert json.loads((llama_fp32 / "accounting.json").read_text())["downstream"]["targets"] == tables[
        "downstream_targets"
    ].to_dict("records")  # the final checkpoint: the report's own downstream_targets table


def test_the_cards_downstream_section_takes_every_source_at_its_step_and_says_when_there_is_none(llama_run):
    """runner eval figures of the checkpoint's step are on its card beside the loop's (a report
    rewritten after `runner eval` holds them); a step nobody scored is one line, a run without
    tasks no section at all."""
    import dataclasses

    from runner.export import card_downstream

    exp = load_experiment(llama_run.parents[1] / "experiments" / "t.yaml")
    tables = read_tables(llama_run / "report")
    loop = tables["downstream"]
    later = loop[loop["step"] == 2].assign(
        source="runner eval",
        convention=lambda df: [json.dumps({**json.loads(c), "limit": 2}, sort_keys=True) for c in df["convention"]],
    )
    tables["downstream"] = pd.concat([loop, later], ignore_index=True)
    at2 = card_downstream.downstream_figures(exp.config, tables, 2)
    assert [f["source"] for f in at2["figures"]] == ["loop"] * 4 + ["runner eval"] * 4
    assert {f["record"] for f in at2["figures"] if f["source"] == "runner eval"} == {3, 4}  # its own records
    assert all(t["step"] <= 2 for t in at2["targets"])
    at4 = card_downstream.downstream_figures(exp.config, tables, 4)
    assert {f["source"] for f in at4["figures"]} == {"loop"}  # another step's figures never travel
    lines = card_downstream.markdown(exp.config, card_downstream.downstream_figures(exp.config, tables, 3))
    assert lines[:3] == [
        "## Downstream tasks (step 3)",
        "",
        "No downstream scoring at step 3 (the audited report has scorings at steps 2, 4).",
    ]
    assert (
        lines[lines.index("## Downstream targets") :].count(
            "| target | point | step | exposure tokens | useful tokens | value | wall s | device-hours | cost USD |"
        )
        == 1
    )
    early = card_downstream.downstream_figures(exp.config, tables, 1)  # before any scoring: no table at all
    text = "\n".join(card_downstream.markdown(exp.config, early))
    assert "No downstream scoring at step 1" in text and "|" not in text and early["targets"] == []
    assert "`sure` (arc_easy acc >= 1): no evaluation recorded" in text
    bare = dataclasses.replace(exp.config, eval=dataclasses.replace(exp.config.eval, tasks={}, targets={}))
    nothing = {**tables, "downstream": loop.iloc[:0]}
    assert card_downstream.downstream_figures(bare, nothing, 4) is None
    assert card_downstream.markdown(bare, None) == []
    # a figure's rounding noise shows as 0 (an adversary's card read 6.93889e-17 for a centered 0)
    assert card_downstream._cell((0.2 - 0.2000000000000001) / 0.8) == "0" and card_downstream._cell(1 / 3) == "0.333333"


# ---- bf16, sharding, an earlier step -----------------------------------------------------------


def test_bf16_export_sharded_matches_the_runs_model_cast_to_bf16(llama_run, tmp_path):
    out = tmp_path / "bf16"
    done = export_run(llama_run, out, dtype="bf16", max_shard_size="100KB")
    index = json.loads((out / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 1 and all((out / s).is_file() for s in shards)
    assert json.loads((out / "config.json").read_text())["torch_dtype"] == "bfloat16"
    loaded = AutoModelForCausalLM.from_pretrained(out).eval()
    assert loaded.model.embed_tokens.weight.dtype == torch.bfloat16
    ids = _validation_ids(llama_run)
    reference = _reference(llama_run, STEPS).to(torch.bfloat16)
    with torch.no_grad():
        want, got = reference(input_ids=ids).logits.float(), loaded(input_ids=ids).logits.float()
    assert float((got - want).abs().max()) <= BF16_ATOL * max(1.0, float(want.abs().max()))
    assert done.verification["model"]["dtype"] == "bf16"


def test_an_earlier_step_carries_its_own_ledger_and_replayed_evaluation(llama_run, tmp_path):
    done = export_run(llama_run, tmp_path / "step2", step=2, dtype="fp32")
    accounting = json.loads((done.out / "accounting.json").read_text())
    assert accounting["checkpoint"] == {**accounting["checkpoint"], "step": 2, "final": False}
    assert accounting["checkpoint"]["exposure_tokens"] == 2 * BATCH * SEQ_LEN  # not the final 4 steps' figure
    assert sum(r["exposure_tokens"] for r in accounting["accounting"]) == 2 * BATCH * SEQ_LEN
    # The replayed evaluation equals what the trainer recorded at step 2 (the same samples, the same weights).
    recorded = {r["domain"]: r for r in read_jsonl(llama_run / "metrics" / "eval.jsonl") if r["step"] == 2}
    for r in accounting["validation"]["domains"]:
        assert r["loss_nats"] == pytest.approx(recorded[r["domain"]]["loss_nats"], rel=1e-5)
    assert "step 2" in (done.out / "README.md").read_text()
    # Its downstream figures are step 2's scoring, not the final one's (bpb moved between them).
    rows = _check_downstream_section(done.out, llama_run / "report", 2)
    final = json.loads((llama_run.parents[1] / "exports" / llama_run.name / "accounting.json").read_text())
    bpb = {
        f["step"]: next(r for r in f["figures"] if r["metric"] == "bpb")
        for f in (accounting["downstream"], final["downstream"])
    }
    assert (
        bpb[2]["value"] != bpb[STEPS]["value"]
        and "## Downstream tasks (step 4)" not in (done.out / "README.md").read_text()
    )
    assert next(r for r in rows if r["metric"] == "bpb")["value"] == f"{bpb[2]['value']:.6g}"


# ---- refusals: nothing is left behind ----------------------------------------------------------


def _leftovers(parent: Path) -> list[str]:
    return sorted(p.name for p in parent.iterdir()) if parent.exists() else []


def test_a_damaged_checkpoint_is_refused_in_one_line_and_no_folder_is_written(llama_run, tmp_path):
    copy = tmp_path / "runs" / "r"
    shutil.copytree(llama_run, copy)
    weights = copy / "checkpoints" / dirname(STEPS) / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 1
    weights.write_bytes(bytes(data))
    out = tmp_path / "exports" / "x"
    proc = run_in_process(tmp_path, ["export", str(copy), "--out", str(out)], env(tmp_path))
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "model.safetensors sha256 mismatch" in errors[0] and "refusing to export" in errors[0]
    assert _leftovers(tmp_path / "exports") == []
    proc = run_in_process(tmp_path, ["export", str(copy), "--out", str(out), "--step", "3"], env(tmp_path))
    assert proc.returncode == 2 and "no checkpoint of step 3" in proc.stderr and "step-0000002" in proc.stderr
    # `runner sample` refuses it too, in its own words.
    line = _refused(tmp_path, ["sample", str(copy), "--prompt", "x"], "model.safetensors sha256 mismatch")
    assert line.endswith("refusing to sample from it") and "export" not in line


def _refused(root: Path, argv: list[str], says: str) -> str:
    """`runner ARGV` exits 2 with one error line, containing `says`, and no traceback; the line."""
    proc = run_in_process(root, argv, env(root))
    errors = [line for line in proc.stderr.splitlines() if "error:" in line]
    assert proc.returncode == 2 and "Traceback" not in proc.stderr and len(errors) == 1, proc.stderr
    assert says in errors[0], errors[0]
    return errors[0]


def _export_case(case: str, run: Path, earlier: Path, tmp: Path) -> tuple[list[str], str]:
    """(the export's extra argv, what its one error line says) for a refused option."""
    out = tmp / "out"
    if case == "parent is a file":
        (tmp / "mine.txt").write_text("keep")
        out = tmp / "mine.txt" / "out"
    elif case == "symlink to an empty folder":
        (tmp / "empty").mkdir()
        out = tmp / "link"
        out.symlink_to(tmp / "empty")
    elif case == "not empty":
        (tmp / "taken").mkdir()
        (tmp / "taken" / "mine.txt").write_text("keep")
        out = tmp / "taken"
    return {
        "inside the run folder": (["--out", str(run / "exported")], "is inside the run folder"),
        "parent is a file": (["--out", str(out)], "mine.txt is not a folder"),
        "unwritable": (["--out", "/proc/runner-export"], "--out: no folder can be made in /proc"),
        "symlink to an empty folder": (["--out", str(out)], f"--out: {out} is a symbolic link"),
        "not empty": (["--out", str(out)], "already exists and is not an empty folder"),
        "an earlier export": (["--out", str(earlier)], "holds an earlier export (step 4 of"),
        "shard size banana": (["--out", str(out), "--max-shard-size", "banana"], "--max-shard-size: not a size"),
        "shard size 0": (["--out", str(out), "--max-shard-size", "0"], "--max-shard-size: not a size: '0'"),
        "shard size 0KB": (["--out", str(out), "--max-shard-size", "0KB"], "a shard holds at least one byte"),
        "push repo id": (["--out", str(out), "--push", "not a/repo!"], "--push: not a Hub repository id"),
    }[case]


@pytest.mark.parametrize(
    "case",
    [
        "inside the run folder",
        "parent is a file",
        "unwritable",
        "symlink to an empty folder",
        "not empty",
        "an earlier export",
        "shard size banana",
        "shard size 0",
        "shard size 0KB",
        "push repo id",
    ],
)
def test_export_refuses_a_bad_out_or_option_in_one_line_before_any_work(llama_run, llama_fp32, tmp_path, case):
    if case == "unwritable" and not Path("/proc").is_dir():
        pytest.skip("no /proc here")
    work = tmp_path / "work"
    work.mkdir()
    argv, says = _export_case(case, llama_run, llama_fp32, work)
    before = {p: (p.read_bytes() if p.is_file() and not p.is_symlink() else None) for p in work.rglob("*")}
    run, earlier = _tree_hashes(llama_run), _tree_hashes(llama_fp32)
    _refused(tmp_path, ["export", str(llama_run), *argv, "--dtype", "fp32"], says)
    after = {p: (p.read_bytes() if p.is_file() and not p.is_symlink() else None) for p in work.rglob("*")}
    assert after == before  # nothing written, nothing removed: not a probe, not a temporary folder
    assert _tree_hashes(llama_run) == run and _tree_hashes(llama_fp32) == earlier
    assert not (llama_run / "exported").exists()


def test_a_shard_size_is_read_exactly_in_the_hubs_units():
    from runner.export.folder import shard_size_bytes

    assert shard_size_bytes("5GB") == 5 * 10**9 and shard_size_bytes(" 0.5 mb ") == 500_000
    assert shard_size_bytes("1" * 400 + "KB") == int("1" * 400) * 1000  # no float: 10**400 overflowed one
    assert shard_size_bytes(1) == 1


def test_an_existing_folder_is_never_written_over(llama_run, tmp_path):
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "mine.txt").write_text("keep")
    with pytest.raises(RunnerError, match="already exists"):
        export_run(llama_run, tmp_path / "taken")
    assert _leftovers(tmp_path / "taken") == ["mine.txt"]


def test_a_folder_that_differs_from_the_run_is_an_error_and_is_removed(llama_run, tmp_path, monkeypatch):
    real = source_mod.export_model

    def perturbed(src, dtype):
        model = real(src, dtype)
        with torch.no_grad():
            model.model.layers[0].mlp.down_proj.weight[0, 0] += 0.5  # one weight off
        return model

    monkeypatch.setattr(folder_mod, "export_model", perturbed)
    with pytest.raises(RunnerError, match="exported logits differ from the run's model"):
        export_run(llama_run, tmp_path / "out", dtype="fp32")
    assert _leftovers(tmp_path) == []
    monkeypatch.setattr(folder_mod, "export_model", real)

    real_tokenizer = folder_mod.write_tokenizer

    def wrong_eos(src, out):
        real_tokenizer(src, out)
        path = out / "tokenizer_config.json"
        path.write_text(json.dumps({**json.loads(path.read_text()), "eos_token": "the"}))

    monkeypatch.setattr(folder_mod, "write_tokenizer", wrong_eos)
    with pytest.raises(RunnerError, match="tokenizer mismatch: AutoTokenizer's eos_token_id"):
        export_run(llama_run, tmp_path / "out", dtype="fp32")
    assert _leftovers(tmp_path) == []


# ---- OLMoE, untied -----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def moe_fp32(moe_run, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("exports") / "moe"
    export_run(moe_run, out, dtype="fp32")
    return out


@pytest.mark.slow  # its own run: ~15 s on 2 loaded cores
def test_olmoe_untied_is_written_with_the_hubs_per_expert_keys_and_equals_the_run(moe_run, moe_fp32):
    config = json.loads((moe_fp32 / "config.json").read_text())
    assert config["architectures"] == ["OlmoeForCausalLM"] and config["tie_word_embeddings"] is False
    assert (config["num_experts"], config["num_experts_per_tok"]) == (
        MOE["moe"]["n_experts"],
        MOE["moe"]["experts_per_token"],
    )
    with safe_open(str(moe_fp32 / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
    assert "model.layers.0.mlp.experts.3.gate_proj.weight" in keys and "lm_head.weight" in keys
    assert not any(k.endswith("experts.gate_up_proj") for k in keys)  # the in-memory fused layout stays in memory
    loaded = AutoModelForCausalLM.from_pretrained(moe_fp32).eval()
    ids = _validation_ids(moe_run)
    with torch.no_grad():
        want = _reference(moe_run, STEPS)(input_ids=ids).logits
        got = loaded(input_ids=ids).logits
    assert float((got - want).abs().max()) <= 1e-5
    src = open_source(moe_run)
    assert src.final and src.step == STEPS


@pytest.mark.slow  # a process of its own (and, once, a pip install into the cache)
def test_transformers_4_57_alone_loads_both_folders_with_the_same_logits(llama_run, llama_fp32, moe_run, moe_fp32):
    from oldtransformers import consume

    cases = ((llama_run, llama_fp32, "LlamaForCausalLM"), (moe_run, moe_fp32, "OlmoeForCausalLM"))
    consumed = consume([(folder, _validation_ids(run).tolist(), "def main(") for run, folder, _ in cases])
    for (run, folder, cls), got in zip(cases, consumed):
        ids = _validation_ids(run)
        assert got["version"].startswith("4.57.") and got["class"] == cls
        with torch.no_grad():
            want = _reference(run, STEPS)(input_ids=ids).logits
        assert float((torch.tensor(got["logits"]) - want).abs().max()) <= 1e-5
        tok = AutoTokenizer.from_pretrained(folder)
        assert got["prompt_ids"] == tok("def main(")["input_ids"]
        # pipeline("text-generation") there writes what transformers 5's generate writes here.
        from runner.export.sample import sample

        assert got["text"] == sample(folder, "def main(", max_new_tokens=6).text


@pytest.mark.slow  # lm-eval's import alone takes seconds
def test_lm_eval_hflm_scores_the_folder_as_the_runs_model(llama_run, llama_fp32):
    lm_eval = pytest.importorskip("lm_eval", reason="the `eval` extra: pip install -e '.[eval]'")
    from lm_eval.api.instance import Instance
    from lm_eval.models.huggingface import HFLM

    assert lm_eval.__version__ == "0.4.13"
    lm = HFLM(pretrained=str(llama_fp32), dtype="float32", max_length=SEQ_LEN, device="cpu", batch_size=1)
    pairs = [("def main(", " return x"), ("", "The license")]  # an empty context takes lm-eval's prefix token
    got = lm.loglikelihood([Instance("loglikelihood", {}, pair, idx=0) for pair in pairs])
    tok = AutoTokenizer.from_pretrained(llama_fp32)
    model = _reference(llama_run, STEPS)
    for (context, continuation), (ll, _) in zip(pairs, got):
        # docs/SPEC.md "Downstream evaluation": c = encode(context) (or [EOS], no BOS here), k the rest
        if context:
            c = tok(context)["input_ids"]
            k = tok(context + continuation)["input_ids"][len(c) :]
        else:
            c, k = [tok.eos_token_id], tok(continuation, add_special_tokens=False)["input_ids"]
        t = torch.tensor([(c + k)[-(SEQ_LEN + 1) :]])
        with torch.no_grad():
            logp = model(input_ids=t[:, :-1]).logits.float().log_softmax(-1)[0]
        want = sum(float(logp[-len(k) + i, k[i]]) for i in range(len(k)))
        assert ll == pytest.approx(want, abs=1e-4 + 1e-6 * abs(want))


def test_export_keys_are_operational_and_leave_the_fingerprint(llama_run):
    root = llama_run.parents[1]
    exp = load_experiment(root / "experiments" / "t.yaml")
    data = yaml.safe_load((root / "experiments" / "t.yaml").read_text())
    path = root / "experiments" / "t-export.yaml"
    path.write_text(
        yaml.safe_dump(
            {**data, "name": "t-export", "export": {"at_end": "/tmp/x", "license": "apache-2.0", "dtype": "fp32"}}
        )
    )
    other = load_experiment(path)
    assert other.fingerprint == exp.fingerprint
    assert (other.config.export.at_end, other.config.export.license, other.config.export.dtype) == (
        "/tmp/x",
        "apache-2.0",
        "fp32",
    )
    path.write_text(yaml.safe_dump({**data, "name": "t-export", "export": {"dtype": "fp16"}}))
    with pytest.raises(RunnerError, match="export.dtype"):
        load_experiment(path)
    assert data["export"]["samples"]["prompts"] == PROMPTS  # llama_run samples; its fingerprint is the plain one
    path.write_text(yaml.safe_dump({**data, "name": "t-export", "export": {}}))
    assert load_experiment(path).fingerprint == exp.fingerprint
    path.write_text(yaml.safe_dump({**data, "name": "t-export", "export": {"samples": {"max_new_tokens": 0}}}))
    with pytest.raises(RunnerError, match="export.samples.max_new_tokens: must be >= 1"):
        load_experiment(path)
    seq_len = data["train"]["seq_len"]
    samples = {"prompts": PROMPTS, "max_new_tokens": 10**8}  # greedy every evaluation: would never end
    path.write_text(yaml.safe_dump({**data, "name": "t-export", "export": {"samples": samples}}))
    with pytest.raises(RunnerError, match=f"export.samples.max_new_tokens: .* at most {seq_len - 1}"):
        load_experiment(path)
    path.unlink()


# ---- export.at_end and runner sample ----------------------------------------------------------


def test_a_finished_launch_exports_itself_where_export_at_end_says(llama_run):
    root = llama_run.parents[1]
    out = root / "exports" / llama_run.name  # export.at_end / <run id>, outside the run folder
    assert f"export: {out.relative_to(root)} (bf16, verified" in (root / "launch.txt").read_text()
    assert json.loads((out / "config.json").read_text())["torch_dtype"] == "bfloat16"
    assert ModelCard.load(out / "README.md").data.license == "apache-2.0"  # export.license
    assert json.loads((out / "export.json").read_text())["step"] == STEPS


def test_sample_from_the_run_and_from_its_exported_folder_agree(llama_run, llama_fp32):
    from runner.export.sample import sample

    prompt = "def main("
    from_run = sample(llama_run, prompt, max_new_tokens=6)
    from_folder = sample(llama_fp32, prompt, max_new_tokens=6)
    assert from_run.text == from_folder.text and from_run.new_tokens == 6
    # The same greedy continuation as an argmax over the run's own model.
    tok = AutoTokenizer.from_pretrained(llama_fp32)
    ids = tok(prompt, return_tensors="pt")["input_ids"]
    model = _reference(llama_run, STEPS)
    with torch.no_grad():
        for _ in range(6):
            ids = torch.cat([ids, model(input_ids=ids).logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    assert from_run.text == tok.decode(ids[0, -6:])
    hot = [sample(llama_fp32, prompt, max_new_tokens=6, temperature=1.0, seed=s).text for s in (1, 1, 2)]
    assert hot[0] == hot[1] != hot[2]  # seeded: reproducible, and not the greedy text of every seed
    root = llama_run.parents[1]
    proc = run_in_process(root, ["sample", str(root / "data"), "--prompt", "x"], env(root))
    assert proc.returncode == 2 and "neither a run folder nor an exported model folder" in proc.stderr
    proc = run_in_process(root, ["sample", str(llama_fp32), "--prompt", prompt, "--max-new-tokens", "3"], env(root))
    assert proc.returncode == 0 and proc.stdout.startswith(prompt)
    from transformers import pipeline

    generate = pipeline("text-generation", model=str(llama_fp32), device="cpu")
    assert (
        generate(prompt, max_new_tokens=6, do_sample=False, return_full_text=False)[0]["generated_text"]
        == from_run.text
    )


def _damage(folder: Path, how: str) -> None:
    if how == "config.json not JSON":
        (folder / "config.json").write_text('{"model_type": "llama",')
    elif how == "config.json missing":
        (folder / "config.json").unlink()
    elif how == "safetensors truncated":
        weights = folder / "model.safetensors"
        weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    elif how == "tokenizer.json not JSON":
        (folder / "tokenizer.json").write_text("garbage")
    elif how == "tokenizer.json missing":
        (folder / "tokenizer.json").unlink()


@pytest.mark.parametrize(
    "how, says",
    ids=[
        "config.json not JSON",
        "config.json missing",
        "safetensors truncated",
        "tokenizer.json not JSON",
        "tokenizer.json missing",
    ],
    argvalues=[
        ("config.json not JSON", "config.json: not readable JSON"),
        ("config.json missing", "config.json: missing: the exported folder is damaged"),
        ("safetensors truncated", "model.safetensors: not a readable safetensors file"),
        ("tokenizer.json not JSON", "tokenizer.json: not readable JSON"),
        ("tokenizer.json missing", "tokenizer.json: missing: the exported folder is damaged"),
    ],
)
def test_sample_refuses_a_damaged_folder_naming_the_file(llama_fp32, tmp_path, how, says):
    folder = tmp_path / "copy"
    shutil.copytree(llama_fp32, folder)
    _damage(folder, how)
    _refused(tmp_path, ["sample", str(folder), "--prompt", "def main("], says)


@pytest.mark.parametrize(
    "option, says",
    ids=[
        "seed 1e23",
        "seed 10**23",
        "temperature nan",
        "temperature inf",
        "temperature < 0",
        "temperature 1e-300",
        "0 tokens",
        "-2 tokens",
    ],
    argvalues=[
        (["--seed", "1e23"], "argument --seed: an integer from 0 to 2**64 - 1, got 1e23"),
        (["--seed", str(10**23)], f"argument --seed: an integer from 0 to 2**64 - 1, got {10**23}"),
        (["--temperature", "nan"], "--temperature: 0 (greedy) or a finite number >= 0.001, got nan"),
        (["--temperature", "inf"], "--temperature: 0 (greedy) or a finite number >= 0.001, got inf"),
        (["--temperature", "-0.5"], "--temperature: 0 (greedy) or a finite number >= 0.001, got -0.5"),
        # logits / 1e-300 overflow float32: NaN probabilities were a RuntimeError traceback out of generate
        (["--temperature", "1e-300"], "--temperature: 0 (greedy) or a finite number >= 0.001, got 1e-300"),
        (["--max-new-tokens", "0"], "argument --max-new-tokens: must be >= 1, got 0"),
        (["--max-new-tokens", "-2"], "argument --max-new-tokens: must be >= 1, got -2"),
    ],
)
def test_sample_refuses_a_bad_setting_in_one_line(llama_fp32, option, says):
    _refused(llama_fp32.parent, ["sample", str(llama_fp32), "--prompt", "def main(", *option], says)


def test_sample_caps_the_new_tokens_at_what_the_models_context_leaves(llama_run, llama_fp32):
    from runner.export.sample import sample

    prompt = "def main("
    room = SEQ_LEN - len(AutoTokenizer.from_pretrained(llama_fp32)(prompt)["input_ids"])
    for target in (llama_fp32, llama_run):  # max_position_embeddings = seq_len, from either
        got = sample(target, prompt, max_new_tokens=100_000_000)
        assert got.new_tokens == room and f"--max-new-tokens 100000000 capped at {room}" in got.note
    assert sample(llama_fp32, prompt, max_new_tokens=room).note is None
    root = llama_run.parents[1]
    proc = run_in_process(root, ["sample", str(llama_fp32), "--prompt", prompt, "--max-new-tokens", "99999"], env(root))
    assert proc.returncode == 0 and f"note: --max-new-tokens 99999 capped at {room}:" in proc.stderr
    with pytest.raises(RunnerError, match=r"--prompt: encodes to \d+ tokens; the model's context is 16 positions"):
        sample(llama_fp32, "def main(x): return x + 1 # " * 4)
    for bad in ({"max_new_tokens": 0}, {"temperature": float("nan")}, {"seed": 2**64}):  # the API checks them too
        with pytest.raises(RunnerError, match=next(iter(bad)).replace("_", "-")):
            sample(llama_fp32, prompt, **bad)
    assert sample(llama_fp32, prompt, max_new_tokens=2, temperature=1e-3).new_tokens == 2  # the smallest allowed


def test_sample_of_a_model_with_nan_logits_is_one_line(llama_fp32, monkeypatch):
    """A diverged model (NaN weights, so NaN logits) sampled at T > 0: torch.multinomial's RuntimeError
    out of generate was a traceback; greedy still answers (argmax of NaN is an id)."""
    from runner.export import sample as sample_module

    opened = sample_module._from_folder

    def diverged(path):
        model, tokenizer, where = opened(path)
        with torch.no_grad():
            model.get_output_embeddings().weight.fill_(float("nan"))
        return model, tokenizer, where

    monkeypatch.setattr(sample_module, "_from_folder", diverged)
    with pytest.raises(RunnerError, match=r"next-token probabilities are not finite .*nothing to sample from"):
        sample_module.sample(llama_fp32, "def main(", max_new_tokens=2, temperature=1.0)


def test_export_samples_logs_each_evaluations_greedy_text_equal_to_generate_on_its_checkpoint(llama_run):
    from mlflow.tracking import MlflowClient

    from runner.export.sample import sample

    root = llama_run.parents[1]
    run_id = json.loads((llama_run / "run.json").read_text())["mlflow"]["run_id"]
    client = MlflowClient(tracking_uri=f"sqlite:///{root / 'mlflow.db'}")
    names = sorted(a.path for a in client.list_artifacts(run_id, "samples"))
    assert names == ["samples/step-000002.txt", "samples/step-000004.txt"]  # eval every 2 steps
    for step in (2, 4):  # checkpoints every 2 steps: the weights each evaluation sampled from
        local = Path(client.download_artifacts(run_id, f"samples/step-{step:06d}.txt", str(root / f"dl{step}")))
        text = local.read_text()
        assert text.startswith(f"step {step}, exposure {step * BATCH * SEQ_LEN} tokens, greedy")
        for i, prompt in enumerate(PROMPTS, 1):
            want = sample(llama_run, prompt, max_new_tokens=5, step=step)  # transformers generate
            assert f"=== prompt {i}: {prompt!r}\n{prompt}{want.text}\n" in text
    assert (llama_run / "samples" / "step-000004.txt").read_text() == text


def test_publish_includes_the_card_of_the_runs_export_and_still_audits(llama_run, llama_fp32, tmp_path):
    from runner.reports.publish import CARD_FILES, audit_reports

    root = llama_run.parents[1]
    run_id = json.loads((llama_run / "run.json").read_text())["run_id"]
    reports = tmp_path / "reports"
    # Without --card: the run's own export.at_end export (exports/<run id>) is found and included.
    proc = run_in_process(root, ["publish", str(llama_run), "--reports-dir", str(reports)], env(root))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    card = reports / "models" / f"t-{run_id}"
    assert f"model card: {card} (from {root / 'exports' / llama_run.name})" in proc.stdout
    assert sorted(p.name for p in card.iterdir()) == sorted(CARD_FILES)
    for f in CARD_FILES:
        assert (card / f).read_bytes() == (root / "exports" / llama_run.name / f).read_bytes()
    assert ModelCard.load(card / "README.md").data.license == "apache-2.0"
    results = audit_reports(reports)
    assert [r.source for r in results if not r.consistent] == [], "\n".join(r.render() for r in results)
    assert len(results) == 1 and Path(results[0].source).parent.name == "t"  # the report; the card's folder passes
    # --card names another export of the same final checkpoint (fp32): its card replaces the first.
    proc = run_in_process(
        root, ["publish", str(llama_run), "--reports-dir", str(reports), "--card", str(llama_fp32)], env(root)
    )
    assert proc.returncode == 0 and (card / "README.md").read_bytes() == (llama_fp32 / "README.md").read_bytes()
    # Not this run's final export: refused in one line before anything is published.
    other = tmp_path / "step2"
    shutil.copytree(llama_fp32, other)
    record = json.loads((other / "export.json").read_text())
    (other / "export.json").write_text(json.dumps({**record, "step": 2}))
    for bad, why in ((other, "exported at step 2, not the run's final step 4"), (root / "data", "no export.json")):
        proc = run_in_process(
            root, ["publish", str(llama_run), "--reports-dir", str(tmp_path / "r2"), "--card", str(bad)], env(root)
        )
        assert proc.returncode == 2 and why in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
        assert not (tmp_path / "r2").exists()


# ---- --push to the loopback Hub ----------------------------------------------------------------


@pytest.fixture()
def hub(monkeypatch):
    from fakehub import FakeHub

    with FakeHub() as server:
        server.tokens.add("hf_writer")
        monkeypatch.setenv("HF_ENDPOINT", server.url)
        monkeypatch.setenv("HF_TOKEN", "hf_writer")
        yield server


def test_push_commits_the_verified_folder_once_on_the_checkpoints_exposure_branch(llama_run, hub, tmp_path):
    from huggingface_hub import HfApi, snapshot_download

    root = llama_run.parents[1]
    out = tmp_path / "pushed"
    argv = ["export", str(llama_run), "--out", str(out), "--dtype", "fp32", "--push", "team/tiny", "--private"]
    proc = run_in_process(root, argv, env(root, HF_ENDPOINT=hub.url, HF_TOKEN="hf_writer"))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    exposure = STEPS * BATCH * SEQ_LEN  # the checkpoint's ledger: 4 steps x 8 x 16
    branch = f"step-{STEPS:07d}-exposure-{exposure}"
    assert branch == "step-0000004-exposure-512" and f"pushed: team/tiny branch {branch}" in proc.stdout
    assert hub.repos[("model", "team/tiny")]["private"] is True
    assert hub.commit_messages == ["runner export: step 4, exposure 512 tokens"]  # one commit per export
    refs = {
        b.name: b.target_commit for b in HfApi(endpoint=hub.url, token="hf_writer").list_repo_refs("team/tiny").branches
    }
    assert set(refs) == {"main", branch}
    # What a user downloads from that branch is the exported folder, byte for byte, and it loads.
    got = Path(snapshot_download("team/tiny", revision=branch, cache_dir=tmp_path / "cache", endpoint=hub.url))
    for f in out.iterdir():
        assert (got / f.name).read_bytes() == f.read_bytes(), f.name
    assert AutoModelForCausalLM.from_pretrained(got).config.architectures == ["LlamaForCausalLM"]


def test_push_failures_are_one_line_and_leave_no_branch_looking_complete(llama_fp32, hub, monkeypatch):
    from runner.export.push import push_folder

    def push(**kw):
        return push_folder(llama_fp32, "team/tiny", step=STEPS, exposure_tokens=512, **kw)

    pushed = push(revision="main")
    assert pushed.branch == "main" and hub.repos[("model", "team/tiny")]["refs"]["main"] == pushed.commit
    hub.fail_commits = True  # the commit fails after the branch was made: the branch goes again
    with pytest.raises(RunnerError, match=r"push to .* failed \(400\).*branch step-0000004-exposure-512 removed"):
        push()
    assert set(hub.repos[("model", "team/tiny")]["refs"]) == {"main"}
    hub.fail_commits, hub.refuse_writes = False, True
    with pytest.raises(RunnerError, match=r"refused the push \(403\).*not created"):
        push()
    monkeypatch.setenv("HF_TOKEN", "hf_wrong")
    hub.refuse_writes = False
    with pytest.raises(RunnerError, match=r"refused the token \(401\)"):
        push()
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")  # nothing listens on the discard port
    with pytest.raises(RunnerError, match="cannot reach the Hub at http://127.0.0.1:9"):
        push()
    root = llama_fp32.parent
    for name in ("HF_TOKEN", "HF_ENDPOINT"):
        monkeypatch.delenv(name)
    environ = {k: v for k, v in env(root).items() if k != "HF_TOKEN"}
    environ["HF_HOME"] = str(root / "no-hf-home")  # no saved login either
    proc = run_in_process(root, ["export", "x", "--out", str(root / "never"), "--push", "team/tiny"], environ)
    assert proc.returncode == 2 and proc.stderr.count("error:") == 1 and "no Hugging Face token" in proc.stderr
    assert not (root / "never").exists()


@pytest.mark.slow  # an export and the snippet's own process
def test_the_card_reads_as_the_hub_template_with_data_described_and_a_snippet_that_runs(llama_run, tmp_path):
    """Issue 38, item 2: what the model is (its parameter count = transformers'), its uses and limits,
    a usage snippet that runs on the folder, each domain's data with its source and licence (a
    datacard.json beside the manifest; none: said), tokens seen and epochs, the licence; figures rounded."""
    import re
    import subprocess
    import sys

    from transformers import AutoModelForCausalLM

    from runner.data.datacard import BUILTIN, write_datacard

    root = llama_run.parents[1]
    card_path = write_datacard(root / "data" / "a", "a", BUILTIN["prose"])
    out = tmp_path / "described"
    try:
        proc = run_in_process(root, ["export", str(llama_run), "--out", str(out), "--dtype", "fp32"], env(root))
    finally:
        card_path.unlink()
    assert proc.returncode == 0, proc.stdout + proc.stderr
    text = (out / "README.md").read_text()
    headings = [x for x in text.splitlines() if x.startswith("## ")]
    order = ["Model description", "Intended uses & limitations", "How to use", "Training data", "Evaluation"]
    order += ["Compute", "Audit", "Reproduce", "Licence"]
    assert [h for h in headings if h[3:] in order] == [f"## {h}" for h in order]
    params = AutoModelForCausalLM.from_pretrained(out).num_parameters()  # tied: the matrix counted once
    assert f"base language model of {params:,} parameters" in text
    assert "**Limitations.**" in text and "far too few for fluent or factual text" in text
    data = text.split("## Training data", 1)[1].split("### Data accounting", 1)[0]
    rows = {r["domain"]: r for r in _card_table("## Training data" + data + "\n## end", "## Training data")}
    assert rows["a"]["what it is"].startswith("English prose: the pydoc help topics of CPython 3.11")
    assert rows["a"]["licence"] == "[PSF-2.0](https://docs.python.org/3.11/license.html)"
    assert rows["b"]["what it is"].startswith("not described")
    accounting = strict_json(out / "accounting.json")
    seen = {r["domain"]: r["exposure_tokens"] for r in accounting["accounting"]}
    assert rows["a"]["tokens seen"] == f"{seen['a']:,}" and float(rows["a"]["epochs"]) > 0
    assert "The weights are released under `apache-2.0`" in text and "PSF-2.0" in text.split("## Licence")[1]
    floats = re.findall(r"(?<![\w.])\d+\.\d+(?![\w.])", text.split("## Reproduce")[0])
    assert floats and all(len(x.replace(".", "").lstrip("0")) <= 6 for x in floats), floats  # none printed raw
    snippet = text.split("```python\n", 1)[1].split("```", 1)[0]
    ran = subprocess.run(
        [sys.executable, "-c", snippet], cwd=out, env=env(root), capture_output=True, text=True, timeout=300
    )
    assert ran.returncode == 0, ran.stderr[-2000:]
    assert ran.stdout.startswith("The")  # the prompt, then 32 greedy tokens


@pytest.mark.slow  # its own run, a scoring and an export
def test_export_after_runner_eval_says_to_rebuild_the_report_first(tmp_path):
    """Issue 38, item 3: `runner eval` leaves report/ as it was; an export then would drop its figures
    from the card, so it is refused in one line naming the command; after `runner report` it exports
    them."""
    run = _train(tmp_path, eval_extra=_tasks())
    root = run.parents[1]
    scored = run_in_process(root, ["eval", str(run), "--tasks", "arc_easy"], env(root))
    assert scored.returncode == 0, scored.stderr
    assert f"report: not rebuilt; `runner report {run}` adds this scoring to it" in scored.stdout
    out = tmp_path / "exported"
    proc = run_in_process(root, ["export", str(run), "--out", str(out), "--dtype", "fp32"], env(root))
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1 and not out.exists(), proc.stderr
    assert lines[0].startswith("error: runs/r/report: report/ predates `runner eval`'s scoring of step 4: ")
    assert f"run `runner report {run}` first" in lines[0]
    assert run_in_process(root, ["report", str(run)], env(root)).returncode == 0
    proc = run_in_process(root, ["export", str(run), "--out", str(out), "--dtype", "fp32"], env(root))
    assert proc.returncode == 0, proc.stderr
    assert "| runner eval | arc_easy | acc |" in (out / "README.md").read_text()


def test_sample_refuses_a_config_that_does_not_describe_the_weights(llama_fp32, tmp_path):
    """Issue 37 item 5: config.json saying GPT-2 over Llama weights loaded with every weight newly
    initialised, and generated from it with exit 0 and no warning."""
    from transformers import GPT2Config

    folder = tmp_path / "mismatched"
    shutil.copytree(llama_fp32, folder)
    llama = json.loads((folder / "config.json").read_text())
    gpt2 = GPT2Config(
        vocab_size=llama["vocab_size"],
        n_positions=llama["max_position_embeddings"],
        n_embd=llama["hidden_size"],
        n_layer=llama["num_hidden_layers"],
        n_head=llama["num_attention_heads"],
    )
    (folder / "config.json").write_text(gpt2.to_json_string())
    line = _refused(tmp_path, ["sample", str(folder), "--prompt", "def main("], "config.json describes gpt2")
    assert " weights missing, which would be random (first " in line, line
    assert "weights in the files not used (first model." in line and line.endswith("partly random weights")


def _forge_card(folder: Path) -> None:
    """The adversary's edit: the card's MFU line says 61%, accounting.json's exposure x10."""
    readme = folder / "README.md"
    lines = readme.read_text().splitlines()
    at = next(i for i, line in enumerate(lines) if line.startswith("- MFU "))
    lines[at] = "- MFU 61.00%" + lines[at][lines[at].index(",") :]
    readme.write_text("\n".join(lines) + "\n")
    accounting = json.loads((folder / "accounting.json").read_text())
    accounting["accounting"][0]["exposure_tokens"] *= 10
    (folder / "accounting.json").write_text(json.dumps(accounting, indent=1) + "\n")


def test_an_edited_export_json_fails_verify_export_not_as_not_an_export(llama_run, llama_fp32, tmp_path):
    """export.json's step edited to "x", -1 or 400 digits: verify-export said "not an export" or "no
    checkpoint of step -1" (a 400-digit step: "File name too long"), exit 2, as for a folder that is no
    export at all. Its recorded sha256 differs: a FAIL (exit 1) naming both checks. Its verification
    figures of another type were a traceback."""
    root = llama_run.parents[1]
    for case, says in [
        ("x", 'step "x" is not a whole number >= 0'),
        (-1, "step -1 is not a whole number >= 0"),
        (10**400, "0 is not a whole number >= 0"),  # beyond int64: was "File name too long"
    ]:
        edited = tmp_path / f"edited-{str(case)[:4]}"
        shutil.copytree(llama_fp32, edited)
        record = json.loads((edited / "export.json").read_text())
        (edited / "export.json").write_text(json.dumps({**record, "step": case}))
        proc = run_in_process(root, ["verify-export", str(edited), "--run", str(llama_run)], env(root))
        lines = proc.stdout.splitlines()
        assert proc.returncode == 1 and lines[-1] == "verdict: FAIL" and "Traceback" not in proc.stderr, proc.stderr
        assert lines[1].startswith("  FAIL       files as recorded in the run folder when exported: "), lines
        assert "export.json (" in lines[1], lines
        assert lines[2].startswith("  FAIL       export.json names the run's checkpoint: ") and says in lines[2], lines
    # the verification figures the card states, of another type: a traceback re-rendering the card
    edited = tmp_path / "edited-verification"
    shutil.copytree(llama_fp32, edited)
    record = json.loads((edited / "export.json").read_text())
    record["verification"]["model"]["tolerance"] = "x"
    (edited / "export.json").write_text(json.dumps(record))
    proc = run_in_process(root, ["verify-export", str(edited), "--run", str(llama_run)], env(root))
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert "  FAIL       export.json's verification figures: verification.model must hold the numbers" in proc.stdout
    assert '"tolerance": "x"' in proc.stdout and "FAIL       model card = the audited report's figures" in proc.stdout


def test_verify_export_checks_an_export_against_its_run_and_a_forged_card_never_publishes(
    llama_run, llama_fp32, tmp_path
):
    """Issue 37 items 4 and 6: `runner verify-export` anchors outside the export (the hashes recorded
    in RUN/exports/ when it was written), checks the weights against the checkpoint tensor by tensor,
    config and tokenizer against the run's, and the card's and accounting.json's figures recomputed
    from the audited report; `publish --card` and `audit-reports` run it, `runner sample` checks the
    recorded hashes."""
    from safetensors.torch import load_file, save_file

    from runner.export.verify_export import RECORDS

    root = llama_run.parents[1]
    proc = run_in_process(root, ["verify-export", str(llama_fp32), "--run", str(llama_run)], env(root))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[-1] == "verdict: PASS" and all(line.split()[0] == "PASS" for line in lines[1:-1]), proc.stdout
    assert "tensors equal, exactly, to the checkpoint's cast as exported" in proc.stdout

    forged = tmp_path / "forged"
    shutil.copytree(llama_fp32, forged)
    _forge_card(forged)
    # the forger rewrites the run folder's record too: the figures are recomputed all the same
    records = sorted((llama_run / RECORDS).glob("*.json"))
    saved = {p: p.read_bytes() for p in records}
    from runner.export.verify_export import file_hashes

    for p in records:
        record = json.loads(p.read_text())
        if record["out"] == str(llama_fp32.resolve()):
            p.write_text(json.dumps({**record, "out": str(forged.resolve()), "files": file_hashes(forged)}))
    proc = run_in_process(root, ["verify-export", str(forged), "--run", str(llama_run)], env(root))
    for p, data in saved.items():
        p.write_bytes(data)
    assert proc.returncode == 1 and proc.stdout.splitlines()[-1] == "verdict: FAIL", proc.stdout
    checks = {line.split(":")[0].split(None, 1)[1]: line.strip() for line in proc.stdout.splitlines()[1:-1]}
    assert checks["files as recorded in the run folder when exported"].startswith("PASS")  # the forged record
    assert "accounting[0].exposure_tokens: " in checks["accounting.json = the audited report's figures"]
    assert "'- MFU 61.00%" in checks["model card = the audited report's figures"]
    # against the true record: the files that differ are named
    from runner.export.verify_export import FAIL, check_recorded_files

    against = check_recorded_files(forged, llama_run)
    assert against.status == FAIL and "README.md (sha256 differs), accounting.json (sha256 differs)" in against.detail

    # a weight edited (the shard rewritten, export.json's hashes too): named tensor by tensor
    weights = tmp_path / "weights"
    shutil.copytree(llama_fp32, weights)
    tensors = load_file(weights / "model.safetensors")
    name = sorted(tensors)[0]
    tensors[name] = tensors[name] + 1e-3
    save_file(tensors, weights / "model.safetensors", metadata={"format": "pt"})
    proc = run_in_process(root, ["verify-export", str(weights), "--run", str(llama_run)], env(root))
    assert (
        proc.returncode == 1 and f"FAIL       weights = checkpoint step {STEPS}'s: {name}: values differ" in proc.stdout
    )

    # an export written before records were kept (export.json lists no files, no record names it)
    from runner.export.verify_export import UNVERIFIED

    older = tmp_path / "older"
    shutil.copytree(llama_fp32, older)
    record = json.loads((older / "export.json").read_text())
    (older / "export.json").write_text(json.dumps({k: v for k, v in record.items() if k != "files"}))
    assert check_recorded_files(older, llama_run).status == UNVERIFIED

    # runner sample refuses the forged folder (its files are not the recorded ones), and says
    # "unverified" of an export whose run folder is not here
    line = _refused(tmp_path, ["sample", str(forged), "--prompt", "def main("], "differ from the run's record")
    assert "README.md (sha256 differs)" in line
    moved = tmp_path / "elsewhere"
    shutil.copytree(llama_fp32, moved)
    record = json.loads((moved / "export.json").read_text())
    (moved / "export.json").write_text(json.dumps({**record, "run_dir": str(tmp_path / "gone")}))
    proc = run_in_process(root, ["sample", str(moved), "--prompt", "def main(", "--max-new-tokens", "2"], env(root))
    assert proc.returncode == 0 and "unverified: the run folder it names" in proc.stderr, proc.stderr
    proc = run_in_process(
        root, ["sample", str(llama_fp32), "--prompt", "def main(", "--max-new-tokens", "2"], env(root)
    )
    assert proc.returncode == 0 and "verified: " in proc.stderr and "unverified" not in proc.stderr, proc.stderr

    # publish --card of the forged folder: refused before anything is published
    reports = tmp_path / "reports"
    proc = run_in_process(
        root, ["publish", str(llama_run), "--reports-dir", str(reports), "--card", str(forged)], env(root)
    )
    assert proc.returncode == 2 and "does not verify against the run (runner verify-export)" in proc.stderr
    assert "Traceback" not in proc.stderr and not reports.exists(), proc.stderr
    # an honest card publishes; its published copy forged afterwards FAILs audit-reports
    proc = run_in_process(
        root, ["publish", str(llama_run), "--reports-dir", str(reports), "--card", str(llama_fp32)], env(root)
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    proc = run_in_process(root, ["audit-reports", str(reports)], env(root))
    card = next((reports / "models").iterdir())
    assert proc.returncode in (0, 5) and f"PASS {card}" in proc.stdout, proc.stdout
    _forge_card(card)
    proc = run_in_process(root, ["audit-reports", str(reports)], env(root))
    assert proc.returncode == 1 and "accounting[0].exposure_tokens" in proc.stdout, proc.stdout
    assert "README.md line " in proc.stdout and "'- MFU 61.00%" in proc.stdout


@pytest.mark.slow  # lm-eval's import alone takes seconds
def test_the_card_carries_the_folders_own_scoring_in_its_dtype_beside_the_runs(llama_run):
    """Issue 37 item 10: the default export is bf16 while the run scored in fp32; at export time the
    folder is scored in its own dtype and the card shows both, each with its dtype. The reference:
    lm-evaluation-harness's HFLM on the bf16 folder (dtype=bfloat16), argmax of its log-likelihoods."""
    lm_eval = pytest.importorskip("lm_eval", reason="the `eval` extra: pip install -e '.[eval]'")
    from lm_eval.api.instance import Instance
    from lm_eval.models.huggingface import HFLM

    from runner.config.load import load_saved_experiment
    from runner.training.downstream.run import prepare, task_specs

    assert lm_eval.__version__ == "0.4.13"
    exported = llama_run.parents[1] / "exports" / llama_run.name  # export.at_end, bf16 by default
    accounting = json.loads((exported / "accounting.json").read_text())
    scoring = accounting["downstream"]["export_scoring"]
    assert scoring["dtype"] == "bfloat16" and scoring["step"] == STEPS
    ours = {(f["task"], f["metric"]): f["value"] for f in scoring["figures"]}
    assert set(ours) == {("arc_easy", m) for m in ("acc", "centered_acc", "bpb")} | {("aggregate", "mean_centered")}
    run_fig = {(f["task"], f["metric"]): f for f in accounting["downstream"]["figures"] if f["source"] == "loop"}
    assert run_fig[("arc_easy", "acc")]["convention"]["dtype"] == "float32"
    card = (exported / "README.md").read_text()
    row = (
        f"| arc_easy | acc | {ours[('arc_easy', 'acc')]:.6g} | {run_fig[('arc_easy', 'acc')]['value']:.6g} "
        "| loop, float32 |"
    )
    assert "## Downstream tasks scored on this folder (bfloat16, at export)" in card and row in card, card

    exp = load_saved_experiment(exported / "experiment.yaml", project_root=llama_run.parents[1])
    task = prepare(exp, task_specs(exp)).tasks[0]
    lm = HFLM(pretrained=str(exported), dtype="bfloat16", max_length=SEQ_LEN, device="cpu", batch_size=1)
    requests = [(r.context, r.continuation) for d in task.documents for r in d.requests]
    lls = [ll for ll, _ in lm.loglikelihood([Instance("loglikelihood", {}, p, idx=0) for p in requests])]
    at, right = 0, 0
    for d in task.documents:
        mine = lls[at : at + d.choices]
        at += d.choices
        right += int(max(range(d.choices), key=lambda i: (mine[i], -i)) == d.gold)
    assert ours[("arc_easy", "acc")] == pytest.approx(right / len(task.documents))
