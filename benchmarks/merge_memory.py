"""OMP_NUM_THREADS=1 python benchmarks/merge_memory.py [--workdir /tmp/merge-bench] [--layers 12] [--hidden 1024]

Peak resident memory of the streaming merge (finetune.export.run.stream_merge) on a
Llama of a few hundred MB built here, against what merging the usual way costs.
Each measurement runs in a fresh process that reports its own peak RSS
(VmHWM), so one phase's memory never hides another's:

  imports   python + torch + transformers + peft + bitsandbytes + finetune.export.run, nothing loaded
  stream    stream_merge of a LoRA r=16 (all linear layers) into the bf16 base -> bf16 shards
  stream-4  the same against the 4-bit base: every linear weight round-tripped through NF4 first
  export    the whole `finetune export RUN --merge` of the 4-bit run (reference logits, merge, verification)
  export-offload  the same with --verify-memory-gib 0.25: the check streams the merged layers from disk
  peft      the usual way: load the bf16 base, PeftModel.from_pretrained, merge_and_unload, save_pretrained

The model and the run live in --workdir (about 1.5 GB with the outputs); reuse it with --skip-build.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TOKENIZER = REPO / "finetune" / "assets" / "tiny-llama"  # any tokenizer whose ids fit the vocabulary


def peak_rss_mib() -> float:
    """This process's peak resident set. VmHWM, not ru_maxrss: Linux carries ru_maxrss across fork+exec, so a
    child would report its parent's resident size at fork time if that were larger."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024  # kB
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def build(work: Path, layers: int, hidden: int) -> None:
    """A random Llama saved as bf16 shards (~100 MB each, like a hub checkpoint), a LoRA on it, and two run dirs."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=32000,
        hidden_size=hidden,
        intermediate_size=int(hidden * 2.75),
        num_hidden_layers=layers,
        num_attention_heads=hidden // 64,
        num_key_value_heads=hidden // 64,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=3,
    )
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(work / "base", max_shard_size="100MB")
    tok = AutoTokenizer.from_pretrained(TOKENIZER)
    tok.save_pretrained(work / "base")
    peft_model = get_peft_model(model, LoraConfig(r=16, lora_alpha=32, target_modules="all-linear", init_lora_weights=False))
    data = work / "data.jsonl"
    data.write_text(json.dumps({"prompt": "a", "completion": "b"}) + "\n")
    for bits in (None, 4):
        run = work / f"run-{bits or 16}"
        peft_model.save_pretrained(run / "adapter")
        tok.save_pretrained(run / "adapter")
        recipe = {
            "model": {"path": str(work / "base")},
            "data": {"path": str(data), "format": "completion"},
            "output_dir": str(run),
            "precision": "fp32",
            "quant": {"bits": bits},
            "lora": {"r": 16, "alpha": 32, "dropout": 0.0, "target": "all-linear"},
        }
        from finetune.config.schema import build_recipe

        (run / "recipe.yaml").write_text(build_recipe(recipe).to_yaml())


def phase(name: str, work: Path) -> dict:
    """Run one measurement in this process (called in a child); returns its numbers."""
    import bitsandbytes  # noqa: F401  (in every phase, so 'imports' is their common floor)
    import peft  # noqa: F401
    import torch
    import transformers  # noqa: F401

    from finetune.export import run as export
    from finetune.model.shards import read_header, weight_files

    out = work / f"out-{name}"
    shutil.rmtree(out, ignore_errors=True)
    t0 = time.perf_counter()
    result: dict = {}
    if name in ("stream", "stream-4"):
        out.mkdir()
        run = work / ("run-4" if name == "stream-4" else "run-16")
        loras = export.read_adapter(run / "adapter")
        quantized = {}
        if name == "stream-4":
            # What export.reference() reads off the loaded 4-bit model: every linear weight of the
            # decoder, NF4 + double quant, block 64, quantized from the fp32 it was loaded in.
            q = export.Quant4(torch.float32, 64, "nf4", True)
            quantized = {k: q for f in weight_files(work / "base") for k in read_header(f).tensors if k.endswith("proj.weight")}
        result = export.stream_merge(work / "base", out, torch.bfloat16, loras, quantized)
    elif name in ("export", "export-offload"):
        # What `finetune export RUN --out OUT --merge --dtype bf16 [--verify-memory-gib 0.25]` runs, with the
        # resident set sampled every 5 ms and its peak kept per step (the steps are told by export's messages).
        import threading

        step = {"name": "reference"}
        peaks: dict[str, float] = {}

        def sample() -> None:
            while True:
                rss = next(
                    int(x.split()[1]) for x in Path("/proc/self/status").read_text().splitlines() if x.startswith("VmRSS:")
                )
                peaks[step["name"]] = max(peaks.get(step["name"], 0), rss / 1024)
                time.sleep(0.005)

        def say(text: str) -> None:
            if text.startswith("merge: streaming"):
                step["name"] = "merge"
            elif text.startswith("merge: loading the merged model"):
                step["name"] = "check"
            elif text.startswith("merge check"):
                step["name"] = "done"

        threading.Thread(target=sample, daemon=True).start()
        budget = 2**28 if name == "export-offload" else None
        meta = export.export_run(work / "run-4", out, merge=True, dtype="bf16", say=say, verify_max_memory=budget).metadata
        check = meta["verification"]
        result = {k: check[k] for k in ("max_abs_diff", "tolerance", "passed", "offloaded", "adapter_effect")}
        result["step_peaks_mib"] = {k: round(v) for k, v in peaks.items()}
    elif name == "peft":
        from peft import PeftModel
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(work / "base", dtype=torch.bfloat16)
        merged = PeftModel.from_pretrained(model, work / "run-16" / "adapter").merge_and_unload()
        merged.save_pretrained(out, max_shard_size="100MB")
    return {"phase": name, "peak_rss_mib": round(peak_rss_mib(), 1), "seconds": round(time.perf_counter() - t0, 1), **result}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--workdir", default="/tmp/merge-bench")
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--skip-build", action="store_true")
    parser.add_argument("--phase", help=argparse.SUPPRESS)  # internal: run one measurement in this process
    parser.add_argument("--phases", default="imports,stream,stream-4,export,export-offload,peft")
    args = parser.parse_args()
    work = Path(args.workdir)
    if args.phase:
        print(json.dumps(phase(args.phase, work)))
        return
    if not args.skip_build:
        shutil.rmtree(work, ignore_errors=True)
        work.mkdir(parents=True)
        build(work, args.layers, args.hidden)
    from finetune.model.shards import read_header, weight_files

    headers = [read_header(f) for f in weight_files(work / "base")]
    sizes = [(n, e["data_offsets"][1] - e["data_offsets"][0]) for h in headers for n, e in h.tensors.items()]
    largest = max(sizes, key=lambda x: x[1])
    total = sum(s for _, s in sizes)
    print(
        f"base: {len(sizes)} tensors, {total / 2**20:.0f} MiB bf16 in {len(headers)} shards; "
        f"largest tensor {largest[0]} {largest[1] / 2**20:.1f} MiB bf16 ({2 * largest[1] / 2**20:.1f} MiB as fp32)"
    )
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"), "PYTHONPATH": str(REPO)}
    for name in args.phases.split(","):
        proc = subprocess.run(
            [sys.executable, __file__, "--workdir", str(work), "--phase", name], env=env, capture_output=True, text=True
        )
        if proc.returncode != 0:
            print(proc.stdout[-2000:], proc.stderr[-4000:])
            raise SystemExit(f"phase {name} failed")
        print(proc.stdout.strip().splitlines()[-1])


if __name__ == "__main__":
    main()
