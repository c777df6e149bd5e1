"""Peer (a) of benchmarks/compare.py: finetune, through its Trainer API with a recipe dict,
hooked to count its batches and pause between optimizer steps; and the per-example attention
prototype its `segment_attention` lever registers."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from compare_job import LORA, LR, SEED
from compare_measure import Lockstep, max_rss

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


def run_finetune(spec: dict[str, Any], lock: Lockstep) -> dict[str, Any]:
    """(a) finetune: its Trainer API with a recipe dict."""
    from finetune.config.schema import build_recipe
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
