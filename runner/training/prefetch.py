"""Reading ahead: the host work of the next steps' batches done in a background thread.

Owns one thread and a bounded queue of `produce(step)` results for consecutive steps, so the
sampler, the batch read and the copy into pinned memory of step k+1 run while step k trains.
The result handed out for step k is `produce(k)`, computed exactly as the caller would have
computed it in the step: the thread changes when the work is done, never what it returns.
Never skips, reorders or repeats a step; an exception raised while producing step k is raised by
`get(k)`, in the caller, at the step it belongs to. `depth=0` computes in the caller (no thread).
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from typing import Any

_POLL_SECONDS = 0.1  # how often a blocked producer looks whether close() was called


class Prefetcher:
    """`get(step)` for step = start, start+1, ..., end-1, in that order."""

    def __init__(self, produce: Callable[[int], Any], start: int, end: int, depth: int):
        if depth < 0:
            raise ValueError(f"depth must be >= 0, got {depth}")
        self.produce = produce
        self.next_step = int(start)
        self.end = int(end)
        self.depth = int(depth)
        self.wait_seconds = 0.0  # time the caller spent blocked in get(): the read it still sees
        self._queue: queue.Queue = queue.Queue(maxsize=max(1, self.depth))
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        if self.depth > 0 and start < end:
            self._thread = threading.Thread(target=self._run, args=(int(start),), name="runner-prefetch", daemon=True)
            self._thread.start()

    def _put(self, item: tuple) -> bool:
        while not self._stop.is_set():
            try:
                self._queue.put(item, timeout=_POLL_SECONDS)
                return True
            except queue.Full:
                continue
        return False

    def _run(self, start: int) -> None:
        for step in range(start, self.end):
            if self._stop.is_set():
                return
            try:
                item = (step, None, self.produce(step))
            except BaseException as exc:  # handed to the caller at this step, as if raised there
                self._put((step, exc, None))
                return
            if not self._put(item):
                return

    def get(self, step: int) -> Any:
        """The result of `produce(step)`; `step` must be the next one."""
        if step != self.next_step or step >= self.end:
            raise RuntimeError(f"prefetcher asked for step {step}, next is {self.next_step} (end {self.end})")
        self.next_step += 1
        t0 = time.perf_counter()
        if self._thread is None:
            result = self.produce(step)
            self.wait_seconds = time.perf_counter() - t0
            return result
        got, exc, result = self._queue.get()
        self.wait_seconds = time.perf_counter() - t0
        if got != step:  # cannot happen with one producer and one consumer; a bug if it does
            raise RuntimeError(f"prefetcher produced step {got} for step {step}")
        if exc is not None:
            raise exc
        return result

    def close(self) -> None:
        """Stop the thread (a step being produced is finished and dropped); idempotent."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
