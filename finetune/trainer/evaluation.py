"""Evaluation during a run: the held-out loss (every process, FSDP in step) and the exact-match records."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from finetune.config import RecipeConfig, resolve_path
from finetune.data import Collator, load_records
from finetune.trainer.parallel import Parallel


@torch.no_grad()
def held_out_loss(
    model,
    examples: Sequence[dict] | None,
    cfg: RecipeConfig,
    collate: Collator,
    parallel: Parallel,
    compute_loss: Callable,
) -> float | None:
    """Mean loss per target token over `examples`, split over the processes; None without examples.

    `model` is the unwrapped model: a DDP forward joins collectives (buffer broadcast), and a
    process with fewer eval batches than the others would leave them waiting.
    """
    if not examples:
        return None
    bs = cfg.eval.batch_size or cfg.train.batch_size
    batches = [examples[i : i + bs] for i in range(0, len(examples), bs)]
    if cfg.eval.max_batches:
        batches = batches[: cfg.eval.max_batches]
    model.eval()
    total = count = 0.0
    mine = batches[parallel.rank :: parallel.world]
    for r in range(parallel.eval_rounds(len(batches), len(mine))):
        rows = mine[r] if r < len(mine) else batches[0]
        batch = {k: v.to(parallel.device) for k, v in collate(list(rows)).items()}
        loss, n = compute_loss(model, batch)
        if r < len(mine):
            total += float(loss)
            count += n
    model.train()
    total, count = parallel.global_sum(total), parallel.global_sum(count)
    return total / count if count else None


def exact_match_records(cfg: RecipeConfig) -> list[dict] | None:
    """eval.exact_match_path's records (the first eval.exact_match_limit), or None."""
    path = cfg.eval.exact_match_path
    if not path:
        return None
    records = load_records(resolve_path(path), cfg.data, key="eval.exact_match_path")
    return records[: cfg.eval.exact_match_limit] if cfg.eval.exact_match_limit else records
