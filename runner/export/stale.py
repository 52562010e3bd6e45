"""Whether a run's report/ still states every downstream figure the run folder holds.

`runner eval` appends its scoring to the run folder (RUN/downstream/eval-step-*.json) and leaves
report/ as it was (a report is rebuilt by `runner report`, which MLflow's evidence then vouches for).
An export takes its card's figures from the audited report, so a scoring made after the report would
silently miss the card: `runner export` refuses, in one line naming the scorings and the command to run.
Never writes anything.
"""

from __future__ import annotations

from pathlib import Path

from runner.errors import RunnerError
from runner.reports import tables as rpt
from runner.reports.audit.downstream import later_scorings
from runner.reports.downstream.table import downstream_table


def check_report_current(run_dir: Path) -> None:
    """Refuse when the run folder holds `runner eval` figures its report/ does not (scored after it)."""
    report = Path(run_dir) / rpt.REPORT_DIR
    recorded = downstream_table(run_dir)
    if recorded.empty or not (report / "run_summary.parquet").exists():
        return  # nothing scored, or no report yet (the export's audit says so)
    table = rpt.read_tables(report).get("downstream")
    if table is None:
        table = recorded.iloc[0:0]
    later = later_scorings(table, recorded)
    if later.empty:
        return
    steps = ", ".join(f"step {int(s)}" for s in sorted(set(later["step"])))
    raise RunnerError(
        f"report/ predates `runner eval`'s scoring of {steps}: the card would leave it out; "
        f"run `runner report {run_dir}` first (it rebuilds the report with it), then export",
        file=str(report),
    )
