"""Context parallelism on this CPU (issue 28): time per token of one process against a sequence split over
2 processes (ring and Ulysses) at the same total length, and the fraction of a step the ring's ranks spend
waiting on its transfers.

    python benchmarks/context_parallel_cpu.py --lengths 2048 8192 --out benchmarks/results/context_parallel_cpu.json

A random-init Llama (hidden 512, 8 layers, 8 heads, 4 key/value heads, vocab: the bundled tokenizer's) in
4-bit NF4 with LoRA r=8 on every linear, fp32, activation checkpointing, one row of --length tokens a step,
--steps steps through finetune's Trainer; the first step is a warm-up. Each configuration runs under
torch.distributed.run with OMP_NUM_THREADS = cores / processes, so every configuration uses the same cores.
Reported: seconds per 1,000 tokens (median step), and for the ring the waiting time (WaitClock: the
seconds its rank spent in the transfers' wait calls, i.e. what compute did not hide) as a fraction of the
timed steps. The machine otherwise idle.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def build(root: Path, length: int, steps: int) -> Path:
    """The model, a text file of `steps` rows of `length` tokens (one character a token), and the recipe."""
    import shutil

    import torch
    import yaml
    from transformers import LlamaConfig, LlamaForCausalLM

    assets = ROOT / "finetune" / "assets" / "tiny-llama"
    model = root / "model"
    model.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(assets / name, model / name)
    vocab = json.loads((assets / "config.json").read_text())["vocab_size"]
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=512,
        intermediate_size=1376,
        num_hidden_layers=8,
        num_attention_heads=8,
        num_key_value_heads=4,
        max_position_embeddings=length + 8,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=3,
    )
    LlamaForCausalLM(config).save_pretrained(model)
    rng = random.Random(0)
    letters = "abcdefghijklmnopqrstuvwxyz "
    with (root / "rows.jsonl").open("w") as f:
        for _ in range(steps):
            f.write(json.dumps({"text": "".join(rng.choice(letters) for _ in range(length - 2))}) + "\n")
    recipe = {
        "model": {"path": str(model)},
        "data": {"path": str(root / "rows.jsonl"), "format": "text", "max_seq_len": length, "shuffle": False},
        "precision": "fp32",
        "quant": {"bits": 4},
        "lora": {"r": 8, "alpha": 16, "dropout": 0.0},
        "train": {"max_steps": steps, "batch_size": 1, "grad_accum": 1, "lr": 1e-4},
        "memory": {"activation_checkpointing": "all"},
        "seed": 0,
        "output_dir": str(root / "out"),
    }
    path = root / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe))
    return path


def worker(recipe: str, report: str) -> None:
    """One process of a configuration: train, then rank 0 writes the median step and the ring's waiting."""
    from finetune.config.schema import load_recipe
    from finetune.parallel.ring import WaitClock
    from finetune.trainer import Callback, Trainer

    marks: list[tuple[float, float]] = []

    class Clock(Callback):
        def on_step_begin(self, state, metrics):
            marks.append((time.perf_counter(), WaitClock.waited_s))

        def on_step_end(self, state, metrics):
            start, waited = marks[-1]
            marks[-1] = (time.perf_counter() - start, WaitClock.waited_s - waited)

    Trainer(load_recipe(recipe), callbacks=[Clock()], progress=False).train()
    timed = marks[1:]  # the first step warms up
    if int(os.environ.get("RANK", "0")) == 0:
        step = statistics.median(t for t, _ in timed)
        waited = (
            sum(w for _, w in timed) / sum(t for t, _ in timed) if os.environ.get("RING") else None
        )  # only the ring's waits are timed
        Path(report).write_text(json.dumps({"step_s": step, "waiting": waited}))


def measure(recipe: Path, length: int, nproc: int, mode: str | None, cores: int) -> dict:
    with tempfile.NamedTemporaryFile(suffix=".json") as report:
        overrides = [] if mode is None else ["--cp", "2", "--mode", mode]
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc), __file__, "--worker"]
        env = {**os.environ, "OMP_NUM_THREADS": str(max(1, cores // nproc)), **({"RING": "1"} if mode == "ring" else {})}
        args = [*cmd, str(recipe), report.name, *overrides]
        subprocess.run(args, check=True, env=env, capture_output=True, cwd=recipe.parent)
        got = json.loads(Path(report.name).read_text())
    got["ms_per_1k_tokens"] = 1000 * got["step_s"] / length * 1000
    return got


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[2048, 8192])
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--worker", nargs=2, metavar=("RECIPE", "REPORT"))
    parser.add_argument("--cp", type=int, default=1)
    parser.add_argument("--mode", default="ring")
    args = parser.parse_args()
    if args.worker:
        recipe = args.worker[0]
        if args.cp > 1:  # the recipe with the split, written beside it
            import yaml

            data = yaml.safe_load(Path(recipe).read_text())
            data["distributed"] = {"context_parallel": args.cp, "context_parallel_mode": args.mode}
            data["output_dir"] += f"-cp{args.cp}-{args.mode}"
            recipe = str(Path(recipe).with_name(f"recipe-cp{args.cp}-{args.mode}-{os.environ.get('RANK', '0')}.yaml"))
            Path(recipe).write_text(yaml.safe_dump(data))  # one file per rank: none reads another's half-written
        worker(recipe, args.worker[1])
        return 0
    cores = os.cpu_count() or 1
    rows = []
    for length in args.lengths:
        with tempfile.TemporaryDirectory() as tmp:
            recipe = build(Path(tmp), length, args.steps)
            for nproc, mode in ((1, None), (2, "ring"), (2, "ulysses")):
                got = measure(recipe, length, nproc, mode, cores)
                row = {"length": length, "processes": nproc, "mode": mode or "one process", **got}
                print(json.dumps(row), flush=True)
                rows.append(row)
    if args.out:
        args.out.write_text(json.dumps({"cores": cores, "rows": rows}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
