"""python benchmarks/mlp_block.py [--tokens 832] [--calls 200] [recipe overrides ...]

One MLP of a recipe's model (the demo's by default: its first decoder layer's, NF4 with double quant, LoRA as the
recipe sets it), forward and backward of one micro-batch's tokens, timed three ways in one process, alternating:
peft over bitsandbytes (eager), model.kernels=finetune's per-projection nodes (fast_lora), and its MLP block over
them (fast_mlp). Prints milliseconds per call (the median of 3 timings of --calls calls each, after 20 warm-up calls)
and each way's ratio to eager. On a CPU this is why the block is installed on CUDA only (fast_mlp.worth_it).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from finetune.config.schema import load_recipe
from finetune.model import fast_lora, fast_mlp
from finetune.trainer import Trainer


def timed(mlp, x: torch.Tensor, calls: int) -> float:
    """Milliseconds per forward + backward of the MLP on x."""
    for _ in range(20):
        mlp(x.requires_grad_(True)).sum().backward()
    t0 = time.perf_counter()
    for _ in range(calls):
        mlp(x).sum().backward()
    return (time.perf_counter() - t0) / calls * 1e3


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--recipe", default="demo-cpu")
    parser.add_argument("--tokens", type=int, default=832, help="one micro-batch's tokens (the demo's: 16 x ~52)")
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    cfg = load_recipe(args.recipe, ["output_dir=/tmp/mlp_block", "overwrite=true", "model.kernels=none", *args.overrides])
    trainer = Trainer(cfg, progress=False)
    trainer.setup()
    mlp = next(m for m in trainer.model.modules() if hasattr(m, "gate_proj") and hasattr(m, "act_fn"))
    mlp.train()
    x = torch.randn(1, args.tokens, mlp.gate_proj.base_layer.in_features).requires_grad_(True)
    ways = {
        "eager": lambda: None,
        "per-projection nodes": lambda: fast_lora.install(mlp),
        "MLP block": lambda: fast_mlp.install(mlp),
    }
    times: dict[str, list[float]] = {way: [] for way in ways}
    for _ in range(3):  # each round installs from scratch, in order: eager, nodes, block
        for way, install in ways.items():
            for module in (mlp, mlp.gate_proj, mlp.up_proj, mlp.down_proj):
                module.__dict__.pop("forward", None)  # the class's own forward again
            if way == "MLP block":
                fast_lora.install(mlp)
            install()
            times[way].append(timed(mlp, x, args.calls))
    dropout = mlp.down_proj.lora_dropout["default"]
    print(f"{type(mlp).__name__}, {args.tokens} tokens, LoRA dropout {getattr(dropout, 'p', 0.0)}, precision {cfg.precision}")
    eager = statistics.median(times["eager"])
    for way, ms in times.items():
        med = statistics.median(ms)
        print(f"  {way:22s} {med:7.2f} ms  ({med / eager:.2f}x)   runs {', '.join(f'{t:.2f}' for t in ms)}")


if __name__ == "__main__":
    main()
