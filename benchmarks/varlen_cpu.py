"""Packed rows on the CPU: sdpa (a block-causal T x T mask per row) vs model.attn_implementation=varlen
(one causal sdpa call per example, no mask). Forward + backward of a LoRA-free Llama-shaped model
(hidden 512, 8 layers, 8 heads, MLP 1376, vocab 4096: compare_job's), fp32, one packed row of T
tokens holding examples of lognormal length (median --median tokens, sigma 0.9), the same row for
both. Reported: median seconds of --reps passes after one warm-up, and the mask's bytes.

    python benchmarks/varlen_cpu.py                 # T = 2048, 8192; ~2 min on 2 cores
"""

from __future__ import annotations

import argparse
import math
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from compare_job import DIMS  # noqa: E402


def packed_positions(length: int, median: float, seed: int = 0) -> tuple[list[int], list[int]]:
    """position_ids of one row of `length` tokens cut into examples of lognormal length."""
    rng = random.Random(seed)
    pos, sizes = [], []
    while len(pos) < length:
        n = min(max(8, int(rng.lognormvariate(math.log(median), 0.9))), length - len(pos))
        pos += list(range(n))
        sizes.append(n)
    return pos, sizes


def main() -> int:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from finetune.model import varlen

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--lengths", type=int, nargs="+", default=[2048, 8192])
    p.add_argument("--median", type=float, default=300)
    p.add_argument("--reps", type=int, default=3)
    args = p.parse_args()
    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=DIMS["vocab"], hidden_size=DIMS["hidden"], intermediate_size=DIMS["intermediate"],
        num_hidden_layers=DIMS["layers"], num_attention_heads=DIMS["heads"], num_key_value_heads=DIMS["heads"],
        max_position_embeddings=max(args.lengths), use_cache=False,
    )  # fmt: skip
    model = LlamaForCausalLM(cfg)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    print(f"{'T':>6} {'examples':>8} {'sdpa s':>8} {'varlen s':>9} {'sdpa/varlen':>11} {'mask MiB':>9} {'max diff':>9}")
    for T in args.lengths:
        pos, sizes = packed_positions(T, args.median)
        ids = torch.randint(4, DIMS["vocab"], (1, T), generator=torch.Generator().manual_seed(1))
        position_ids = torch.tensor([pos])
        times, losses = {}, {}
        for attention in ("sdpa", varlen.register()):
            model.set_attn_implementation(attention)
            runs = []
            for _ in range(args.reps + 1):
                model.zero_grad(set_to_none=True)
                t0 = time.perf_counter()
                loss = model(input_ids=ids, position_ids=position_ids, labels=ids).loss
                loss.backward()
                runs.append(time.perf_counter() - t0)
            times[attention], losses[attention] = statistics.median(runs[1:]), float(loss)
        ratio = times["sdpa"] / times["varlen"]
        diff = abs(losses["sdpa"] - losses["varlen"])
        print(
            f"{T:>6} {len(sizes):>8} {times['sdpa']:>8.2f} {times['varlen']:>9.2f} {ratio:>11.2f} {T * T / 2**20:>9.0f} {diff:>9.1e}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
