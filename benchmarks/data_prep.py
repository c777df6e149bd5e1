"""Data preparation speed and packing efficiency.

    python benchmarks/data_prep.py [--examples 50000] [--json out.json]

Builds a synthetic instruction dataset (alpaca and multi-turn messages) with
lognormal response lengths, tokenizes it with the bundled tiny-llama tokenizer
(byte-level BPE, ChatML template) and reports, per format:
  cold build (num_proc 1 and 2), warm build (tokenized cache hit), and
  padding waste: packed rows vs. random micro-batches vs. length-grouped micro-batches.
Run it on an otherwise idle machine: timings are wall clock.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from finetune.config.schema import build_recipe, resolve_path  # noqa: E402
from finetune.data import build_datasets, length_grouped  # noqa: E402

WORDS = "river pear dog bird stone cloud lamp apple tree house road wolf boat sock green quiet".split()


def sentence(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


def make_rows(fmt: str, n: int, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        reply = lambda: sentence(rng, max(1, min(900, int(rng.lognormvariate(3.5, 0.9)))))  # noqa: E731
        if fmt == "alpaca":
            rows.append({"instruction": sentence(rng, rng.randint(4, 30)), "input": "", "output": reply()})
        else:
            msgs = [{"role": "system", "content": "Answer briefly."}]
            for _ in range(rng.randint(1, 3)):
                msgs += [
                    {"role": "user", "content": sentence(rng, rng.randint(3, 25))},
                    {"role": "assistant", "content": reply()},
                ]
            rows.append({"messages": msgs})
    return rows


def padding_waste(lengths: list[int], order: list[int], batch: int) -> float:
    used = padded = 0
    for i in range(0, len(order) - batch + 1, batch):
        b = [lengths[j] for j in order[i : i + batch]]
        used += sum(b)
        padded += max(b) * len(b)
    return 1 - used / padded


def timed(cfg, tok) -> tuple[float, object]:
    t0 = time.perf_counter()
    bundle = build_datasets(cfg, tok)
    return time.perf_counter() - t0, bundle


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--examples", type=int, default=50_000)
    ap.add_argument("--max-seq-len", type=int, default=1024)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(resolve_path("asset:tiny-llama"))
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for fmt in ("alpaca", "messages"):
            path = Path(tmp) / f"{fmt}.jsonl"
            path.write_text("".join(json.dumps(r) + "\n" for r in make_rows(fmt, args.examples)))
            base = {"path": str(path), "format": fmt, "max_seq_len": args.max_seq_len, "cache_dir": f"{tmp}/cache"}

            def cfg(base=base, **data):  # base bound now: the loop rebinds it per format
                return build_recipe({"model": {"path": "x"}, "data": {**base, **data}, "output_dir": f"{tmp}/run"})

            cold1, plain = timed(cfg(cache=False), tok)
            cold2, _ = timed(cfg(cache=False, num_proc=2), tok)
            timed(cfg(), tok)  # fill the cache
            warm, cached = timed(cfg(), tok)
            assert cached.from_cache
            _, packed = timed(cfg(cache=False, packing=True), tok)
            lengths = plain.train.lengths().tolist()
            order = list(range(len(lengths)))
            random.Random(0).shuffle(order)
            r = {
                "examples": plain.train_stats.examples,
                "tokens": plain.train_stats.tokens,
                "cold_s_num_proc_1": round(cold1, 2),
                "cold_s_num_proc_2": round(cold2, 2),
                "warm_cache_hit_s": round(warm, 3),
                "examples_per_s_num_proc_1": round(plain.train_stats.examples / cold1),
                "packed_rows": packed.train_stats.rows,
                "packing_waste": round(packed.train_stats.packing_waste, 4),
                "padding_waste_random_batches_of_8": round(padding_waste(lengths, order, 8), 4),
                "padding_waste_length_grouped_batches_of_8": round(
                    padding_waste(lengths, length_grouped(order, lengths, 64 * 8), 8), 4
                ),
            }
            results[fmt] = r
            print(fmt, json.dumps(r, indent=1))
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
