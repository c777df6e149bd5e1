"""What each memory.* offload mode costs and saves, on this machine.

    python benchmarks/offload.py                      # CPU: ~200 MB of fp32 layer weights, 3 steps per mode
    python benchmarks/offload.py --hidden 2048 --layers 16 --quant 4 --steps 5   # a GPU

Builds a Llama-shaped model with random weights and the bundled tokenizer, then
trains it with the demo data once per mode, each mode in a fresh process so peaks do
not mix: base_weights device | cpu | disk (activation_checkpointing all, so the modes
differ only in where the frozen weights wait), activation_offload (with checkpointing
none: compare it with mode `none`) and optimizer_offload. For each it reports the
median step time and memory:

- CPU: peak RssAnon (anonymous resident memory, sampled every 2 ms from
  /proc/self/status) during training, over the same figure right after the imports.
  File-backed pages (the memory-mapped base_weights=disk file in the page cache) are
  not in RssAnon: that is the point of `disk`. Loading is reported on its own line:
  from_pretrained materialises every weight once before the stream takes them.
- CUDA: torch.cuda.max_memory_allocated during training.

Prints a table and writes JSON (--out). Numbers in benchmarks/README.md.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

MODES = {
    "device": {"base_weights": "device"},
    "cpu": {"base_weights": "cpu"},
    "disk": {"base_weights": "disk"},
    # Only what non-checkpointed layers save can move (a checkpointed layer's input lives in its
    # checkpoint), so activation_offload runs without checkpointing: compare it with `none`.
    "none": {"activation_checkpointing": "none"},
    "activation_offload": {"activation_checkpointing": "none", "activation_offload": True},
    "optimizer_offload": {"optimizer_offload": True},
}


def rss_anon() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) * 1024
    return 0


class PeakSampler:
    """Samples RssAnon in a thread: the peak between start() and stop()."""

    def __init__(self, every_s: float = 0.002):
        self.every_s, self.peak, self._stop = every_s, 0, threading.Event()

    def __enter__(self):
        self.peak = rss_anon()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def _run(self):
        while not self._stop.is_set():
            self.peak = max(self.peak, rss_anon())
            time.sleep(self.every_s)

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, rss_anon())


def build_model(out: Path, hidden: int, layers: int) -> int:
    """A random Llama with the bundled tokenizer (bf16 on disk); returns the bytes of its decoder-layer linear weights in fp32."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from finetune.config.schema import resolve_path

    tok = AutoTokenizer.from_pretrained(resolve_path("asset:tiny-llama"))
    cfg = LlamaConfig(
        vocab_size=len(tok),
        hidden_size=hidden,
        intermediate_size=int(hidden * 2.75) // 64 * 64,
        num_hidden_layers=layers,
        num_attention_heads=max(hidden // 64, 1),
        num_key_value_heads=max(hidden // 256, 1),
        max_position_embeddings=512,
        tie_word_embeddings=False,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg)
    # Saved in bf16 and trained in fp32, as a GPU run materialises weights somewhere other
    # than the file: in fp32 on a CPU, transformers would compute straight from the
    # memory-mapped checkpoint and even base_weights=device would hold no weights in RssAnon.
    model.to(torch.bfloat16).save_pretrained(out)
    tok.save_pretrained(out)
    return sum(m.weight.numel() * 4 for layer in model.model.layers for m in layer.modules() if isinstance(m, torch.nn.Linear))


def child(args) -> dict:
    """One mode in this process: train, time the steps, sample memory."""
    import torch

    from finetune.config.schema import build_recipe
    from finetune.trainer import Trainer

    baseline = rss_anon()
    memory = {"activation_checkpointing": "all", **MODES[args.mode]}
    if args.mode == "disk":
        memory["offload_dir"] = args.offload_dir
    cfg = build_recipe(
        {
            "model": {"path": args.model},
            "data": {"path": "asset:demo/train.jsonl", "max_seq_len": args.seq},
            "output_dir": args.out_dir,
            "overwrite": True,
            "seed": 0,
            "precision": args.precision,
            "quant": {"bits": None if args.quant == "none" else 4},
            "lora": {"r": 16, "alpha": 32, "dropout": 0.0},
            "train": {"max_steps": args.steps, "batch_size": args.batch, "grad_accum": 1, "log_every_steps": 1},
            "memory": memory,
            "checkpoint": {"every_steps": None},
            "report": {"plot": False},
        }
    )
    trainer = Trainer(cfg, progress=False)
    with PeakSampler() as load:
        trainer.setup()
    after_setup = rss_anon()
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    times = []
    with PeakSampler() as train:
        trainer.model.train()
        for step in range(args.steps):
            if cuda:
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            trainer.accumulate_gradients(step)
            trainer.optimizer.step()
            trainer.optimizer.zero_grad(set_to_none=True)
            if cuda:
                torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
    result = {
        "mode": args.mode,
        "step_s_median": statistics.median(times[1:] or times),  # the first step warms up
        "rss_anon_baseline": baseline,
        "rss_anon_load_peak": load.peak,
        "rss_anon_after_setup": after_setup,
        "rss_anon_train_peak": train.peak,
        "cuda_peak_allocated": torch.cuda.max_memory_allocated() if cuda else None,
        "streamed_bytes": trainer.memory.stream.streamed_bytes if trainer.memory.stream else None,
    }
    trainer.close()
    return result


def mib(n) -> str:
    return "-" if n is None else f"{n / 2**20:,.0f}"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--quant", choices=["none", "4"], default="none")
    p.add_argument("--precision", default="fp32")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=128, help="data.max_seq_len (the demo examples are <= 65 tokens)")
    p.add_argument("--modes", default=",".join(MODES))
    p.add_argument("--out", help="write the results as JSON here")
    p.add_argument("--child", dest="mode", help=argparse.SUPPRESS)
    p.add_argument("--model", help=argparse.SUPPRESS)
    p.add_argument("--out-dir", help=argparse.SUPPRESS)
    p.add_argument("--offload-dir", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.mode:
        print(json.dumps(child(args)))
        return

    work = Path(tempfile.mkdtemp(prefix="finetune-offload-bench-"))
    try:
        run_modes(args, work)
    finally:
        shutil.rmtree(work, ignore_errors=True)  # the model is GBs


def run_modes(args, work: Path) -> None:
    layer_bytes = build_model(work / "model", args.hidden, args.layers)
    print(
        f"model: hidden {args.hidden}, {args.layers} layers, decoder-layer linear weights {mib(layer_bytes)} MiB in fp32; quant {args.quant}"
    )
    results = []
    for mode in args.modes.split(","):
        cmd = [
            sys.executable,
            __file__,
            "--child",
            mode,
            "--model",
            str(work / "model"),
            "--out-dir",
            str(work / f"run-{mode}"),
            "--offload-dir",
            str(work / "offload"),
            "--hidden",
            str(args.hidden),
            "--layers",
            str(args.layers),
            "--quant",
            args.quant,
            "--precision",
            args.precision,
            "--steps",
            str(args.steps),
            "--batch",
            str(args.batch),
            "--seq",
            str(args.seq),
        ]
        done = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
        if done.returncode != 0:
            sys.exit(f"{mode} failed:\n{done.stderr[-3000:]}")
        results.append(json.loads(done.stdout.strip().splitlines()[-1]))
    print(
        f"{'mode':20} {'step s':>8} {'RssAnon MiB: base':>18} {'load peak':>10} {'after setup':>12} {'train peak':>11} {'train-base':>11} {'CUDA peak MiB':>14}"
    )
    for r in results:
        print(
            f"{r['mode']:20} {r['step_s_median']:8.3f} {mib(r['rss_anon_baseline']):>18} {mib(r['rss_anon_load_peak']):>10} "
            f"{mib(r['rss_anon_after_setup']):>12} {mib(r['rss_anon_train_peak']):>11} {mib(r['rss_anon_train_peak'] - r['rss_anon_baseline']):>11} "
            f"{mib(r['cuda_peak_allocated']):>14}"
        )
    if args.out:
        Path(args.out).write_text(
            json.dumps({"layer_weight_bytes_fp32": layer_bytes, "args": vars(args), "results": results}, indent=2)
        )


if __name__ == "__main__":
    main()
