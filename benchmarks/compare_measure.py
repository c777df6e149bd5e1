"""What a worker of benchmarks/compare.py measures and how it pauses: the tokens, trained
tokens, examples, padding and FLOPs of every batch a tool trains on (any layout), the
single-thread matmul peak, resident memory, and the worker's end of the lockstep protocol."""

from __future__ import annotations

import json
import os
import time
from typing import Any

from compare_job import PAD_ID, example_flops

# ----------------------------------------------------------------------------- batch accounting


def batch_segments(batch: dict[str, Any], pad_id: int = PAD_ID) -> list[tuple[int, int]]:
    """(tokens, trained tokens) of every example in a collated batch, whatever its layout:
    padded rows with attention_mask; packed rows with position_ids (finetune pads a row's
    end with a segment of its own whose first token is the pad id and that trains nothing);
    padding-free flattened rows (TRL)."""
    ids, labels = batch["input_ids"], batch["labels"]
    targets = (labels[:, 1:] != -100).long()
    trained_at = [[0] + row for row in targets.tolist()]  # trained[t]: the label at t is trained (t >= 1)
    out = []
    if "position_ids" in batch and batch["position_ids"] is not None:
        pos = batch["position_ids"].tolist()
        ids_l = ids.tolist()
        for r, row in enumerate(pos):
            starts = [t for t, p in enumerate(row) if p == 0] + [len(row)]
            for a, b in zip(starts, starts[1:]):
                n_trained = sum(trained_at[r][a + 1 : b])  # a segment's first label never counts (shifted away)
                if ids_l[r][a] == pad_id and n_trained == 0:
                    continue  # padding segment
                out.append((b - a, n_trained))
        return out
    mask = batch.get("attention_mask")
    lengths = mask.sum(1).tolist() if mask is not None else [ids.shape[1]] * ids.shape[0]
    for r, n in enumerate(lengths):
        out.append((int(n), sum(trained_at[r][1:n])))
    return out


class StepStats:
    """Accumulates what the micro-batches of one optimizer step held."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.tokens = self.trained = self.examples = self.padded = 0
        self.flops = 0.0

    def add(self, batch: dict[str, Any]) -> None:
        segs = batch_segments(batch)
        self.tokens += sum(s for s, _ in segs)
        self.trained += sum(t for _, t in segs)
        self.examples += len(segs)
        self.padded += int(batch["input_ids"].numel())
        self.flops += sum(example_flops(s, t) for s, t in segs)

    def as_dict(self) -> dict[str, float]:
        return {
            "tokens": self.tokens,
            "trained": self.trained,
            "examples": self.examples,
            "padded": self.padded,
            "flops": self.flops,
        }


# ----------------------------------------------------------------------------- peak matmul rate


def matmul_peak_gflops(n: int = 2048, reps: int = 3) -> float:
    """Best-of-reps single-thread fp32 torch.mm rate (FLOP/s / 1e9)."""
    import torch

    torch.set_num_threads(1)
    a, b = torch.randn(n, n), torch.randn(n, n)
    torch.mm(a, b)
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        torch.mm(a, b)
        best = min(best, time.perf_counter() - t0)
    return 2 * n**3 / best / 1e9


# ----------------------------------------------------------------------------- worker side


def current_rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def max_rss() -> int:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux


class Lockstep:
    """The worker's end of the lockstep protocol: pause() reports the span that just ended
    and blocks until the parent says go (or finish: then it never pauses again)."""

    def __init__(self) -> None:
        self.cmd = os.fdopen(int(os.environ["BENCH_CMD_FD"]), "r")
        self.rep = os.fdopen(int(os.environ["BENCH_REP_FD"]), "w")
        self.span = StepStats()
        self.total = StepStats()
        self.t0: float | None = None
        self.free = False
        self.loaded: dict[str, int] = {}
        self.step_examples: list[int] = []  # examples in every optimizer step, warm-up and last included
        self._examples = 0

    def send(self, obj: dict[str, Any]) -> None:
        self.rep.write(json.dumps(obj) + "\n")
        self.rep.flush()

    def mark_loaded(self) -> None:
        """Model and data ready, before the first step."""
        self.loaded = {"rss_loaded": current_rss(), "maxrss_loaded": max_rss()}

    def record(self, batch: dict[str, Any]) -> None:
        before = self.total.examples
        self.span.add(batch)
        self.total.add(batch)
        self._examples += self.total.examples - before

    def end_step(self) -> None:
        self.step_examples.append(self._examples)
        self._examples = 0

    def pause(self) -> None:
        if self.free:
            return
        now = time.perf_counter()
        if self.t0 is None:
            self.send({"event": "ready", **self.loaded, "rss_warm": current_rss()})
        else:
            self.send({"event": "span", "dt": now - self.t0, **self.span.as_dict()})
        self.span.reset()
        msg = json.loads(self.cmd.readline() or '{"cmd": "finish"}')
        self.free = msg["cmd"] == "finish"
        self.t0 = time.perf_counter()
