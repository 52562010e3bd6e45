"""The planner's arithmetic reproduces the seed examples; plans of built configs are complete."""

import dataclasses
import json
import math

import pytest
from conftest import REPO
from transformers.utils.hub import convert_file_size_to_int

from runner.config.load import experiment_from_dict, load_experiment
from runner.errors import RunnerError
from runner.export import DEFAULT_MAX_SHARD_SIZE
from runner.planning import assumptions
from runner.planning.flops import params_of_config
from runner.planning.memory import memory_per_device
from runner.planning.plan import (
    EXPORT_SHARD_BYTES,
    SECONDS_PER_DAY,
    build_plan,
    chinchilla_optimal_tokens,
    compute_seconds,
    effective_tokens,
    pure_training_seconds,
    training_flops,
    wall_clock_seconds,
)
from runner.planning.plan_text import format_plan
from runner.reports.planning_inputs import read_calibration

H200 = 989.4


@pytest.mark.parametrize(
    "params,tokens,days", [(0.76e9, 25e9, 3.3), (1.3e9, 26e9, 6.0), (7e9, 140e9, 172.0), (13e9, 260e9, 590.0)]
)
def test_seed_training_days_at_40_percent_of_one_h200(params, tokens, days):
    seconds = compute_seconds(training_flops(params, tokens), 0.40, H200)  # 6ND at 40% of one H200
    assert seconds / SECONDS_PER_DAY == pytest.approx(days, rel=0.02)


def test_seed_wall_clock_with_overheads():
    pure = pure_training_seconds(10e9, 100e3)
    assert pure / 3600 == pytest.approx(27.8, abs=0.05)
    assert wall_clock_seconds(pure, 0.20) / 3600 == pytest.approx(33.3, abs=0.05)


def test_compute_rules_of_thumb():
    assert training_flops(1e9, 2e10) == 1.2e20
    assert chinchilla_optimal_tokens(1.3e9) == 26e9
    with pytest.raises(RunnerError):
        compute_seconds(training_flops(1e9, 1e9), 0.0, H200)


def test_effective_tokens_under_repetition():
    assert effective_tokens(100.0, 1.0) == 100.0
    # 4 epochs: R = 3 -> D' = U (1 + 15.4 (1 - e^(-3/15.4)))
    assert effective_tokens(100.0, 4.0) == pytest.approx(100 * (1 + 15.4 * (1 - math.exp(-3 / 15.4))))
    assert effective_tokens(100.0, 4.0) < 400.0
    assert effective_tokens(100.0, 1e6) == pytest.approx(100 * 16.4)  # saturates


def config(**train):
    t = dict(
        seq_len=128,
        global_batch_sequences=16,
        micro_batch_sequences=4,
        exposure_tokens=16 * 128 * 100,
        checkpoint={"keep_last": 2},
    )
    t.update(train)
    labels = {"version": 1, "description": "planner test"}
    return {
        "name": "tiny",
        **labels,
        "seed": 1,
        "tokenizer": {
            "name": "tok",
            **labels,
            "path": "tokenizer.json",
            "sha256": None,
            "vocab_size": 4096,
            "eos_id": 0,
            "token_dtype": "uint16",
        },
        "model": dict(
            name="llama-tiny",
            **labels,
            arch="llama",
            hidden_size=64,
            n_layers=2,
            n_heads=4,
            n_kv_heads=2,
            intermediate_size=172,
            tie_embeddings=True,
            attn_implementation="sdpa",
            activation_checkpointing=False,
        ),
        "optim": {"name": "adamw", **labels, "lr": 1e-3},
        "eval": {"name": "eval", **labels, "interval_steps": 10, "samples_per_domain": 4},
        "hardware": dict(
            name="h200",
            **labels,
            accelerator="cuda",
            device_name="H200 SXM",
            peak_tflops=None,
            peak_dtype="bf16",
            memory_gib=141,
            price_per_device_hour_usd=3.0,
            devices_per_node=1,
            nodes=1,
            precision="bf16",
            distributed="none",
            default_mfu=0.4,
        ),
        "mixture": {"name": "web", **labels, "domains": {"web": {"target_ratio": 1.0, "max_repetition_ratio": 1.0}}},
        "train": t,
        "data": {"manifests": {}},
        "plan": dict(
            checkpoint_overhead_fraction=0.02,
            eval_overhead_fraction=0.03,
            recovery_overhead_fraction=0.05,
            raw_bytes_per_token=4.2,
            inference_tokens=0,
        ),
    }


def typed(cfg: dict):
    """The planner reads the config the loader makes of a resolved dict."""
    return experiment_from_dict(cfg).config


def test_plan_of_a_config_is_consistent(tmp_path):
    cfg = config()
    plan = build_plan(typed(cfg), root=tmp_path)
    n = params_of_config(typed(cfg)).all
    tokens = 16 * 128 * 100
    assert plan["compute"]["flops_6n"] == pytest.approx(6 * params_of_config(typed(cfg)).non_embedding * tokens)
    assert plan["compute"]["tokens_per_param"] == pytest.approx(tokens / n)
    a = plan["time"]["assumed"]
    assert a["tokens_per_second"] == pytest.approx(0.4 * H200 * 1e12 / plan["compute"]["flops_per_token"])
    assert a["wall_hours"] == pytest.approx(a["pure_hours"] * 1.10)
    assert a["cost_usd"] == pytest.approx(a["wall_hours"] * 3.0)
    assert plan["time"]["measured"] is None
    assert plan["mixture"]["status"] == "absent"
    assert plan["storage"]["checkpoints_bytes"] == 2 * 12 * n
    assert plan["storage"]["token_shard_bytes"] == tokens * 2
    json.dumps(plan)
    text = format_plan(plan)
    assert "no data.manifests pinned" in text and "fits" in text
    # --mfu halves the throughput when the MFU halves
    assert build_plan(typed(cfg), mfu=0.2, root=tmp_path)["time"]["assumed"]["pure_hours"] == pytest.approx(
        2 * a["pure_hours"]
    )


def test_memory_by_hand_and_the_fit_verdict():
    cfg = config()
    n = params_of_config(typed(cfg)).all
    mem = memory_per_device(typed(cfg))
    s, b, h, kv, f, v, heads = 128, 4, 64, 32, 172, 4096, 4
    # bf16 copies of the matmul weights only: 2 layers' q, k, v, o, gate, up, down and the (tied) head
    copies = 2 * (2 * h + 2 * kv) * h + 2 * 3 * h * f + v * h
    assert mem["model_state_total_bytes"] == 16 * n + 2 * copies
    assert mem["grads_held_at_peak"]  # 4 micro batches per step: the first three's gradients wait
    # bytes per token under bf16 autocast: fp32 residual stream and norms, bf16 matmul inputs
    norm = 4 * h + 4 + 4 * h
    attention = norm + 3 * 2 * h + 2 * h + 2 * 2 * kv + 4 * heads + 2 * h
    mlp = norm + 2 * 2 * h + 4 * 2 * f
    head = norm + 2 * h + 4 * v + 9  # lm_head input, log-softmax, targets, mask
    rope = 2 * s * (h // heads) * 4
    saved = s * b * (2 * (attention + mlp) + head + 8) + rope
    transient = 8 * v * s * b  # the plain loss's backward: two fp32 [tokens, vocab] gradients
    assert mem["activation_bytes_saved"] == saved
    assert mem["activation_bytes_full"] == saved + transient
    checkpointed = s * b * (2 * 4 * h + head + 8) + s * b * (attention + mlp) + rope + transient
    assert mem["activation_bytes_checkpointed"] == checkpointed
    assert mem["fits"]
    # room for the state and checkpointed activations, not for the full activations
    assert mem["total_bytes"] == 16 * n + 2 * copies + saved + transient
    cfg["hardware"]["memory_gib"] = (16 * n + 2 * copies + mem["activation_bytes_checkpointed"] + 1) / 2**30
    mem = memory_per_device(typed(cfg))
    assert not mem["fits"] and mem["fits_with_checkpointing"]
    cfg["hardware"].update(distributed="fsdp", devices_per_node=8)
    assert memory_per_device(typed(cfg))["model_state_total_bytes"] == pytest.approx((16 * n + 2 * copies) / 8)


def test_manifests_named_but_not_on_disk_is_one_line(tmp_path):
    cfg = config()
    cfg["data"]["manifests"] = {"web": {"path": "data/web/manifest.json", "sha256": None}}
    plan = build_plan(typed(cfg), root=tmp_path)
    assert plan["mixture"]["status"] == "absent"
    assert "not on disk for web" in plan["mixture"]["line"]


def write_run(folder, rows, run_cfg=None):
    (folder / "metrics").mkdir(parents=True)
    (folder / "metrics" / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (folder / "run.json").write_text(json.dumps({"conventions": {}}))
    if run_cfg is not None:
        import yaml

        (folder / "experiment.yaml").write_text(yaml.safe_dump(run_cfg))


def test_calibration_replaces_assumptions(tmp_path):
    cfg = config()
    # first step slow (compile), then 1000 tokens/s for 1 s steps; wall 5 s over 4 s of steps
    rows = [
        dict(
            step=1,
            tokens_per_second=100.0,
            step_seconds=1.0,
            wall_seconds=1.5,
            tokens_processed=2048,
            tokens_useful=2040,
        )
    ]
    rows += [
        dict(
            step=i,
            tokens_per_second=1000.0,
            step_seconds=1.0,
            wall_seconds=1.5 + (i - 1) * 1.1666667,
            tokens_processed=2048 * i,
            tokens_useful=2040 * i,
        )
        for i in range(2, 5)
    ]
    write_run(tmp_path / "run", rows, cfg)
    cal = read_calibration(tmp_path / "run", typed(cfg))
    assert cal.processed_tokens_per_second == 1000.0
    assert cal.overhead_fraction == pytest.approx(0.25, abs=1e-4)
    assert cal.useful_fraction == pytest.approx(2040 / 2048)
    assert cal.same_experiment
    plan = build_plan(typed(cfg), calibration=cal, root=tmp_path)
    m = plan["time"]["measured"]
    assert m["pure_hours"] == pytest.approx(16 * 128 * 100 / 1000 / 3600)
    assert m["wall_hours"] == pytest.approx(m["pure_hours"] * 1.25, rel=1e-4)
    text = format_plan(plan)
    assert "measured" in text
    # what "measured MFU" is: the median step (not the whole run's wall clock, which is the overheads)
    assert f"measured MFU: the median step's tokens/s of {tmp_path / 'run'} (4 steps, the first left out" in text


def test_a_calibration_runs_start_up_is_added_once_never_a_fraction_of_training(tmp_path):
    """run.json t_startup is in wall_seconds: a 6-step smoke's 3.5 s start over 1 s of steps read as 350%
    overheads, and its full run at 18% MFU took longer than at an assumed 9%. The start-up is left out of
    the fraction and added once, per attempt."""
    cfg = config()
    rows = [dict(step=i, tokens_per_second=1000.0, step_seconds=1.0, wall_seconds=7.0 + 1.02 * i) for i in range(1, 7)]
    write_run(tmp_path / "run", rows, cfg)
    run_json = tmp_path / "run" / "run.json"
    run_json.write_text(json.dumps({"conventions": {}, "t_startup": {"seconds": 14.0, "attempts": 2}}))
    cal = read_calibration(tmp_path / "run", typed(cfg))
    # the last row's wall 13.12 s less the start-ups' 14.0 s is below the steps' 6 s: the steps' own time
    assert cal.overhead_fraction == 0.0 and cal.startup_seconds == 7.0
    run_json.write_text(json.dumps({"conventions": {}, "t_startup": {"seconds": 7.0, "attempts": 1}}))
    cal = read_calibration(tmp_path / "run", typed(cfg))
    assert cal.overhead_fraction == pytest.approx(6.12 / 6.0 - 1.0) and cal.startup_seconds == 7.0
    m = build_plan(typed(cfg), calibration=cal, root=tmp_path)["time"]["measured"]
    pure = 16 * 128 * 100 / 1000
    assert m["wall_hours"] * 3600 == pytest.approx(pure * 6.12 / 6.0 + 7.0)
    assert "its start-up (7.0 s, one attempt's) added once" in format_plan(
        build_plan(typed(cfg), calibration=cal, root=tmp_path)
    )


def test_calibration_from_another_model_carries_its_mfu(tmp_path):
    cfg = config()
    other = config()
    other["model"]["n_layers"] = 4
    write_run(tmp_path / "run", [dict(tokens_per_second=1e6, step_seconds=1.0, wall_seconds=1.0)], other)
    cal = read_calibration(tmp_path / "run", typed(cfg))
    assert not cal.same_experiment and "MFU is carried over" in cal.note
    m = build_plan(typed(cfg), calibration=cal, root=tmp_path)["time"]["measured"]
    assert m["mfu"] == pytest.approx(cal.mfu)


@pytest.mark.slow  # 3.5 s: the fixture run's report, plots included
def test_a_report_folder_calibrates_a_plan_as_its_run_does(tmp_path):
    """A published report (a colleague's H200 run) calibrates a plan: its throughput table's steps give the
    tokens/s and MFU its run folder gives; its run summary gives the whole run's wall clock, devices and
    useful fraction. A folder that is neither is one line."""
    import pandas as pd
    from runfixtures import make_run

    from runner.config.load import load_saved_experiment
    from runner.reports.audit.evidence import write_report_with_evidence

    run = make_run(tmp_path)
    write_report_with_evidence(run)
    cfg = load_saved_experiment(run / "experiment.yaml").config
    from_run, from_report = read_calibration(run, cfg), read_calibration(run / "report", cfg)
    assert from_report.processed_tokens_per_second == from_run.processed_tokens_per_second
    assert from_report.mfu == from_run.mfu and from_report.steps == from_run.steps and from_report.same_experiment
    summary = pd.read_parquet(run / "report" / "run_summary.parquet").iloc[0]
    steps = pd.read_parquet(run / "report" / "throughput.parquet")
    assert from_report.useful_fraction == summary["useful_tokens"] / summary["processed_tokens"] < 1  # a lost step
    assert from_report.overhead_fraction == pytest.approx(summary["wall_seconds"] / steps["step_seconds"].sum() - 1)
    plan = build_plan(cfg, calibration=from_report, root=tmp_path)
    assert plan["time"]["measured"]["tokens_per_second"] == from_run.processed_tokens_per_second
    with pytest.raises(RunnerError, match="no metrics/train.jsonl: not a run folder or a report folder"):
        read_calibration(tmp_path, cfg)
    table = pd.read_parquet(run / "report" / "run_summary.parquet")
    table["wall_seconds"] = float("nan")  # a damaged summary: one line, not a ValueError
    table.to_parquet(run / "report" / "run_summary.parquet")
    with pytest.raises(RunnerError, match=r"run_summary.parquet: wall_seconds: not a number: nan"):
        read_calibration(run / "report", cfg)


def test_a_run_on_another_kind_of_device_does_not_calibrate(tmp_path):
    """`runner plan experiments/1p3b.yaml --calibrate <a cpu-tiny run>` carried the CPU's 13% MFU to the
    H200 plan (20.8 days, $2,125 in the measured column): refused, naming both devices."""
    cfg = config()
    cpu = config()
    cpu["hardware"].update(name="cpu", accelerator="cpu", device_name="cpu", precision="fp32")
    write_run(tmp_path / "run", [dict(tokens_per_second=1e4, step_seconds=1.0, wall_seconds=1.0)], cpu)
    with pytest.raises(RunnerError) as err:
        read_calibration(tmp_path / "run", typed(cfg))
    assert str(err.value) == (
        f"{tmp_path / 'run'}: --calibrate: trained on a cpu (cpu), this plan is for a GPU (H200 SXM): an MFU "
        "measured on one kind of device says nothing of the other; calibrate with a run on a GPU"
    )
    write_run(tmp_path / "gpu", [dict(tokens_per_second=1e4, step_seconds=1.0, wall_seconds=1.0)], cfg)
    with pytest.raises(RunnerError, match=r"trained on a GPU \(H200 SXM\), this plan is for a cpu \(cpu\)"):
        read_calibration(tmp_path / "gpu", typed(cpu))


def test_calibration_needs_metrics(tmp_path):
    with pytest.raises(RunnerError, match="metrics/train.jsonl"):
        read_calibration(tmp_path, typed(config()))


def write_manifest_on_disk(root, domain, pool_tokens):
    import numpy as np

    from runner.data.manifest import write_manifest

    folder = root / "data" / domain
    folder.mkdir(parents=True)
    np.zeros(pool_tokens, dtype=np.uint16).tofile(folder / "train-00000.bin")
    np.zeros(10, dtype=np.uint16).tofile(folder / "val-00000.bin")
    fields = {
        "format": "runner-manifest/1",
        "domain": domain,
        "tokenizer_sha256": "t",
        "token_dtype": "uint16",
        "vocab_size": 4096,
        "eos_id": 0,
        "shards": [{"path": "train-00000.bin", "tokens": pool_tokens, "documents": 1, "sha256": "x"}],
        "validation_shards": [{"path": "val-00000.bin", "tokens": 10, "documents": 1, "sha256": "y"}],
        "validation": {"fraction": 0.02, "rule": "test"},
        "pool_tokens": pool_tokens,
        "documents": 1,
        "validation_tokens": 10,
        "validation_documents": 1,
        "sources": [],
    }
    return write_manifest(folder / "manifest.json", fields)


def test_mixture_plan_with_manifests_on_disk(tmp_path):
    # web pool: 20 samples of 128; code pool: 10 samples. 100 steps x 16 seqs = 1600 samples.
    web_sha = write_manifest_on_disk(tmp_path, "web", 20 * 128 + 1)
    write_manifest_on_disk(tmp_path, "code", 10 * 128 + 1)
    cfg = config()
    cfg["mixture"]["domains"] = {
        "web": {"target_ratio": 0.75, "max_repetition_ratio": 100.0},
        "code": {"target_ratio": 0.25, "max_repetition_ratio": 100.0},
    }
    cfg["data"]["manifests"] = {
        "web": {"path": "data/web/manifest.json", "sha256": web_sha},
        "code": {"path": "data/code/manifest.json", "sha256": "0" * 64},
    }
    plan = build_plan(typed(cfg), root=tmp_path)
    mix = plan["mixture"]
    assert mix["status"] == "planned"
    web, code = mix["domains"]["web"], mix["domains"]["code"]
    assert web["exposure_tokens"] == 0.75 * 16 * 128 * 100 and web["pool_tokens"] == 20 * 128
    assert web["epochs"] == pytest.approx(60.0) and code["epochs"] == pytest.approx(40.0)
    assert web["effective_tokens"] == pytest.approx(effective_tokens(20 * 128, 60.0))
    assert any("web: 60.0 epochs" in w for w in plan["warnings"])
    assert any("data.manifests.code.sha256" in w for w in plan["warnings"])
    assert plan["storage"]["data_tokens"] == 30 * 128
    text = format_plan(plan)
    assert "effective" in text and "warning: web: 60.0 epochs" in text
    # caps below the needed epochs: the plan says infeasible instead of failing
    cfg["mixture"]["domains"]["web"]["max_repetition_ratio"] = 2.0
    plan = build_plan(typed(cfg), root=tmp_path)
    assert plan["mixture"]["status"] == "infeasible" and "INFEASIBLE" in format_plan(plan)


def test_cli_plan_json_on_a_project_experiment(capsys):
    from pathlib import Path

    from runner.cli import main

    exp = Path(__file__).resolve().parents[2] / "experiments" / "1p3b.yaml"
    assert main(["plan", str(exp), "--json", "--mfu", "0.5"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["time"]["assumed"]["mfu"] == 0.5 and plan["hardware"]["peak_tflops"] == 989.4
    assert plan["memory"]["fits"] is True


@pytest.mark.slow
def test_plan_of_an_infeasible_mixture_prints_the_plan_and_exits_2(project_with_data):
    import yaml
    from trainfixtures import run_in_process

    path = project_with_data / "recipes/mixture/builtin-3dom.yaml"
    data = yaml.safe_load(path.read_text())
    data["domains"]["legal"]["max_repetition_ratio"] = 1.0
    path.write_text(yaml.safe_dump(data))
    out = run_in_process(project_with_data, ["plan", "experiments/cpu-tiny.yaml"], dict(__import__("os").environ))
    assert out.returncode == 2
    assert "pool tokens of the manifests" in out.stdout
    assert "mixture: INFEASIBLE" in out.stderr and "largest feasible budget" in out.stderr


def test_an_impossible_calibration_is_refused_and_an_absurd_mfu_prints_short(tmp_path):
    """A run folder whose steps say 1e300 tokens/s calibrated a plan at MFU "1e302%" (audit-claims calls
    over 100% IMPOSSIBLE); --mfu 1e-300 printed 300-digit hours, device-hours, dollars and checkpoints."""
    import re

    cfg = config()
    write_run(tmp_path / "run", [dict(step=i, tokens_per_second=1e300, step_seconds=1.0) for i in (1, 2)], cfg)
    with pytest.raises(RunnerError, match=r"run\.jsonl?|train\.jsonl") as err:
        read_calibration(tmp_path / "run", typed(cfg))
    assert "--calibrate" in str(err.value) and "(over 100%)" in str(err.value) and "not a calibration" in str(err.value)
    plan = build_plan(typed(cfg), mfu=1e-300, root=tmp_path)
    text = format_plan(plan)
    assert not re.search(r"[0-9,]{40}", text), text
    mfu_row = next(line for line in text.splitlines() if line.split()[:1] == ["MFU"])
    assert mfu_row.split()[-1] == "1e-298%"
    wall = plan["time"]["assumed"]["wall_hours"]
    row = next(" ".join(line.split()) for line in text.splitlines() if "wall clock" in line)
    assert wall > 1e290 and row == f"wall clock {wall:.3g} h ({wall / 24:.3g} d)"


def test_a_pilot_far_below_one_token_per_parameter_does_not_print_zero(tmp_path):
    cfg = config()
    cfg["train"]["exposure_tokens"] = 16 * 128 * 2  # two steps: a smoke run
    plan = build_plan(typed(cfg), root=tmp_path)
    tpp = plan["compute"]["tokens_per_param"]
    assert 0 < tpp < 0.05
    line = next(l for l in format_plan(plan).splitlines() if "tokens per parameter" in l)
    assert line.split()[-1] == f"{tpp:.3g}" and line.split()[-1] != "0.0"


def test_tokens_to_serve_are_planned_as_forward_flops_and_said_only_when_set(tmp_path):
    """plan.inference_tokens was read by nothing: now the plan counts their forward FLOPs (the training
    convention / 3 per token, downstream_cost's basis) and says them beside training's."""
    cfg = config()
    quiet = build_plan(typed(cfg), root=tmp_path)
    assert quiet["compute"]["inference_flops"] == 0 and "tokens to serve" not in format_plan(quiet)
    cfg["plan"]["inference_tokens"] = 1e12
    plan = build_plan(typed(cfg), root=tmp_path)
    c = plan["compute"]
    assert c["inference_flops"] == pytest.approx(c["flops_per_token"] / 3 * 1e12)
    ratio = 1e12 / 3 / c["exposure_tokens"]
    lines = format_plan(plan).splitlines()
    assert any("tokens to serve" in l and "1 T" in l and "plan.inference_tokens" in l for l in lines), lines
    serving = next(l for l in lines if "FLOPs serving them" in l)
    assert f"{c['inference_flops']:.3e}" in serving and f"{ratio:.3g} x training's" in serving, serving


def test_the_export_estimate_of_1p3b_by_hand():
    """`runner plan` says what `runner export` of the model writes and costs: bf16 weights stored once,
    5 GB shards, the host's peak memory and time from the measured per-parameter figures."""
    assert convert_file_size_to_int(DEFAULT_MAX_SHARD_SIZE) == EXPORT_SHARD_BYTES
    cfg = load_experiment(REPO / "experiments" / "1p3b.yaml").config
    n = params_of_config(cfg).all
    ex = build_plan(cfg, root=REPO)["export"]
    assert ex["dtype"] == cfg.export.dtype == "bf16"
    assert ex["weights_bytes"] == 2 * n and ex["shards"] == math.ceil(2 * n / 5e9) == 1
    assert ex["host_peak_bytes"] == pytest.approx(0.55e9 + 10.1 * n)
    assert ex["seconds"] == pytest.approx(3.9 + 0.33e-6 * n)
    assert 6 * 60 < ex["seconds"] < 10 * 60 and 12 * 2**30 < ex["host_peak_bytes"] < 16 * 2**30
    text = format_plan(build_plan(cfg, root=REPO))
    assert "export (runner export, bf16" in text and "host peak memory" in text
    # fp32 doubles the folder; a 7B model in fp32 is split into shards
    cfg = dataclasses.replace(cfg, export=dataclasses.replace(cfg.export, dtype="fp32"))
    ex = build_plan(cfg, root=REPO)["export"]
    assert ex["weights_bytes"] == 4 * n and ex["host_peak_bytes"] == pytest.approx(0.55e9 + 8.3 * n)
    assert assumptions.EXPORT_HOST_BYTES_PER_PARAM["fp32"] < assumptions.EXPORT_HOST_BYTES_PER_PARAM["bf16"]
    olmoe = load_experiment(REPO / "experiments" / "olmoe-1b-7b.yaml").config
    olmoe = dataclasses.replace(olmoe, export=dataclasses.replace(olmoe.export, dtype="fp32"))
    ex = build_plan(olmoe, root=REPO)["export"]
    assert ex["shards"] == math.ceil(4 * params_of_config(olmoe).all / 5e9) > 1


@pytest.mark.parametrize(
    "column, value, says",
    [
        ("step", float("inf"), "throughput.parquet: step: row 0: not a finite number: inf"),  # OverflowError
        ("step", float("nan"), "throughput.parquet: step: row 0: not a finite number: nan"),  # ValueError
        ("tokens_per_second", float("inf"), "throughput.parquet: tokens_per_second: row 0: not a finite number"),
    ],
)
def test_a_report_whose_throughput_is_not_finite_does_not_calibrate(tmp_path, column, value, says):
    """`runner plan --calibrate REPORT` read the report's throughput table as numbers: an infinite step was
    int()'s OverflowError (NaN: ValueError), an infinite tokens/s a measured "MFU inf%" in the plan. One
    line naming the table, column and row; NaN tokens/s stays a step not measured."""
    import shutil

    import pandas as pd

    from runner.config.load import load_saved_experiment

    copy = tmp_path / "report"
    shutil.copytree(REPO / "reports" / "cpu-tiny" / "20261201-crash-resume", copy)
    cfg = load_saved_experiment(copy / "experiment.yaml").config
    table = pd.read_parquet(copy / "throughput.parquet")
    good = table.copy()
    table[column] = [value, *table[column].iloc[1:]]
    table.to_parquet(copy / "throughput.parquet")
    with pytest.raises(RunnerError) as err:
        read_calibration(copy, cfg)
    assert str(err.value).startswith(f"{copy / says}"), str(err.value)
    good["tokens_per_second"] = [float("nan"), *good["tokens_per_second"].iloc[1:]]
    good.to_parquet(copy / "throughput.parquet")
    assert read_calibration(copy, cfg).steps == len(good) - 1
