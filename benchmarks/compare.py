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
`example_flops`:
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
import math
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]

# ----------------------------------------------------------------------------- the job

DIMS = {"vocab": 4096, "hidden": 512, "layers": 8, "heads": 8, "intermediate": 1376}
LORA = {"r": 16, "alpha": 32, "dropout": 0.05}
MAX_SEQ_LEN = 512
LR = 1e-3  # LoRA on a random-init model moves slowly at 2e-4; the same for every tool
SEED = 0
SPECIALS = ["<pad>", "<s>", "</s>", "<unk>"]
PAD_ID, BOS_ID, EOS_ID, UNK_ID = range(4)

SYLLABLES = "ka lo mi ne ru sa to vi ba de fo gu hi jo ku le ma no pi qua re si tu we xa yo zu an el or".split()
TASKS = ["Repeat the words", "Reverse the words", "Sort the words", "Repeat every second word", "Echo the list"]


def lexicon(n: int = 1500, seed: int = SEED) -> list[str]:
    """n distinct pseudo-words of 1-4 syllables (BPE turns frequent ones into single tokens)."""
    rng = random.Random(seed)
    words: set[str] = set()
    while len(words) < n:
        words.add("".join(rng.choice(SYLLABLES) for _ in range(rng.choice([1, 2, 2, 3, 3, 4]))))
    return sorted(words)


def make_records(n: int, seed: int = SEED, median_words: float = 80.0, sigma: float = 0.9) -> list[dict[str, str]]:
    """Prompt/completion records: an instruction over a short word list, and a response of
    lognormal length (median `median_words` words) that follows from the list, so the
    loss can fall. Word frequencies are Zipfian, as in text."""
    rng = random.Random(seed)
    words = lexicon(seed=seed)
    weights = [1.0 / (i + 1) for i in range(len(words))]
    rows = []
    for _ in range(n):
        task = rng.randrange(len(TASKS))
        items = rng.choices(words, weights, k=rng.randint(3, 30))
        length = max(1, int(rng.lognormvariate(math.log(median_words), sigma)))
        if task == 1:
            base = items[::-1]
        elif task == 2:
            base = sorted(items)
        elif task == 3:
            base = items[::2]
        else:
            base = items
        reply = [base[i % len(base)] for i in range(length)]
        rows.append({"prompt": f"{TASKS[task]}: {' '.join(items)}\nAnswer:", "completion": " " + " ".join(reply)})
    return rows


def make_long_records(n: int, words: int, seed: int = SEED + 1) -> list[dict[str, str]]:
    """Records of a fixed, long length (the memory comparison)."""
    rng = random.Random(seed)
    lex = lexicon(seed=SEED)
    out = []
    for _ in range(n):
        items = rng.choices(lex, k=12)
        out.append(
            {
                "prompt": f"{TASKS[0]}: {' '.join(items)}\nAnswer:",
                "completion": " " + " ".join(items[i % 12] for i in range(words)),
            }
        )
    return out


def build_tokenizer(texts: list[str], out_dir: Path, vocab: int = DIMS["vocab"]):
    """Byte-level BPE trained on the generated text; adds <s> in front like Llama's tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab, special_tokens=SPECIALS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False
    )
    tok.train_from_iterator(texts, trainer)
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A $B", special_tokens=[("<s>", BOS_ID)])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>", unk_token="<unk>")
    fast.model_max_length = 4096
    fast.save_pretrained(out_dir)
    return fast


def build_model(out_dir: Path, seed: int = SEED) -> int:
    """Random-init Llama of DIMS, saved fp32. Returns its parameter count."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=DIMS["vocab"],
        hidden_size=DIMS["hidden"],
        intermediate_size=DIMS["intermediate"],
        num_hidden_layers=DIMS["layers"],
        num_attention_heads=DIMS["heads"],
        num_key_value_heads=DIMS["heads"],
        max_position_embeddings=2048,
        bos_token_id=BOS_ID,
        eos_token_id=EOS_ID,
        pad_token_id=PAD_ID,
        tie_word_embeddings=False,
        initializer_range=0.02,
        use_cache=False,
    )
    model = LlamaForCausalLM(cfg).to(torch.float32)
    model.save_pretrained(out_dir)
    return sum(p.numel() for p in model.parameters())


def parameter_counts(dims: dict[str, int] = DIMS, r: int = LORA["r"]) -> dict[str, int]:
    """Matmul parameters of the decoder linears, the LM head, and LoRA (all linears, rank r)."""
    d, i, L, v = dims["hidden"], dims["intermediate"], dims["layers"], dims["vocab"]
    shapes = [(d, d)] * 4 + [(d, i), (d, i), (i, d)]  # q k v o, gate up, down (in, out)
    base = L * sum(a * b for a, b in shapes)
    lora = L * sum(r * (a + b) for a, b in shapes)
    return {"base_linear": base, "lm_head": d * v, "embedding": d * v, "lora": lora, "total": base + 2 * d * v + L * 2 * d + d}


def example_flops(length: int, trained: int, dims: dict[str, int] = DIMS, r: int = LORA["r"]) -> float:
    """Model FLOPs of one training pass (forward + backward) over one example; see the module docstring."""
    n = parameter_counts(dims, r)
    d, L, v = dims["hidden"], dims["layers"], dims["vocab"]
    return (4 * n["base_linear"] + 6 * n["lora"]) * length + 4 * d * v * trained + 12 * L * d * length**2


def prepare(workdir: Path, n_examples: int, n_eval: int = 48) -> dict[str, Any]:
    """Data, tokenizer and model in workdir (reused when already there with the same settings)."""
    stamp = {"n": n_examples, "n_eval": n_eval, "dims": DIMS, "seed": SEED, "version": 3}
    meta_path = workdir / "prepared.json"
    if meta_path.exists() and json.loads(meta_path.read_text()).get("stamp") == stamp:
        return json.loads(meta_path.read_text())
    workdir.mkdir(parents=True, exist_ok=True)
    rows = make_records(n_examples + n_eval)
    train, held = rows[:n_examples], rows[n_examples:]
    for name, part in (("train.jsonl", train), ("eval.jsonl", held)):
        (workdir / name).write_text("".join(json.dumps(r) + "\n" for r in part))
    long_rows = make_long_records(16, 1900)
    (workdir / "long.jsonl").write_text("".join(json.dumps(r) + "\n" for r in long_rows))
    tok = build_tokenizer([r["prompt"] + r["completion"] for r in rows], workdir / "model")
    n_params = build_model(workdir / "model")
    lengths = [len(tok(r["prompt"] + r["completion"])["input_ids"]) + 1 for r in train]
    long_len = [len(tok(r["prompt"] + r["completion"])["input_ids"]) + 1 for r in long_rows]
    meta = {
        "stamp": stamp,
        "model": str(workdir / "model"),
        "train": str(workdir / "train.jsonl"),
        "eval": str(workdir / "eval.jsonl"),
        "long": str(workdir / "long.jsonl"),
        "parameters": n_params,
        "lengths": length_summary(lengths, MAX_SEQ_LEN),
        "long_lengths": length_summary(long_len, 2048),
    }
    meta_path.write_text(json.dumps(meta, indent=1))
    return meta


def length_summary(lengths: list[int], cap: int) -> dict[str, float]:
    from finetune.data.packing import pack_rows

    clipped = [min(n, cap) for n in lengths]
    rows = pack_rows(clipped, cap)
    s = sorted(clipped)
    return {
        "examples": len(s),
        "mean": round(statistics.mean(s), 1),
        "median": s[len(s) // 2],
        "p90": s[int(0.9 * len(s))],
        "max": s[-1],
        "truncated": sum(n > cap for n in lengths),
        "examples_per_packed_row": round(len(s) / len(rows), 2),
    }


# ----------------------------------------------------------------------------- batch accounting


def batch_segments(batch: dict[str, Any], pad_id: int = PAD_ID) -> list[tuple[int, int]]:
    """(tokens, trained tokens) of every example in a collated batch, whatever its layout:
    padded rows with attention_mask; packed rows with position_ids (finetune pads a row's
    end with a segment of its own whose first token is the pad id and that trains nothing);
    padding-free flattened rows (TRL)."""
    ids, labels = batch["input_ids"], batch["labels"]
    targets = (labels[:, 1:] != -100).long()
    trained_at = [[0] + row for row in targets.tolist()]  # trained[t]: the label at t is trained (t >= 1)
    out = []
    if "position_ids" in batch and batch["position_ids"] is not None:
        pos = batch["position_ids"].tolist()
        ids_l = ids.tolist()
        for r, row in enumerate(pos):
            starts = [t for t, p in enumerate(row) if p == 0] + [len(row)]
            for a, b in zip(starts, starts[1:]):
                n_trained = sum(trained_at[r][a + 1 : b])  # a segment's first label never counts (shifted away)
                if ids_l[r][a] == pad_id and n_trained == 0:
                    continue  # padding segment
                out.append((b - a, n_trained))
        return out
    mask = batch.get("attention_mask")
    lengths = mask.sum(1).tolist() if mask is not None else [ids.shape[1]] * ids.shape[0]
    for r, n in enumerate(lengths):
        out.append((int(n), sum(trained_at[r][1:n])))
    return out


class StepStats:
    """Accumulates what the micro-batches of one optimizer step held."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.tokens = self.trained = self.examples = self.padded = 0
        self.flops = 0.0

    def add(self, batch: dict[str, Any]) -> None:
        segs = batch_segments(batch)
        self.tokens += sum(s for s, _ in segs)
        self.trained += sum(t for _, t in segs)
        self.examples += len(segs)
        self.padded += int(batch["input_ids"].numel())
        self.flops += sum(example_flops(s, t) for s, t in segs)

    def as_dict(self) -> dict[str, float]:
        return {
            "tokens": self.tokens,
            "trained": self.trained,
            "examples": self.examples,
            "padded": self.padded,
            "flops": self.flops,
        }


# ----------------------------------------------------------------------------- peak matmul rate


def matmul_peak_gflops(n: int = 2048, reps: int = 3) -> float:
    """Best-of-reps single-thread fp32 torch.mm rate (FLOP/s / 1e9)."""
    import torch

    torch.set_num_threads(1)
    a, b = torch.randn(n, n), torch.randn(n, n)
    torch.mm(a, b)
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        torch.mm(a, b)
        best = min(best, time.perf_counter() - t0)
    return 2 * n**3 / best / 1e9


# ----------------------------------------------------------------------------- a lever that needs code: per-example attention

SEGMENT_SDPA = "sdpa_segments"


def segment_sdpa(
    module, query, key, value, attention_mask, dropout=0.0, scaling=None, is_causal=None, position_ids=None, **kwargs
):
    """Attention computed example by example inside packed rows (a prototype, registered by the
    benchmark only). transformers' sdpa path gives a packed row a block-diagonal mask over the whole
    row, so the CPU kernel computes all T^2 scores and cannot skip masked blocks; here each example
    (a run of position_ids starting at 0) gets a causal sdpa call of its own: sum(s^2)/2 scores
    instead of T^2. Right-padded rows without position_ids are one segment each (padding sits after
    every real token, so a causal mask alone is exact for the real tokens). Not for generation
    (no KV cache, no left padding). query/key/value: (batch, heads, T, head_dim)."""
    import torch
    import torch.nn.functional as F

    if key.shape[1] != query.shape[1]:  # grouped-query attention: expand the KV heads
        rep = query.shape[1] // key.shape[1]
        key, value = key.repeat_interleave(rep, dim=1), value.repeat_interleave(rep, dim=1)
    T = query.shape[2]
    rows = []
    for b in range(query.shape[0]):
        if position_ids is None:
            starts = [0]
        else:
            starts = (position_ids[min(b, position_ids.shape[0] - 1)] == 0).nonzero().flatten().tolist() or [0]
        bounds = starts + [T]
        parts = [
            F.scaled_dot_product_attention(
                query[b : b + 1, :, a:e],
                key[b : b + 1, :, a:e],
                value[b : b + 1, :, a:e],
                is_causal=True,
                scale=scaling,
                dropout_p=dropout if module.training else 0.0,
            )
            for a, e in zip(bounds, bounds[1:])
            if e > a
        ]
        rows.append(parts[0] if len(parts) == 1 else torch.cat(parts, dim=2))
    out = rows[0] if len(rows) == 1 else torch.cat(rows, dim=0)
    return out.transpose(1, 2).contiguous(), None


def register_segment_sdpa() -> str:
    from transformers import AttentionInterface

    AttentionInterface.register(SEGMENT_SDPA, segment_sdpa)  # no mask function: the model then builds no mask
    return SEGMENT_SDPA


# ----------------------------------------------------------------------------- worker side


def current_rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def max_rss() -> int:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux


class Lockstep:
    """The worker's end of the lockstep protocol: pause() reports the span that just ended
    and blocks until the parent says go (or finish: then it never pauses again)."""

    def __init__(self) -> None:
        self.cmd = os.fdopen(int(os.environ["BENCH_CMD_FD"]), "r")
        self.rep = os.fdopen(int(os.environ["BENCH_REP_FD"]), "w")
        self.span = StepStats()
        self.total = StepStats()
        self.t0: float | None = None
        self.free = False
        self.loaded: dict[str, int] = {}
        self.step_examples: list[int] = []  # examples in every optimizer step, warm-up and last included
        self._examples = 0

    def send(self, obj: dict[str, Any]) -> None:
        self.rep.write(json.dumps(obj) + "\n")
        self.rep.flush()

    def mark_loaded(self) -> None:
        """Model and data ready, before the first step."""
        self.loaded = {"rss_loaded": current_rss(), "maxrss_loaded": max_rss()}

    def record(self, batch: dict[str, Any]) -> None:
        before = self.total.examples
        self.span.add(batch)
        self.total.add(batch)
        self._examples += self.total.examples - before

    def end_step(self) -> None:
        self.step_examples.append(self._examples)
        self._examples = 0

    def pause(self) -> None:
        if self.free:
            return
        now = time.perf_counter()
        if self.t0 is None:
            self.send({"event": "ready", **self.loaded, "rss_warm": current_rss()})
        else:
            self.send({"event": "span", "dt": now - self.t0, **self.span.as_dict()})
        self.span.reset()
        msg = json.loads(self.cmd.readline() or '{"cmd": "finish"}')
        self.free = msg["cmd"] == "finish"
        self.t0 = time.perf_counter()


def encode_eval(records: list[dict[str, str]], tok, max_len: int) -> list[tuple[list[int], list[int]]]:
    out = []
    for r in records:
        p = tok(r["prompt"])["input_ids"]
        ids = (tok(r["prompt"] + r["completion"])["input_ids"] + [tok.eos_token_id])[:max_len]
        labels = ([-100] * len(p) + ids[len(p) :])[: len(ids)]
        out.append((ids, labels))
    return out


def eval_loss(model, examples: list[tuple[list[int], list[int]]], batch: int = 8) -> float:
    """Token-mean cross-entropy over the completion tokens of held-out examples, full logits,
    padded batches: the same function for every tool."""
    import torch
    import torch.nn.functional as F

    model.eval()
    total, count = 0.0, 0
    with torch.no_grad():
        for i in range(0, len(examples), batch):
            chunk = examples[i : i + batch]
            width = max(len(ids) for ids, _ in chunk)
            ids = torch.full((len(chunk), width), PAD_ID)
            labels = torch.full((len(chunk), width), -100)
            mask = torch.zeros((len(chunk), width), dtype=torch.long)
            for r, (x, y) in enumerate(chunk):
                ids[r, : len(x)], labels[r, : len(y)], mask[r, : len(x)] = torch.tensor(x), torch.tensor(y), 1
            logits = model(input_ids=ids, attention_mask=mask, use_cache=False).logits[:, :-1]
            tgt = labels[:, 1:]
            keep = tgt != -100
            total += float(F.cross_entropy(logits[keep].float(), tgt[keep], reduction="sum"))
            count += int(keep.sum())
    return total / count


def read_jsonl(path: str) -> list[dict[str, Any]]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def bnb_config():
    import torch
    from transformers import BitsAndBytesConfig

    return BitsAndBytesConfig(
        load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True, bnb_4bit_compute_dtype=torch.float32
    )


def peft_lora_config():
    from peft import LoraConfig

    return LoraConfig(
        r=LORA["r"],
        lora_alpha=LORA["alpha"],
        lora_dropout=LORA["dropout"],
        target_modules="all-linear",
        bias="none",
        task_type="CAUSAL_LM",
    )


def run_finetune(spec: dict[str, Any], lock: Lockstep) -> dict[str, Any]:
    """(a) finetune: its Trainer API with a recipe dict."""
    from finetune.config import build_recipe
    from finetune.trainer import Trainer, loss_sum_and_count

    out = Path(spec["out"])
    recipe = {
        "model": {"path": spec["model"], "attn_implementation": "sdpa"},
        "data": {
            "path": spec["train"],
            "format": "completion",
            "max_seq_len": spec["max_seq_len"],
            "packing": spec.get("packing", False),
            "group_by_length": spec.get("grouping", False),
            "cache": False,  # every worker tokenizes, like the peers (and no shared-cache races)
        },
        "output_dir": str(out),
        "overwrite": True,
        "seed": SEED,
        "precision": "fp32",
        "quant": {"bits": 4 if spec["quant"] else None},
        "lora": {"r": LORA["r"], "alpha": LORA["alpha"], "dropout": LORA["dropout"], "target": "all-linear"},
        "train": {
            "max_steps": spec["steps"],
            "batch_size": spec["micro"],
            "grad_accum": spec["accum"],
            "lr": LR,
            "weight_decay": 0.0,
            "warmup_steps": 0,
            "scheduler": "constant",
            "max_grad_norm": 1.0,
            "log_every_steps": 1,
        },
        "memory": {"activation_checkpointing": "all" if spec["gc"] else "none"},
        "checkpoint": {"every_steps": None},
    }
    full_head = spec.get("head") == "full"

    class Bench(Trainer):
        def setup(self):
            super().setup()
            base = self.accelerator.unwrap_model(self.model).get_base_model()
            if spec.get("attention") == "segments":
                base.set_attn_implementation(register_segment_sdpa())
            if spec.get("compile"):
                for layer in base.model.layers:  # the decoder layers only: the LM head gathers a data-dependent shape
                    layer.compile()
            lock.mark_loaded()

        def step_batches(self, step):
            batches = super().step_batches(step)
            for b in batches:
                lock.record(b)
            lock.end_step()
            return batches

        def accumulate_gradients(self, step):
            if step >= 1:
                lock.pause()
            return super().accumulate_gradients(step)

        def compute_loss(self, model, batch):
            if not full_head:
                return super().compute_loss(model, batch)
            # The plain way: logits at every position, then the loss at the targets.
            inputs = {k: batch[k] for k in ("input_ids", "attention_mask", "position_ids") if k in batch}
            return loss_sum_and_count(model(**inputs, use_cache=False).logits, batch["labels"])

    trainer = Bench(build_recipe(recipe), progress=False)
    trainer.train()
    peak = max_rss()
    losses = [r["loss"] for r in (json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()) if "loss" in r]
    model = trainer.accelerator.unwrap_model(trainer.model)
    return {"maxrss_train": peak, "losses": losses, "model": model, "tokenizer": trainer.tokenizer}


def _hf_args(cls, spec: dict[str, Any], **extra):
    return cls(
        output_dir=spec["out"],
        per_device_train_batch_size=spec["micro"],
        gradient_accumulation_steps=spec["accum"],
        learning_rate=LR,
        weight_decay=0.0,
        lr_scheduler_type="constant",
        warmup_steps=0,
        max_grad_norm=1.0,
        max_steps=spec["steps"],
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        bf16=False,
        fp16=False,
        use_cpu=True,
        seed=SEED,
        disable_tqdm=True,
        gradient_checkpointing=spec["gc"],
        **extra,
    )


def _hooked(cls, lock: Lockstep):
    from transformers import TrainerCallback

    class Pause(TrainerCallback):
        def on_train_begin(self, args, state, control, **kw):
            lock.mark_loaded()

        def on_step_end(self, args, state, control, **kw):
            lock.end_step()
            lock.pause()

    class Hooked(cls):
        def training_step(self, model, inputs, *args, **kwargs):
            lock.record(inputs)
            return super().training_step(model, inputs, *args, **kwargs)

    return Hooked, Pause()


def load_base(spec: dict[str, Any]):
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(
        spec["model"], dtype=torch.float32, quantization_config=bnb_config() if spec["quant"] else None, device_map={"": "cpu"}
    )


def run_trl(spec: dict[str, Any], lock: Lockstep) -> dict[str, Any]:
    """(b) TRL SFTTrainer + peft_config, prompt/completion data (completion-only loss is
    TRL's default for that format), packing as in spec (TRL's default strategy: bfd,
    which turns on padding-free batches), TRL's defaults otherwise."""
    import torch
    from datasets import Dataset
    from transformers import AutoTokenizer
    from trl import SFTConfig, SFTTrainer

    tok = AutoTokenizer.from_pretrained(spec["model"])
    records = read_jsonl(spec["train"])
    Hooked, pause = _hooked(SFTTrainer, lock)
    args = _hf_args(SFTConfig, spec, max_length=spec["max_seq_len"], packing=spec.get("packing", False))
    trainer = Hooked(
        model=load_base(spec),
        args=args,
        train_dataset=Dataset.from_list(records),
        processing_class=tok,
        peft_config=peft_lora_config(),
        callbacks=[pause],
    )
    if spec["quant"]:
        # TRL casts QLoRA adapters to bf16 (the QLoRA paper's setting). Every tool here trains
        # in fp32 (this CPU has no native bf16: its bf16 matmuls are emulated, ~100x slower),
        # so the adapters go back to fp32 before the optimizer is built.
        for p in trainer.model.parameters():
            if p.requires_grad:
                p.data = p.data.to(torch.float32)
    trainer.train()
    peak = max_rss()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    return {"maxrss_train": peak, "losses": losses, "model": trainer.model, "tokenizer": tok}


def run_hf(spec: dict[str, Any], lock: Lockstep) -> dict[str, Any]:
    """(c) what a user writes with transformers + peft: tokenize prompt + completion + EOS,
    labels -100 on the prompt, DataCollatorForSeq2Seq, Trainer with its defaults."""
    from datasets import Dataset
    from peft import get_peft_model, prepare_model_for_kbit_training
    from transformers import AutoTokenizer, DataCollatorForSeq2Seq, Trainer, TrainingArguments

    tok = AutoTokenizer.from_pretrained(spec["model"])
    msl = spec["max_seq_len"]

    def tokenize(r):
        prompt = tok(r["prompt"])["input_ids"]
        ids = (tok(r["prompt"] + r["completion"])["input_ids"] + [tok.eos_token_id])[:msl]
        return {
            "input_ids": ids,
            "attention_mask": [1] * len(ids),
            "labels": ([-100] * len(prompt) + ids[len(prompt) :])[: len(ids)],
        }

    ds = Dataset.from_list(read_jsonl(spec["train"])).map(tokenize, remove_columns=["prompt", "completion"])
    model = load_base(spec)
    if spec["quant"]:
        model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=spec["gc"])
    model = get_peft_model(model, peft_lora_config())
    Hooked, pause = _hooked(Trainer, lock)
    extra = {"train_sampling_strategy": "group_by_length"} if spec.get("grouping") else {}
    trainer = Hooked(
        model=model,
        args=_hf_args(TrainingArguments, spec, **extra),
        train_dataset=ds,
        data_collator=DataCollatorForSeq2Seq(tok, padding=True, label_pad_token_id=-100),
        callbacks=[pause],
    )
    trainer.train()
    peak = max_rss()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    return {"maxrss_train": peak, "losses": losses, "model": trainer.model, "tokenizer": tok}


TOOLS = {"finetune": run_finetune, "trl": run_trl, "hf": run_hf}


def worker_main(spec: dict[str, Any]) -> None:
    import torch

    torch.set_num_threads(1)
    lock = Lockstep()
    try:
        result = TOOLS[spec["tool"]](spec, lock)
        lock.free = True
        model, tok = result.pop("model"), result.pop("tokenizer")
        held = encode_eval(read_jsonl(spec["eval"]), tok, spec["max_seq_len"]) if spec.get("eval") else []
        result["eval_loss"] = eval_loss(model, held) if held else None
        result["total"] = lock.total.as_dict()
        result["step_examples"] = lock.step_examples
        result["threads"] = torch.get_num_threads()
        lock.send({"event": "done", **lock.loaded, **result})
    except BaseException as exc:  # the parent prints it with the log tail
        import traceback

        lock.send({"event": "error", "error": f"{type(exc).__name__}: {exc}", "trace": traceback.format_exc()[-3000:]})
        raise


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
