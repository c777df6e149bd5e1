"""The split strategies' own collectives inside forward and backward, timed: what a rank spends there is waiting on
the others (and moving bytes), not its own work. The straggler watch takes it out of the rank's compute
(trainer/profiling.StepClock), so a slow rank of a tensor- or context-parallel group, or of FSDP's processes, shows as
the slow one instead of every rank showing its time.

    waits.recording(True)                # a step's clock runs (nothing is kept otherwise: eval, generation)
    with waits.collective(x.device):     # around one collective this rank blocks on
        dist.all_reduce(x, group=group)
    seconds = waits.taken()              # since the last call (CUDA: events on the compute stream, read once here)

Timed: tensor parallelism's all-reduces (regions.py), sequence parallelism's gathers and reduce-scatters, the
vocabulary's gathers and reductions, the ring's transfers, Ulysses' forward all-to-alls, FSDP2's all-gathers (issued
and waited for) and reduce-scatters (fsdp.time_gathers wraps its unit's methods). Not timed: Ulysses' backward
all-to-all (inside torch's autograd function), and a GRPO group's broadcast of its first rank's completions (that rank samples for the group by design: timing the others' wait would name it a straggler
every step). On a GPU a collective's span is its kernels' time on the compute stream, which includes waiting for
the slowest peer to arrive.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

_spans: list[tuple[Any, Any]] = []  # (start, end) marks of this process's timed collectives since the last taken()
_on = [False]  # recording: between a step clock's start and its stop


def recording(on: bool) -> None:
    """Keep spans from now on (a step's clock started), or no longer (it stopped): a held-out eval's, a reference
    pass's or a generation's collectives would otherwise pile up events until the next step."""
    _on[0] = on
    if not on:
        _spans.clear()


def _mark(cuda: bool) -> Any:
    if not cuda:
        return time.perf_counter()
    event = torch.cuda.Event(enable_timing=True)
    event.record()
    return event


@contextmanager
def collective(device: torch.device) -> Iterator[None]:
    """Time the collective inside (a CUDA device: events on its current stream, never a synchronization here)."""
    if not _on[0]:
        yield
        return
    cuda = device.type == "cuda"
    start = _mark(cuda)
    try:
        yield
    finally:
        _spans.append((start, _mark(cuda)))


def taken() -> float:
    """Seconds in timed collectives since the last call (waits for a GPU's last one to finish)."""
    spans = list(_spans)
    _spans.clear()
    events = [end for _, end in spans if not isinstance(end, float)]
    if events:
        events[-1].synchronize()  # one stream's events: the last one done, every one is
    return sum(b - a if isinstance(a, float) else a.elapsed_time(b) / 1000 for a, b in spans)
