"""finetune's DPO vs TRL's DPOTrainer: same model, adapter, pairs and batches; loss per step and step time.

    pip install -e ".[bench]"                         # adds trl (1.16.0 measured)
    python benchmarks/dpo_vs_trl.py                   # 16 steps x 8 pairs, 3 rounds: ~1-2 min on 2 cores
    python benchmarks/dpo_vs_trl.py --quant 4         # the same on the 4-bit NF4 base (the demo recipe's)
    python benchmarks/dpo_vs_trl.py --trl-head-on-scored-only --json /tmp/dpo_vs_trl_head.json   # where TRL's time goes

Results: printed, and JSON (--json, default benchmarks/results/dpo_vs_trl.json).
Numbers and their reading: benchmarks/README.md.

The job (both tools in one process, taking turns step by step):
  model      the bundled tiny Llama (asset:tiny-llama, 1.4M parameters, tied head), fp32 weights
             and compute; --quant 4 loads it NF4 + double quant (fp32 compute) for both
  adapter    LoRA r=16, alpha 32, dropout 0 on q k v o gate up down (what lora.target=all-linear
             resolves to here); ours is built by the Trainer, TRL's from a peft LoraConfig with those
             modules, and then our initial adapter weights are copied into TRL's (peft draws A at
             random, B = 0), so both start identical
  pairs      the first steps x batch records of finetune/assets/demo/pairs.jsonl (string prompt /
             chosen / rejected), in file order (ours: data.shuffle=false; TRL:
             train_sampling_strategy=sequential), so step i trains both on the same pairs
  training   DPO sigmoid loss, beta 0.1, reference = the base with the adapter off (both); AdamW
             (torch.optim.AdamW: betas 0.9/0.999, eps 1e-8, weight decay 0; TRL optim=adamw_torch),
             lr 5e-4 constant, no warm-up, clip 1.0; one micro-batch per step (no accumulation);
             max length 128 (no pair comes near it); no activation checkpointing (ours: the demo
             recipe's; TRL: gradient_checkpointing=False, its default is True)

Measured:
  1. the first step's loss of both: ln 2 = 0.693147 exactly when policy = reference (B = 0)
  2. the loss of every step, and |ours - TRL| per step; also grad norm and reward margin per step
  3. the token ids each side trains on: every row's unpadded input_ids and which of its positions
     are scored (ours: labels != -100; TRL: completion_mask), compared row by row
  4. step time: everything the tool's own loop does per optimizer step (collate, reference forward,
     policy forward + backward, clip, AdamW, logging), in lockstep: both trainers are built, then
     TRL trains in a thread and ours in the main one, handing a baton over at every step-end
     callback, so the two alternate step by step and a burst of load from other jobs hits both
     alike (one computes while the other waits). A step is timed from taking the baton to the
     step-end callback. The first step of each run is warm-up and not counted; --rounds rounds
     alternate which tool goes first; reported: the median over all timed steps of all rounds,
     and the median of the step-by-step ratios TRL / ours. Threads: --threads (default 2, both
     OMP_NUM_THREADS and torch.set_num_threads).

Everything is built locally (no network, no hub). trl is imported only inside build_trl() (and checked first in main()).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import platform
import statistics
import sys
import tempfile
import threading
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
PAIRS = ROOT / "finetune" / "assets" / "demo" / "pairs.jsonl"
LN2 = math.log(2.0)
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]  # all-linear on a Llama
INSTALL_HINT = 'TRL is the [bench] extra: pip install -e ".[bench]"  (or: pip install "trl>=1.16,<2")'


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=16, help="optimizer steps per run (one epoch over steps x batch pairs)")
    p.add_argument("--batch", type=int, default=8, help="pairs per step (2 x batch sequences per forward)")
    p.add_argument("--lr", type=float, default=5e-4)
    p.add_argument("--beta", type=float, default=0.1)
    p.add_argument("--r", type=int, default=16)
    p.add_argument("--alpha", type=float, default=32.0)
    p.add_argument("--max-len", type=int, default=128)
    p.add_argument("--quant", choices=["none", "4"], default="none", help="base weights: fp32, or NF4 (fp32 compute)")
    p.add_argument("--rounds", type=int, default=3, help="runs of each tool; the first tool alternates per round")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument(
        "--trl-head-on-scored-only",
        action="store_true",
        help="diagnostic: make TRL's fused LM head take its Triton-device path (head only at scored positions) on "
        "the CPU too, by patching trl.trainer.utils._use_triton; by default it scores every position off-GPU",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=str(ROOT / "benchmarks" / "results" / "dpo_vs_trl.json"))
    return p.parse_args(argv)


def read_pairs(n: int) -> list[dict[str, Any]]:
    with PAIRS.open(encoding="utf-8") as f:
        records = [json.loads(line) for line in f if line.strip()]
    if len(records) < n:
        raise SystemExit(f"{PAIRS} has {len(records)} pairs; --steps x --batch asks for {n}")
    return records[:n]


def trained_rows(input_ids, attention_mask, scored) -> list[tuple[list[int], list[int]]]:
    """(unpadded ids, positions whose token is scored) of every row of a collated batch."""
    out = []
    for ids, mask, sc in zip(input_ids.tolist(), attention_mask.tolist(), scored.tolist()):
        n = sum(mask)
        out.append((ids[:n], [t for t in range(n) if sc[t]]))
    return out


# ----------------------------------------------------------------------------- lockstep


class Baton:
    """Two training loops in one process, one optimizer step at a time: a loop waits for its
    turn before its first step and hands over after each step, so a burst of load from other
    jobs on the machine hits both tools' neighbouring steps alike. Records each step's time
    from taking the turn to the step-end callback (the waiting is not counted)."""

    def __init__(self, first: str, second: str):
        self.order = [first, second]
        self.turn = first
        self.finished: set[str] = set()
        self.cond = threading.Condition()
        self.began: dict[str, float] = {}
        self.steps: dict[str, list[float]] = {first: [], second: []}

    def take(self, name: str) -> None:
        with self.cond:
            if not self.cond.wait_for(lambda: self.turn == name, timeout=1800):
                raise TimeoutError(f"{name} waited 30 minutes for its turn")
        self.began[name] = time.perf_counter()

    def step_end(self, name: str) -> None:
        self.steps[name].append(time.perf_counter() - self.began[name])
        self._hand_over(name)
        self.take(name)

    def done(self, name: str) -> None:
        """The loop ended (or failed): never wait for it again."""
        with self.cond:
            self.finished.add(name)
            self.order.remove(name)
            if self.order:
                self.turn = self.order[0]
            self.cond.notify_all()

    def _hand_over(self, name: str) -> None:
        with self.cond:
            others = [n for n in self.order if n != name]
            self.turn = others[0] if others else name
            self.cond.notify_all()


# ----------------------------------------------------------------------------- finetune


def build_ours(args: argparse.Namespace, pairs_path: Path, out: Path, baton: Baton) -> Any:
    from finetune import Callback, Trainer, load_recipe

    overrides = [
        f"output_dir={out}",
        "overwrite=true",
        f"seed={args.seed}",
        "precision=fp32",  # "auto" picks bf16 on CPUs with native bf16 (this EPYC has it); TRL runs fp32
        f"data.path={pairs_path}",
        f"data.max_seq_len={args.max_len}",
        "data.eval_fraction=0",
        "data.shuffle=false",
        "quant.bits=null" if args.quant == "none" else "quant.bits=4",
        f"lora.r={args.r}",
        f"lora.alpha={args.alpha}",
        "lora.dropout=0.0",
        "lora.target=all-linear",
        "train.objective=dpo",
        f"train.beta={args.beta}",
        f"train.max_steps={args.steps}",
        f"train.batch_size={args.batch}",
        "train.grad_accum=1",
        f"train.lr={args.lr}",
        "train.warmup_steps=0",
        "train.scheduler=constant",
        "train.weight_decay=0.0",
        "train.max_grad_norm=1.0",
        "train.log_every_steps=1",
        "memory.activation_checkpointing=none",
        "eval.every_steps=null",
        "checkpoint.every_steps=null",
        "report.plot=false",
    ]
    cfg = load_recipe("dpo-demo-cpu", overrides)

    class Log(Callback):
        def __init__(self) -> None:
            self.rows: list[dict[str, Any]] = []

        def on_train_begin(self, state, metrics):
            baton.take("finetune")

        def on_step_end(self, state, metrics):
            self.rows.append(dict(metrics))
            baton.step_end("finetune")

    class Recorded(Trainer):
        """Keeps the batches it trains on (read only) for the token comparison."""

        def __init__(self, *a: Any, **kw: Any) -> None:
            super().__init__(*a, **kw)
            self.batches: list[dict[str, Any]] = []

        def step_batches(self, step):
            batches = super().step_batches(step)
            self.batches.extend({k: v.detach().cpu().clone() for k, v in b.items()} for b in batches)
            return batches

    log = Log()
    trainer = Recorded(cfg, progress=False, callbacks=[log])
    trainer.log = log
    trainer.setup()
    return trainer


def ours_results(trainer: Any, peft_cfg: Any) -> dict[str, Any]:
    rows = []
    for b in trainer.batches:
        rows += trained_rows(b["input_ids"], b["attention_mask"], b["labels"] != -100)
    log = trainer.log.rows
    return {
        "targets": sorted(peft_cfg.target_modules),
        "scaling": peft_cfg.lora_alpha / peft_cfg.r,
        "losses": [r["loss"] for r in log],
        "grad_norms": [r["grad_norm"] for r in log],
        "margins": [r.get("rewards/margin") for r in log],
        "accuracies": [r.get("rewards/accuracy") for r in log],
        "tokens": [r["tokens"] for r in log],
        "trained_tokens": [r["trained_tokens"] for r in log],
        "rows": rows,
        "widths": [int(b["input_ids"].shape[1]) for b in trainer.batches],
    }


def initial_adapter(trainer: Any) -> dict[str, Any]:
    model = trainer.parallel.unwrap(trainer.model)
    return {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}


# ----------------------------------------------------------------------------- TRL


def build_trl(args: argparse.Namespace, records: list[dict[str, Any]], init: dict[str, Any], out: Path, baton: Baton) -> Any:
    import torch

    try:
        from trl import DPOConfig, DPOTrainer
    except ImportError as exc:
        raise SystemExit(f"{exc}\n{INSTALL_HINT}") from None
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, AutoTokenizer, BitsAndBytesConfig, PrinterCallback, TrainerCallback

    from finetune.config.schema import resolve_path

    path = resolve_path("asset:tiny-llama")
    load: dict[str, Any] = {"dtype": torch.float32, "attn_implementation": "sdpa"}
    if args.quant == "4":
        load["quantization_config"] = BitsAndBytesConfig(
            load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True, bnb_4bit_compute_dtype=torch.float32
        )
    model = AutoModelForCausalLM.from_pretrained(path, **load)
    tok = AutoTokenizer.from_pretrained(path)

    class Turns(TrainerCallback):
        def on_train_begin(self, a, state, control, **kw):
            baton.take("trl")

        def on_step_end(self, a, state, control, **kw):
            baton.step_end("trl")

    class Recorded(DPOTrainer):
        """Keeps each step's batch and exact loss (read only)."""

        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            loss = super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
            if model.training:
                self.seen.append(
                    {k: inputs[k].detach().cpu().clone() for k in ("input_ids", "attention_mask", "completion_mask")}
                )
                self.exact.append(float((loss[0] if return_outputs else loss).detach()))
            return loss

    config = DPOConfig(
        output_dir=str(out),
        seed=args.seed,
        per_device_train_batch_size=args.batch,
        gradient_accumulation_steps=1,
        max_steps=args.steps,
        learning_rate=args.lr,
        lr_scheduler_type="constant",
        warmup_steps=0,
        weight_decay=0.0,
        optim="adamw_torch",  # torch.optim.AdamW, as ours (TRL's default adamw_torch_fused differs in the last bits)
        max_grad_norm=1.0,
        beta=args.beta,
        loss_type=["sigmoid"],
        max_length=args.max_len,
        gradient_checkpointing=False,
        bf16=False,
        fp16=False,
        use_cpu=True,
        train_sampling_strategy="sequential",
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,
        dataloader_num_workers=0,
    )
    trainer = Recorded(
        model=model,
        args=config,
        train_dataset=Dataset.from_list(records),
        processing_class=tok,
        peft_config=LoraConfig(
            r=args.r, lora_alpha=args.alpha, lora_dropout=0.0, target_modules=TARGETS, bias="none", task_type="CAUSAL_LM"
        ),
        callbacks=[Turns()],
    )
    trainer.remove_callback(PrinterCallback)  # the log dicts it prints with disable_tqdm
    trainer.seen, trainer.exact = [], []
    params = {n: p for n, p in trainer.model.named_parameters() if p.requires_grad}
    if set(params) != set(init):
        raise RuntimeError(
            f"adapters differ: only ours {sorted(set(init) - set(params))[:4]}, only TRL's {sorted(set(params) - set(init))[:4]}"
        )
    with torch.no_grad():
        for name, p in params.items():
            # TRL casts QLoRA adapters to bf16 (the QLoRA paper's setting): back to fp32, like ours and the compute.
            p.data = p.data.to(torch.float32)
            p.copy_(init[name])
    return trainer


def trl_results(trainer: Any) -> dict[str, Any]:
    logs = [h for h in trainer.state.log_history if "loss" in h and "train_runtime" not in h]
    rows = []
    for b in trainer.seen:
        rows += trained_rows(b["input_ids"], b["attention_mask"], b["completion_mask"])
    return {
        "losses": trainer.exact,
        "logged_losses": [h["loss"] for h in logs],
        "grad_norms": [h.get("grad_norm") for h in logs],
        "margins": [h.get("rewards/margins") for h in logs],
        "accuracies": [h.get("rewards/accuracies") for h in logs],
        "rows": rows,
        "widths": [int(b["input_ids"].shape[1]) for b in trainer.seen],
        "adapter_dtype": str(next(p for p in trainer.model.parameters() if p.requires_grad).dtype),
    }


def run_round(args: argparse.Namespace, records: list, pairs_path: Path, out: Path, first: str, init: dict | None) -> dict:
    """Build both trainers, then train them in lockstep: TRL in a thread, ours in this one
    (it installs signal handlers, which only the main thread may)."""
    baton = Baton(first, "trl" if first == "finetune" else "finetune")
    ours = build_ours(args, pairs_path, out / "ours", baton)
    init = init if init is not None else initial_adapter(ours)
    peft_cfg = ours.parallel.unwrap(ours.model).peft_config["default"]
    trl = build_trl(args, records, init, out / "trl", baton)
    failure: list[BaseException] = []

    def train_trl() -> None:
        try:
            trl.train()
        except BaseException as exc:  # re-raised in the main thread
            failure.append(exc)
        finally:
            baton.done("trl")

    thread = threading.Thread(target=train_trl, name="trl")
    thread.start()
    try:
        with ours:
            ours.train()
    finally:
        baton.done("finetune")
        thread.join()
    if failure:
        raise failure[0]
    return {
        "init": init,
        "finetune": {**ours_results(ours, peft_cfg), "step_s": baton.steps["finetune"]},
        "trl": {**trl_results(trl), "step_s": baton.steps["trl"]},
    }


# ----------------------------------------------------------------------------- comparison


def compare_tokens(ours: list, trl: list, tok) -> dict[str, Any]:
    """Row by row: the same unpadded ids, and the same scored positions?"""
    same_ids = sum(a[0] == b[0] for a, b in zip(ours, trl))
    same_scored = sum(a == b for a, b in zip(ours, trl))
    first = None
    for i, (a, b) in enumerate(zip(ours, trl)):
        if a != b:
            first = {
                "row": i,
                "ours_ids": a[0],
                "trl_ids": b[0],
                "ours_scored": tok.decode([a[0][t] for t in a[1]]),
                "trl_scored": tok.decode([b[0][t] for t in b[1]]),
            }
            break
    return {
        "rows": [len(ours), len(trl)],
        "identical_ids": same_ids,
        "identical_ids_and_scored_positions": same_scored,
        "scored_tokens": [sum(len(a[1]) for a in ours), sum(len(b[1]) for b in trl)],
        "first_difference": first,
    }


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def versions() -> dict[str, str]:
    import importlib.metadata as md

    out = {"python": platform.python_version()}
    for name in ("torch", "transformers", "peft", "trl", "accelerate", "datasets", "bitsandbytes", "finetune"):
        try:
            out[name] = md.version(name)
        except md.PackageNotFoundError:
            out[name] = "not installed"
    return out


def fmt(x: float | None, digits: int = 6) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", str(args.threads))
    os.environ.setdefault("MKL_NUM_THREADS", str(args.threads))
    for var in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"):
        os.environ.setdefault(var, "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sys.path.insert(0, str(ROOT))
    import torch

    torch.set_num_threads(args.threads)
    try:
        import trl.trainer.utils  # fail before the first run, not after it
    except ImportError as exc:
        raise SystemExit(f"{exc}\n{INSTALL_HINT}") from None
    if args.trl_head_on_scored_only:
        trl.trainer.utils._use_triton = lambda device: True  # type: ignore[attr-defined]

    records = read_pairs(args.steps * args.batch)
    tmp = Path(tempfile.mkdtemp(prefix="dpo-vs-trl-"))
    pairs_path = tmp / "pairs.jsonl"
    pairs_path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    load_before = os.getloadavg()

    runs: dict[str, list[dict[str, Any]]] = {"finetune": [], "trl": []}
    init = None
    for r in range(args.rounds):
        first = "finetune" if r % 2 == 0 else "trl"
        t0 = time.perf_counter()
        got = run_round(args, records, pairs_path, tmp / f"round-{r}", first, init)
        init = got["init"]  # every round starts from the first round's adapter
        for name in runs:
            res = got[name]
            runs[name].append(res)
            print(
                f"round {r + 1}/{args.rounds} {name}: loss {res['losses'][0]:.6f} -> {res['losses'][-1]:.6f}, "
                f"median step {statistics.median(res['step_s'][1:]) * 1000:.1f} ms",
                flush=True,
            )
        print(f"round {r + 1}/{args.rounds}: {time.perf_counter() - t0:.1f} s with loading, {first} first", flush=True)
    load_after = os.getloadavg()

    ours, trl_ = runs["finetune"][0], runs["trl"][0]
    from transformers import AutoTokenizer

    from finetune.config.schema import resolve_path

    tok = AutoTokenizer.from_pretrained(resolve_path("asset:tiny-llama"))
    tokens = compare_tokens(ours["rows"], trl_["rows"], tok)
    diffs = [abs(a - b) for a, b in zip(ours["losses"], trl_["losses"])]
    repeat_diff = {
        name: max((abs(a - b) for run in rs[1:] for a, b in zip(rs[0]["losses"], run["losses"])), default=0.0)
        for name, rs in runs.items()
    }
    timed = {name: [t for run in rs for t in run["step_s"][1:]] for name, rs in runs.items()}
    step_ms = {name: statistics.median(ts) * 1000 for name, ts in timed.items()}
    per_round = {name: [statistics.median(run["step_s"][1:]) * 1000 for run in rs] for name, rs in runs.items()}
    # TRL's step over ours at the same step of the same round (they ran back to back): robust to load drifts
    paired = [t / o for ro, rt in zip(runs["finetune"], runs["trl"]) for o, t in zip(ro["step_s"][1:], rt["step_s"][1:])]

    print(f"\nfirst-step loss: finetune {ours['losses'][0]:.6f}, TRL {trl_['losses'][0]:.6f}, ln 2 = {LN2:.6f}")
    print(
        f"token ids: {tokens['identical_ids_and_scored_positions']}/{tokens['rows'][0]} rows identical (ids and scored positions)"
    )
    print(f"{'step':>4} {'finetune':>10} {'TRL':>10} {'|diff|':>9} {'gnorm ours':>10} {'gnorm TRL':>10}")
    for i, (a, b) in enumerate(zip(ours["losses"], trl_["losses"])):
        print(
            f"{i + 1:>4} {a:>10.6f} {b:>10.6f} {abs(a - b):>9.2e} {fmt(ours['grad_norms'][i], 4):>10} {fmt(trl_['grad_norms'][i], 4):>10}"
        )
    print(
        f"max |loss diff| {max(diffs):.3e}; across rounds: finetune {repeat_diff['finetune']:.1e}, TRL {repeat_diff['trl']:.1e}"
    )
    print(
        f"median step: finetune {step_ms['finetune']:.1f} ms, TRL {step_ms['trl']:.1f} ms "
        f"(TRL / finetune = {step_ms['trl'] / step_ms['finetune']:.2f}; median of step-by-step ratios "
        f"{statistics.median(paired):.2f}); per round: {per_round}"
    )

    result = {
        "command": "python benchmarks/dpo_vs_trl.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "machine": {
            "cpu": cpu_name(),
            "cores": os.cpu_count(),
            "torch_threads": torch.get_num_threads(),
            "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
            "load_average_1min": [round(load_before[0], 2), round(load_after[0], 2)],
        },
        "versions": versions(),
        "job": {
            "model": "asset:tiny-llama (Llama, 4 layers, hidden 160, vocab 912, tied head)",
            "base": "fp32" if args.quant == "none" else "NF4 + double quant, fp32 compute",
            "compute": "fp32",
            "lora": {"r": args.r, "alpha": args.alpha, "dropout": 0.0, "targets": ours["targets"], "scaling": ours["scaling"]},
            "pairs": f"first {args.steps * args.batch} of finetune/assets/demo/pairs.jsonl, in file order",
            "pairs_sha256": hashlib.sha256(pairs_path.read_bytes()).hexdigest(),
            "batch_pairs": args.batch,
            "steps": args.steps,
            "beta": args.beta,
            "optimizer": f"AdamW lr {args.lr} constant, no warm-up, weight decay 0, clip 1.0",
            "max_len": args.max_len,
            "rounds": args.rounds,
            "trl_head_on_scored_only": args.trl_head_on_scored_only,
        },
        "first_step_loss": {"finetune": ours["losses"][0], "trl": trl_["losses"][0], "ln2": LN2},
        "tokens": tokens,
        "batch_widths_equal": ours["widths"] == trl_["widths"],
        "loss": {
            "finetune": ours["losses"],
            "trl": trl_["losses"],
            "abs_diff": diffs,
            "max_abs_diff": max(diffs),
            "max_abs_diff_between_rounds": repeat_diff,
        },
        "grad_norm": {"finetune": ours["grad_norms"], "trl": trl_["grad_norms"]},
        "reward_margin": {"finetune": ours["margins"], "trl": trl_["margins"]},
        "reward_accuracy": {"finetune": ours["accuracies"], "trl": trl_["accuracies"]},
        "step_time": {
            "what": "interval between consecutive step-end callbacks (the tool's whole loop per optimizer step); "
            "the first step of each run is warm-up and not counted",
            "median_ms": step_ms,
            "median_ms_per_round": per_round,
            "ratio_trl_over_finetune": step_ms["trl"] / step_ms["finetune"],
            "median_of_step_by_step_ratios": statistics.median(paired),
            "steps_ms": {name: [[round(t * 1000, 2) for t in run["step_s"]] for run in rs] for name, rs in runs.items()},
        },
        "trl_trained_adapter_dtype": trl_["adapter_dtype"],
    }
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n", encoding="utf-8")
        print(f"wrote {args.json}")
    return result


if __name__ == "__main__":
    main()
