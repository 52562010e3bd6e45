"""Each report table schema rejects each kind of bad table, lazily listing every failure."""

from __future__ import annotations

import pandas as pd
import pytest
from runfixtures import SEQ_LEN, make_run

from runner.reports.tables import build_tables
from schemas.report_tables import SCHEMA_VERSION, SCHEMAS, validate_tables


@pytest.fixture(scope="module")
def good(tmp_path_factory):
    return build_tables(make_run(tmp_path_factory.mktemp("schemas")))


def _with(tables, name, edit):
    out = {k: v.copy() for k, v in tables.items()}
    out[name] = edit(out[name].copy())
    return out


def _set(col, value, row=0):
    def edit(df):
        df.loc[df.index[row], col] = value
        return df

    return edit


def test_clean_tables_pass_and_schemas_are_documented(good):
    assert validate_tables(good) == []
    for schema in SCHEMAS.values():
        assert all(col.description for col in schema.columns.values()), schema.name
    assert good["run_summary"].iloc[0]["schema_version"] == SCHEMA_VERSION


BAD = [
    ("run_summary", _set("schema_version", "runner-report/0"), "equal_to"),
    ("run_summary", _set("mfu", 1.5), "less_than_or_equal_to"),
    (
        "run_summary",
        lambda df: df.assign(unique_tokens=df["exposure_tokens"] + SEQ_LEN, pool_tokens=df["pool_tokens"] + 10**6),
        "invariant 1",
    ),
    ("run_summary", lambda df: df.assign(lost_tokens=df["lost_tokens"] + 1), "lost = processed - exposure"),
    ("run_summary", lambda df: df.assign(steps=df["steps"] + 1), "invariant 3"),
    ("run_summary", _set("recompute_counted", True), "equal_to"),
    ("run_summary", lambda df: df.assign(extra=1), "column_in_schema"),
    ("run_summary", _set("fingerprint", "not-a-hash"), "str_matches"),
    ("run_summary", lambda df: df.assign(mfu=df["mfu"] * 1.01), "mfu = flops_per_token"),
    (
        "run_summary",
        lambda df: df.assign(cost_per_billion_useful_tokens=df["cost_per_billion_useful_tokens"] * 2),
        "cost = price * device wall h",
    ),
    (
        "run_summary",
        lambda df: df.assign(device_step_seconds=df["step_seconds_total"] / 2),
        "device-seconds >= seconds",
    ),
    ("run_summary", lambda df: df.assign(hfu=df["mfu"] * 0.5), "hfu = hfu_flops_per_token"),
    ("run_summary", lambda df: df.assign(device_wall_seconds=df["device_step_seconds"] / 2), "steps <= wall"),
    ("run_summary", lambda df: df.assign(devices_counted=1), "devices_counted = devices held"),
    ("run_summary", lambda df: pd.concat([df, df]), "exactly one row"),
    ("accounting", lambda df: df.assign(realized_ratio=df["realized_ratio"] * 1.005), "realized_ratio = exposure"),
    ("accounting", lambda df: df.assign(max_repetition_ratio=1.0), "invariant 4"),
    ("accounting", lambda df: df.assign(target_ratio=[0.3, 0.2, 0.5]), "invariant 5"),
    ("accounting", lambda df: df.assign(target_ratio=[0.3, 0.3, 0.5]), "sum to 1"),
    ("accounting", lambda df: pd.concat([df, df.iloc[:1]]), "field_uniqueness"),
    ("accounting", lambda df: df.assign(pool_tokens=df["pool_tokens"] + 1), "pool = samples * L"),
    ("accounting", _set("processed_tokens", -5), "greater_than_or_equal_to"),
    (
        "accounting",
        lambda df: df.assign(unique_tokens=df["pool_tokens"] + SEQ_LEN, exposure_tokens=df["pool_tokens"] + SEQ_LEN),
        "unique <= pool",
    ),
    ("accounting", lambda df: df.assign(epochs=df["epochs"] + 0.1), "epochs = exposure / pool"),
    ("repetition", lambda df: pd.concat([df, df.iloc[:1]]), "one row per (domain, times_seen)"),
    ("repetition", _set("samples", -1), "greater_than_or_equal_to"),
    ("repetition", _set("times_seen", 300), "less_than_or_equal_to"),
    ("validation", lambda df: pd.concat([df, df.iloc[:1]]), "one row per (step, domain)"),
    ("validation", _set("loss_nats", float("nan")), "not_nullable"),
    ("validation", _set("bpb", float("inf")), "finite"),
    (
        "validation",
        lambda df: df.assign(exposure_tokens=df["exposure_tokens"][::-1].to_numpy()),
        "exposure is one non-decreasing value per step",
    ),
    ("validation", _set("device_wall_seconds", 1e300), "one device time per evaluation step"),  # one domain's row
    ("throughput", lambda df: df.iloc[::-1], "steps strictly increase"),
    # a row's speed as the loop computes it (a tokens/s of 1.5 on one row passed every check)
    ("throughput", _set("tokens_per_second", 1.5), "tokens_per_second x step_seconds = the global batch"),
    ("throughput", _set("mfu", 2.0), "less_than_or_equal_to"),
    ("throughput", _set("step_seconds", 0.0), "greater_than"),
    ("throughput", lambda df: df.assign(step=df["step"].astype(float)), "dtype"),
]


@pytest.mark.parametrize("table,edit,check", BAD, ids=[f"{t}-{c}" for t, _, c in BAD])
def test_schema_rejects_bad_table(good, table, edit, check):
    failures = validate_tables(_with(good, table, edit))
    assert any(f.table == table and check in f.check for f in failures), [str(f) for f in failures]


def test_cross_table_invariants(good):
    bad_total = _with(good, "run_summary", lambda df: df.assign(useful_tokens=df["useful_tokens"] - 1))
    assert any("invariant 2" in f.check and f.column == "useful_tokens" for f in validate_tables(bad_total))

    def shift(df):  # one web sample moved from seen-once to seen-twice: exposure recount breaks
        web = df["domain"] == "web"
        df.loc[web & (df["times_seen"] == 1), "samples"] -= 1
        return pd.concat([df, pd.DataFrame([{"domain": "web", "times_seen": 2, "samples": 1}])], ignore_index=True)

    failures = validate_tables(_with(good, "repetition", shift))
    assert any(f.check == "histogram exposure = exposure" and f.column == "web" for f in failures)


def test_validation_is_lazy_listing_every_failure(good):
    tables = _with(
        good, "accounting", lambda df: df.assign(realized_ratio=df["realized_ratio"] * 1.005, max_repetition_ratio=1.0)
    )
    tables = _with(tables, "throughput", _set("mfu", 2.0))
    checks = {(f.table, f.check) for f in validate_tables(tables)}
    assert ("accounting", "realized_ratio = exposure / total exposure") in checks
    assert ("accounting", "invariant 4: epochs <= max_repetition_ratio") in checks
    assert any(t == "throughput" for t, _ in checks)


def test_missing_table_is_a_failure(good):
    tables = dict(good)
    del tables["throughput"]
    assert [f.check for f in validate_tables(tables) if f.table == "throughput"] == ["table present"]
