"""OMP_NUM_THREADS=1 python benchmarks/gguf_memory.py [--workdir /tmp/gguf-bench] [--models tiny,0.5b] [--out JSON]

Peak resident memory of `finetune export RUN --gguf` (finetune.export.gguf_export.export_gguf, what the CLI
calls) on the bundled tiny Llama and on a Qwen2.5-0.5B-shaped Qwen2 built here with random weights (issue 31).
Each measurement runs in a fresh process that reports its own peak RSS (VmHWM), so one phase's memory
never hides another's:

  imports     python + torch + transformers + peft + bitsandbytes + gguf + finetune.export.gguf_export, nothing loaded
  export-f16  the whole export of the QLoRA run, --gguf-type f16 (reference logits, merge, write, read-back check),
              the resident set sampled every 5 ms and its peak kept per step (told by the export's messages)
  export-q8_0 the same, --gguf-type q8_0
  write-f16   the merge and the GGUF write alone, without the reference model and the check (the 4-bit round trip
              of every LoRA'd weight as reference() reports it on a CPU: NF4, double quant, block 64, from fp32)
  write-q8_0  the same, q8_0
  read-f16    transformers' GGUF loader alone (AutoModelForCausalLM.from_pretrained(gguf_file=), fp32, one forward)
              on the file export-f16 wrote: what the read-back check costs by itself
  read-q8_0   the same on export-q8_0's file

A model's run is a QLoRA run made the way benchmarks/merge_memory.py makes one: a LoRA r=16 on every
linear layer with random (non-zero) B, saved as a peft adapter, and a recipe with quant.bits=4; nothing trained.
The models and runs live in --workdir (about 4 GB with the outputs); reuse them with --skip-build.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TINY = REPO / "finetune" / "assets" / "tiny-llama"  # the bundled model; its byte-level BPE tokenizer for both
# Qwen2.5-0.5B's shape (494M parameters, tied embeddings, q/k/v biases) with the bundled tokenizer's 912 tokens in
# its 151,936-row vocabulary (the rest written as unused placeholders, as llama.cpp's converter writes them).
QWEN_05B = dict(
    vocab_size=151936,
    hidden_size=896,
    intermediate_size=4864,
    num_hidden_layers=24,
    num_attention_heads=14,
    num_key_value_heads=2,
    max_position_embeddings=32768,
    rms_norm_eps=1e-6,
    tie_word_embeddings=True,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=3,
)
from merge_memory import peak_rss_mib  # noqa: E402  (same folder: a script's own; stdlib only)

STEPS = (("gguf: merging", "merge"), ("gguf: writing", "write"), ("gguf: reading", "check"), ("gguf check", "done"))


def build(work: Path, model: str) -> None:
    """The model (the bundled one, or the 0.5B built here in bf16), a LoRA on it and the QLoRA run's directory."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer, Qwen2Config, Qwen2ForCausalLM

    from finetune.config.schema import build_recipe

    torch.manual_seed(0)
    base = TINY if model == "tiny" else work / "base"
    if model == "0.5b":
        Qwen2ForCausalLM(Qwen2Config(**QWEN_05B)).to(torch.bfloat16).save_pretrained(base)
        for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
            shutil.copyfile(TINY / name, base / name)
    tok = AutoTokenizer.from_pretrained(TINY)
    lora = LoraConfig(r=16, lora_alpha=32, target_modules="all-linear", init_lora_weights=False)
    peft_model = get_peft_model(AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32), lora)
    data = work / "data.jsonl"
    data.write_text(json.dumps({"prompt": "a", "completion": "b"}) + "\n")
    run = work / "run"
    peft_model.save_pretrained(run / "adapter")
    tok.save_pretrained(run / "adapter")
    recipe = {
        "model": {"path": str(base)},
        "data": {"path": str(data), "format": "completion"},
        "output_dir": str(run),
        "precision": "fp32",
        "quant": {"bits": 4},
        "lora": {"r": 16, "alpha": 32, "dropout": 0.0, "target": "all-linear"},
    }
    (run / "recipe.yaml").write_text(build_recipe(recipe).to_yaml())


def _sampler(step: dict[str, str], peaks: dict[str, dict[str, float]]) -> None:
    """Keep each step's peak resident set, and apart its peaks of anonymous memory and of mapped file pages
    (clean pages of the files read, which count in RSS but the kernel can drop), sampled every 5 ms."""
    while True:
        fields = dict(x.split(":", 1) for x in Path("/proc/self/status").read_text().splitlines() if ":" in x)
        mine = peaks.setdefault(step["name"], {"rss": 0, "anon": 0, "file": 0})
        for key, field in (("rss", "VmRSS"), ("anon", "RssAnon"), ("file", "RssFile")):
            mine[key] = max(mine[key], int(fields[field].split()[0]) / 1024)
        time.sleep(0.005)


def _rounded(peaks: dict[str, dict[str, float]]) -> dict[str, dict[str, int]]:
    return {step: {k: round(v) for k, v in p.items()} for step, p in peaks.items()}


def phase(name: str, work: Path) -> dict:
    """Run one measurement in this process (called in a child); returns its numbers."""
    import threading

    import bitsandbytes  # noqa: F401  (in every phase, so 'imports' is their common floor)
    import gguf  # noqa: F401
    import peft  # noqa: F401
    import torch
    import transformers  # noqa: F401

    from finetune.export import gguf_export

    kind, _, gguf_type = name.partition("-")
    out = work / f"out-{gguf_type}"
    t0 = time.perf_counter()
    result: dict = {}
    step = {"name": {"export": "reference", "write": "setup"}.get(kind, kind)}
    peaks: dict[str, dict[str, float]] = {}
    threading.Thread(target=_sampler, args=(step, peaks), daemon=True).start()
    if kind == "export":
        shutil.rmtree(out, ignore_errors=True)

        def say(text: str) -> None:
            step["name"] = next((s for prefix, s in STEPS if text.startswith(prefix)), step["name"])

        meta = gguf_export.export_gguf(work / "run", out, gguf_type=gguf_type, say=say, device=torch.device("cpu")).metadata
        check = meta["verification"]
        result = {k: check[k] for k in ("max_abs_diff", "tolerance", "passed", "adapter_effect")}
        result["gguf_bytes"] = meta["gguf"]["bytes"]
        result["staged_bytes"] = meta["merge"].get("bytes", 0)  # the fp32 merge staged on disk before the write (0: none)
    elif kind == "write":
        result = _merge_and_write(work, work / f"write-{gguf_type}", gguf_type, step)
    elif kind == "read":
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(str(out), gguf_file=f"model-{gguf_type}.gguf", dtype=torch.float32)
        with torch.no_grad():
            model(input_ids=torch.arange(4, 68).reshape(1, -1))
    seconds, peak = round(time.perf_counter() - t0, 1), round(peak_rss_mib(), 1)
    if kind != "imports":
        result["step_peaks_mib"] = _rounded(peaks)
    if kind == "export":  # the same bytes before and after a change to the writer
        result["gguf_sha256"] = _sha256(out / f"model-{gguf_type}.gguf")
    return {"phase": name, "peak_rss_mib": peak, "seconds": seconds, **result}


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def _merge_and_write(work: Path, out: Path, gguf_type: str, step: dict[str, str]) -> dict:
    """The export's merge and GGUF write alone (no reference model, no check), as export_gguf runs them: each
    tensor merged (export/merge.py's MergedTensors), converted and written before the next is read."""
    import torch
    import yaml
    from transformers import AutoTokenizer

    from finetune.export.gguf_file import write_gguf
    from finetune.export.gguf_vocab import add_vocab
    from finetune.export.merge import MergedTensors, Quant4, read_adapter

    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    base = Path(yaml.safe_load((work / "run" / "recipe.yaml").read_text())["model"]["path"])
    config = json.loads((base / "config.json").read_text())
    loras = read_adapter(work / "run" / "adapter")
    q = Quant4(torch.float32, 64, "nf4", True)  # what reference() reads off the 4-bit model on a CPU
    quantized = {name.removeprefix("base_model.model.").removesuffix(".base_layer"): q for name in loras}
    AutoTokenizer.from_pretrained(TINY).save_pretrained(out / ".tokenizer")
    vocab = lambda w: add_vocab(w, out / ".tokenizer", int(config["vocab_size"]))  # noqa: E731
    step["name"] = "merge"  # merge and write are one step now
    merged = MergedTensors(base, loras, quantized)
    stats = write_gguf(merged, out / f"model-{gguf_type}.gguf", config, gguf_type, "bench", vocab)
    return {"gguf_bytes": stats["bytes"], "staged_bytes": 0, "merged": merged.merged}


def describe(work: Path) -> dict:
    """Parameters and bf16 bytes of the run's base model."""
    import yaml

    from finetune.model.shards import read_header, weight_files

    base = Path(yaml.safe_load((work / "run" / "recipe.yaml").read_text())["model"]["path"])
    entries = [e for f in weight_files(base) for e in read_header(f).tensors.values()]
    params = sum(math.prod(e["shape"]) for e in entries)
    return {"base": str(base), "parameters": params, "bytes": sum(e["data_offsets"][1] - e["data_offsets"][0] for e in entries)}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--workdir", default="/tmp/gguf-bench")
    parser.add_argument("--models", default="tiny,0.5b")
    parser.add_argument("--skip-build", action="store_true")
    parser.add_argument("--phase", help=argparse.SUPPRESS)  # internal: run one measurement in this process
    parser.add_argument("--phases", default="imports,export-f16,export-q8_0,write-f16,write-q8_0,read-f16,read-q8_0")
    parser.add_argument("--out", help="write the results as JSON here (benchmarks/results/...)")
    args = parser.parse_args()
    if args.phase:
        print(json.dumps(phase(args.phase, Path(args.workdir))))
        return
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"), "PYTHONPATH": str(REPO)}
    results: dict = {"command": " ".join(["python", "benchmarks/gguf_memory.py", *sys.argv[1:]])}
    for model in args.models.split(","):
        work = Path(args.workdir) / model
        if not args.skip_build:
            shutil.rmtree(work, ignore_errors=True)
            work.mkdir(parents=True)
            build(work, model)
        rows = [describe(work)]
        print(model, rows[0], flush=True)
        for name in args.phases.split(","):
            cmd = [sys.executable, __file__, "--workdir", str(work), "--phase", name]
            proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
            if proc.returncode != 0:
                print(proc.stdout[-2000:], proc.stderr[-4000:])
                raise SystemExit(f"{model}: phase {name} failed")
            rows.append(json.loads(proc.stdout.strip().splitlines()[-1]))
            print(model, json.dumps(rows[-1]), flush=True)
        results[model] = rows
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=2) + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()
