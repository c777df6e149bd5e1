"""The prompts of an online objective (data.format=prompt, train.objective=grpo): each record's prompt
rendered (a text as written; messages with the chat template, the assistant's turn opened) and
tokenized, the record kept whole for the rewards. Nothing of a record is trained: the trainer samples
completions of each prompt (objectives/grpo.py). A prompt that leaves no room for train.max_new_tokens
within data.max_seq_len is dropped and counted.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from typing import Any

from finetune.config.schema import RecipeConfig
from finetune.data.dataset import DataBundle, DataStats
from finetune.data.records import load_usable, split_held_out
from finetune.data.sources import eval_spec, source_specs
from finetune.errors import DataError


class PromptSet(Sequence):
    """Tokenized prompts, each {"input_ids", "prompt" (the rendered text), "record"}."""

    unit = "prompts"

    def __init__(self, items: list[dict[str, Any]]):
        self.items = items

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i):
        return self.items[i]

    def lengths(self) -> list[int]:
        return [len(x["input_ids"]) for x in self.items]

    def fingerprint(self) -> str:
        """What a resume compares: the token ids and the records the rewards read."""
        h = hashlib.sha256()
        for x in self.items:
            h.update(json.dumps([x["input_ids"], x["record"]], sort_keys=True, default=str).encode())
        return h.hexdigest()[:16]


def render(prompt: str | list[dict], tokenizer: Any) -> str:
    """A text prompt as written; messages through the chat template, the assistant's turn opened."""
    if isinstance(prompt, str):
        return prompt
    return tokenizer.apply_chat_template(prompt, add_generation_prompt=True, tokenize=False)


def encode_prompts(records: list[dict], cfg: RecipeConfig, tokenizer: Any) -> tuple[PromptSet, DataStats]:
    """Records' prompts rendered and tokenized as training does them (`finetune eval` of a grpo run too)."""
    room = cfg.data.max_seq_len - cfg.train.max_new_tokens
    items, too_long = [], 0
    for rec in records:
        text = render(rec["prompt"], tokenizer)
        ids = tokenizer(text, add_special_tokens=isinstance(rec["prompt"], str))["input_ids"]
        if len(ids) > room:
            too_long += 1
            continue
        items.append({"input_ids": ids, "prompt": text, "record": rec})
    tokens = sum(len(x["input_ids"]) for x in items)
    return PromptSet(items), DataStats(len(items), 0, 0, tokens, 0, too_long=too_long, unit="prompts")


def build_prompts(cfg: RecipeConfig, tokenizer: Any) -> DataBundle:
    """The train (and eval) prompts of a recipe: data.eval_path, or data.eval_fraction of the records."""
    d = cfg.data
    pool: list[dict] = []
    for spec in source_specs(cfg):
        src, keep, _ = load_usable(spec, d.skip_bad_rows)
        pool += [src.records[i] for i in keep]
    ev = eval_spec(cfg)
    if ev is not None:
        src, keep, _ = load_usable(ev, d.skip_bad_rows)
        train_records, eval_records = pool, [src.records[i] for i in keep]
    elif d.eval_fraction > 0:
        train_items, eval_items = split_held_out(cfg, [(0, i) for i in range(len(pool))])
        train_records, eval_records = [pool[i] for _, i in train_items], [pool[i] for _, i in eval_items]
    else:
        train_records, eval_records = pool, []
    train, train_stats = encode_prompts(train_records, cfg, tokenizer)
    if not len(train):
        raise DataError(
            f"data.path: no prompt leaves room for train.max_new_tokens={cfg.train.max_new_tokens} within "
            f"data.max_seq_len={d.max_seq_len} ({train_stats.too_long} too long)",
            hint="raise data.max_seq_len or lower train.max_new_tokens",
        )
    evals, eval_stats = encode_prompts(eval_records, cfg, tokenizer) if eval_records else (None, None)
    return DataBundle(train, evals, train_stats, eval_stats)
