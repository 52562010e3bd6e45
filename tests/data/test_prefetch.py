"""Reading the next global batch in a background thread changes when the work is done, never what a
step trains on: weights and token ledger are bit-identical with and without it, across a SIGKILL."""

from __future__ import annotations

import json
import signal
import threading
import time

import pytest
from trainfixtures import launch, make_project

from runner.fsio import sha256_file
from runner.training.prefetch import Prefetcher

COUNTS = ("processed", "exposure", "useful", "unique", "lost")


@pytest.mark.parametrize("depth", [0, 1, 3])
def test_each_step_gets_exactly_its_own_result_in_order(depth):
    calls = []

    def produce(step):
        calls.append((step, threading.current_thread().name))
        return {"step": step, "square": step * step}

    p = Prefetcher(produce, 5, 12, depth)
    got = [p.get(step) for step in range(5, 12)]
    p.close()
    assert got == [{"step": s, "square": s * s} for s in range(5, 12)]
    assert [s for s, _ in calls] == list(range(5, 12))  # each step produced once, in order
    threads = {name for _, name in calls}
    assert threads == ({"runner-prefetch"} if depth else {threading.current_thread().name})


def test_a_failure_is_raised_at_the_step_it_belongs_to():
    def produce(step):
        if step == 3:
            raise IndexError("sample 99 outside domain 'web'")
        return step

    p = Prefetcher(produce, 0, 6, 2)
    assert [p.get(s) for s in range(3)] == [0, 1, 2]
    with pytest.raises(IndexError, match="sample 99"):
        p.get(3)
    p.close()


def test_steps_must_be_asked_in_order():
    p = Prefetcher(lambda s: s, 0, 4, 1)
    p.get(0)
    with pytest.raises(RuntimeError, match="asked for step 2, next is 1"):
        p.get(2)
    p.close()


def test_close_stops_a_producer_blocked_on_a_full_queue():
    started = threading.Event()

    def produce(step):
        started.set()
        return step

    p = Prefetcher(produce, 0, 10**9, 1)
    started.wait(5)
    time.sleep(0.05)
    thread = p._thread
    p.close()
    assert thread is not None and not thread.is_alive()


def _weights(run, steps):
    return sha256_file(run / "checkpoints" / f"step-{steps:07d}" / "model.safetensors")


def _counters(run):
    return json.loads((run / "ledger.json").read_text())["counters"]


@pytest.mark.slow
def test_prefetch_gives_bit_identical_weights_and_ledger_also_across_a_kill(tmp_path):
    steps = 8
    base = make_project(tmp_path / "sync", steps=steps, train_extra={"prefetch_batches": 0})
    ahead = make_project(tmp_path / "ahead", steps=steps, train_extra={"prefetch_batches": 3})
    ref, fast = tmp_path / "sync" / "runs" / "r", tmp_path / "ahead" / "runs" / "r"
    launch(tmp_path / "sync", base, "--run-dir", ref, "--no-tracking")
    # The read-ahead run is killed mid-step (batches of later steps already read) and resumed.
    proc = launch(tmp_path / "ahead", ahead, "--run-dir", fast, "--kill-at-step", 5, "--no-tracking", check=False)
    assert proc.returncode == -signal.SIGKILL
    launch(tmp_path / "ahead", fast, "--no-tracking")
    assert _weights(fast, steps) == _weights(ref, steps)
    a, b = _counters(ref), _counters(fast)
    for d in a:
        assert {k: a[d][k] for k in ("exposure", "useful", "unique")} == {
            k: b[d][k] for k in ("exposure", "useful", "unique")
        }
    assert b["total"]["lost"] > 0  # the killed step's work was spent and lost, as without read-ahead
    runtime = json.loads((fast / "run.json").read_text())["runtime"]
    assert runtime["prefetch_batches"] == 3
    rows = [json.loads(x) for x in (fast / "metrics" / "train.jsonl").read_text().splitlines()]
    assert all(r["data_wait_seconds"] >= 0 for r in rows)
