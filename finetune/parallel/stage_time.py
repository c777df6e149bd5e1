"""How long a pipeline rank computes in a window, and how long it waits: the measured bubble.

    clock = BusyClock(device)
    stage.forward_one_chunk = clock.timed(stage.forward_one_chunk)   # what the schedule calls, per micro-batch
    with clock.window():
        schedule.step(...)
    busy_s, window_s = clock.last        # the rest of the window: waiting on the other stages and the sends

Spans nest (a backward that runs its weight gradients inside): only the outermost counts. On CUDA the
spans are events on the current stream, read once after the window (no synchronization inside it); on a
CPU, the host clock.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch


class BusyClock:
    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.spans: list[tuple[Any, Any]] = []
        self.depth = 0
        self.open = False  # inside window(): spans are counted
        self.last = (0.0, 0.0)  # (busy seconds, window seconds) of the last window

    def _mark(self) -> Any:
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def _seconds(self, start: Any, end: Any) -> float:
        return start.elapsed_time(end) / 1000 if self.cuda else end - start

    def timed(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        """`fn` with each call's time counted as busy."""

        def run(*args: Any, **kwargs: Any) -> Any:
            self.depth += 1
            start = self._mark() if self.depth == 1 and self.open else None  # (eval passes: outside a window)
            try:
                return fn(*args, **kwargs)
            finally:
                self.depth -= 1
                if start is not None:
                    self.spans.append((start, self._mark()))

        return run

    @contextmanager
    def window(self) -> Iterator[None]:
        """One window's schedule: `last` = (busy, whole) seconds once it ends."""
        self.spans, self.open = [], True
        start = self._mark()
        try:
            yield
        finally:
            self.open = False
        end = self._mark()
        if self.cuda:
            end.synchronize()
        self.last = (sum(self._seconds(a, b) for a, b in self.spans), self._seconds(start, end))
