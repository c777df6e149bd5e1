"""On a GPU: finetune vs TRL's SFTTrainer (its defaults; with Liger; Liger + packing; padding-free)
vs a plain HF Trainer + peft script vs unsloth (where its wheel installs), on one QLoRA job; and
each shipped single-GPU recipe's measured peak next to `finetune plan`.

    pip install -e ".[bench,gpu]"                   # trl and liger-kernel; unsloth is tried when installed
    python benchmarks/gpu.py                          # peers, Llama-3.1-8B config, 480 examples
    python benchmarks/gpu.py --models llama-3.1-8b qwen2.5-7b --tools finetune finetune_offload trl_liger_packing
    python benchmarks/gpu.py --suite recipes          # each recipe's peak under its card's cap vs the plan
    python benchmarks/gpu.py --tiny --device cpu --examples 24 --median-words 30 --repeats 1   # smoke run (tests)

The job, built on the machine (no hub, no downloads):
  model      random init from tests/fixtures/configs/<name> at full size, saved once in bf16 under
             --workdir (~16 GB each); every tool loads it 4-bit (NF4, double quant, bf16 compute)
             its own way. --tiny: 2 layers, hidden 256, vocabulary 4096.
  tokenizer  compare_job's byte-level BPE (4,096 entries) trained on 2,000 fixed records; the model keeps
             its vocabulary (128,256 or 152,064 rows), so the LM head costs what it costs
  data       compare_job.make_records: an instruction over a word list and a reply of lognormal
             length (median --median-words words, sigma 1.0), prompt/completion; replies too long
             for max_seq_len 2048 are shortened (whole words) so that no tool truncates
  training   LoRA r16 alpha 32 dropout 0.05 on every linear; torch AdamW, lr 2e-4 constant, no
             warm-up, weight decay 0, clip 1.0; bf16; one epoch over --examples; loss on the
             completion + EOS. Global batch: 16 examples (4 x 4) unpadded; packed tools take
             1 row x A, A = round(16 x mean length / 2048) rows of 2048 (about the same tokens)

Each tool --repeats times (3), interleaved (every tool once a round, each round starting one further along), each run
in its own process: a row holds the medians, each run's numbers and the spread (max - min over the median of trained
tokens/s; single runs differed by ~15% on an H100), and apart_from_baseline: whether its runs' range and the
baseline's do not overlap. Per run: trained tokens/s over the optimizer steps after the
first 3 (CUDA synchronized at every step's end), total tokens/s, peak torch.cuda.max_memory_allocated
while training (reset when training begins) and while loading, held-out loss after the epoch (the
same function for every tool), MFU = model FLOPs / time / the GPU's dense bf16 peak (finetune.gpus;
the FLOP formula is compare_job's with grouped-query attention: base linears 4N, LoRA 6N per token,
head 4dV per trained token, attention 12 L (H hd) s^2 per example). Ratios against --baseline.
Results: printed, and JSON (--json) with every version and the GPU's name.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from compare_job import LORA, build_tokenizer, make_long_records, make_records, read_jsonl  # noqa: E402
from gpu_tools import FINETUNE_ENV, FINETUNE_SETTINGS, TRL_SETTINGS, WARMUP_STEPS, run_recipe, run_tool  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = ROOT / "tests" / "fixtures" / "configs"
TOOLS = [*FINETUNE_SETTINGS, *TRL_SETTINGS, "hf", "unsloth"]
DEFAULT_TOOLS = ["finetune", "finetune_offload", "trl", "trl_liger_packing", "hf", "unsloth"]
# The single-GPU recipes and the card each is written for (GiB, the planner's GPU). They run with
# train.grad_accum=1 (the peak is a micro-batch's: accumulation adds no tensor). The MoE and 70B
# recipes need models too big for the device's disk in bf16; FSDP needs two GPUs.
RECIPES = {"qlora-1x24gb": (24, "rtx4090"), "qlora-longctx-1x24gb": (24, "rtx4090"),
           "qlora-offload-1x12gb": (12, "rtx3060"), "dpo-qlora-1x24gb": (24, "rtx4090")}  # fmt: skip
TINY = {"hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 64, "vocab_size": 4096}  # fmt: skip
GLOBAL_BATCH = 16


# ----------------------------------------------------------------------------- the job


def build_model(name: str, out: Path, tok, device: str, tiny: bool) -> None:
    """Random-init model of a fixture config, saved with the tokenizer (skipped when already there)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    if (out / "config.json").exists():
        return
    cfg = AutoConfig.from_pretrained(CONFIGS / name)
    if tiny:
        for key, value in TINY.items():
            setattr(cfg, key, value)
    cfg.bos_token_id, cfg.eos_token_id, cfg.pad_token_id = tok.bos_token_id, tok.eos_token_id, tok.pad_token_id
    cfg.use_cache = False
    torch.manual_seed(0)
    dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(cfg, dtype=dtype)
    partial = out.with_name(out.name + ".partial")  # renamed when complete: an interrupted save is never reused
    shutil.rmtree(partial, ignore_errors=True)
    shutil.rmtree(out, ignore_errors=True)
    model.save_pretrained(partial)
    tok.save_pretrained(partial)
    partial.rename(out)


def prepare(args: argparse.Namespace) -> dict[str, Any]:
    work = Path(args.workdir)
    work.mkdir(parents=True, exist_ok=True)
    rows = make_records(args.examples + 32, median_words=args.median_words, sigma=1.0)
    # Trained on a fixed corpus (the same pseudo-words): a model directory built by an earlier run with
    # other --examples/--median-words holds this same tokenizer, so a reused model still matches it.
    tok = build_tokenizer([r["prompt"] + r["completion"] for r in make_records(2000)], work / "tokenizer")
    trimmed = sum(fit_length(r, tok, args.max_seq_len) for r in rows)
    for name, part in (("train.jsonl", rows[: args.examples]), ("eval.jsonl", rows[args.examples :])):
        (work / name).write_text("".join(json.dumps(r) + "\n" for r in part))
    lengths = [len(tok(r["prompt"] + r["completion"])["input_ids"]) + 1 for r in rows[: args.examples]]
    models = {}
    for name in args.models:
        models[name] = work / f"{'tiny-' if args.tiny else ''}{name}"
        build_model(name, models[name], tok, args.device, args.tiny)
    mean = statistics.mean(lengths)
    return {
        "work": work,
        "tokenizer": tok,
        "models": models,
        "lengths": {
            "mean": round(mean, 1),
            "median": sorted(lengths)[len(lengths) // 2],
            "max": max(lengths),
            "trimmed": trimmed,
        },
        "packed_accum": max(1, round(GLOBAL_BATCH * mean / args.max_seq_len)),
    }


def fit_length(record: dict[str, str], tok, max_len: int) -> bool:
    """Shorten a reply (whole words) until prompt + reply + EOS fits max_len tokens, so that no tool
    truncates and every tool trains the same tokens (TRL's padding-free mode cannot truncate)."""
    words = record["completion"].split(" ")
    cut = False
    while len(tok(record["prompt"] + record["completion"])["input_ids"]) + 1 > max_len:
        words = words[: max(1, int(len(words) * 0.9))]
        record["completion"], cut = " ".join(words), True
    return cut


def flops_per_step(cfg: dict[str, Any], step: dict[str, float]) -> float:
    """Model FLOPs of one optimizer step (see the module docstring); dense decoders."""
    d, i, L, V = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"], cfg["vocab_size"]
    heads, kv = cfg["num_attention_heads"], cfg.get("num_key_value_heads") or cfg["num_attention_heads"]
    hd = cfg.get("head_dim") or d // heads
    shapes = [(d, heads * hd), (d, kv * hd), (d, kv * hd), (heads * hd, d), (d, i), (d, i), (i, d)]
    base = L * sum(a * b for a, b in shapes)
    lora = L * sum(LORA["r"] * (a + b) for a, b in shapes)
    return (4 * base + 6 * lora) * step["tokens"] + 4 * d * V * step["trained"] + 12 * L * heads * hd * step["sum_s2"]


# ----------------------------------------------------------------------------- workers


def run_worker(spec: dict[str, Any], log: Path, timeout: int) -> dict[str, Any]:
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", TRANSFORMERS_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    env.update(FINETUNE_ENV.get(spec.get("tool", ""), {}))
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), *([os.environ["PYTHONPATH"]] if os.environ.get("PYTHONPATH") else [])])
    result = Path(spec["out"]) / "result.json"
    result.unlink(missing_ok=True)
    t0 = time.perf_counter()
    with log.open("w") as out:
        try:
            proc = subprocess.run([sys.executable, __file__, "--worker", json.dumps(spec)], env=env, stdout=out,
                                  stderr=subprocess.STDOUT, cwd=str(ROOT), timeout=timeout)  # fmt: skip
            rc = proc.returncode
        except subprocess.TimeoutExpired:
            rc = "timeout"
    if rc != 0 or not result.exists():
        tail = log.read_text(errors="replace").strip().splitlines()[-3:]
        return {"error": f"exit {rc}: " + " | ".join(tail)[-600:], "log": str(log)}
    return {**json.loads(result.read_text()), "wall_s": round(time.perf_counter() - t0, 1), "log": str(log)}


def worker_main(spec: dict[str, Any]) -> None:
    got = run_recipe(spec) if spec.get("recipe") else run_tool(spec)
    (Path(spec["out"]) / "result.json").write_text(json.dumps(got))


# ----------------------------------------------------------------------------- the suites


def summarize(raw: dict[str, Any], cfg: dict[str, Any], peak_flops: float | None) -> dict[str, Any]:
    steps = raw["steps"]
    timed = steps[WARMUP_STEPS:] if len(steps) > WARMUP_STEPS + 1 else steps[1:] or steps
    seconds = sum(s["seconds"] for s in timed)
    flops = sum(flops_per_step(cfg, s) for s in timed)
    return {
        "steps": len(steps),
        "timed_steps": len(timed),
        "examples": sum(s["examples"] for s in steps),
        "trained_tok_s": sum(s["trained"] for s in timed) / seconds,
        "tok_s": sum(s["tokens"] for s in timed) / seconds,
        "mfu": flops / seconds / peak_flops if peak_flops else None,
        "peak_train_gib": raw["peak_train"] / 2**30 if raw["peak_train"] else None,
        "peak_loading_gib": raw["peak_loading"] / 2**30 if raw["peak_loading"] else None,
        "eval_loss": raw["eval_loss"],
        "train_losses": [round(x, 4) for x in raw.get("losses", [])],  # per step: packed tools take fewer steps
        "settings": raw["settings"],
        "wall_s": raw["wall_s"],
    }


def schedule(tools: list[str], repeats: int) -> list[tuple[int, str]]:
    """(round, tool) in the order they run: every tool once a round, each round starting one tool further along, so
    that no tool always runs first (a cold GPU) or after the same neighbour."""
    return [(r, tools[(r + i) % len(tools)]) for r in range(repeats) for i in range(len(tools))]


def aggregate(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """One tool's row from its runs: the median of each rate, the largest peak, each run's numbers, and the spread
    ((max - min) / median of trained tokens/s) a difference between tools must exceed to mean anything."""
    ok = [r for r in runs if "error" not in r]
    errors = [r["error"] for r in runs if "error" in r]
    if not ok:
        return {"error": errors[-1], "errors": errors, "runs": []}
    rates = [r["trained_tok_s"] for r in ok]
    row = dict(ok[0])
    for key in ("trained_tok_s", "tok_s", "mfu", "eval_loss", "wall_s"):
        values = [r[key] for r in ok if r.get(key) is not None]
        row[key] = statistics.median(values) if values else None
    for key in ("peak_train_gib", "peak_loading_gib"):
        values = [r[key] for r in ok if r.get(key) is not None]
        row[key] = max(values) if values else None
    row["runs"] = [{k: r.get(k) for k in ("trained_tok_s", "tok_s", "peak_train_gib", "eval_loss", "wall_s")} for r in ok]
    row["spread"] = (max(rates) - min(rates)) / statistics.median(rates) if len(rates) > 1 else None  # (one run: unknown)
    row["errors"] = errors
    return row


def versus(rows: dict[str, Any], baseline: str) -> None:
    """Ratios of each row's medians to the baseline's, and whether their runs' ranges are apart (above the noise)."""
    base = rows.get(baseline, {})
    if "error" in base or not base:
        return
    low, high = (min(r["trained_tok_s"] for r in base["runs"]), max(r["trained_tok_s"] for r in base["runs"]))
    for row in rows.values():
        if "error" in row:
            continue
        row["speed_vs_baseline"] = row["trained_tok_s"] / base["trained_tok_s"]
        rates = [r["trained_tok_s"] for r in row["runs"]]
        # (a single run on either side has no range: whether it stands apart is unknown)
        row["apart_from_baseline"] = min(rates) > high or max(rates) < low if min(len(rates), len(base["runs"])) > 1 else None
        if row["peak_train_gib"] and base["peak_train_gib"]:
            row["peak_vs_baseline"] = row["peak_train_gib"] / base["peak_train_gib"]


def peers(args: argparse.Namespace, job: dict[str, Any], say=print, save=lambda part: None) -> dict[str, Any]:
    from finetune.gpus import gpu_for_device

    peak = None
    if args.device.startswith("cuda"):
        import torch

        props = torch.cuda.get_device_properties(0)
        peak = gpu_for_device(props.name, props.total_memory).bf16_tflops * 1e12
    out: dict[str, Any] = {}
    for name, model in job["models"].items():
        cfg = json.loads((model / "config.json").read_text())
        runs: dict[str, list[dict[str, Any]]] = {tool: [] for tool in args.tools}
        for round_, tool in schedule(args.tools, args.repeats):
            spec = {"tool": tool, "model": str(model), "train": str(job["work"] / "train.jsonl"), "eval": str(job["work"] / "eval.jsonl"),
                    "out": str(job["work"] / "runs" / name / tool / f"r{round_}"), "device": args.device, "precision": args.precision,
                    "max_seq_len": args.max_seq_len, "micro": 4, "accum": GLOBAL_BATCH // 4, "packed_accum": job["packed_accum"],
                    "finetune_set": args.finetune_set}  # fmt: skip
            Path(spec["out"]).mkdir(parents=True, exist_ok=True)
            say(f"{name} / {tool} (round {round_ + 1} of {args.repeats}) ...")
            raw = run_worker(spec, Path(spec["out"]) / "log.txt", args.timeout)
            runs[tool].append(raw if "error" in raw else summarize(raw, cfg, peak))
            say(f"  {json.dumps(runs[tool][-1])[:400]}")
            rows = out[name] = {tool: aggregate(done) for tool, done in runs.items() if done}
            versus(rows, args.baseline)
            save(out)  # after every run: a lease cut short keeps what it measured
    return out


def recipe_data(job: dict[str, Any], recipe: str, seq: int, long_rows: bool) -> list[str]:
    """The data overrides a recipe runs with: pairs for DPO, one long example per row for long context."""
    work = job["work"]
    rows = read_jsonl(str(work / "train.jsonl"))
    if recipe.startswith("dpo"):
        pairs = [
            {"prompt": r["prompt"], "chosen": r["completion"], "rejected": rows[i - 1]["completion"]} for i, r in enumerate(rows)
        ]
        (work / "pairs.jsonl").write_text("".join(json.dumps(p) + "\n" for p in pairs))
        return [f"data.path={work / 'pairs.jsonl'}"]
    if long_rows:  # every example at least max_seq_len tokens (truncated to it)
        (work / "long.jsonl").write_text("".join(json.dumps(r) + "\n" for r in make_long_records(4, seq)))
        return [f"data.path={work / 'long.jsonl'}", "data.format=completion", "train.max_steps=2"]
    return [f"data.path={work / 'train.jsonl'}", "data.format=completion"]


def recipes(args: argparse.Namespace, job: dict[str, Any], say=print, save=lambda part: None) -> dict[str, Any]:
    from finetune.config.schema import load_recipe

    out: dict[str, Any] = {}
    for name, model in job["models"].items():
        for recipe in args.recipes:
            cap, plan_gpu = RECIPES[recipe]
            seq = load_recipe(recipe, ["model.path=x", "data.path=x.jsonl"]).data.max_seq_len
            long_rows = seq > 8192  # the long-context recipe: rows of one example each, as long as the recipe's
            seq = min(seq, 512) if args.tiny else seq
            run_dir = job["work"] / "recipes" / name / recipe
            run_dir.mkdir(parents=True, exist_ok=True)
            overrides = [f"model.path={model}", f"output_dir={run_dir / 'run'}", "overwrite=true", "train.max_steps=3",
                         "train.grad_accum=1", "train.warmup_steps=0", "eval.every_steps=null", "checkpoint.every_steps=null", "report.plot=false",
                         "data.cache=false", f"data.max_seq_len={seq}", *recipe_data(job, recipe, seq, long_rows)]  # fmt: skip
            spec = {"recipe": recipe, "overrides": overrides, "cap_gib": cap, "plan_gpu": plan_gpu, "device": args.device,
                    "out": str(run_dir)}  # fmt: skip
            say(f"{name} / {recipe} (cap {cap} GiB) ...")
            raw = run_worker(spec, run_dir / "log.txt", args.timeout)
            if "error" not in raw and raw["measured_reserved"] is not None:  # allocated vs allocated (on CUDA): the
                # plan's peak adds allocator slack and the CUDA context
                raw["measured_vs_plan"] = raw["measured"] / raw["planned_allocated"] - 1
            say(f"  {json.dumps(raw)[:400]}")
            out[f"{name}/{recipe}"] = raw
            save(out)
    return out


def versions() -> dict[str, Any]:
    import importlib.metadata as md

    found: dict[str, Any] = {}
    for pkg in ("torch", "transformers", "peft", "bitsandbytes", "accelerate", "trl", "liger-kernel", "unsloth", "flash-attn"):
        try:
            found[pkg] = md.version(pkg)
        except md.PackageNotFoundError:
            found[pkg] = None
    import torch

    found["gpu"] = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    found["cuda"] = torch.version.cuda
    rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    found["finetune"] = rev or None
    return found


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--suite", choices=["peers", "recipes", "all"], default="peers")
    p.add_argument("--models", nargs="+", default=["llama-3.1-8b"], choices=sorted(d.name for d in CONFIGS.iterdir()))
    p.add_argument("--tools", nargs="+", default=DEFAULT_TOOLS, choices=TOOLS)
    p.add_argument("--recipes", nargs="+", default=list(RECIPES), choices=list(RECIPES))
    p.add_argument("--baseline", default="trl_liger_packing", help="the tool ratios are taken against")
    p.add_argument("--examples", type=int, default=480)
    p.add_argument("--median-words", type=float, default=300.0)
    p.add_argument("--max-seq-len", type=int, default=2048)
    p.add_argument("--device", default="cuda")
    p.add_argument("--precision", choices=["bf16", "fp32"], default=None, help="default: bf16 on CUDA, fp32 elsewhere")
    p.add_argument("--finetune-set", nargs="*", default=[], metavar="KEY=VALUE", help="more overrides for the finetune runs")
    p.add_argument("--tiny", action="store_true", help="a 2-layer model of the same family (smoke runs)")
    p.add_argument("--timeout", type=int, default=1800, help="seconds per run")
    p.add_argument("--repeats", type=int, default=3, help="runs of each tool, interleaved (medians and spreads)")
    p.add_argument("--workdir", default="/tmp/finetune-bench/gpu")
    p.add_argument("--json", default=None, help="results file (default: WORKDIR/results.json)")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        worker_main(json.loads(args.worker))
        return 0
    args.precision = args.precision or ("bf16" if args.device.startswith("cuda") else "fp32")
    job = prepare(args)
    say = lambda m: print(m, flush=True)  # noqa: E731
    say(f"data: {args.examples} examples, lengths {job['lengths']}; packed tools take 1 x {job['packed_accum']} rows a step")
    results: dict[str, Any] = {"versions": versions(), "args": {k: v for k, v in vars(args).items() if k != "worker"},
                               "lengths": job["lengths"], "packed_accum": job["packed_accum"]}  # fmt: skip
    path = Path(args.json or Path(args.workdir) / "results.json")

    def saved(suite: str):  # written after every row: a run stopped by a timeout keeps the rows it finished
        return lambda part: (results.__setitem__(suite, part), path.write_text(json.dumps(results, indent=1)))

    if args.suite in ("peers", "all"):
        results["peers"] = peers(args, job, say, saved("peers"))
    if args.suite in ("recipes", "all"):
        results["recipes"] = recipes(args, job, say, saved("recipes"))
    path.write_text(json.dumps(results, indent=1))
    say(f"results: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
