"""DAPO's two sampling-side techniques (Yu et al. 2025), for train.objective=grpo:

    overlong shaping   train.overlong_buffer: B    a completion longer than max_new_tokens - B tokens is penalised,
                       linearly to -1 at max_new_tokens (it ran out of room: its reward says so, softly)
    dynamic sampling   train.dynamic_sampling: N   a group whose rewards are all equal teaches nothing (its advantages
                       are 0): its prompt is sampled again, up to N times, until its rewards differ

DAPO's dynamic sampling draws further prompts from the data to replace such groups; here a group is refilled from
its own prompt, so each step trains the prompts the data order gave it and a resumed run the same ones.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from finetune.objectives.sampling import Completions

Draw = Callable[[list[int], int], tuple[Completions, torch.Tensor, torch.Tensor]]


def overlong_penalty(lengths: torch.Tensor, max_new_tokens: int, buffer: int) -> torch.Tensor:
    """DAPO's soft overlong punishment of completions of `lengths` tokens: 0 up to max_new_tokens - buffer, then
    (max_new_tokens - buffer - length) / buffer, -1 at max_new_tokens (and beyond)."""
    return ((max_new_tokens - buffer - lengths.float()) / buffer).clamp(min=-1.0, max=0.0)


def flat_groups(total: torch.Tensor, group: int) -> list[int]:
    """The groups (in order) whose rewards are all equal: no advantage to learn from."""
    grouped = total.view(-1, group)
    return [g for g in range(grouped.shape[0]) if bool((grouped[g] == grouped[g, 0]).all())]


def refill(
    draw: Draw, done: Completions, each: torch.Tensor, total: torch.Tensor, group: int, tries: int
) -> tuple[Completions, torch.Tensor, torch.Tensor, int]:
    """Each flat group sampled again (draw(groups, attempt) -> their completions, each reward, total) until its
    rewards differ or `tries` attempts are spent; returns the completions and rewards kept, and the redraws made (a
    group drawn again twice counts 2)."""
    tokens, texts, each, total = list(done.tokens), list(done.texts), each.clone(), total.clone()
    redrawn = 0
    for attempt in range(1, tries + 1):
        flat = flat_groups(total, group)
        if not flat:
            break
        again, again_each, again_total = draw(flat, attempt)
        rows = [g * group + j for g in flat for j in range(group)]
        for i, r in enumerate(rows):
            tokens[r], texts[r] = again.tokens[i], again.texts[i]
        each[rows], total[rows] = again_each, again_total
        redrawn += len(flat)
    return Completions(tokens, texts), each, total, redrawn
