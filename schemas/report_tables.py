"""The report's tables as pandera schemas, one DataFrameSchema per table.

Owns the column names, dtypes and descriptions of every report table, and the frame-level checks
that encode the SPEC's accounting invariants (1-5) inside one table, plus `validate_tables`, which
adds the checks that need two tables (invariant 2: totals equal the sum of domains; histogram
versus counters). Never reads or writes files and never recomputes anything from a config: that is
runner.reports.audit.run's job.

Token counters are exact integers in tokens (input positions, SPEC "Token counters"); `L` (the
sequence length) is recovered inside the accounting table as `pool_tokens / samples`, because the
pool of a domain is `samples * L` by definition.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import numpy as np
import pandas as pd
import pandera.pandas as pa
from pandera.extensions import register_check_method

SCHEMA_VERSION = "runner-report/4"  # 2: device-seconds columns; MFU and cost over them. 3: validation samples, tokens and progress columns; targets table; expert tables. 4: run_summary step_clock
"""Bumped whenever a column is added, removed, renamed or changes meaning."""
#: columns added since an older version this runner still reads and audits, with the value a report
#: written under it stands for: such a report is checked against its own version's tables
#: (schemas_for), never rewritten, and readers take the default (with_added_columns)
ADDED_SINCE: dict[str, dict[str, dict[str, object]]] = {
    "runner-report/3": {"run_summary": {"step_clock": "host"}},  # runs before issue 28 timed steps on the host
}
READABLE_VERSIONS = (*ADDED_SINCE, SCHEMA_VERSION)

# Float equalities in derived columns (ratios, epochs, MFU) are recomputed from exact integers,
# so only floating-point noise is tolerated, not a rounding a human could notice.
REL_TOL = 1e-9


def _close(a, b, rel: float = REL_TOL):
    a, b = np.asarray(a, dtype=float), np.asarray(b, dtype=float)
    return np.abs(a - b) <= rel * np.maximum(np.abs(b), 1e-300) + 1e-15


# ---- invariant checks (registered so they have names in failure reports) ----------------------


@register_check_method(supported_types=pd.DataFrame)
def counters_ordered(df):
    """SPEC invariant 1: unique <= exposure <= processed and useful <= exposure."""
    return (
        (df["unique_tokens"] <= df["exposure_tokens"])
        & (df["exposure_tokens"] <= df["processed_tokens"])
        & (df["useful_tokens"] <= df["exposure_tokens"])
    )


@register_check_method(supported_types=pd.DataFrame)
def unique_within_pool(df):
    """SPEC invariant 1: unique <= pool."""
    return df["unique_tokens"] <= df["pool_tokens"]


@register_check_method(supported_types=pd.DataFrame)
def lost_is_processed_minus_exposure(df):
    """SPEC: lost = processed - exposure."""
    return df["lost_tokens"] == df["processed_tokens"] - df["exposure_tokens"]


@register_check_method(supported_types=pd.DataFrame)
def exposure_is_whole_steps(df):
    """SPEC invariant 3: exposure_total = committed_steps * global_batch_sequences * L."""
    return df["exposure_tokens"] == df["steps"] * df["global_batch_sequences"] * df["seq_len"]


@register_check_method(supported_types=pd.DataFrame)
def pool_is_whole_samples(df):
    """SPEC: pool = samples * L, the same L for every domain, and 0 <= tail < L."""
    seq_len = df["pool_tokens"] // df["samples"].clip(lower=1)
    same_len = seq_len.nunique() == 1
    return (
        (df["pool_tokens"] == df["samples"] * seq_len)
        & same_len
        & (df["tail_tokens"] >= 0)
        & (df["tail_tokens"] < seq_len)
    )


@register_check_method(supported_types=pd.DataFrame)
def epochs_is_exposure_over_pool(df):
    """SPEC: epochs = exposure / pool."""
    return pd.Series(_close(df["epochs"], df["exposure_tokens"] / df["pool_tokens"]), index=df.index)


@register_check_method(supported_types=pd.DataFrame)
def epochs_within_cap(df):
    """SPEC invariant 4: epochs <= max_repetition_ratio of the domain."""
    return df["exposure_tokens"] <= df["max_repetition_ratio"] * df["pool_tokens"] * (1 + REL_TOL)


@register_check_method(supported_types=pd.DataFrame)
def realized_ratio_is_share(df):
    """SPEC: realized_ratio = exposure / total exposure (over the domains of this table)."""
    total = df["exposure_tokens"].sum()
    return pd.Series(_close(df["realized_ratio"], df["exposure_tokens"] / max(total, 1)), index=df.index)


@register_check_method(supported_types=pd.DataFrame)
def target_ratios_sum_to_one(df):
    """A mixture's target ratios are shares of one budget."""
    return bool(abs(df["target_ratio"].sum() - 1.0) <= 1e-6)


@register_check_method(supported_types=pd.DataFrame)
def mixture_exact(df):
    """SPEC invariant 5: |exposure_d - target_ratio_d * exposure_total| <= L."""
    seq_len = df["pool_tokens"] // df["samples"].clip(lower=1)
    total = df["exposure_tokens"].sum()
    # the sampler works with exact decimal ratios; 1e-9 of the total absorbs float rounding only
    return (df["exposure_tokens"] - df["target_ratio"] * total).abs() <= seq_len + 1e-9 * total


@register_check_method(supported_types=pd.DataFrame)
def goodput_within_mfu(df):
    """useful <= processed and wall >= step time, so goodput MFU can never exceed MFU."""
    return df["goodput_mfu"] <= df["mfu"] * (1 + 1e-6)


@register_check_method(supported_types=pd.DataFrame)
def step_time_within_wall(df):
    """Training steps are part of the elapsed time, never more than it."""
    return df["step_seconds_total"] <= df["wall_seconds"] * (1 + 1e-6)


@register_check_method(supported_types=pd.DataFrame)
def device_seconds_cover_seconds(df):
    """At least one device held through every second: device-seconds >= seconds, steps <= wall."""
    return (
        (df["device_step_seconds"] >= df["step_seconds_total"] * (1 - 1e-9))
        & (df["device_wall_seconds"] >= df["wall_seconds"] * (1 - 1e-9))
        & (df["device_step_seconds"] <= df["device_wall_seconds"] * (1 + 1e-6))
    )


@register_check_method(supported_types=pd.DataFrame)
def mfu_matches_definition(df):
    """SPEC: mfu = flops_per_token * processed / (step time * peak * devices), the time x devices
    being device-seconds summed over attempts (a resume may hold another device count)."""
    want = df["flops_per_token"] * df["processed_tokens"] / (df["device_step_seconds"] * df["peak_tflops"] * 1e12)
    return pd.Series(_close(df["mfu"], want, 1e-6), index=df.index)


@register_check_method(supported_types=pd.DataFrame)
def hfu_matches_definition(df):
    """HFU (activation checkpointing) counts the recomputed forward: never below MFU. Empty = not reported."""
    want = df["hfu_flops_per_token"] * df["processed_tokens"] / (df["device_step_seconds"] * df["peak_tflops"] * 1e12)
    both_empty = df["hfu"].isna() & df["hfu_flops_per_token"].isna()
    ok = pd.Series(_close(df["hfu"], want, 1e-6), index=df.index) & (df["hfu"] >= df["mfu"] * (1 - 1e-9))
    return both_empty | ok


@register_check_method(supported_types=pd.DataFrame)
def goodput_mfu_matches_definition(df):
    """SPEC: goodput_mfu = flops_per_token * useful / (wall time * peak * devices), as device-seconds."""
    want = df["flops_per_token"] * df["useful_tokens"] / (df["device_wall_seconds"] * df["peak_tflops"] * 1e12)
    return pd.Series(_close(df["goodput_mfu"], want, 1e-6), index=df.index)


@register_check_method(supported_types=pd.DataFrame)
def cost_matches_definition(df):
    """SPEC: cost = devices * price per device-hour * wall hours / (useful / 1e9), as device-hours."""
    want = df["price_per_device_hour"] * (df["device_wall_seconds"] / 3600.0) / (df["useful_tokens"] / 1e9)
    return pd.Series(_close(df["cost_per_billion_useful_tokens"], want, 1e-6), index=df.index)


@register_check_method(supported_types=pd.DataFrame)
def histogram_keys_unique(df):
    """One row per (domain, times_seen)."""
    return ~df.duplicated(["domain", "times_seen"], keep=False)


@register_check_method(supported_types=pd.DataFrame)
def one_eval_per_step_and_domain(df):
    """Each evaluation measures each domain once."""
    return ~df.duplicated(["step", "domain"], keep=False)


@register_check_method(supported_types=pd.DataFrame)
def exposure_grows_with_step(df):
    """The exposure at an evaluation is a function of its step, non-decreasing in it."""
    per_step = df.groupby("step")["exposure_tokens"]
    one_value = per_step.transform("nunique") == 1
    firsts = per_step.first().sort_index()
    monotone = bool(firsts.is_monotonic_increasing)
    return one_value & monotone


@register_check_method(supported_types=pd.DataFrame)
def one_progress_per_step(df):
    """An evaluation happens at one point of the run: one useful count, one time and one device time
    per step (each domain's row carries the step's one stamp)."""
    per_step = df.groupby("step")
    return (
        (per_step["useful_tokens"].transform("nunique") == 1)
        & (per_step["wall_seconds"].transform("nunique", dropna=False) == 1)
        & (per_step["device_wall_seconds"].transform("nunique", dropna=False) == 1)
    )


@register_check_method(supported_types=pd.DataFrame)
def validation_tokens_fixed(df):
    """The same validation samples are scored at every evaluation: one token count per domain."""
    return df.groupby("domain")["tokens"].transform("nunique") == 1


@register_check_method(supported_types=pd.DataFrame)
def useful_within_exposure(df):
    """SPEC invariant 1 at the evaluation: useful <= exposure."""
    return df["useful_tokens"] <= df["exposure_tokens"]


@register_check_method(supported_types=pd.DataFrame)
def device_time_covers_time(df):
    """At least one device held through every second (rows without recorded times pass)."""
    return df["wall_seconds"].isna() | (df["device_wall_seconds"] >= df["wall_seconds"] * (1 - 1e-9))


@register_check_method(supported_types=pd.DataFrame)
def one_row_per_target_point(df):
    """One row per (target, point)."""
    return ~df.duplicated(["target", "point"], keep=False)


@register_check_method(supported_types=pd.DataFrame)
def value_on_the_right_side(df):
    """`met` rows are at or below the threshold; `before` and `best` rows above it."""
    met = df["point"] == "met"
    return (met & (df["value"] <= df["threshold"])) | (~met & (df["value"] > df["threshold"]))


@register_check_method(supported_types=pd.DataFrame)
def bracket_is_whole(df):
    """A met target has a `met` row (and maybe `before`, at an earlier step); one never met has one
    `best` row; `met` says which, on every row of the target."""
    ok = pd.Series(True, index=df.index)
    for _, g in df.groupby("target"):
        points = list(g["point"])
        met = bool(g["met"].iloc[0])
        steps = dict(zip(g["point"], g["step"]))
        whole = (
            g["met"].nunique() == 1
            and (sorted(points) in (["met"], ["before", "met"]) if met else points == ["best"])
            and ("before" not in steps or steps["before"] < steps["met"])
        )
        ok[g.index] = whole
    return ok


@register_check_method(supported_types=pd.DataFrame)
def one_row_per_layer_domain_expert(df):
    """The expert load holds each (layer, domain, expert) once."""
    return ~df.duplicated(["layer", "domain", "expert"], keep=False)


@register_check_method(supported_types=pd.DataFrame)
def one_row_per_layer_and_domain(df):
    """The balance table holds each (layer, domain) once."""
    return ~df.duplicated(["layer", "domain"], keep=False)


@register_check_method(supported_types=pd.DataFrame)
def routed_is_exposure_times_k(df):
    """SPEC (Mixture-of-experts): per layer and domain the loads sum to exposure x k (no drops)."""
    return df["routed_tokens"] == df["exposure_tokens"] * df["experts_per_token"]


@register_check_method(supported_types=pd.DataFrame)
def balance_matches_definition(df):
    """SPEC: load imbalance = max / mean; idle capacity = 1 - mean / max (empty where nothing was routed)."""
    empty = df["mean_load_tokens"] == 0
    imbalance = _close(df["load_imbalance"], df["max_load_tokens"] / df["mean_load_tokens"].where(~empty))
    idle = _close(df["idle_capacity"], 1.0 - df["mean_load_tokens"] / df["max_load_tokens"].where(~empty))
    both_empty = empty & df["load_imbalance"].isna() & df["idle_capacity"].isna() & df["load_cv"].isna()
    return pd.Series(imbalance & idle, index=df.index) | both_empty


@register_check_method(supported_types=pd.DataFrame)
def steps_strictly_increase(df):
    """Throughput rows are one per logged step, in order."""
    return bool(df["step"].is_monotonic_increasing and df["step"].is_unique)


# ---- the tables ---------------------------------------------------------------------------------


def _tokens(description: str) -> pa.Column:
    return pa.Column("int64", pa.Check.ge(0), description=description + " (tokens, exact integer)")


def _fraction(description: str, *, positive: bool = False) -> pa.Column:
    low = pa.Check.gt(0.0) if positive else pa.Check.ge(0.0)
    return pa.Column("float64", [low, pa.Check.le(1.0)], description=description)


def _finite_positive(description: str) -> pa.Column:
    return pa.Column(
        "float64", [pa.Check.gt(0.0), pa.Check(np.isfinite, element_wise=False, name="finite")], description=description
    )


RUN_SUMMARY = pa.DataFrameSchema(
    name="run_summary",
    description="One row: what was trained, how much, how fast, at what cost, under which MFU convention.",
    strict=True,
    columns={
        "schema_version": pa.Column(
            str, pa.Check.eq(SCHEMA_VERSION), description="Report schema version of this table."
        ),
        "experiment": pa.Column(str, description="Experiment name from the recipe."),
        "version": pa.Column(str, description="Experiment version from the recipe."),
        "fingerprint": pa.Column(
            str, pa.Check.str_matches(r"^[0-9a-f]{64}$"), description="sha256 of the resolved config."
        ),
        "run_id": pa.Column(str, description="Run folder id."),
        "status": pa.Column(
            str, pa.Check.isin(["running", "finished", "preempted", "failed"]), description="Run status from run.json."
        ),
        "steps": pa.Column("int64", pa.Check.ge(0), description="Committed optimizer steps."),
        "seq_len": pa.Column("int64", pa.Check.gt(0), description="L: input positions per sample."),
        "global_batch_sequences": pa.Column(
            "int64", pa.Check.gt(0), description="Samples per committed step over all devices."
        ),
        "pool_tokens": _tokens("Sum over domains of samples * L"),
        "processed_tokens": _tokens("Input positions through forward+backward in any step, lost ones included"),
        "exposure_tokens": _tokens("Input positions in committed steps, repeats included"),
        "useful_tokens": _tokens("Target positions in committed steps that contributed to the loss"),
        "unique_tokens": _tokens("Distinct pool input positions among the exposures"),
        "lost_tokens": _tokens("processed - exposure"),
        "wall_seconds": _finite_positive("Elapsed seconds of the run: steps, eval, checkpoints, stalls, recovery."),
        "step_seconds_total": _finite_positive("Seconds spent in training steps only (sum of step times)."),
        "device_wall_seconds": _finite_positive(
            "Sum over attempts of wall seconds x devices held (= wall_seconds x devices when the world size never changed)."
        ),
        "device_step_seconds": _finite_positive(
            "Sum over steps (lost ones included) of step seconds x devices that ran it."
        ),
        "params": pa.Column("int64", pa.Check.gt(0), description="N: parameters counted by `params_counted`."),
        "flops_per_token": _finite_positive("Training FLOPs per token under `flops_formula` (6N or 6N+attn)."),
        "mfu": _fraction("flops_per_token * processed / (device_step_seconds * peak); time_basis step."),
        "goodput_mfu": _fraction("flops_per_token * useful / (device_wall_seconds * peak); time_basis wall."),
        "hfu_flops_per_token": pa.Column(
            "float64",
            pa.Check.gt(0.0),
            nullable=True,
            description="With activation checkpointing: FLOPs per token counting the recomputed forward (8N + attention); empty otherwise.",
        ),
        "hfu": pa.Column(
            "float64",
            [pa.Check.ge(0.0), pa.Check.le(1.0)],
            nullable=True,
            description="With activation checkpointing: hfu_flops_per_token * processed / (device_step_seconds * peak); empty otherwise.",
        ),
        "flops_formula": pa.Column(
            str, pa.Check.isin(["6N", "6N+attn"]), description="6N (Kaplan/Chinchilla) or 6N+attn (PaLM appendix B)."
        ),
        "params_counted": pa.Column(
            str, pa.Check.isin(["all", "non_embedding", "active"]), description="Which parameters N counts."
        ),
        "attention_causal_half": pa.Column(
            bool, description="Whether the attention term is halved for the causal mask."
        ),
        "recompute_counted": pa.Column(bool, pa.Check.eq(False), description="False for MFU (true would make it HFU)."),
        "peak_tflops": _finite_positive("Dense peak TFLOP/s of one device for peak_dtype; never the sparse figure."),
        "peak_dtype": pa.Column(str, description="Compute dtype the peak is for (bf16, fp32)."),
        "peak_source": pa.Column(str, description="Where the peak comes from (datasheet, recipe, measured)."),
        "devices_counted": pa.Column(
            "int64",
            pa.Check.gt(0),
            description="Devices in the MFU denominator: every device the run held, idle ones included (latest attempt; device-seconds carry earlier ones).",
        ),
        "time_basis": pa.Column(
            str, pa.Check.eq("step"), description="Time basis of `mfu` (goodput_mfu is always wall)."
        ),
        "step_clock": pa.Column(
            str,
            pa.Check.isin(["device", "host"]),
            description="What timed a step: device (ended when the device finished it, optimizer included; one "
            "synchronize per optimizer step) or host (when the host had queued it: runs before issue 28).",
        ),
        "device_name": pa.Column(str, description="Accelerator model the peak belongs to."),
        "devices": pa.Column(
            "int64",
            pa.Check.gt(0),
            description="Devices the run held in its latest attempt: run.json `devices` (the world size), which a launcher may make differ from the recipe's devices_per_node * nodes.",
        ),
        "price_per_device_hour": pa.Column(
            "float64", pa.Check.ge(0.0), description="USD per device-hour from the hardware recipe."
        ),
        "cost_per_billion_useful_tokens": pa.Column(
            "float64", pa.Check.ge(0.0), description="USD: price * device_wall_seconds / 3600 / (useful / 1e9)."
        ),
    },
    checks=[
        pa.Check.counters_ordered(error="invariant 1: unique <= exposure <= processed, useful <= exposure"),
        pa.Check.unique_within_pool(error="invariant 1: unique <= pool"),
        pa.Check.lost_is_processed_minus_exposure(error="lost = processed - exposure"),
        pa.Check.exposure_is_whole_steps(error="invariant 3: exposure = steps * global_batch * L"),
        pa.Check.goodput_within_mfu(error="goodput_mfu <= mfu"),
        pa.Check.hfu_matches_definition(error="hfu = hfu_flops_per_token * processed / (device step s * peak) >= mfu"),
        pa.Check(
            lambda df: df["devices_counted"] == df["devices"],
            name="all_devices_counted",
            error="devices_counted = devices held",
        ),
        pa.Check.step_time_within_wall(error="step_seconds_total <= wall_seconds"),
        pa.Check.device_seconds_cover_seconds(error="device-seconds >= seconds, steps <= wall"),
        pa.Check.mfu_matches_definition(error="mfu = flops_per_token * processed / (device step s * peak)"),
        pa.Check.goodput_mfu_matches_definition(
            error="goodput_mfu = flops_per_token * useful / (device wall s * peak)"
        ),
        pa.Check.cost_matches_definition(error="cost = price * device wall h / (useful / 1e9)"),
        pa.Check(lambda df: len(df) == 1, name="one_row", error="run_summary has exactly one row"),
    ],
)

ACCOUNTING = pa.DataFrameSchema(
    name="accounting",
    description="Token counters per domain (the run's totals are in run_summary).",
    strict=True,
    columns={
        "domain": pa.Column(str, unique=True, description="Domain name from the mixture (one row each)."),
        "target_ratio": _fraction("Share of exposure the mixture asks for.", positive=True),
        "realized_ratio": _fraction("exposure / total exposure."),
        "pool_tokens": pa.Column("int64", pa.Check.gt(0), description="samples * L (tokens, exact integer)."),
        "processed_tokens": _tokens("Input positions of this domain through forward+backward, lost included"),
        "exposure_tokens": _tokens("Input positions of this domain in committed steps, repeats included"),
        "useful_tokens": _tokens("Target positions of this domain that contributed to the loss"),
        "unique_tokens": _tokens("Distinct pool input positions of this domain among the exposures"),
        "lost_tokens": _tokens("processed - exposure"),
        "epochs": pa.Column("float64", pa.Check.ge(0.0), description="exposure / pool."),
        "max_repetition_ratio": pa.Column(
            "float64", pa.Check.ge(1.0), description="Cap on epochs from the mixture recipe."
        ),
        "tail_tokens": _tokens("pool_tokens_in_manifest - samples * L - 1: the tail that fits no sample"),
        "samples": pa.Column("int64", pa.Check.gt(0), description="floor((manifest pool tokens - 1) / L)."),
    },
    checks=[
        pa.Check.counters_ordered(error="invariant 1: unique <= exposure <= processed, useful <= exposure"),
        pa.Check.unique_within_pool(error="invariant 1: unique <= pool"),
        pa.Check.lost_is_processed_minus_exposure(error="lost = processed - exposure"),
        pa.Check.pool_is_whole_samples(error="pool = samples * L, one L, 0 <= tail < L"),
        pa.Check.epochs_is_exposure_over_pool(error="epochs = exposure / pool"),
        pa.Check.epochs_within_cap(error="invariant 4: epochs <= max_repetition_ratio"),
        pa.Check.realized_ratio_is_share(error="realized_ratio = exposure / total exposure"),
        pa.Check.target_ratios_sum_to_one(error="target ratios sum to 1"),
        pa.Check.mixture_exact(error="invariant 5: |exposure - target * total| <= L"),
    ],
)

REPETITION = pa.DataFrameSchema(
    name="repetition",
    description="Repetition histogram: how many samples of each domain were seen 0, 1, 2, ... times.",
    strict=True,
    columns={
        "domain": pa.Column(str, description="Domain name."),
        "times_seen": pa.Column(
            "int64",
            [pa.Check.ge(0), pa.Check.le(255)],
            description="Times a sample was in a committed step (ledger counter saturates at 255).",
        ),
        "samples": pa.Column(
            "int64", pa.Check.ge(0), description="Samples of the domain seen exactly times_seen times."
        ),
    },
    checks=[pa.Check.histogram_keys_unique(error="one row per (domain, times_seen)")],
)

VALIDATION = pa.DataFrameSchema(
    name="validation",
    description="Validation loss per domain at each evaluation, on the same held-out samples every time.",
    strict=True,
    columns={
        "step": pa.Column("int64", pa.Check.ge(0), description="Committed steps at the evaluation."),
        "exposure_tokens": _tokens("Total exposure at the evaluation"),
        "domain": pa.Column(str, description="Domain whose validation samples were scored."),
        "loss_nats": _finite_positive("Mean token cross-entropy in nats."),
        "bpb": _finite_positive("Bits per UTF-8 byte of the target text."),
        "samples": pa.Column(
            "int64", pa.Check.ge(1), description="Validation samples the loss is averaged over (below 16: noise)."
        ),
        "tokens": pa.Column(
            "int64",
            pa.Check.gt(0),
            description="Validation target tokens scored for the domain (the same every time): its weight in the mean over domains.",
        ),
        "useful_tokens": _tokens("Total useful tokens of the run when the evaluation ran"),
        "wall_seconds": pa.Column(
            "float64",
            pa.Check.ge(0.0),
            nullable=True,
            description="Wall seconds from the first launch to the end of the evaluation, every attempt (lost work and restarts) included; empty for evaluations recorded before runs kept it.",
        ),
        "device_wall_seconds": pa.Column(
            "float64",
            pa.Check.ge(0.0),
            nullable=True,
            description="The same span in device-seconds (each attempt's wall x the devices it held); empty when wall_seconds is.",
        ),
    },
    checks=[
        pa.Check.one_eval_per_step_and_domain(error="one row per (step, domain)"),
        pa.Check.exposure_grows_with_step(error="exposure is one non-decreasing value per step"),
        pa.Check.one_progress_per_step(error="one useful count, one time and one device time per evaluation step"),
        pa.Check.validation_tokens_fixed(error="one validation token count per domain"),
        pa.Check.useful_within_exposure(error="useful <= exposure at every evaluation"),
        pa.Check.device_time_covers_time(error="device_wall_seconds >= wall_seconds"),
    ],
)

TARGETS = pa.DataFrameSchema(
    name="targets",
    description="Quality targets (SPEC 'Quality targets'): for each, the evaluation where it was first met and the one before it, or the best one if never met.",
    strict=True,
    columns={
        "target": pa.Column(str, pa.Check.str_matches(r"^[A-Za-z0-9_-]+$"), description="Target name (eval recipe)."),
        "domain": pa.Column(str, description="Domain whose value is judged, or `mean`: weighted by validation tokens."),
        "metric": pa.Column(str, pa.Check.isin(["loss_nats", "bpb"]), description="loss_nats or bpb."),
        "threshold": _finite_positive("Met when the value is <= this."),
        "met": pa.Column(bool, description="Whether any evaluation of the run's lineage met the target."),
        "point": pa.Column(
            str,
            pa.Check.isin(["before", "met", "best"]),
            description="met: first evaluation at or below the threshold; before: the evaluation before it; best: the lowest value of a target never met.",
        ),
        "step": pa.Column("int64", pa.Check.gt(0), description="Committed steps at the evaluation."),
        "exposure_tokens": _tokens("Total exposure at the evaluation"),
        "useful_tokens": _tokens("Total useful tokens at the evaluation"),
        "value": _finite_positive("The judged value at the evaluation (nats or bits per byte)."),
        "wall_seconds": pa.Column(
            "float64",
            pa.Check.ge(0.0),
            nullable=True,
            description="time_to_target on the met row: wall seconds from the first launch to the end of the evaluation, all attempts.",
        ),
        "device_hours": pa.Column(
            "float64",
            pa.Check.ge(0.0),
            nullable=True,
            description="device_hours_to_target on the met row: device-seconds over the same span / 3600.",
        ),
        "cost_usd": pa.Column(
            "float64",
            pa.Check.ge(0.0),
            nullable=True,
            description="cost_to_target on the met row: device_hours x price per device-hour.",
        ),
    },
    checks=[
        pa.Check.one_row_per_target_point(error="one row per (target, point)"),
        pa.Check.value_on_the_right_side(error="met rows <= threshold, before/best rows above it"),
        pa.Check.bracket_is_whole(error="met target: [before,] met at a later step; never met: one best row"),
        pa.Check(
            lambda df: df["wall_seconds"].isna() | (df["device_hours"] * 3600.0 >= df["wall_seconds"] * (1 - 1e-9)),
            name="device_hours_cover_wall",
            error="device_hours x 3600 >= wall_seconds",
        ),
    ],
)

THROUGHPUT = pa.DataFrameSchema(
    name="throughput",
    description="Speed at each logged training step.",
    strict=True,
    columns={
        "step": pa.Column("int64", pa.Check.ge(0), description="Step the row was logged at."),
        "tokens_per_second": _finite_positive("Processed tokens per second of step time."),
        "step_seconds": _finite_positive("Seconds of the step (forward, backward, optimizer)."),
        "mfu": _fraction("MFU of the step, time basis step."),
        "goodput_mfu": _fraction("Goodput MFU up to the step, time basis wall."),
    },
    checks=[pa.Check.steps_strictly_increase(error="steps strictly increase")],
)

ALL_DOMAINS = "(all)"  #: the expert_balance row of a layer over every domain together

EXPERT_LOAD = pa.DataFrameSchema(
    name="expert_load",
    description=(
        "Mixture of experts only (empty for a dense model): input positions of each domain routed to "
        "each expert of each layer in committed steps; a position counts once for each of the k experts it is sent to."
    ),
    strict=True,
    columns={
        "layer": pa.Column("int64", pa.Check.ge(0), description="Decoder layer (0 = nearest the embedding)."),
        "domain": pa.Column(str, description="Domain of the samples the positions belong to."),
        "expert": pa.Column("int64", pa.Check.ge(0), description="Routed expert of the layer."),
        "routed_tokens": _tokens("Input positions routed to the expert in committed steps"),
    },
    checks=[pa.Check.one_row_per_layer_domain_expert(error="one row per (layer, domain, expert)")],
)

EXPERT_BALANCE = pa.DataFrameSchema(
    name="expert_balance",
    description=(
        "Mixture of experts only: per layer and domain (and over all domains, domain '(all)'), the routed "
        "positions against exposure x k, and how evenly the experts shared them."
    ),
    strict=True,
    columns={
        "layer": pa.Column("int64", pa.Check.ge(0), description="Decoder layer."),
        "domain": pa.Column(str, description="Domain, or '(all)' for every domain together."),
        "exposure_tokens": _tokens("Exposure of the domain (the ledger's counter)"),
        "experts_per_token": pa.Column("int64", pa.Check.gt(0), description="k: experts each position is routed to."),
        "routed_tokens": _tokens("Sum over the layer's experts of routed positions: exposure x k"),
        "max_load_tokens": _tokens("Routed positions of the layer's busiest expert"),
        "mean_load_tokens": pa.Column("float64", pa.Check.ge(0.0), description="routed_tokens / experts."),
        "load_imbalance": pa.Column(
            "float64",
            pa.Check.ge(1.0),
            nullable=True,
            description="max / mean load (1 = uniform; experts = one expert took all).",
        ),
        "load_cv": pa.Column(
            "float64", pa.Check.ge(0.0), nullable=True, description="Population std / mean of the loads."
        ),
        "idle_capacity": pa.Column(
            "float64",
            [pa.Check.ge(0.0), pa.Check.lt(1.0)],
            nullable=True,
            description="1 - mean / max: the share of the experts' capacity (sized for the busiest) left idle.",
        ),
    },
    checks=[
        pa.Check.one_row_per_layer_and_domain(error="one row per (layer, domain)"),
        pa.Check.routed_is_exposure_times_k(error="routed = exposure x experts_per_token (SPEC)"),
        pa.Check.balance_matches_definition(error="imbalance = max / mean, idle = 1 - mean / max"),
    ],
)

ROUTER = pa.DataFrameSchema(
    name="router",
    description="Mixture of experts only: router losses and the step's load balance at each logged step.",
    strict=True,
    columns={
        "step": pa.Column("int64", pa.Check.ge(0), description="Step the row was logged at."),
        "router_aux_loss": pa.Column(
            "float64",
            [pa.Check.ge(0.0), pa.Check(np.isfinite, element_wise=False, name="finite")],
            description="Load-balancing loss E * sum_e f_e P_e, mean over layers and micro batches (1 = uniform).",
        ),
        "router_z_loss": pa.Column(
            "float64",
            [pa.Check.ge(0.0), pa.Check(np.isfinite, element_wise=False, name="finite")],
            description="z-loss: mean logsumexp(router logits)^2, mean over layers and micro batches.",
        ),
        "load_imbalance": pa.Column(
            "float64", pa.Check.ge(1.0), description="The step's worst layer: max / mean load."
        ),
        "load_cv": pa.Column("float64", pa.Check.ge(0.0), description="The step's std / mean load, mean over layers."),
        "idle_capacity": _fraction("The step's 1 - mean / max load, mean over layers."),
    },
    checks=[pa.Check.steps_strictly_increase(error="steps strictly increase")],
)


@register_check_method(supported_types=pd.DataFrame)
def downstream_metric_in_range(df):
    """SPEC "Downstream evaluation": an accuracy is in [0, 1], a centered one <= 1, bpb > 0."""
    metric, value = df["metric"].astype(str), df["value"]
    accuracy = metric.str.startswith("acc")
    centered = metric.str.startswith("centered_") | (metric == "mean_centered")
    return (~accuracy | ((value >= 0) & (value <= 1))) & (~centered | (value <= 1)) & ((metric != "bpb") | (value > 0))


@register_check_method(supported_types=pd.DataFrame)
def downstream_convention_names_its_metric(df):
    """Each figure's convention record (canonical JSON) names the figure's metric (the aggregate: its rule)."""

    def names(row) -> bool:
        try:
            record = json.loads(row["convention"])
        except (TypeError, ValueError):
            return False
        return record.get("metric", record.get("rule")) == row["metric"]

    return df.apply(names, axis=1).astype(bool)


@register_check_method(supported_types=pd.DataFrame)
def downstream_baseline_unless_bpb(df):
    """Only bpb, which is no accuracy, may lack a random baseline."""
    return (df["metric"].astype(str) == "bpb") | df["random_baseline"].notna()


#: One of SCHEMAS since after runner-report/3 reports were published: a report whose evidence.json lists
#: no downstream table was written before it existed and reads it as empty (runner.reports.tables.LATER_TABLES).
DOWNSTREAM = pa.DataFrameSchema(
    name="downstream",
    description="Downstream multiple-choice figures per task and metric at each scoring (SPEC 'Downstream evaluation').",
    strict=True,
    columns={
        "source": pa.Column(
            str,
            pa.Check.isin(["loop", "runner eval"]),
            description="Scored in the training loop or by `runner eval` after the fact.",
        ),
        "step": pa.Column("int64", pa.Check.ge(0), description="Committed steps of the scored weights."),
        "exposure_tokens": _tokens("Total exposure of the scored weights"),
        "task": pa.Column(str, description="Task name in the eval recipe (`aggregate`: the figure over tasks)."),
        "metric": pa.Column(
            str, description="acc, acc_norm, acc_per_char, acc_per_token, centered_<acc>, bpb, or the aggregate's rule."
        ),
        "value": pa.Column(
            "float64", pa.Check(np.isfinite, element_wise=False, name="finite"), description="The figure."
        ),
        "documents": pa.Column("int64", pa.Check.ge(1), description="Documents scored (the fixed subset)."),
        "random_baseline": pa.Column(
            "float64",
            [pa.Check.ge(0.0), pa.Check.lt(1.0)],
            nullable=True,
            description="An accuracy's: mean over documents of 1 / choices, or the task's stated baseline; empty for bpb (none; rows written before carry the accuracies').",
        ),
        "convention": pa.Column(
            str,
            description="The convention record (canonical JSON): task file sha256, format, metric, limit, seed, shots, empty-context prefix, delimiter, seq_len, dtype. Figures compare only when equal.",
        ),
        "t_eval_seconds": pa.Column(
            "float64", pa.Check.ge(0.0), description="Wall seconds of the scoring (t_eval; never step time)."
        ),
        "useful_tokens": _tokens("Useful tokens of the scored weights (their lineage's ledger)"),
        "wall_seconds": pa.Column(
            "float64",
            pa.Check.ge(0.0),
            nullable=True,
            description="Loop: wall seconds from the first launch to the end of the scoring, all attempts (a downstream target's time_to_target); empty for runner eval and rows recorded before it.",
        ),
        "device_wall_seconds": pa.Column(
            "float64",
            pa.Check.ge(0.0),
            nullable=True,
            description="Loop: device-seconds held over the same span (device_hours_to_target x 3600); empty where wall_seconds is.",
        ),
    },
    checks=[
        pa.Check.downstream_metric_in_range(error="accuracies in [0, 1], centered <= 1, bpb > 0"),
        pa.Check.downstream_convention_names_its_metric(error="the convention record names the metric"),
        pa.Check.downstream_baseline_unless_bpb(error="a random baseline on every figure but bpb"),
    ],
)


@register_check_method(supported_types=pd.DataFrame)
def at_or_above_on_the_right_side(df):
    """A downstream target's `met` rows are at or above `at_least`; `before` and `best` rows below it."""
    met = df["point"] == "met"
    return (met & (df["value"] >= df["at_least"])) | (~met & (df["value"] < df["at_least"]))


#: One of SCHEMAS since after runner-report/3 reports were published (runner.reports.tables.LATER_TABLES).
DOWNSTREAM_TARGETS = pa.DataFrameSchema(
    name="downstream_targets",
    description="Downstream quality targets (SPEC 'Downstream evaluation'): for each, the in-loop scoring where its figure first reached at_least and the one before it, or the best one if never met.",
    strict=True,
    columns={
        "target": pa.Column(str, pa.Check.str_matches(r"^[A-Za-z0-9_-]+$"), description="Target name (eval recipe)."),
        "task": pa.Column(str, description="Task whose figure is judged (eval.tasks), or `aggregate`."),
        "metric": pa.Column(
            str, description="The task's recorded metric (acc, acc_norm, centered_acc, ...; the aggregate's rule)."
        ),
        "at_least": pa.Column(
            "float64",
            [pa.Check.le(1.0), pa.Check(np.isfinite, element_wise=False, name="finite")],
            description="Met when the value is >= this.",
        ),
        "met": pa.Column(bool, description="Whether any loop scoring of the run's lineage met the target."),
        "point": pa.Column(
            str,
            pa.Check.isin(["before", "met", "best"]),
            description="met: first loop scoring at or above at_least; before: the scoring before it; best: the highest value of a target never met.",
        ),
        "step": pa.Column("int64", pa.Check.gt(0), description="Committed steps at the scoring."),
        "exposure_tokens": _tokens("Total exposure at the scoring"),
        "useful_tokens": _tokens("Total useful tokens at the scoring"),
        "value": pa.Column(
            "float64",
            [pa.Check.le(1.0), pa.Check(np.isfinite, element_wise=False, name="finite")],
            description="The judged figure at the scoring (the downstream table's).",
        ),
        "wall_seconds": pa.Column(
            "float64",
            pa.Check.ge(0.0),
            nullable=True,
            description="time_to_target on the met row: wall seconds from the first launch to the end of the scoring, all attempts.",
        ),
        "device_hours": pa.Column(
            "float64",
            pa.Check.ge(0.0),
            nullable=True,
            description="device_hours_to_target on the met row: device-seconds over the same span / 3600.",
        ),
        "cost_usd": pa.Column(
            "float64",
            pa.Check.ge(0.0),
            nullable=True,
            description="cost_to_target on the met row: device_hours x price per device-hour.",
        ),
    },
    checks=[
        pa.Check.one_row_per_target_point(error="one row per (target, point)"),
        pa.Check.at_or_above_on_the_right_side(error="met rows >= at_least, before/best rows below it"),
        pa.Check.bracket_is_whole(error="met target: [before,] met at a later step; never met: one best row"),
        pa.Check(
            lambda df: df["wall_seconds"].isna() | (df["device_hours"] * 3600.0 >= df["wall_seconds"] * (1 - 1e-9)),
            name="device_hours_cover_wall",
            error="device_hours x 3600 >= wall_seconds",
        ),
    ],
)

SCHEMAS: dict[str, pa.DataFrameSchema] = {
    "run_summary": RUN_SUMMARY,
    "accounting": ACCOUNTING,
    "repetition": REPETITION,
    "validation": VALIDATION,
    "throughput": THROUGHPUT,
    "targets": TARGETS,
    "expert_load": EXPERT_LOAD,
    "expert_balance": EXPERT_BALANCE,
    "router": ROUTER,
    "downstream": DOWNSTREAM,
    "downstream_targets": DOWNSTREAM_TARGETS,
}


#: what reading a table of the wrong shape raises (a column dropped: AttributeError of itertuples' rows;
#: text, null, NaN or infinity where a count belongs: int() of them, x / 0 of object columns)
UNREADABLE = (KeyError, TypeError, ValueError, AttributeError, ArithmeticError)


@dataclass(frozen=True)
class TableFailure:
    """One failed check: which table, which check, on which column/row, with the offending value."""

    table: str
    check: str
    column: str | None
    index: object
    failure_case: object

    def __str__(self) -> str:
        where = f"{self.column}" if self.column else ""
        if self.index is not None and not (isinstance(self.index, float) and np.isnan(self.index)):
            where += f"[{self.index}]"
        return f"{self.table}: {self.check}: " + (
            f"{where} = {self.failure_case!r}" if where else f"{self.failure_case!r}"
        )


def schemas_for(version: str) -> dict[str, pa.DataFrameSchema]:
    """The tables as `version` (one of READABLE_VERSIONS) wrote them: the columns added since left out."""
    added = ADDED_SINCE.get(version, {}) if version != SCHEMA_VERSION else {}
    out = dict(SCHEMAS)
    for name, columns in added.items():
        schema = SCHEMAS[name].remove_columns(list(columns))
        if "schema_version" in schema.columns:
            schema = schema.update_column("schema_version", checks=[pa.Check.eq(version)])
        out[name] = schema
    return out


def with_added_columns(tables: dict[str, pd.DataFrame], version: str) -> dict[str, pd.DataFrame]:
    """The tables of a report written under `version` with each column added since at the value it
    stands for (ADDED_SINCE), for readers of the current columns; the tables themselves stay as written."""
    out = dict(tables)
    for name, columns in (ADDED_SINCE.get(version, {}) if version != SCHEMA_VERSION else {}).items():
        if name in out:
            out[name] = out[name].assign(**{c: v for c, v in columns.items() if c not in out[name]})
    return out


def _schema_failures(name: str, df: pd.DataFrame, schemas: dict[str, pa.DataFrameSchema]) -> list[TableFailure]:
    try:
        # Row labels carry no meaning in a report table; a duplicated label only confuses pandera. A NaN
        # compared in a check is that check's failure, not numpy's "invalid value" warning on stderr.
        with np.errstate(invalid="ignore"):
            schemas[name].validate(df.reset_index(drop=True), lazy=True)
    except pa.errors.SchemaErrors as err:
        out = []
        for row in err.failure_cases.itertuples(index=False):
            out.append(
                TableFailure(
                    name,
                    str(row.check),
                    None if row.column in (None, name) else str(row.column),
                    row.index,
                    row.failure_case,
                )
            )
        return out
    return []


def cross_table_failures(tables: dict[str, pd.DataFrame]) -> list[TableFailure]:
    """Invariant 2 (totals = sum of domains) and histogram/counter agreement."""
    out: list[TableFailure] = []
    summary, acct, hist = tables["run_summary"], tables["accounting"], tables["repetition"]
    if len(summary) == 1 and len(acct):
        row = summary.iloc[0]
        for counter in (
            "pool_tokens",
            "processed_tokens",
            "exposure_tokens",
            "useful_tokens",
            "unique_tokens",
            "lost_tokens",
        ):
            total, summed = int(row[counter]), int(acct[counter].sum())
            if total != summed:
                out.append(
                    TableFailure(
                        "run_summary", "invariant 2: total = sum of domains", counter, 0, f"{total} != {summed}"
                    )
                )
    if len(acct) and len(summary) == 1:
        seq_len = int(summary.iloc[0]["seq_len"])
        for d in acct.itertuples(index=False):
            h = hist[hist["domain"] == d.domain]
            checks = {
                "histogram samples = domain samples": (int(h["samples"].sum()), int(d.samples)),
                "histogram exposure = exposure": (
                    int((h["times_seen"] * h["samples"]).sum()) * seq_len,
                    int(d.exposure_tokens),
                ),
                "histogram seen samples = unique": (
                    int(h.loc[h["times_seen"] > 0, "samples"].sum()) * seq_len,
                    int(d.unique_tokens),
                ),
            }
            for check, (got, want) in checks.items():
                if got != want:
                    out.append(TableFailure("repetition", check, d.domain, None, f"{got} != {want}"))
        extra = set(hist["domain"]) - set(acct["domain"])
        for d in sorted(extra):
            out.append(TableFailure("repetition", "histogram domains = accounting domains", d, None, d))
    out += _throughput_failures(summary, tables.get("throughput"))
    return out


def _throughput_failures(summary: pd.DataFrame, speed: pd.DataFrame | None) -> list[TableFailure]:
    """Each logged step's speed as the loop computes it: tokens/s = the global batch's tokens / step
    seconds. (Its MFU is not recounted here: the row's is under the FLOPs count of the runner that
    trained, the summary's under this one's, and an elastic run's steps hold different devices.)"""
    needed = ("global_batch_sequences", "seq_len")
    if speed is None or not len(speed) or len(summary) != 1 or any(c not in summary for c in needed):
        return []
    row = summary.iloc[0]
    batch = float(row["global_batch_sequences"]) * float(row["seq_len"])
    with np.errstate(all="ignore"):
        tokens = speed["tokens_per_second"].to_numpy(dtype=float) * speed["step_seconds"].to_numpy(dtype=float)
    return [
        TableFailure(
            "throughput",
            "tokens_per_second x step_seconds = the global batch",
            "tokens_per_second",
            i,
            f"step {step}: {tokens[i]:.6g} tokens, the batch {batch:.6g}",
        )
        for i, step in enumerate(speed["step"])
        if not abs(tokens[i] - batch) <= 1e-6 * batch
    ]


def validate_tables(tables: dict[str, pd.DataFrame], version: str = SCHEMA_VERSION) -> list[TableFailure]:
    """Validate every table lazily (as `version` wrote them) and the cross-table invariants; return
    every failure found."""
    failures: list[TableFailure] = []
    schemas = schemas_for(version)
    for name in SCHEMAS:
        if name not in tables:
            failures.append(TableFailure(name, "table present", None, None, "missing"))
            continue
        failures.extend(_schema_failures(name, tables[name], schemas))
    if all(n in tables for n in ("run_summary", "accounting", "repetition")):
        try:
            failures.extend(cross_table_failures(tables))
        except UNREADABLE as err:  # malformed columns already failed above
            failures.append(
                TableFailure("report", "cross-table sums computable", None, None, f"{type(err).__name__}: {err}")
            )
    return failures
