"""Side by side: finetune vs TRL SFTTrainer vs a plain HF Trainer + peft script, on the same job.

    pip install -e ".[bench]"        # adds trl; everything else is finetune's own dependencies
    cd /work/wt-bench && PYTHONPATH=$PWD OMP_NUM_THREADS=1 python benchmarks/compare.py            # main + memory, ~14 min on 2 cores
    python benchmarks/compare.py --quick                              # smoke run: 800 examples, 3 timed steps, ~8 min
    python benchmarks/compare.py --suite levers --quant lora          # finetune's levers, one at a time (~7 min)
    python benchmarks/compare.py --suite peers --quant lora           # more peer configurations (their best)

Results: printed tables, and JSON (--json, default /tmp/finetune-bench/compare.json).
Numbers and their reading: benchmarks/README.md.

The job, built locally (no network, no hub):
  model      Llama-shaped, 29.5M parameters (hidden 512, 8 layers, 8 heads, MLP 1376, vocab 4096,
             untied head), random init, fp32 weights; QLoRA runs load it 4-bit (NF4, double quant,
             fp32 compute) through bitsandbytes
  tokenizer  byte-level BPE, vocab 4096, trained with `tokenizers` on the generated text (the bundled
             tiny-llama tokenizer has only 912 entries); adds <s>, EOS </s>, pad <pad>
  data       3,000 prompt/completion records: an instruction over a list of pseudo-words, and a reply
             built from that list with lognormal length (median 80 words, sigma 0.9); 138 tokens on
             average, median 104, p90 278, 71 truncated at max_seq_len 512. 48 more are held out.
  training   LoRA r=16, alpha 32, dropout 0.05 on every linear layer of the decoder; AdamW, lr 1e-3
             constant, no warm-up, weight decay 0, clip 1.0; fp32; 8 examples per optimizer step
             (unpadded tools: micro-batch 4 x accumulation 2; packed: 2 rows of 512 ~ 7.4 examples);
             loss on completion tokens + EOS only, token-mean over the whole step

Every configuration runs in its own worker process (its own peak RSS, its own imports),
all with one thread (torch.set_num_threads(1), OMP/MKL_NUM_THREADS=1). The workers
are started together and then run in lockstep: the parent lets worker A run one
optimizer step, then B, then C, ... and again (order rotated each round), so CPU
contention from other jobs on the machine hits every tool alike; ratios are also
taken step against step within a round. The first optimizer step of every worker
is a warm-up and is not timed, nor is the last (finetune saves its adapter after it).
A timed step spans everything the tool's own loop does between two optimizer steps
(batch fetch + collate, forward/backward over the accumulation window, clip, AdamW,
logging). Hooks only read: they count the batches each tool trained on, and pause.

Counted per step, from the batches each tool actually trained on: total tokens (not
padding), trained tokens (label-bearing, after the shift), examples, padded slots.
FLOPs (model FLOPs, not hardware FLOPs: recomputation by gradient checkpointing and
work on padding are not counted) per example of s tokens with t trained tokens -- see
`example_flops` in compare_job.py:
    (4 * N_base + 6 * N_lora) * s      base linears: forward 2N + backward 2N (input grads only, frozen);
                                       LoRA matrices: forward 2N + backward 4N (input and weight grads)
    + 4 * d * V * t                    LM head, forward + input-grad backward, at trained positions only
    + 12 * L * d * s^2                 attention scores and values, forward 4Lds^2 + backward 8Lds^2
                                       (full square, the PaLM appendix-B convention)
with N_base = 25.30M (q k v o gate up down of 8 layers), N_lora = 1.25M, d = 512, V = 4096, L = 8.
MFU = model FLOPs / step time / peak, peak = this machine's single-thread fp32 torch.mm rate
(2048 x 2048, best of 3), measured in the same run before, during and after the rounds (median).

Peers, configured as their documentation recommends, changed only where the job demands:
  TRL        SFTTrainer(model, SFTConfig, train_dataset=Dataset(prompt, completion), peft_config=LoraConfig):
             completion-only loss (TRL's default for prompt/completion data), TRL's default
             gradient checkpointing on (and off: *_nogc), packing off (default) and on
             (packing=True: best-fit decreasing, which switches on padding-free batches);
             bf16=False (fp32 like everyone); for QLoRA its adapters are cast back to fp32
             (TRL casts them to bf16, which this CPU lacks natively)
  HF         the script a user writes: tokenize prompt + completion + EOS, labels -100 on the
             prompt, DataCollatorForSeq2Seq, Trainer defaults (no checkpointing, random order);
             prepare_model_for_kbit_training for QLoRA; hf_grouped adds
             train_sampling_strategy="group_by_length"
  both       optim = their default adamw_torch_fused; finetune uses torch.optim.AdamW
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))  # this folder's modules, also when loaded by path (tests)
# The job, the measurements, the peers and the worker side live in the compare_*.py modules beside this file.
# The `x as x` imports are not used here: tests/test_bench_compare.py loads this file by path and uses them through it.
from compare_job import DIMS, LORA, LR, MAX_SEQ_LEN, prepare  # noqa: E402
from compare_job import example_flops as example_flops  # noqa: E402
from compare_job import make_records as make_records  # noqa: E402
from compare_job import parameter_counts as parameter_counts  # noqa: E402
from compare_measure import StepStats as StepStats  # noqa: E402
from compare_measure import batch_segments as batch_segments  # noqa: E402
from compare_measure import matmul_peak_gflops  # noqa: E402
from compare_peer_finetune import register_segment_sdpa as register_segment_sdpa  # noqa: E402
from compare_worker import worker_main  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]

# ----------------------------------------------------------------------------- parent side


LOADS: list[float] = []  # 1-minute load average after every round: how contended the machine was


class Worker:
    def __init__(self, name: str, spec: dict[str, Any], logdir: Path):
        self.name, self.spec = name, spec
        cmd_r, cmd_w = os.pipe()
        rep_r, rep_w = os.pipe()
        env = dict(os.environ)
        env.update(
            BENCH_CMD_FD=str(cmd_r),
            BENCH_REP_FD=str(rep_w),
            OMP_NUM_THREADS="1",
            MKL_NUM_THREADS="1",
            TOKENIZERS_PARALLELISM="false",
            HF_HUB_OFFLINE="1",
            HF_DATASETS_OFFLINE="1",
            TRANSFORMERS_OFFLINE="1",
            PYTHONPATH=os.pathsep.join([str(ROOT)] + [p for p in [os.environ.get("PYTHONPATH")] if p]),
        )
        self.log = logdir / f"{name}.log"
        self.proc = subprocess.Popen(
            [sys.executable, __file__, "--worker", json.dumps(spec)],
            env=env,
            pass_fds=(cmd_r, rep_w),
            stdout=self.log.open("w"),
            stderr=subprocess.STDOUT,
            cwd=str(ROOT),
        )
        os.close(cmd_r)
        os.close(rep_w)
        self.cmd = os.fdopen(cmd_w, "w")
        self.rep = os.fdopen(rep_r, "r")
        self.spans: list[dict[str, Any]] = []
        self.ready: dict[str, Any] = {}
        self.done: dict[str, Any] = {}
        self.maxrss_child = 0

    def receive(self, expect: str) -> dict[str, Any]:
        line = self.rep.readline()
        if not line:
            self.proc.wait()
            raise RuntimeError(f"worker {self.name} exited (rc {self.proc.returncode}); log tail:\n{self.tail()}")
        msg = json.loads(line)
        if msg["event"] == "error":
            raise RuntimeError(f"worker {self.name}: {msg['error']}\n{msg['trace']}")
        if msg["event"] != expect:
            raise RuntimeError(f"worker {self.name}: expected {expect}, got {msg}")
        return msg

    def tail(self, n: int = 3000) -> str:
        return self.log.read_text(errors="replace")[-n:] if self.log.exists() else ""

    def step(self) -> dict[str, Any]:
        self.cmd.write('{"cmd": "go"}\n')
        self.cmd.flush()
        span = self.receive("span")
        self.spans.append(span)
        return span

    def finish(self) -> None:
        self.cmd.write('{"cmd": "finish"}\n')
        self.cmd.flush()

    def collect(self) -> None:
        self.done = self.receive("done")
        _, status, usage = os.wait4(self.proc.pid, 0)
        self.maxrss_child = usage.ru_maxrss * 1024  # this child's own peak, nothing else's
        self.proc.returncode = os.waitstatus_to_exitcode(status)


def run_lockstep(
    configs: dict[str, dict[str, Any]], rounds: int, logdir: Path, say=print
) -> tuple[dict[str, Worker], list[float]]:
    """Start every worker, wait for all to finish their warm-up step, then `rounds` rounds
    in which each worker runs one optimizer step in turn (order rotated every round)."""
    logdir.mkdir(parents=True, exist_ok=True)
    workers = {}
    for name, spec in configs.items():
        workers[name] = Worker(name, {**spec, "steps": rounds + 2}, logdir)
    try:
        t0 = time.perf_counter()
        for w in workers.values():
            w.ready = w.receive("ready")
        say(f"  {len(workers)} workers loaded and warmed up in {time.perf_counter() - t0:.0f}s")
        peaks = [matmul_peak_gflops()]
        names = list(workers)
        for r in range(rounds):
            t0 = time.perf_counter()
            order = names[r % len(names) :] + names[: r % len(names)]
            for name in order:
                workers[name].step()
            if r % 4 == 3:
                peaks.append(matmul_peak_gflops())
            LOADS.append(round(os.getloadavg()[0], 2))
            say(f"  round {r + 1}/{rounds}: {time.perf_counter() - t0:.1f}s (load average {LOADS[-1]})")
        for w in workers.values():
            w.finish()
        for w in workers.values():
            w.collect()
    except BaseException:
        for w in workers.values():
            if w.proc.poll() is None:
                w.proc.kill()
        raise
    peaks.append(matmul_peak_gflops())
    return workers, peaks


def median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def summarize(w: Worker, peak_gflops: float) -> dict[str, Any]:
    spans = w.spans
    dt = [s["dt"] for s in spans]
    res = {
        "spec": {k: v for k, v in w.spec.items() if k not in ("model", "train", "eval", "out")},
        "steps_timed": len(spans),
        "trained_tok_s": median([s["trained"] / s["dt"] for s in spans]),
        "tok_s": median([s["tokens"] / s["dt"] for s in spans]),
        "trained_tok_s_aggregate": sum(s["trained"] for s in spans) / sum(dt),
        "tok_s_aggregate": sum(s["tokens"] for s in spans) / sum(dt),
        "step_s_median": median(dt),
        "examples_per_step": statistics.mean(s["examples"] for s in spans),
        "padding_fraction": 1 - sum(s["tokens"] for s in spans) / max(1, sum(s["padded"] for s in spans)),
        "mfu": median([s["flops"] / s["dt"] for s in spans]) / (peak_gflops * 1e9),
        "mfu_aggregate": sum(s["flops"] for s in spans) / sum(dt) / (peak_gflops * 1e9),
        "peak_rss_mib": w.maxrss_child / 2**20,
        "peak_rss_train_mib": w.done.get("maxrss_train", 0) / 2**20,
        "rss_loaded_mib": w.done.get("rss_loaded", 0) / 2**20,
        "examples_seen": w.done["total"]["examples"],
        "trained_tokens_seen": w.done["total"]["trained"],
        "final_train_loss": statistics.mean(w.done["losses"][-max(1, len(w.done["losses"]) // 4) :]),
        "first_loss": w.done["losses"][0] if w.done["losses"] else None,
        "eval_loss": w.done.get("eval_loss"),
        "losses": w.done["losses"],
        "step_examples": w.done.get("step_examples"),
        "threads": w.done.get("threads"),
    }
    return res


def ratios(workers: dict[str, Worker], ours: str, key: str = "trained") -> dict[str, dict[str, float]]:
    """ours / peer, two ways: the median over rounds of the step-rate ratio within a round
    (robust to contention bursts), and total over total (robust to steps of different content)."""
    mine = workers[ours].spans
    out = {}
    for name, w in workers.items():
        if name == ours:
            continue
        per_round = median([(a[key] / a["dt"]) / (b[key] / b["dt"]) for a, b in zip(mine, w.spans)])
        totals = (sum(a[key] for a in mine) / sum(a["dt"] for a in mine)) / (
            sum(b[key] for b in w.spans) / sum(b["dt"] for b in w.spans)
        )
        out[name] = {"median_of_rounds": per_round, "total_over_total": totals}
    return out


# ----------------------------------------------------------------------------- suites

GLOBAL_BATCH = 8  # examples per optimizer step (unpacked: micro 4 x accum 2; packed: 2 rows of 512 ~ 7.4 examples)


def suite_configs(suite: str, meta: dict[str, Any], quant: bool, compile_lever: bool = False) -> dict[str, dict[str, Any]]:
    rows = max(1, round(GLOBAL_BATCH / meta["lengths"]["examples_per_packed_row"]))  # packed rows per step ~ 16 examples
    base = {"quant": quant, "max_seq_len": MAX_SEQ_LEN, "model": meta["model"], "train": meta["train"], "eval": meta["eval"]}
    unpacked = {"micro": 4, "accum": GLOBAL_BATCH // 4}
    packed = {"micro": 1, "accum": rows, "packing": True}
    if suite == "main":
        return {
            # finetune at its fastest recipe settings: packed rows, two per micro-batch, no checkpointing
            "finetune": {**base, "tool": "finetune", "micro": rows, "accum": 1, "packing": True, "gc": False},
            "trl": {**base, "tool": "trl", **unpacked, "gc": True},  # TRL defaults: packing off, checkpointing on
            "trl_packed": {**base, "tool": "trl", **packed, "gc": True},  # packing=True (bfd + padding-free)
            "trl_packed_nogc": {**base, "tool": "trl", **packed, "gc": False},
            "hf": {**base, "tool": "hf", **unpacked, "gc": False},  # the plain script, Trainer defaults
            "hf_grouped": {**base, "tool": "hf", **unpacked, "grouping": True, "gc": False},  # + group_by_length
            # finetune with length grouping instead of packing: the same layout as hf_grouped
            "finetune_grouped": {**base, "tool": "finetune", **unpacked, "grouping": True, "gc": False},
        }
    if suite == "peers":  # other configurations of the peers, to find their best
        return {
            "finetune": {**base, "tool": "finetune", **packed, "gc": False},
            "trl_nogc": {**base, "tool": "trl", **unpacked, "gc": False},
            "trl_packed_nogc": {**base, "tool": "trl", **packed, "gc": False},
            "trl_packed_rows_batched_nogc": {**base, "tool": "trl", "micro": rows, "accum": 1, "packing": True, "gc": False},
            "hf_grouped": {**base, "tool": "hf", **unpacked, "grouping": True, "gc": False},
        }
    if suite == "levers":  # finetune only: the main configuration, then one lever changed at a time
        best = {**base, "tool": "finetune", "micro": rows, "accum": 1, "packing": True, "gc": False}
        return {
            "best": best,
            "one_row_per_micro": {**best, **packed},
            "grouped_not_packed": {**best, **unpacked, "packing": False, "grouping": True},
            "neither": {**best, **unpacked, "packing": False},
            "checkpointing_on": {**best, "gc": True},
            "full_logits_head": {**best, "head": "full"},
            "segment_attention": {**best, "attention": "segments"},  # a prototype, not in finetune/
            **({"compiled_layers": {**best, "compile": True}} if compile_lever else {}),
        }
    if suite == "memory":
        long = {**base, "train": meta["long"], "eval": None, "max_seq_len": 2048, "micro": 1, "accum": 1}
        return {
            "finetune": {**long, "tool": "finetune", "gc": True},
            "finetune_nogc": {**long, "tool": "finetune", "gc": False},
            "trl": {**long, "tool": "trl", "gc": True},
            "trl_nogc": {**long, "tool": "trl", "gc": False},
            "hf": {**long, "tool": "hf", "gc": False},
            "hf_gc": {**long, "tool": "hf", "gc": True},
        }
    raise ValueError(suite)


def versions() -> dict[str, str]:
    import importlib.metadata as md
    import platform

    out = {"python": platform.python_version()}
    for pkg in ("torch", "transformers", "peft", "trl", "bitsandbytes", "accelerate", "datasets", "tokenizers"):
        try:
            out[pkg] = md.version(pkg)
        except md.PackageNotFoundError:
            out[pkg] = "missing"
    return out


def machine_load() -> dict[str, Any]:
    load1, load5, _ = os.getloadavg()
    return {"cpus": os.cpu_count(), "loadavg_1m": round(load1, 2), "loadavg_5m": round(load5, 2)}


def fmt_table(rows: list[list[str]]) -> str:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["| " + " | ".join(c.ljust(w) for c, w in zip(r, widths)) + " |" for r in rows]
    lines.insert(1, "|" + "|".join("-" * (w + 2) for w in widths) + "|")
    return "\n".join(lines)


def report(results: dict[str, Any], ours: str | None, speed: bool = True) -> str:
    head = [
        "config",
        "base",
        "trained tok/s",
        "tok/s",
        "ours/this",
        "MFU",
        "peak RSS MiB",
        "examples",
        "pad",
        "eval loss",
        "train loss",
    ]
    if not speed:
        head = [
            "config",
            "base",
            "checkpointing",
            "peak RSS MiB",
            "RSS loaded MiB",
            "peak - loaded",
            "s/step (2 steps, not a speed test)",
        ]
    rows = [head]
    for name, r in results["configs"].items():
        if not speed:
            rows.append(
                [
                    name,
                    "4-bit" if r["spec"]["quant"] else "fp32",
                    "on" if r["spec"]["gc"] else "off",
                    f"{r['peak_rss_mib']:.0f}",
                    f"{r['rss_loaded_mib']:.0f}",
                    f"{r['peak_rss_mib'] - r['rss_loaded_mib']:.0f}",
                    f"{r['step_s_median']:.1f}",
                ]
            )
            continue
        ratio = r.get("ratio_ours_over_this")
        rows.append(
            [
                name,
                "4-bit" if r["spec"]["quant"] else "fp32",
                f"{r['trained_tok_s_aggregate']:.0f} ({r['trained_tok_s']:.0f})",
                f"{r['tok_s_aggregate']:.0f}",
                "-" if ratio is None else f"{ratio['total_over_total']:.2f} ({ratio['median_of_rounds']:.2f})",
                f"{100 * r['mfu_aggregate']:.0f}%",
                f"{r['peak_rss_mib']:.0f}",
                f"{r['examples_seen']}",
                f"{100 * r['padding_fraction']:.0f}%",
                "-" if r["eval_loss"] is None else f"{r['eval_loss']:.3f}",
                f"{r['final_train_loss']:.3f}",
            ]
        )
    return fmt_table(rows)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--suite", choices=["main", "peers", "levers", "memory"], nargs="+", default=["main", "memory"])
    ap.add_argument(
        "--with-compile", action="store_true", help="levers: add torch.compile of the decoder layers (compiles for ~1 minute)"
    )
    ap.add_argument("--quick", action="store_true", help="800 examples, 3 timed steps (a smoke run, ~8 minutes)")
    ap.add_argument("--rounds", type=int, help="timed optimizer steps per config (default 10; quick 3)")
    ap.add_argument("--quant", choices=["both", "lora", "qlora"], default="both")
    ap.add_argument("--workdir", type=Path, default=Path("/tmp/finetune-bench"))
    ap.add_argument("--json", type=Path, default=None, help="write results here (default WORKDIR/compare.json)")
    ap.add_argument("--only", nargs="*", help="run only these config names")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        worker_main(json.loads(args.worker))
        return
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch

    torch.set_num_threads(1)
    rounds = args.rounds or (3 if args.quick else 10)
    t_all = time.perf_counter()
    meta = prepare(args.workdir, 800 if args.quick else 3000)
    print(f"job: {meta['parameters']:,}-parameter Llama, {meta['lengths']}")
    results: dict[str, Any] = {
        "command": " ".join(["python", "benchmarks/compare.py"] + sys.argv[1:]),
        "versions": versions(),
        "threads_per_tool": 1,
        "load_before": machine_load(),
        "job": {"dims": DIMS, "lora": LORA, "lr": LR, "global_batch_examples": GLOBAL_BATCH, "max_seq_len": MAX_SEQ_LEN, **meta},
        "suites": {},
    }
    quants = {"both": [False, True], "lora": [False], "qlora": [True]}[args.quant]
    for suite in args.suite:
        for quant in quants if suite != "memory" else [False]:
            configs = suite_configs(suite, meta, quant, args.with_compile)
            if args.only:
                configs = {k: v for k, v in configs.items() if k in args.only}
            tag = f"{suite}-{'qlora' if quant else 'lora'}"
            for name, spec in configs.items():
                spec["out"] = str(args.workdir / "runs" / tag / name)
            n_rounds = 2 if suite == "memory" else rounds
            print(f"{tag}: {len(configs)} configs x {n_rounds} timed steps")
            workers, peaks = run_lockstep(configs, n_rounds, args.workdir / "logs" / tag)
            peak = median(peaks)
            ours = next(iter(configs))
            res = {"peak_gflops_fp32_1thread": peak, "peak_samples": peaks, "configs": {}}
            ratio = ratios(workers, ours)
            for name, w in workers.items():
                res["configs"][name] = summarize(w, peak)
                res["configs"][name]["ratio_ours_over_this"] = ratio.get(name)
            results["suites"][tag] = res
            print(f"{tag} (ours = {ours}; fp32 matmul peak {peak:.1f} GFLOP/s on 1 thread, median of {len(peaks)}):")
            if suite != "memory":
                print(
                    "  trained tok/s: total/total over the timed steps (median of the steps' rates); "
                    "ours/this: total/total (median over rounds of the within-round ratio)"
                )
            print(report(res, ours, speed=suite != "memory"))
    results["load_after"] = machine_load()
    results["load_per_round"] = LOADS
    # This run keeps one thread busy itself; a higher load, or matmul-peak samples that spread
    # by more than 15%, mean other jobs shared the cores: absolute rates are then noisy, ratios less so.
    peaks_all = [p for suite in results["suites"].values() for p in suite["peak_samples"]]
    results["contended"] = bool((LOADS and median(LOADS) > 1.5) or (peaks_all and max(peaks_all) > 1.15 * min(peaks_all)))
    results["wall_s"] = round(time.perf_counter() - t_all, 1)
    out = args.json or args.workdir / "compare.json"
    out.write_text(json.dumps(results, indent=1))
    print(f"wrote {out} ({results['wall_s']:.0f}s)")


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    main()
