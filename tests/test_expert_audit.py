"""The expert-load check rests on more than one defence (issue 27, item 9): the final checkpoint's
check recounts the expert load the checkpoint stores, and the router table is compared with the
`expert_load_*` / router metrics MLflow recorded at every logged step."""

from __future__ import annotations

import json

import numpy as np
import pandas as pd
import pytest
from trainfixtures import launch, make_project

from runner.reports import evidence as ev
from runner.reports.audit import audit
from runner.reports.audit_tracked import METRICS
from runner.reports.expert_tables import balance_rows
from runner.reports.tables import _typed
from schemas.report_tables import SCHEMAS

pytestmark = pytest.mark.slow

MOE = {
    "arch": "olmoe",
    "intermediate_size": 32,
    "moe": {"n_experts": 4, "experts_per_token": 2, "expert_intermediate_size": 32},
}
CHECKPOINT = "final checkpoint agrees with the report"


@pytest.fixture(scope="module")
def moe_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("moe")
    exp = make_project(root, steps=6, checkpoint_every=3, model_extra=MOE, train_extra={"log_interval_steps": 2})
    run = root / "runs" / "moe"
    launch(root, exp, "--run-dir", run)
    return run


def _save(report, name: str, df: pd.DataFrame) -> None:
    df = _typed(name, df)
    df.to_parquet(report / f"{name}.parquet", index=False)
    df.to_csv(report / f"{name}.csv", index=False)


def _reseal(report) -> None:
    """A careful forger: evidence.json recomputed from the edited tables."""
    found = json.loads((report / "evidence.json").read_text())
    found["tables"] = {n: ev.table_sha256(n, pd.read_parquet(report / f"{n}.parquet")) for n in found["tables"]}
    (report / "evidence.json").write_text(json.dumps(found, indent=1))


def _check(result, name):
    return next(c for c in result.checks if c.name == name)


def test_a_consistent_expert_load_forgery_fails_against_the_checkpoint(moe_run, tmp_path):
    import shutil

    run = tmp_path / "run"
    shutil.copytree(moe_run, run)
    report = run / "report"
    genuine = audit(run, check_mlflow=False)
    assert _check(genuine, CHECKPOINT).status == "PASS", genuine.render()
    load = pd.read_parquet(report / "expert_load.parquet")
    first = load.index[(load["layer"] == 0) & (load["domain"] == "a")]
    load.loc[first[0], "routed_tokens"] -= 1  # one position moved to another expert: every sum holds
    load.loc[first[1], "routed_tokens"] += 1
    _save(report, "expert_load", load)
    raw = json.loads((run / "expert_load.json").read_text())  # and the run folder's own record of it
    e0, e1 = (int(load.loc[i, "expert"]) for i in first[:2])
    raw["routed_tokens"]["a"][0][e0] -= 1
    raw["routed_tokens"]["a"][0][e1] += 1
    (run / "expert_load.json").write_text(json.dumps(raw))
    domains = sorted(load["domain"].unique())
    routed = np.zeros((2, len(domains), 4), dtype=np.int64)
    for r in load.itertuples():
        routed[r.layer, domains.index(r.domain), r.expert] = r.routed_tokens
    acct = pd.read_parquet(report / "accounting.parquet").set_index("domain")["exposure_tokens"]
    rows = balance_rows(routed, domains, {d: int(acct[d]) for d in domains}, 2)
    _save(report, "expert_balance", pd.DataFrame(rows, columns=list(SCHEMAS["expert_balance"].columns)))
    _reseal(report)
    result = audit(run, check_mlflow=False)
    assert result.failed() == [CHECKPOINT], result.render()  # every table-level check holds: only this one sees it
    detail = _check(result, CHECKPOINT).detail
    assert f"expert load layer 0, a, expert {e0}: checkpoint {int(load.loc[first[0], 'routed_tokens']) + 1}" in detail
    assert f"expert {e1}: checkpoint {int(load.loc[first[1], 'routed_tokens']) - 1}" in detail


def test_the_router_table_is_compared_with_mlflows_router_metrics(moe_run, tmp_path):
    import shutil

    report = tmp_path / "report"
    shutil.copytree(moe_run / "report", report)
    genuine = _check(audit(report), METRICS)
    assert genuine.status == "PASS", genuine.detail
    assert "expert_load" not in genuine.detail.split("no report counterpart:")[1]  # compared, not listed
    router = pd.read_parquet(report / "router.parquet")
    router["load_imbalance"] = 1.0 + (router["load_imbalance"] - 1.0) / 2  # a better-balanced story
    _save(report, "router", router)
    _reseal(report)
    result = audit(report)
    assert METRICS in result.failed(), result.render()
    assert "step/expert_load_imbalance at step 2: MLflow " in _check(result, METRICS).detail
