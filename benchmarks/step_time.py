"""python benchmarks/step_time.py [--steps 5] [--recipe demo-cpu] [recipe overrides ...]

Time optimizer steps (forward + backward over the accumulation window + AdamW) of a
recipe through the trainer's own code path (packing, target-only LM head and all),
after one warm-up step. Prints seconds and tokens per step.
Used for the thread-oversubscription table in benchmarks/README.md:
run it alone, with OMP_NUM_THREADS=1, and beside another training process.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from finetune.config.schema import load_recipe
from finetune.trainer import Trainer


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--recipe", default="demo-cpu")
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    cfg = load_recipe(args.recipe, ["output_dir=/tmp/step_time", "overwrite=true"] + args.overrides)
    trainer = Trainer(cfg, progress=False)
    trainer.setup()
    print(f"threads {torch.get_num_threads()}, {trainer.state.window} {trainer.unit}/step")
    times = []
    for step in range(args.steps + 1):
        t0 = time.perf_counter()
        totals = trainer.accumulate_gradients(step)
        targets, tokens = totals.units, totals.tokens
        trainer.optimizer.step()
        trainer.optimizer.zero_grad(set_to_none=True)
        dt = time.perf_counter() - t0
        if step:  # step 0 warms up allocator and kernels
            times.append(dt)
        print(f"step {step}: {dt:.3f} s, {tokens} tokens ({int(targets)} trained){'  (warm-up)' if not step else ''}")
    print(f"median {statistics.median(times):.3f} s/step")


if __name__ == "__main__":
    main()
