"""The synthetic job of benchmarks/compare.py: pseudo-word records, a byte-level BPE tokenizer
trained on them, a random-init Llama, the FLOP formula, and the files every worker reads.
Nothing here times anything; see compare.py for the job's description."""

from __future__ import annotations

import json
import math
import random
import statistics
from pathlib import Path
from typing import Any

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


def read_jsonl(path: str) -> list[dict[str, Any]]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
