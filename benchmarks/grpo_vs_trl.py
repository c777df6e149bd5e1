"""finetune's GRPO vs TRL's GRPOTrainer on the CPU: same model, adapter, prompts, draws and reward; step time, tokens/s, peak RSS.

    pip install -e ".[bench]"                        # adds trl (1.16.0 measured); no other dependency
    python benchmarks/grpo_vs_trl.py                 # 10 steps x 8 prompts x 8 completions, 4 rounds: ~2-3 min on 2 cores
    python benchmarks/grpo_vs_trl.py --quant none --json benchmarks/results/grpo_vs_trl_fp32.json   # the fp32 base
    python benchmarks/grpo_vs_trl.py --tool trl --steps 8 --profile /tmp/trl.prof --out /tmp/trl.json   # one worker, cProfiled

Results: printed, and JSON (--json, default benchmarks/results/grpo_vs_trl.json).
Numbers and their reading: benchmarks/README.md.

The job (recipes/grpo-demo-cpu.yaml's, for both tools):
  model      the bundled tiny Llama (asset:tiny-llama, 1.4M parameters, tied head), NF4 + double quant with
             fp32 compute (--quant none: fp32 weights); fp32 everywhere else (ours: precision=fp32; TRL:
             bf16=False, and its QLoRA cast of the adapter to bf16 undone). Both keep bitsandbytes' one 4-bit
             kernel in eval mode too (ours: model/load.py keep_4bit_numerics; TRL's model: the same flag set)
  adapter    LoRA r=16, alpha 32, dropout 0 on q k v o gate up down (lora.target=all-linear here); ours built
             by the Trainer, TRL's from a peft LoraConfig, then our initial adapter weights are copied into
             TRL's (the first finetune worker saves them once set up; every TRL worker loads them)
  prompts    the first steps x batch records of finetune/assets/demo/prompts.jsonl ("words: ...\n<cue>:", with
             an `answer` column), in file order (ours: data.shuffle=false, no held-out prompts; TRL:
             shuffle_dataset=False), plain text tokenized with BOS by both
  sampling   G = 8 completions of each prompt (--generations), 8 prompts per optimizer step (--batch): 64
             completions a step. TRL counts completions in per_device_train_batch_size, so it gets batch x G = 64,
             gradient_accumulation_steps=1, steps_per_generation=1, num_iterations=1: one generation batch, one
             optimizer update, as ours. max_new_tokens 16 (TRL: max_completion_length), temperature 1.0, top_p
             1.0, top_k off, transformers' generate with a KV cache (no vLLM); a completion ends at </s> or
             <|im_end|> (ids 2 and 5: ours takes EOS and the tokenizer's end-of-turn tokens; TRL, EOS only, is
             given the same through generation_kwargs and its eos_token_ids)
  stops      the demo's stop strings "." and "\n": ours cuts a completion after generation at the token that
             reaches the first stop string past its leading whitespace (objectives/sampling.py cut()). TRL has
             no such option, so its worker applies the same cut (cut_at_stop below, a copy of ours) to the
             completion ids its _generate_single_turn returns: both train the same tokens, and the reward reads
             the text before the stop. --no-stop runs both without stop strings.
  reward     exact_match against the record's `answer`: 1.0 when the completion (before the stop) equals it,
             both stripped (ours: the built-in, finetune/objectives/rewards.py; TRL: exact_match below)
  loss       grpo (per-completion token mean, averaged over completions), advantages (r - mean) / (std + 1e-4)
             per group, epsilon 0.2, beta 0 (no reference pass); AdamW (torch.optim.AdamW, betas 0.9/0.999, eps
             1e-8, weight decay 0; TRL optim=adamw_torch), lr 2e-3 constant, no warm-up, clip 1.0; no activation
             checkpointing (TRL's default is on)
  same draws the finetune worker records the generator state each step's sampling starts from (read inside
             model.generate); each TRL worker sets that state at its step's start. With the same adapter, prompts
             and generation settings, both then sample the same completions: the same rewards, advantages, loss
             and (to fp32 rounding) gradient, step after step for as long as no sampled token flips. The
             benchmark checks it with a sha256 of every step's generated ids.

Measured, each tool in its own process (so each has its own RSS), the two in lockstep:
  both workers of a round start at once and set up on their own; from train begin on they take turns step
  by step over pipes from the parent (a worker writes a byte at train begin and after each step end, and
  reads one to go on), so a burst of load from other jobs on the machine hits neighbouring steps of both.
  Rounds alternate which tool goes first (ours first in round 1: it writes the adapter and the states).
  1. seconds per optimizer step: from taking the turn to the step-end callback (everything the tool's loop
     does: sampling, rewards, the loss forward, backward, clip, AdamW, logging; the waiting is not
     counted). Step 1 is warm-up and not counted. Median over all timed steps of all rounds; the median of
     the step-by-step ratios (same step, same round); and the same in process CPU time.
  2. where a step goes: time inside model.generate, the tool's compute_loss (policy forward + loss) and
     accelerator.backward (all three wrapped on the instance); other = the rest of the step.
  3. generated tokens/s: the completion tokens each step trains (up to and including the end token or the
     stop string's token; ours completion_length, TRL's completions/mean_length, x 64) per second of step
     time, over the timed steps.
  4. peak RSS: the worker's ru_maxrss (the whole process); also its RSS after importing the stack both run
     on (torch, transformers, peft, accelerate, bitsandbytes), after the tool's own imports, at train begin.
  5. step 1's (and every step's) mean reward, loss and grad norm of both.
Threads: --threads per worker (OMP_NUM_THREADS and torch.set_num_threads), default 1: the machine this was
measured on is shared with other sessions' jobs, and two OpenMP teams of 2 on 2 cores spin-wait each other
20-50x slower (benchmarks/README.md, "CPU thread oversubscription"); one thread each leaves a core per worker.

Everything is local (no network, no hub). A TRL worker imports nothing of finetune.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
PROMPTS = ROOT / "finetune" / "assets" / "demo" / "prompts.jsonl"
MODEL = ROOT / "finetune" / "assets" / "tiny-llama"  # asset:tiny-llama
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]  # all-linear on a Llama
STOPS = [".", "\n"]  # recipes/grpo-demo-cpu.yaml's train.stop
# finetune/data/templates.py END_OF_TURN_TOKENS: ours ends a completion at EOS and at these (the tiny Llama has <|im_end|>)
END_OF_TURN = ("<|im_end|>", "<|eot_id|>", "<|end|>", "<end_of_turn>", "<|endoftext|>", "</s>", "<|eom_id|>")
INSTALL_HINT = 'TRL is the [bench] extra: pip install -e ".[bench]"  (or: pip install "trl>=1.16,<2")'
MiB = 1024 * 1024
KEPT = ("step_s", "step_cpu_s", "generate_s", "generate_cpu_s", "generated_width", "rss_peak", "rss_base", "rss_after_imports")
KEPT += ("phase_s", "rss_train_begin", "wall_s", "process_s", "reward", "completion_tokens", "generated_sha")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=10, help="optimizer steps per run (one epoch over steps x batch prompts)")
    p.add_argument("--batch", type=int, default=8, help="prompts per optimizer step")
    p.add_argument("--generations", type=int, default=8, help="completions per prompt (G, num_generations)")
    p.add_argument("--max-new-tokens", type=int, default=16)
    p.add_argument("--context-words", type=int, default=0, help="a line of this many words before each prompt (long prompts)")
    p.add_argument("--max-seq-len", type=int, default=64, help="ours: data.max_seq_len (prompt + completion)")
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--r", type=int, default=16)
    p.add_argument("--alpha", type=float, default=32.0)
    p.add_argument("--quant", choices=["none", "4"], default="4", help="base weights: NF4 (the demo's) or fp32")
    p.add_argument("--no-stop", action="store_true", help="no stop strings on either side (EOS and max_new_tokens only)")
    p.add_argument("--rounds", type=int, default=4, help="lockstep runs of both; the tool going first alternates")
    p.add_argument("--threads", type=int, default=1, help="OMP and torch threads per worker (1: see the docstring)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=str(ROOT / "benchmarks" / "results" / "grpo_vs_trl.json"))
    # worker mode (the parent runs these; by hand: one tool once, e.g. to profile it)
    p.add_argument("--tool", choices=["finetune", "trl"], help="run one tool in this process and print its JSON")
    p.add_argument("--init", help="worker: the initial adapter (torch.save'd); finetune writes it if absent")
    p.add_argument("--rng", help="worker: the generator state of each step's sampling; finetune writes it, TRL replays it")
    p.add_argument("--prompts", help="worker: the prompts file (default: the first steps x batch of the demo's)")
    p.add_argument("--out", help="worker: write the JSON here (default: stdout)")
    p.add_argument("--baton", help="worker: GO_FD,DONE_FD: take turns with another worker step by step (the parent's)")
    p.add_argument("--profile", help="worker: cProfile the training steps (not setup) into this file")
    return p.parse_args(argv)


def rss_now() -> int:
    """This process's resident set now, bytes (VmRSS)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def rss_peak() -> int:
    """This process's peak resident set, bytes (ru_maxrss is KiB on Linux)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def write_prompts(n: int, path: Path, context_words: int = 0) -> Path:
    """The first n demo prompts; context_words > 0: each led by a line of that many of the prompts' own words (a
    long prompt, as real GRPO data has: where prefilling each prompt once instead of G times shows)."""
    with PROMPTS.open(encoding="utf-8") as f:
        records = [json.loads(line) for line in f if line.strip()]
    if len(records) < n:
        raise SystemExit(f"{PROMPTS} has {len(records)} prompts; --steps x --batch asks for {n}")
    words = sorted({w for r in records for w in r["prompt"].split()[1:] if w.isalpha()})
    for i, r in enumerate(records[:n]):
        if context_words:
            notes = " ".join(words[(7 * i + 3 * k) % len(words)] for k in range(context_words))
            r["prompt"] = f"notes: {notes}\n{r['prompt']}"
    path.write_text("".join(json.dumps(r) + "\n" for r in records[:n]), encoding="utf-8")
    return path


def save_atomic(obj: Any, path: Path) -> None:
    """torch.save, seen whole or not at all by a reader in another process."""
    import torch

    tmp = path.with_name(path.name + f".{os.getpid()}.tmp")
    torch.save(obj, tmp)
    os.replace(tmp, path)


def wait_for(path: Path, timeout_s: float = 600.0) -> Path:
    """The path once another process has written it (the TRL worker sets up while ours does)."""
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path} did not appear in {timeout_s:.0f} s")
        time.sleep(0.1)
    return path


def cut_at_stop(row: list[int], ends: list[int], stops: list[str], tokenizer) -> list[int]:
    """The tokens trained of one completion: up to and including the first end token, or the token that
    reaches the first stop string after the completion's leading whitespace. A copy of the token half of
    finetune/objectives/sampling.py cut(), for the TRL worker (which imports nothing of finetune)."""
    end = next((i + 1 for i, t in enumerate(row) if t in ends), len(row))
    body = row[: end - 1] if row[end - 1 : end] and row[end - 1] in ends else row[:end]
    text = tokenizer.decode(body, skip_special_tokens=True)
    begun = len(text) - len(text.lstrip())
    hit = min((i for i in (text.find(s, begun) for s in stops) if i >= 0), default=-1)
    if hit < 0:
        return row[:end]
    return row[: next(i for i in range(1, len(body) + 1) if len(tokenizer.decode(body[:i], skip_special_tokens=True)) > hit)]


def text_before_stop(text: str, stops: list[str]) -> str:
    """The text the reward reads: before the first stop string past the leading whitespace (cut()'s text half)."""
    begun = len(text) - len(text.lstrip())
    hit = min((i for i in (text.find(s, begun) for s in stops) if i >= 0), default=-1)
    return text if hit < 0 else text[:hit]


class Clock:
    """A worker's step timing (wall and CPU), its turns in the lockstep, and what it records of sampling.

    With a baton (two pipe fds from the parent), the worker waits for its turn at train begin and after
    every step end: it writes a byte when it reaches that point and reads one to go on. A step is timed
    from taking the turn to its step-end callback; the waiting is not counted.

    Sampling: `writer` (finetune) saves the generator state each step sampled from (read at model.generate)
    to `states`; a replaying worker (TRL) sets it before each step, so both draw from the same state."""

    def __init__(self, baton: str | None, states: str | None, writer: bool):
        self.fds = tuple(int(x) for x in baton.split(",")) if baton else None
        self.states_path = Path(states) if states else None
        self.writer = writer
        self.known: list = []  # the states on file (read once a step needs them)
        self.rng_states: list = []
        self.began = 0.0
        self.began_cpu = 0.0
        self.step_wall: list[float] = []
        self.step_cpu: list[float] = []
        self.gen_s: list[float] = []
        self.gen_cpu_s: list[float] = []
        self.gen_hash: list[str] = []
        self.gen_width: list[int] = []
        self.gen_in_hash: list[str] = []
        self.rng_hash: list[str] = []
        self.rss_train_begin = 0
        self.profiler: Any = None
        self.phases: dict[str, list[float]] = {}  # time_calls(): seconds per call

    def _turn(self) -> None:
        if self.fds is not None:
            go, done = self.fds
            os.write(done, b".")
            if os.read(go, 1) != b".":
                raise SystemExit("the parent closed the baton")
        self.began, self.began_cpu = time.perf_counter(), time.process_time()

    def begin(self, profile: str | None) -> None:
        self.rss_train_begin = rss_now()
        if profile:
            import cProfile

            self.profiler = cProfile.Profile()
            self.profiler.enable()
        self._turn()

    def step_begin(self, step: int) -> None:
        """A replaying worker: set the generator to the state ours sampled step `step` from."""
        if self.writer or self.states_path is None:
            return
        import torch

        if len(self.known) < step:
            self.known = torch.load(self.states_path)  # ours finished this step first (or in an earlier round)
        torch.set_rng_state(self.known[step - 1])

    def step_end(self) -> None:
        self.step_wall.append(time.perf_counter() - self.began)
        self.step_cpu.append(time.process_time() - self.began_cpu)
        if self.writer and self.states_path is not None:
            self._save_states()
        self._turn()

    def _save_states(self) -> None:
        import torch

        if self.states_path.exists() and not self.known:
            self.known = torch.load(self.states_path)
        n = len(self.rng_states)
        if len(self.known) >= n:  # an earlier round wrote them: ours must sample from the same states again
            if not all(torch.equal(a, b) for a, b in zip(self.known[:n], self.rng_states)):
                raise RuntimeError("finetune sampled from other generator states than in its first round")
        else:
            save_atomic(self.rng_states, self.states_path)
            self.known = list(self.rng_states)

    def end(self, profile: str | None) -> None:
        if self.profiler is not None:
            self.profiler.disable()
            self.profiler.dump_stats(profile)

    def wrap_generate(self, model) -> None:
        """Time every model.generate of this instance; keep its generator state and hash its input and output."""
        inner = model.generate

        def generate(*a, **kw):
            import torch

            ids = kw.get("input_ids") if kw.get("input_ids") is not None else a[0]
            mask = kw.get("attention_mask")
            seen = [ids.cpu().numpy().tobytes(), b"" if mask is None else mask.cpu().numpy().tobytes()]
            self.gen_in_hash.append(hashlib.sha256(b"|".join(seen)).hexdigest()[:16])
            state = torch.get_rng_state()
            self.rng_states.append(state)
            self.rng_hash.append(hashlib.sha256(state.numpy().tobytes()).hexdigest()[:16])
            t0, c0 = time.perf_counter(), time.process_time()
            out = inner(*a, **kw)
            self.gen_s.append(time.perf_counter() - t0)
            self.gen_cpu_s.append(time.process_time() - c0)
            new = out[:, ids.shape[1] :].contiguous()
            self.gen_width.append(int(new.shape[1]))
            self.gen_hash.append(hashlib.sha256(new.cpu().numpy().tobytes()).hexdigest()[:16])
            return out

        model.generate = generate

    def time_calls(self, owner: Any, name: str, key: str) -> None:
        """Time every call of owner.<name> (an instance attribute wrapping the method) into phases[key]."""
        inner = getattr(owner, name)
        spent = self.phases.setdefault(key, [])

        def timed(*a, **kw):
            t0 = time.perf_counter()
            try:
                return inner(*a, **kw)
            finally:
                spent.append(time.perf_counter() - t0)

        setattr(owner, name, timed)


def common_result(clock: Clock, rss_base: int, rss_imports: int, t_start: float) -> dict[str, Any]:
    import torch

    return {
        "step_s": clock.step_wall,
        "step_cpu_s": clock.step_cpu,
        "generate_s": clock.gen_s,
        "generate_cpu_s": clock.gen_cpu_s,
        "phase_s": clock.phases,
        "generated_width": clock.gen_width,
        "generated_sha": clock.gen_hash,
        "generate_input_sha": clock.gen_in_hash,
        "generator_state_sha": clock.rng_hash,
        "rss_base": rss_base,
        "rss_after_imports": rss_imports,
        "rss_train_begin": clock.rss_train_begin,
        "rss_peak": rss_peak(),
        "process_s": time.perf_counter() - t_start,
        "torch_threads": torch.get_num_threads(),
    }


# ----------------------------------------------------------------------------- finetune


def run_finetune(args: argparse.Namespace, prompts: Path, out: Path, t_start: float) -> dict[str, Any]:
    import torch

    from finetune import Callback, Trainer, load_recipe

    rss_imports = rss_now()
    clock = Clock(args.baton, args.rng, writer=True)
    overrides = [
        f"output_dir={out}",
        "overwrite=true",
        f"seed={args.seed}",
        "precision=fp32",  # "auto" picks bf16 on CPUs with native bf16 (this EPYC has it); TRL runs fp32
        f"data.path={prompts}",
        f"data.max_seq_len={args.max_seq_len}",
        "data.eval_path=null",  # no held-out greedy rewards before and after: the steps only
        "data.eval_fraction=0",
        "data.shuffle=false",
        "quant.bits=null" if args.quant == "none" else "quant.bits=4",
        f"lora.r={args.r}",
        f"lora.alpha={args.alpha}",
        "lora.dropout=0.0",
        "lora.target=all-linear",
        "train.objective=grpo",
        "train.loss_type=grpo",
        f"train.num_generations={args.generations}",
        f"train.max_new_tokens={args.max_new_tokens}",
        f"train.temperature={args.temperature}",
        "train.top_p=1.0",
        "train.epsilon=0.2",
        "train.beta=0.0",
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
    if args.no_stop:
        overrides.append("train.stop=[]")  # else the recipe's [".", "\n"]
    cfg = load_recipe("grpo-demo-cpu", overrides)
    if list(cfg.train.stop) != ([] if args.no_stop else STOPS):
        raise RuntimeError(f"train.stop is {cfg.train.stop}")
    rows: list[dict[str, Any]] = []

    class Timed(Callback):
        def on_train_begin(self, state, metrics):
            clock.begin(args.profile)

        def on_step_end(self, state, metrics):
            clock.step_end()
            rows.append(dict(metrics))

    trainer = Trainer(cfg, progress=False, callbacks=[Timed()])
    trainer.setup()
    model = trainer.parallel.unwrap(trainer.model)
    clock.wrap_generate(model)
    clock.time_calls(trainer, "compute_loss", "loss_forward")  # the policy forward and the loss (sampling is before)
    clock.time_calls(trainer.accelerator, "backward", "backward")
    init = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    if args.init:
        path = Path(args.init)
        if path.exists():  # every round starts from the same adapter (and ours is deterministic: checked)
            saved = torch.load(path)
            if set(saved) != set(init) or any(not torch.equal(saved[k], init[k]) for k in init):
                raise RuntimeError(f"finetune's initial adapter differs from {path}'s")
        else:
            save_atomic(init, path)
    with trainer:
        trainer.train()
    clock.end(args.profile)
    from finetune.objectives.sampling import end_ids

    return {
        **common_result(clock, args.rss_base, rss_imports, t_start),
        "loss": [r["loss"] for r in rows],
        "grad_norm": [r["grad_norm"] for r in rows],
        "reward": [r.get("reward") for r in rows],
        "reward_std": [r.get("reward_std") for r in rows],
        "completion_tokens": [r.get("completion_length", 0.0) * args.batch * args.generations for r in rows],
        "end_ids": end_ids(trainer.tokenizer, model),
        "finetune_from": str(Path(sys.modules["finetune"].__file__).parent),
        "adapter_dtype": str(next(iter(init.values())).dtype),
        "trainable_params": sum(p.numel() for p in init.values()),
    }


# ----------------------------------------------------------------------------- TRL


def run_trl(args: argparse.Namespace, prompts: Path, out: Path, t_start: float) -> dict[str, Any]:
    import torch

    try:
        from trl import GRPOConfig, GRPOTrainer
    except ImportError as exc:
        raise SystemExit(f"{exc}\n{INSTALL_HINT}") from None
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, AutoTokenizer, BitsAndBytesConfig, PrinterCallback, TrainerCallback

    rss_imports = rss_now()
    clock = Clock(args.baton, args.rng, writer=False)
    stops = [] if args.no_stop else STOPS
    load: dict[str, Any] = {"dtype": torch.float32, "attn_implementation": "sdpa"}
    if args.quant == "4":
        load["quantization_config"] = BitsAndBytesConfig(
            load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True, bnb_4bit_compute_dtype=torch.float32
        )
    model = AutoModelForCausalLM.from_pretrained(MODEL, **load)
    for module in model.modules():  # as ours (model/load.py keep_4bit_numerics): one 4-bit kernel in train and eval
        if hasattr(module, "support_avx512bf16_for_cpu"):
            module.support_avx512bf16_for_cpu = False
    tok = AutoTokenizer.from_pretrained(MODEL)
    records = [json.loads(line) for line in prompts.read_text(encoding="utf-8").splitlines() if line.strip()]
    # The end tokens ours uses (sampling.py end_ids(): EOS, the tokenizer's end-of-turn tokens, the generation
    # config's); TRL's own are EOS and the generation config's only: given ours, in generate and in its EOS cut.
    specials = set(tok.all_special_tokens) | set(tok.get_added_vocab())
    ends = sorted(
        {tok.eos_token_id, model.generation_config.eos_token_id}
        | {tok.convert_tokens_to_ids(t) for t in END_OF_TURN if t in specials}
    )

    def exact_match(completions: list[str], answer: list[str], **kw: Any) -> list[float]:
        return [float(text_before_stop(c, stops).strip() == str(a).strip()) for c, a in zip(completions, answer)]

    class Timed(TrainerCallback):
        def on_train_begin(self, a, state, control, **kw):
            clock.begin(args.profile)

        def on_step_begin(self, a, state, control, **kw):
            clock.step_begin(state.global_step + 1)

        def on_step_end(self, a, state, control, **kw):
            clock.step_end()

    class StopStrings(GRPOTrainer):
        """Cuts each completion at the stop strings as finetune does (TRL's own cut is at EOS only)."""

        def _generate_single_turn(self, *a: Any, **kw: Any):
            ids, logprobs = super()._generate_single_turn(*a, **kw)
            if stops:
                ids = [cut_at_stop(row, self.eos_token_ids, stops, self._tokenizer) for row in ids]
            return ids, logprobs

    config = GRPOConfig(
        output_dir=str(out),
        seed=args.seed,
        per_device_train_batch_size=args.batch * args.generations,  # completions, not prompts
        gradient_accumulation_steps=1,
        steps_per_generation=1,
        num_iterations=1,
        num_generations=args.generations,
        max_completion_length=args.max_new_tokens,
        temperature=args.temperature,
        top_p=1.0,
        top_k=0,
        beta=0.0,
        epsilon=0.2,
        loss_type="grpo",
        scale_rewards="group",
        max_steps=args.steps,
        learning_rate=args.lr,
        lr_scheduler_type="constant",
        warmup_steps=0,
        weight_decay=0.0,
        optim="adamw_torch",  # torch.optim.AdamW, as ours
        max_grad_norm=1.0,
        gradient_checkpointing=False,
        bf16=False,
        fp16=False,
        use_cpu=True,
        use_vllm=False,
        shuffle_dataset=False,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,
        dataloader_num_workers=0,
        log_completions=False,
        generation_kwargs={"eos_token_id": ends},
    )
    trainer = StopStrings(
        model=model,
        reward_funcs=[exact_match],
        args=config,
        train_dataset=Dataset.from_list(records),
        processing_class=tok,
        peft_config=LoraConfig(
            r=args.r, lora_alpha=args.alpha, lora_dropout=0.0, target_modules=TARGETS, bias="none", task_type="CAUSAL_LM"
        ),
        callbacks=[Timed()],
    )
    trainer.remove_callback(PrinterCallback)  # the log dicts it prints with disable_tqdm
    trainer.eos_token_ids = ends  # where _generate_single_turn cuts (it read the model's generation config)
    params = {n: p for n, p in trainer.model.named_parameters() if p.requires_grad}
    init = torch.load(wait_for(Path(args.init))) if args.init else None  # ours writes it once set up
    if init is not None and set(params) != set(init):
        raise RuntimeError(
            f"adapters differ: only ours {sorted(set(init) - set(params))[:4]}, only TRL's {sorted(set(params) - set(init))[:4]}"
        )
    with torch.no_grad():
        for name, p in params.items():
            p.data = p.data.to(torch.float32)  # TRL casts QLoRA adapters to bf16: back to fp32, like ours
            if init is not None:
                p.copy_(init[name])
    clock.wrap_generate(trainer.model)
    clock.time_calls(trainer, "compute_loss", "loss_forward")  # the policy forward and the loss (sampling is before)
    clock.time_calls(trainer.accelerator, "backward", "backward")
    trainer.train()
    clock.end(args.profile)
    logs = [h for h in trainer.state.log_history if "loss" in h and "train_runtime" not in h]
    n = args.batch * args.generations
    return {
        **common_result(clock, args.rss_base, rss_imports, t_start),
        "loss": [h["loss"] for h in logs],
        "grad_norm": [h.get("grad_norm") for h in logs],
        "reward": [h.get("reward") for h in logs],
        "reward_std": [h.get("reward_std") for h in logs],
        "completion_tokens": [h.get("completions/mean_length", 0.0) * n for h in logs],
        "end_ids": list(trainer.eos_token_ids),
        "adapter_dtype": str(next(iter(params.values())).dtype),
        "trainable_params": sum(p.numel() for p in params.values()),
        "adapter_copied": init is not None,
    }


def worker(args: argparse.Namespace) -> None:
    t_start = time.perf_counter()
    import torch

    torch.set_num_threads(args.threads)
    import accelerate  # noqa: F401  (the stack both tools run on, imported first: RSS past it is the tool's own)
    import bitsandbytes  # noqa: F401
    import peft  # noqa: F401
    import transformers  # noqa: F401

    args.rss_base = rss_now()
    tmp = Path(tempfile.mkdtemp(prefix=f"grpo-vs-trl-{args.tool}-"))
    prompts = (
        Path(args.prompts) if args.prompts else write_prompts(args.steps * args.batch, tmp / "prompts.jsonl", args.context_words)
    )
    run = run_finetune if args.tool == "finetune" else run_trl
    try:
        result = {"tool": args.tool, **run(args, prompts, tmp / "out", t_start)}
    finally:
        shutil.rmtree(tmp, ignore_errors=True)  # the run's adapter, metrics and checkpoints: not looked at
    text = json.dumps(result)
    if args.out:
        Path(args.out).write_text(text, encoding="utf-8")
    else:
        print(text)


# ----------------------------------------------------------------------------- the parent


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def git_state() -> dict[str, Any]:
    """The commit measured, and whether finetune/ had uncommitted changes (other sessions edit it)."""

    def git(*a: str) -> str:
        return subprocess.run(["git", *a], cwd=ROOT, capture_output=True, text=True).stdout.strip()

    return {"commit": git("rev-parse", "HEAD"), "uncommitted_in_finetune": git("status", "--porcelain", "finetune").splitlines()}


def versions() -> dict[str, str]:
    import importlib.metadata as md

    out = {"python": platform.python_version()}
    for name in ("torch", "transformers", "peft", "trl", "accelerate", "datasets", "bitsandbytes", "finetune"):
        try:
            out[name] = md.version(name)
        except md.PackageNotFoundError:
            out[name] = "not installed"
    return out


def worker_cmd(args: argparse.Namespace, tool: str, tmp: Path, out: Path, fds: tuple[int, int]) -> list[str]:
    cmd = [sys.executable, str(Path(__file__).resolve()), "--tool", tool, "--prompts", str(tmp / "prompts.jsonl")]
    cmd += ["--init", str(tmp / "init_adapter.pt"), "--rng", str(tmp / "sampling_states.pt"), "--baton", f"{fds[0]},{fds[1]}"]
    cmd += ["--out", str(out), "--steps", str(args.steps), "--batch", str(args.batch), "--generations", str(args.generations)]
    cmd += ["--max-new-tokens", str(args.max_new_tokens), "--temperature", str(args.temperature), "--lr", str(args.lr)]
    cmd += ["--r", str(args.r), "--alpha", str(args.alpha), "--quant", args.quant, "--threads", str(args.threads)]
    cmd += ["--max-seq-len", str(args.max_seq_len)]
    return cmd + ["--seed", str(args.seed)] + (["--no-stop"] if args.no_stop else [])


def run_round(args: argparse.Namespace, tmp: Path, order: list[str], r: int) -> dict[str, dict[str, Any]]:
    """Both workers at once, taking turns step by step in `order` (each sets up meanwhile, on its own)."""
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads), MKL_NUM_THREADS=str(args.threads))
    env |= {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    procs, go, done, outs, logs, t0 = {}, {}, {}, {}, {}, {}
    for tool in order:
        go_r, go[tool] = os.pipe()
        done[tool], done_w = os.pipe()
        outs[tool], logs[tool] = tmp / f"round{r}-{tool}.json", (tmp / f"round{r}-{tool}.log").open("w")
        t0[tool] = time.perf_counter()
        procs[tool] = subprocess.Popen(
            worker_cmd(args, tool, tmp, outs[tool], (go_r, done_w)),
            env=env,
            stdout=logs[tool],
            stderr=subprocess.STDOUT,
            pass_fds=(go_r, done_w),
        )
        os.close(go_r)
        os.close(done_w)
    active = list(order)
    for tool in order:  # both have set up and reached train begin (or died)
        if os.read(done[tool], 1) != b".":
            active.remove(tool)
    while active:
        for tool in list(active):
            os.write(go[tool], b".")
            if os.read(done[tool], 1) != b".":  # the worker ended: its pipe closed
                active.remove(tool)
    results = {}
    for tool in order:
        os.close(go[tool])
        os.close(done[tool])
        code = procs[tool].wait()
        logs[tool].close()
        if code != 0:
            sys.stderr.write((tmp / f"round{r}-{tool}.log").read_text(encoding="utf-8")[-8000:])
            raise SystemExit(f"the {tool} worker failed (exit {code}); its log: {tmp / f'round{r}-{tool}.log'}")
        results[tool] = json.loads(outs[tool].read_text(encoding="utf-8"))
        results[tool]["wall_s"] = time.perf_counter() - t0[tool]
    return results


def summarize(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Timed steps (all but each run's first) of every round: medians, tokens/s, generate's share, RSS."""
    timed = [t for r in runs for t in r["step_s"][1:]]
    cpu = [t for r in runs for t in r["step_cpu_s"][1:]]
    gen = [g for r in runs for g in r["generate_s"][1:]]
    gen_cpu = [g for r in runs for g in r["generate_cpu_s"][1:]]
    tokens = sum(c for r in runs for c in r["completion_tokens"][1:])
    return {
        "timed_steps": len(timed),
        "median_step_s": statistics.median(timed),
        "median_step_s_per_round": [statistics.median(r["step_s"][1:]) for r in runs],
        "median_step_cpu_s": statistics.median(cpu),
        "first_step_s": [r["step_s"][0] for r in runs],
        "median_generate_s": statistics.median(gen),
        "median_generate_cpu_s": statistics.median(gen_cpu),
        "median_rest_of_step_s": statistics.median(t - g for r in runs for t, g in zip(r["step_s"][1:], r["generate_s"][1:])),
        "median_loss_forward_s": statistics.median(x for r in runs for x in r["phase_s"]["loss_forward"][1:]),
        "median_backward_s": statistics.median(x for r in runs for x in r["phase_s"]["backward"][1:]),
        "median_other_s": statistics.median(
            t - g - f - b
            for r in runs
            for t, g, f, b in zip(
                r["step_s"][1:], r["generate_s"][1:], r["phase_s"]["loss_forward"][1:], r["phase_s"]["backward"][1:]
            )
        ),
        "generate_share": sum(gen) / sum(timed),
        "completion_tokens_per_step": tokens / len(timed),
        "tokens_per_s": tokens / sum(timed),
        "tokens_per_cpu_s": tokens / sum(cpu),
        "peak_rss_mib": statistics.median(r["rss_peak"] for r in runs) / MiB,
        "peak_rss_mib_per_round": [round(r["rss_peak"] / MiB, 1) for r in runs],
        "rss_base_mib": statistics.median(r["rss_base"] for r in runs) / MiB,
        "rss_after_imports_mib": statistics.median(r["rss_after_imports"] for r in runs) / MiB,
        "rss_train_begin_mib": statistics.median(r["rss_train_begin"] for r in runs) / MiB,
        "process_wall_s": [round(r["wall_s"], 1) for r in runs],
    }


def main(argv: list[str] | None = None) -> dict[str, Any] | None:
    args = parse_args(argv)
    for var in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"):
        os.environ.setdefault(var, "1")
    os.environ.setdefault("OMP_NUM_THREADS", str(args.threads))
    if args.tool:
        sys.path.insert(0, str(ROOT))
        worker(args)
        return None
    try:
        import trl  # noqa: F401  (fail before the first run, not after it)
    except ImportError as exc:
        raise SystemExit(f"{exc}\n{INSTALL_HINT}") from None

    tmp = Path(tempfile.mkdtemp(prefix="grpo-vs-trl-"))
    prompts = write_prompts(args.steps * args.batch, tmp / "prompts.jsonl", args.context_words)
    prompts_sha256 = hashlib.sha256(prompts.read_bytes()).hexdigest()
    load_before = os.getloadavg()
    runs: dict[str, list[dict[str, Any]]] = {"finetune": [], "trl": []}
    orders = [["finetune", "trl"] if r % 2 == 0 else ["trl", "finetune"] for r in range(args.rounds)]
    for r, order in enumerate(orders):  # round 1 has ours first: it writes the adapter and the sampling states
        got = run_round(args, tmp, order, r)
        for tool in order:
            res = got[tool]
            runs[tool].append(res)
            print(
                f"round {r + 1}/{args.rounds} {tool:>8}: median step {statistics.median(res['step_s'][1:]):.3f} s "
                f"(CPU {statistics.median(res['step_cpu_s'][1:]):.3f} s; generate {statistics.median(res['generate_s'][1:]):.3f} s), "
                f"step 1: reward {res['reward'][0]:.4f} loss {res['loss'][0]:.6f} grad norm {res['grad_norm'][0]:.4f}; "
                f"peak RSS {res['rss_peak'] / MiB:.0f} MiB; process {res['wall_s']:.1f} s",
                flush=True,
            )
    load_after = os.getloadavg()
    shutil.rmtree(tmp, ignore_errors=True)  # kept when a worker fails: its log is there

    summary = {tool: summarize(rs) for tool, rs in runs.items()}
    ours, theirs = runs["finetune"][0], runs["trl"][0]
    same_draws = [a == b for a, b in zip(ours["generated_sha"], theirs["generated_sha"])]
    identical_prefix = next((i for i, same in enumerate(same_draws) if not same), len(same_draws))
    repeat = {tool: all(r["generated_sha"] == rs[0]["generated_sha"] for r in rs) for tool, rs in runs.items()}
    speedup = summary["trl"]["median_step_s"] / summary["finetune"]["median_step_s"]
    speedup_cpu = summary["trl"]["median_step_cpu_s"] / summary["finetune"]["median_step_cpu_s"]
    # TRL's step over ours at the same step of the same round (neighbours in time): robust to load drifts
    paired = [t / o for ro, rt in zip(runs["finetune"], runs["trl"]) for o, t in zip(ro["step_s"][1:], rt["step_s"][1:])]
    rss_ratio = summary["finetune"]["peak_rss_mib"] / summary["trl"]["peak_rss_mib"]
    met = speedup >= 1.5 and rss_ratio <= 1.0

    print(
        f"\n{'step':>4} {'reward ours':>11} {'reward TRL':>10} {'loss ours':>11} {'loss TRL':>11} {'gnorm ours':>10} {'gnorm TRL':>10} same draws"
    )
    for i in range(args.steps):
        print(
            f"{i + 1:>4} {ours['reward'][i]:>11.4f} {theirs['reward'][i]:>10.4f} {ours['loss'][i]:>11.6f} {theirs['loss'][i]:>11.6f} "
            f"{ours['grad_norm'][i]:>10.4f} {theirs['grad_norm'][i]:>10.4f} {same_draws[i] if i < len(same_draws) else '-'}"
        )
    for tool in ("finetune", "trl"):
        s = summary[tool]
        print(
            f"{tool:>8}: median step {s['median_step_s']:.3f} s (per round {[round(x, 3) for x in s['median_step_s_per_round']]}; "
            f"CPU {s['median_step_cpu_s']:.3f} s), generate {s['median_generate_s']:.3f} s ({100 * s['generate_share']:.0f}% "
            f"of step time), rest {s['median_rest_of_step_s']:.3f} s (loss forward {s['median_loss_forward_s']:.3f}, backward "
            f"{s['median_backward_s']:.3f}, other {s['median_other_s']:.3f}), {s['tokens_per_s']:.1f} completion tok/s, peak RSS {s['peak_rss_mib']:.0f} MiB "
            f"(torch + transformers + peft + accelerate + bitsandbytes {s['rss_base_mib']:.0f}, the tool's imports "
            f"{s['rss_after_imports_mib']:.0f}, at train begin {s['rss_train_begin_mib']:.0f})"
        )
    print(
        f"TRL / finetune step time = {speedup:.2f} (step by step {statistics.median(paired):.2f}; CPU time {speedup_cpu:.2f}; "
        f"target >= 1.5); finetune / TRL peak RSS = {rss_ratio:.2f} (target <= 1.0): "
        f"{'met' if met else 'NOT met'}"
    )

    result = {
        "command": "python benchmarks/grpo_vs_trl.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "machine": {
            "cpu": cpu_name(),
            "cores": os.cpu_count(),
            "threads": args.threads,
            "load_average_1min": [round(load_before[0], 2), round(load_after[0], 2)],
        },
        "versions": versions(),
        "finetune_source": {**git_state(), "imported_from": ours["finetune_from"]},
        "job": {
            "model": "asset:tiny-llama (Llama, 4 layers, hidden 160, vocab 912, tied head)",
            "base": "fp32" if args.quant == "none" else "NF4 + double quant, fp32 compute",
            "compute": "fp32",
            "lora": {"r": args.r, "alpha": args.alpha, "dropout": 0.0, "targets": TARGETS},
            "trainable_params": ours["trainable_params"],
            "prompts": f"first {args.steps * args.batch} of finetune/assets/demo/prompts.jsonl, in file order"
            + (f", each after a line of {args.context_words} words from the whole file's prompts" if args.context_words else ""),
            "max_seq_len": args.max_seq_len,
            "prompts_sha256": prompts_sha256,
            "prompts_per_step": args.batch,
            "num_generations": args.generations,
            "completions_per_step": args.batch * args.generations,
            "trl_per_device_train_batch_size": args.batch * args.generations,
            "max_new_tokens": args.max_new_tokens,
            "temperature": args.temperature,
            "top_p": 1.0,
            "stop": [] if args.no_stop else STOPS,
            "end_ids": {"finetune": ours["end_ids"], "trl": theirs["end_ids"]},
            "reward": "exact_match against the answer column",
            "loss": "grpo, epsilon 0.2, beta 0, one update per sampling",
            "optimizer": f"AdamW lr {args.lr} constant, no warm-up, weight decay 0, clip 1.0",
            "steps": args.steps,
            "rounds": args.rounds,
            "order": orders,
            "trained_adapter_dtype": {"finetune": ours["adapter_dtype"], "trl": theirs["adapter_dtype"]},
        },
        "same_job": {
            "step1": {
                tool: {"reward": r["reward"][0], "loss": r["loss"][0], "grad_norm": r["grad_norm"][0]}
                for tool, r in (("finetune", ours), ("trl", theirs))
            },
            "same_generated_ids_per_step": same_draws,
            "steps_with_identical_draws_from_the_start": identical_prefix,
            "each_tool_repeats_its_draws_across_rounds": repeat,
            "reward": {"finetune": ours["reward"], "trl": theirs["reward"]},
            "reward_std": {"finetune": ours["reward_std"], "trl": theirs["reward_std"]},
            "loss": {"finetune": ours["loss"], "trl": theirs["loss"]},
            "grad_norm": {"finetune": ours["grad_norm"], "trl": theirs["grad_norm"]},
            "completion_tokens": {"finetune": ours["completion_tokens"], "trl": theirs["completion_tokens"]},
        },
        "summary": summary,
        "ratios": {
            "step_time_trl_over_finetune": speedup,
            "median_of_step_by_step_ratios": statistics.median(paired),
            "cpu_time_per_step_trl_over_finetune": speedup_cpu,
            "per_round_step_time_trl_over_finetune": [
                t / f for t, f in zip(summary["trl"]["median_step_s_per_round"], summary["finetune"]["median_step_s_per_round"])
            ],
            "tokens_per_s_finetune_over_trl": summary["finetune"]["tokens_per_s"] / summary["trl"]["tokens_per_s"],
            "peak_rss_finetune_over_trl": rss_ratio,
            "target": "finetune >= 1.5x TRL's speed at no more peak RSS",
            "target_met": met,
        },
        "runs": {tool: [{k: v for k, v in r.items() if k in KEPT} for r in rs] for tool, rs in runs.items()},
    }
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n", encoding="utf-8")
        print(f"wrote {args.json}")
    return result


if __name__ == "__main__":
    main()
