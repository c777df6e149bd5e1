"""The training objective: summed next-token cross-entropy over target tokens, and their count.

A loss function takes (model, batch) and returns (summed loss, number of target tokens);
the trainer divides by the target tokens of the whole accumulation window on every
process, so pass your own `loss_fn` in the same form (see Trainer).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from finetune.data import IGNORE_INDEX
from finetune.evaluate import loss_sum_and_count, shifted_targets


def count_targets(batch: dict[str, torch.Tensor]) -> int:
    return int((shifted_targets(batch["labels"]) != IGNORE_INDEX).sum())


def model_inputs(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """What the model is called with. Packed rows carry position_ids and no attention_mask: the
    model then keeps each packed example's attention to itself (finetune.data.dataset.Collator),
    but only without a KV cache (use_cache=False), which transformers would otherwise take as a
    sign of generation and ignore the packing."""
    return {k: batch[k] for k in ("input_ids", "attention_mask", "position_ids") if k in batch}


class CausalLMLoss:
    """Cross-entropy of the next token where a label is set.

    head_on_targets_only: run the LM head only where a target is predicted (a boolean
    logits_to_keep gives flat (n_targets, vocab) logits), so masked prompt positions cost
    no head matmul and no logits memory, which for a 150k vocabulary is most of the
    activation peak. Turned off for good by the first model that ignores or rejects it.
    """

    def __init__(self, head_on_targets_only: bool = True):
        self.head_on_targets_only = head_on_targets_only

    def __call__(self, model, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, int]:
        inputs, labels = model_inputs(batch), batch["labels"]
        if self.head_on_targets_only:
            keep = torch.zeros_like(labels, dtype=torch.bool)
            keep[:, :-1] = shifted_targets(labels) != IGNORE_INDEX
            try:
                out = model(**inputs, use_cache=False, logits_to_keep=keep)
            except (TypeError, IndexError):
                # TypeError: no such argument. IndexError: a model (or a transformers release
                # before the boolean form, e.g. 5.17) that slices hidden_states[:, keep, :].
                # A real indexing bug raises again on the full path below.
                out = None
            if out is not None and out.logits.dim() == 2:
                n = int(keep.sum())
                if n == 0:
                    return out.logits.sum() * 0.0, 0
                return F.cross_entropy(out.logits.float(), labels[:, 1:][keep[:, :-1]], reduction="sum"), n
            self.head_on_targets_only = False  # this model ignores or rejects it: full logits from now on
            if out is not None:
                return loss_sum_and_count(out.logits, labels)
        out = model(**inputs, use_cache=False)
        return loss_sum_and_count(out.logits, labels)
