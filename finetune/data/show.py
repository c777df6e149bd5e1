"""`finetune data RECIPE`: a few examples with trained tokens marked, and what the dataset looks like.

Trained tokens are green on a terminal and wrapped in [[ ]] otherwise (logs, pipes);
masked tokens are dimmed on a terminal and left as they are otherwise:
    <s>Q: 2+2=[[4</s>]]
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

import numpy as np

from finetune.data.dataset import DataBundle, DataStats
from finetune.data.tokenize import IGNORE_INDEX

_GREEN, _DIM, _RESET = "\x1b[32;1m", "\x1b[2m", "\x1b[0m"


def marked_text(tokenizer: Any, input_ids: Sequence[int], labels: Sequence[int], color: bool) -> str:
    """The example's text, trained runs marked. Each run is decoded whole, so multi-byte characters survive."""
    out: list[str] = []
    start = 0
    for end in range(1, len(input_ids) + 1):
        if end < len(input_ids) and (labels[end] != IGNORE_INDEX) == (labels[start] != IGNORE_INDEX):
            continue
        text = _runs_folded(tokenizer.decode(list(input_ids[start:end]), skip_special_tokens=False))
        trained = labels[start] != IGNORE_INDEX
        if color:
            out.append(f"{_GREEN if trained else _DIM}{text}{_RESET}")
        else:
            out.append(f"[[{text}]]" if trained else text)
        start = end
    return "".join(out)


def _runs_folded(text: str) -> str:
    """A special token repeated 4+ times (an image's tokens: hundreds for Qwen2-VL) shown once with its count."""
    return re.sub(r"(<[^<>\s]{1,40}>)\1{3,}", lambda m: f"{m.group(1)}x{len(m.group(0)) // len(m.group(1))}", text)


def length_histogram(lengths: np.ndarray, max_len: int, bins: int = 8, width: int = 40) -> list[str]:
    """Rows of 'lo-hi  count  ####' over [0, max_len]."""
    if len(lengths) == 0:
        return []
    edges = np.linspace(0, max_len, bins + 1).astype(int)
    counts, _ = np.histogram(np.minimum(lengths, max_len), bins=edges)
    top = max(int(counts.max()), 1)
    return [
        f"  {lo:>6}-{hi:<6} {c:>8,}  {'#' * max(1 if c else 0, round(width * c / top))}"
        for lo, hi, c in zip(edges[:-1], edges[1:], counts)
    ]


def describe(stats: DataStats, lengths: np.ndarray, max_len: int, name: str) -> list[str]:
    lines = [f"{name}: {stats.summary()}"]
    if len(lengths):
        lines.append(
            f"  example length: min {int(lengths.min())}, median {int(np.median(lengths))}, "
            f"p95 {int(np.percentile(lengths, 95))}, max {int(lengths.max())} (data.max_seq_len {max_len})"
        )
        lines += length_histogram(lengths, max_len)
    return lines + [f"  warning: {w}" for w in stats.warnings]


def report(bundle: DataBundle, tokenizer: Any, max_len: int, examples: int = 3, color: bool = False) -> str:
    """What `finetune data` prints: statistics of train and eval data, then the first examples marked."""
    lines = [f"tokenized data {'read from the cache' if bundle.from_cache else 'built'}"]
    lines += describe(bundle.train_stats, _example_lengths(bundle.train), max_len, "train")
    if bundle.eval is not None and bundle.eval_stats is not None:
        lines += describe(bundle.eval_stats, _example_lengths(bundle.eval), max_len, "eval")
    legend = "trained tokens in green, masked dimmed" if color else "trained tokens in [[ ]]"
    lines.append(f"first {min(examples, len(bundle.train))} train {'rows' if _packed(bundle.train) else 'examples'} ({legend}):")
    for i in range(min(examples, len(bundle.train))):
        ex = bundle.train[i]
        n = len(ex["input_ids"])
        if "record" in ex:  # a prompt (data.format=prompt): nothing of it is trained; its columns reach the rewards
            columns = {k: v for k, v in ex["record"].items() if k != "prompt"}
            lines.append(f"--- {i}: {n} tokens (a prompt: its sampled completions are trained); other columns {columns}")
            lines.append(tokenizer.decode(ex["input_ids"], skip_special_tokens=False))
            continue
        trained = sum(1 for t in ex["labels"] if t != IGNORE_INDEX)
        lines.append(f"--- {i}: {n} tokens, {trained} trained")
        lines.append(marked_text(tokenizer, ex["input_ids"], ex["labels"], color))
    return "\n".join(lines)


def _packed(data: Sequence[dict]) -> bool:
    return bool(getattr(data, "packed", False))


def _example_lengths(data: Sequence[dict]) -> np.ndarray:
    if hasattr(data, "example_lengths"):
        return data.example_lengths()
    return np.array([len(ex["input_ids"]) for ex in data])
