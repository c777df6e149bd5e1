"""What a pipeline stage holds: peak host RAM per process of one process against 2 pipeline stages, on a
random-init Llama of about 0.3B parameters in 4-bit (issue 27's "each process loads only its stage").

    python benchmarks/pipeline_memory.py                                   # builds the model, runs both, prints JSON
    python benchmarks/pipeline_memory.py --out benchmarks/results/pipeline_memory_cpu.json

Each run trains 2 steps of QLoRA (r=16, all linear layers, fp32, batch 2 x accum 2, 256 tokens) through
finetune's Trainer and reports, per process: the RSS after imports (the floor: torch, transformers), the
peak RSS (VmHWM in /proc/self/status), and the weights it holds (bytes of parameters not on the meta device).
On CPU the model lives in host RAM, so peak RSS minus the floor is what the process holds: on a GPU the
same split is what each card holds.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
WORKER = """
import json, os, sys

def high_water():  # this process's peak RSS (VmHWM: its own, where ru_maxrss would carry a parent's across exec)
    line = next(l for l in open("/proc/self/status") if l.startswith("VmHWM:"))
    return int(line.split()[1]) * 1024

import torch, transformers, peft, bitsandbytes  # noqa: F401 - the import floor
floor = high_water()
from finetune.config.schema import build_recipe
from finetune.trainer import Trainer
recipe = json.loads(sys.argv[1])
with Trainer(build_recipe(recipe), progress=False) as trainer:
    trainer.train()
    held = sum(p.numel() * p.element_size() for p in trainer.model.parameters() if not p.is_meta)
peak = high_water()
rank = int(os.environ.get("RANK", "0"))
with open(os.path.join(sys.argv[2], f"rank{rank}.json"), "w") as f:
    json.dump({"rank": rank, "floor_bytes": floor, "peak_rss_bytes": peak, "held_parameter_bytes": held}, f)
"""


def build_model(where: Path) -> None:
    """A Llama-shaped random model (hidden 1024, 16 layers, vocab 32000) with a byte-level tokenizer."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    sys.path.insert(0, str(ROOT / "tests"))
    from conftest import build_char_tokenizer  # the tests' character tokenizer: no hub

    tok = build_char_tokenizer(where)
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=32000, hidden_size=1024, intermediate_size=2816, num_hidden_layers=16,
                      num_attention_heads=16, num_key_value_heads=4, max_position_embeddings=1024,
                      bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)  # fmt: skip
    LlamaForCausalLM(cfg).to(torch.bfloat16).save_pretrained(where)


def run(where: Path, nproc: int, out: Path) -> list[dict]:
    rows = [{"instruction": f"Say the word number {i}.", "input": "", "output": f"word {i} " * 20} for i in range(64)]
    data = where / "train.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    recipe = {
        "model": {"path": str(where)},
        "data": {"path": str(data), "format": "alpaca", "max_seq_len": 256},
        "output_dir": str(out / f"run{nproc}"),
        "overwrite": True,
        "precision": "fp32",
        "quant": {"bits": 4},
        "lora": {"r": 16, "alpha": 32, "dropout": 0.0},
        "train": {"max_steps": 2, "batch_size": 2, "grad_accum": 2, "lr": 1e-4},
        "memory": {"activation_checkpointing": "all"},
        "checkpoint": {"every_steps": None},
        "report": {"plot": False},
        "distributed": {"pipeline_parallel": nproc},
    }
    results = out / f"rss{nproc}"
    results.mkdir(parents=True, exist_ok=True)
    worker = out / "worker.py"
    worker.write_text(WORKER)
    launcher = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc)] if nproc > 1 else [sys.executable]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    subprocess.run([*launcher, str(worker), json.dumps(recipe), str(results)], check=True, env=env, cwd=out)
    return [json.loads((results / f"rank{r}.json").read_text()) for r in range(nproc)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--work", default="/tmp/finetune-pipeline-memory")
    ap.add_argument("--out", default=None, help="write the JSON here as well")
    args = ap.parse_args()
    work = Path(args.work)
    model = work / "model"
    if not (model / "config.json").exists():
        model.mkdir(parents=True, exist_ok=True)
        build_model(model)
    report = {"model": "random Llama, hidden 1024, 16 layers, vocab 32000, 4-bit NF4 (double quant), LoRA r=16"}
    for nproc in (1, 2):
        for r in run(model, nproc, work):
            r["peak_minus_floor_mib"] = round((r["peak_rss_bytes"] - r["floor_bytes"]) / 2**20, 1)
            r["held_parameter_mib"] = round(r["held_parameter_bytes"] / 2**20, 1)
            report[f"{'one process' if nproc == 1 else 'pipeline stage'} {r['rank']}"] = r
    text = json.dumps(report, indent=2)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
