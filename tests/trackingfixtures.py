"""Readers shared by the tracking tests (test_tracking_journal, test_tracking_store, test_tracking_server):
an MLflow store's metric rows, the journal's unsent entries, a free loopback port. The empty-store
fixtures (`template_store`, `store`) are conftest's."""

from __future__ import annotations

import socket
import sqlite3
from pathlib import Path

from runner.fsio import read_jsonl


def metric_rows(db: Path, run_id: str) -> list[tuple]:
    with sqlite3.connect(db) as c:
        return c.execute(
            "select key, step, value from metrics where run_uuid=? order by key, step, timestamp", (run_id,)
        ).fetchall()


def pending(run_dir: Path) -> list[dict]:
    """Entries of the pending journal that no `ack` line covers (what the next start re-sends)."""
    lines = read_jsonl(run_dir / "journal" / "mlflow-pending.jsonl", skip_torn=True)
    acked = max((e["seq"] for e in lines if e["kind"] == "ack"), default=-1)
    return [e for e in lines if e["kind"] != "ack" and e["seq"] > acked]


def free_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port
