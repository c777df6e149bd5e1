"""Completions sampled from the training model itself (grpo's rollouts, its held-out rewards): prompts
left-padded, a KV cache, the adapter's dropout off, each completion cut after its first end token.

    done = complete(model, prompts, n, tokenizer, ends, train, greedy=False)   # n completions per prompt
    batch = trainable_rows(prompts, done, n, pad_id)       # prompt + completion rows, the completion labelled
"""

from __future__ import annotations

import hashlib
import inspect
from dataclasses import dataclass
from typing import Any

import torch

from finetune.data import IGNORE_INDEX
from finetune.data.templates import end_of_turn_ids


@dataclass
class Completions:
    tokens: list[list[int]]  # each completion up to and including its first end token (what is trained)
    texts: list[str]  # each decoded without its end token (what the rewards read)

    @property
    def lengths(self) -> torch.Tensor:
        return torch.tensor([len(t) for t in self.tokens], dtype=torch.float32)


def end_ids(tokenizer, model) -> list[int]:
    """The tokens that end a completion: EOS and the template's end-of-turn tokens (<|im_end|>, <|eot_id|>, ...),
    and the model's generation config's."""
    found = set(end_of_turn_ids(tokenizer))
    configured = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    found |= set(configured if isinstance(configured, list) else [configured] if configured is not None else [])
    return sorted(found)


def sampling_seed(seed: int, step: int, micro: int, rank: int, attempt: int = 0) -> int:
    """The seed of one micro-batch's sampling: its own for every step, micro-batch and process (ranks draw
    independently; a resumed run draws what the uninterrupted one did, whatever else used the generator), and for
    each further attempt at its flat groups (train.dynamic_sampling)."""
    digest = hashlib.sha256(f"{seed}/{step}/{micro}/{rank}{f'/{attempt}' if attempt else ''}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & (2**63 - 1)


@torch.no_grad()
def complete(
    model,
    prompts: dict[str, Any],
    n: int,
    tokenizer,
    ends: list[int],
    train: Any,
    greedy: bool,
    seed: int | None = None,
    synced: bool = False,
) -> Completions:
    """n completions of every prompt of a prompt batch (Collator: left-padded), in prompt order; seed: drawn from
    a generator of its own seeded so (else the global one); synced: the weights are sharded (FSDP), so every
    process steps the decoder until all are done (a rank that stopped early still gathers with the others)."""
    from transformers import GenerationConfig

    ids = prompts["input_ids"].repeat_interleave(n, dim=0)
    mask = prompts["attention_mask"].repeat_interleave(n, dim=0)
    # Every setting given: transformers fills unset ones from the model's generation_config (a chat model's
    # do_sample, repetition_penalty...), and the completions must come from the policy the loss scores.
    sampling = {"do_sample": not greedy, "temperature": 1.0 if greedy else train.temperature}
    sampling |= {"top_p": 1.0 if greedy else train.top_p, "top_k": 0, "typical_p": 1.0, "repetition_penalty": 1.0}
    stops = list(train.stop)
    config = GenerationConfig(
        max_new_tokens=train.max_new_tokens,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=ends,
        use_cache=True,
        no_repeat_ngram_size=0,
        **sampling,
    )
    was_training = model.training
    model.eval()  # LoRA dropout off while sampling: the completions are the policy's own
    devices = [ids.device.index or 0] if ids.device.type == "cuda" else []
    try:
        with torch.random.fork_rng(devices=devices, enabled=seed is not None):
            if seed is not None:
                torch.manual_seed(seed)
            cache = shared_prefill(model, prompts, n, synced)
            # Stop strings are cut afterwards (cut()): one that leads a completion (a newline) does not end it.
            out = model.generate(
                input_ids=ids, attention_mask=mask, generation_config=config, synced_gpus=synced, past_key_values=cache
            )
    finally:
        model.train(was_training)
    done = [cut(row, ends, stops, tokenizer) for row in out[:, ids.shape[1] :].tolist()]
    return Completions([t for t, _ in done], [text for _, text in done])


def shared_prefill(model, prompts: dict[str, Any], n: int, synced: bool = False) -> Any:
    """Each prompt's KV cache, computed once and repeated for its n completions (TRL prefills each prompt n times):
    every prompt token but the last, at the positions generate gives them (left padding counted out); generate
    then feeds the last token of every row and samples on. The same logits as n separate prefills (fp32: within
    1e-5 on the CPU; tests/test_grpo.py). None (generate prefills every row) where sharing cannot hold (shareable).
    synced (FSDP): every rank decides alike, or one rank's prefill forward would wait for gathers the others skip."""
    from transformers import DynamicCache

    from finetune.model.load import base_of

    base = base_of(model)
    if n < 2 or not shareable(base):  # (the same on every rank: no collective for held-out sampling)
        return None
    width = prompts["input_ids"].shape[1]
    if synced and torch.distributed.is_initialized():  # (the narrowest batch of any rank decides for all)
        least = torch.tensor([width], device=prompts["input_ids"].device)
        torch.distributed.all_reduce(least, op=torch.distributed.ReduceOp.MIN)
        width = int(least)
    if width < 2 or not repeatable_cache(base):
        return None
    cache = DynamicCache(config=base.config)
    mask = prompts["attention_mask"]
    positions = (mask.long().cumsum(-1) - 1).clamp(min=0)  # (pad positions are masked: any value serves)
    model(input_ids=prompts["input_ids"][:, :-1], attention_mask=mask[:, :-1], position_ids=positions[:, :-1],
          past_key_values=cache, use_cache=True, logits_to_keep=1)  # fmt: skip
    cache.batch_repeat_interleave(n)  # rows in generate's order: each prompt's n completions together
    return cache


def repeatable_cache(base) -> bool:
    """Whether every layer's cache holds keys and values (softmax attention): not linear-attention or state-space
    layers (Qwen3-Next, Falcon-H1), whose states neither repeat across rows nor skip the tokens before them."""
    from transformers import DynamicCache

    layers = DynamicCache(config=base.config).layers
    return all(type(layer).__name__ in ("DynamicLayer", "DynamicSlidingWindowLayer") for layer in layers)


def shareable(base) -> bool:
    """Whether generate can take a prefilled cache from this model: a dynamic KV cache, a forward taking position_ids
    and logits_to_keep, no cache class of its generation config's choosing (generate refuses both), and no
    multimodal rope (Qwen2-VL's rope_deltas: generate adds the last call's to a continued cache's positions)."""
    dynamic = getattr(base, "_supports_default_dynamic_cache", lambda: False)()
    takes = set(inspect.signature(base.forward).parameters)
    chosen = getattr(getattr(base, "generation_config", None), "cache_implementation", None) not in (None, "hybrid")
    rope_deltas = any(hasattr(m, "rope_deltas") for m in (base, getattr(base, "model", None)) if m is not None)
    return dynamic and {"position_ids", "logits_to_keep"} <= takes and not chosen and not rope_deltas


def cut(row: list[int], ends: list[int], stops: list[str], tokenizer) -> tuple[list[int], str]:
    """(the tokens trained: up to and including the first end token, or the token that reaches the first stop
    string after the completion's leading whitespace; the text the rewards read: before either)."""
    end = next((i + 1 for i, t in enumerate(row) if t in ends), len(row))
    body = row[: end - 1] if row[end - 1] in ends else row[:end]
    text = tokenizer.decode(body, skip_special_tokens=True)
    begun = len(text) - len(text.lstrip())  # a stop string ends a completion once it has begun (not a leading newline)
    hit = min((i for i in (text.find(s, begun) for s in stops) if i >= 0), default=-1)
    if hit < 0:
        return row[:end], text
    # The first token whose text reaches past the stop string's start ends the completion.
    n = next(i for i in range(1, len(body) + 1) if len(tokenizer.decode(body[:i], skip_special_tokens=True)) > hit)
    return row[:n], text[:hit]


def trainable_rows(prompts: dict[str, Any], done: Completions, n: int, pad_id: int) -> dict[str, torch.Tensor]:
    """Each prompt (its padding removed) followed by each of its n completions, right-padded; only the
    completion tokens labelled (the prompt and the padding never trained)."""
    rows = []
    for i, completion in enumerate(done.tokens):
        p = i // n
        prompt = prompts["input_ids"][p][prompts["attention_mask"][p].bool()].tolist()
        rows.append((prompt, completion))
    width = max(len(p) + len(c) for p, c in rows)
    device = prompts["input_ids"].device
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    labels = torch.full_like(ids, IGNORE_INDEX)
    mask = torch.zeros_like(ids)
    for r, (prompt, completion) in enumerate(rows):
        whole = prompt + completion
        ids[r, : len(whole)] = torch.tensor(whole)
        labels[r, len(prompt) : len(whole)] = torch.tensor(completion)
        mask[r, : len(whole)] = 1
    return {"input_ids": ids.to(device), "labels": labels.to(device), "attention_mask": mask.to(device)}
