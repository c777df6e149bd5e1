"""The pipeline bubble of torch.distributed.pipelining's schedules on this CPU (issue 27's measurement):
GPipe, 1F1B and interleaved 1F1B at p stages and m micro-batches, gloo, one thread per process.

    python -m torch.distributed.run --nproc_per_node 2 benchmarks/pipeline_bubble.py --microbatches 8

Each rank holds a stack of identical MLP blocks (interleaved: V virtual stages per rank, the same
blocks in all). Busy time is measured, not assumed: every forward and backward of a block is timed
on its own rank (forward: a clock pair; backward: from the output's gradient arriving to the first
weight's gradient accumulated), and the
bubble is 1 - busy / step, per rank, the median of --steps timed steps after one warm-up. The ideal
bubble of GPipe and 1F1B is (p - 1) / (m + p - 1); interleaving divides the p - 1 by V.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B

BUSY = [0.0]  # seconds this rank spent computing in the current step


class Marked(torch.autograd.Function):
    """Identity on the stage's output whose backward notes when the stage's backward starts."""

    @staticmethod
    def forward(ctx, x, marks):
        ctx.marks = marks
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        ctx.marks.append(time.perf_counter())
        return grad, None


class Block(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.up, self.down = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)

    def forward(self, x):
        return x + self.down(torch.relu(self.up(x)))


class Stack(nn.Module):
    """A stage: `depth` blocks, its forward and backward time added to BUSY."""

    def __init__(self, width: int, depth: int):
        super().__init__()
        self.blocks = nn.Sequential(*(Block(width) for _ in range(depth)))
        self.marks: list[float] = []  # per backward: its start (the output's grad arrives), its end
        # The first block's first weight gets its gradient last: the end of this stage's backward.
        self.blocks[0].up.weight.register_post_accumulate_grad_hook(lambda _: self.marks.append(time.perf_counter()))

    def forward(self, x):
        t0 = time.perf_counter()
        y = self.blocks(x)
        BUSY[0] += time.perf_counter() - t0
        return Marked.apply(y, self.marks)


def run(schedule: str, args: argparse.Namespace, rank: int, world: int) -> dict[str, float]:
    torch.manual_seed(0)
    virtual = args.virtual if schedule == "interleaved_1f1b" else 1
    n_stages = world * virtual
    stacks = [Stack(args.width, args.depth // virtual) for _ in range(virtual)]
    stages = [PipelineStage(s, rank + v * world, n_stages, torch.device("cpu")) for v, s in enumerate(stacks)]

    def loss_fn(out, target):
        return (out - target).pow(2).mean()

    kind = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}.get(schedule)
    sched = (
        kind(stages[0], n_microbatches=args.microbatches, loss_fn=loss_fn)
        if kind
        else ScheduleInterleaved1F1B(stages, n_microbatches=args.microbatches, loss_fn=loss_fn)
    )
    x = torch.randn(args.microbatches * args.rows, args.width)
    target = torch.randn_like(x)
    ratios, steps = [], []
    for i in range(args.steps + 1):
        for s in stacks:
            s.marks.clear()
            s.zero_grad(set_to_none=True)
        BUSY[0] = 0.0
        dist.barrier()
        t0 = time.perf_counter()
        if rank == 0:
            sched.step(x)
        elif rank == world - 1:
            sched.step(target=target)
        else:
            sched.step()
        step = time.perf_counter() - t0
        # Backward time per micro-batch: from the mark at the stage output's backward to the one at its input's.
        for s in stacks:
            marks = s.marks
            BUSY[0] += sum(b - a for a, b in zip(marks[0::2], marks[1::2], strict=False))
        if i:  # the first step warms up
            ratios.append(1 - BUSY[0] / step)
            steps.append(step)
    return {"bubble": statistics.median(ratios), "step_s": statistics.median(steps)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--microbatches", type=int, default=8)
    p.add_argument("--virtual", type=int, default=2, help="virtual stages per rank for interleaved 1F1B")
    p.add_argument("--width", type=int, default=256)
    p.add_argument("--depth", type=int, default=8, help="blocks per rank")
    p.add_argument("--rows", type=int, default=64, help="rows per micro-batch")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--json", default=None)
    args = p.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    out = {}
    for schedule in ("gpipe", "1f1b", "interleaved_1f1b"):
        mine = run(schedule, args, rank, world)
        every: list[dict[str, float] | None] = [None] * world
        dist.all_gather_object(every, mine)
        ideal = (world - 1) / ((args.virtual if schedule == "interleaved_1f1b" else 1) * args.microbatches + world - 1)
        out[schedule] = {"ideal_bubble": ideal, "per_rank": every}
        if rank == 0:
            bubbles = ", ".join(f"{r['bubble']:.3f}" for r in every if r)
            print(f"{schedule:<17} p={world} m={args.microbatches}: bubble per rank {bubbles} (ideal {ideal:.3f}); "
                  f"step {every[0]['step_s'] * 1000:.1f} ms", flush=True)  # fmt: skip
    if rank == 0 and args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "world": world, "schedules": out}, f, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
