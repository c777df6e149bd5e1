"""A group's completions scored in one row behind their one prompt (GRPO's training forward, and the sampling
policy's and the reference's log-probabilities): the prompt's tokens run through the model once, not G times.

    a group's row   prompt     | completion 1    | completion 2    | ... | completion G   (right-padded to the widest)
    position_ids    0 .. P-1   | P .. P+c1-1     | P .. P+c2-1     | ...
    attends to      its prompt | the prompt and completion 1's earlier tokens, never another completion's

The mask is a (groups, 1, L, L) tensor that sdpa and eager attention take as given (transformers passes a 4-D mask
through), so nothing else changes: no KV cache (checkpointed layers recompute as before), one forward under
DDP, FSDP and ZeRO. Each completion's first token is predicted by the prompt's last position, read once per
completion. The same log-probabilities as the G rows of prompt + completion (fp32: tests/test_grpo.py).

Shared only where it pays and holds (else None: the rows as they are):
  - the mask costs no more than the rows' own: groups x L^2 <= rows x W^2 (a prompt at least ~sqrt(G) times its
    completions), so the attention's work and its mask never exceed the unshared rows', and the planner's bound holds;
  - attention is sdpa or eager (varlen, flash and flex build their own masks), every layer softmax attention
    over a KV cache (a recurrent layer, Qwen3-Next's, would read the completions before it), no multimodal rope,
    no sliding window narrower than a row (the mask does not window);
  - whole rows of text: not a context- or sequence-parallel part, no images; every group's G rows the same prompt.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from finetune.data import IGNORE_INDEX

ROW_KEYS = ("input_ids", "attention_mask", "labels")  # what a GRPO batch's rows are (the rest is per-row numbers)
NOT_WHOLE_ROWS = ("context_part", "sequence_split", "position_ids")  # a part of each row, or packed rows


@dataclass(frozen=True)
class Sharing:
    """What the model allows: the prompt shared across each run of `group` rows."""

    group: int
    additive: bool  # eager attention adds the mask to its scores (a float mask); sdpa takes booleans
    window: int | None  # the config's sliding window (its windowed layers'), None without one
    dtype: torch.dtype = torch.float32  # the added mask's: the hidden states' (a wider one would upcast the scores)


@dataclass
class SharedRows:
    inputs: dict[str, torch.Tensor]  # input_ids and position_ids (groups, L), attention_mask (groups, 1, L, L)
    keep: torch.Tensor  # (groups, L) bool: the positions whose next-token logits are read
    picks: torch.Tensor  # each target of the unshared rows (row-major) -> its logits among the kept positions


def sharing_for(model, group: int) -> Sharing | None:
    """Whether this model's forward can share a group's prompt (see the module's list); None where it cannot."""
    from finetune.model.load import base_of
    from finetune.objectives.sampling import repeatable_cache, shareable

    base = base_of(model)
    config = base.config
    attention = getattr(config, "_attn_implementation", None)
    if group < 2 or attention not in ("sdpa", "eager") or not shareable(base) or not repeatable_cache(base):
        return None
    windowed = getattr(config, "use_sliding_window", True) is not False  # Qwen2's switch
    window = getattr(config, "sliding_window", None) if windowed else None
    dtype = base.get_input_embeddings().weight.dtype
    return Sharing(
        group, additive=attention == "eager", window=window or None, dtype=dtype if dtype.is_floating_point else torch.float32
    )


def shared_rows(batch: dict[str, Any], how: Sharing) -> SharedRows | None:
    """The batch's rows, each group's prompt once, where it pays and holds (module doc); else None."""
    if any(k in batch for k in NOT_WHOLE_ROWS) or batch["attention_mask"].dim() != 2:
        return None
    extra = {k for k, v in batch.items() if torch.is_tensor(v) and v.dim() >= 2 and k not in ROW_KEYS}
    if extra - {"old_logps", "ref_logps"}:  # image inputs, token types: not rows of text alone
        return None
    ids, labels = batch["input_ids"], batch["labels"]
    rows, width = ids.shape
    if rows % how.group or (how.window is not None and width > how.window):
        return None
    lengths = (labels != IGNORE_INDEX).sum(1)
    prompt_lengths = (batch["attention_mask"].sum(1) - lengths).tolist()  # right-padded: prompt, completion, padding
    lengths, ids_list = lengths.tolist(), ids.tolist()
    groups = rows // how.group
    widths = []
    for g in range(groups):
        members = range(g * how.group, (g + 1) * how.group)
        p = prompt_lengths[members[0]]
        prompt = ids_list[members[0]][:p]
        if p < 1 or any(prompt_lengths[r] != p or ids_list[r][:p] != prompt for r in members):
            return None  # not one prompt per group (the rows are not a GRPO group's)
        widths.append(p + sum(lengths[r] for r in members))
    longest = max(widths)
    if groups * longest**2 > rows * width**2:
        return None  # the mask and the attention would cost more than the rows' own
    return _layout(ids_list, prompt_lengths, lengths, how, longest, ids.device)


def _layout(ids: list[list[int]], prompts: list[int], lengths: list[int], how: Sharing, longest: int, device) -> SharedRows:
    groups = len(ids) // how.group
    shared = torch.zeros(groups, longest, dtype=torch.long)
    positions = torch.zeros_like(shared)
    part = torch.full_like(shared, -1)  # -1 padding, 0 the prompt, j + 1 completion j
    keep = torch.zeros(groups, longest, dtype=torch.bool)
    predictor: list[int] = []  # each target's position in the flattened shared rows, in the unshared rows' order
    for g in range(groups):
        first = g * how.group
        p = prompts[first]
        shared[g, :p] = torch.tensor(ids[first][:p])
        positions[g, :p] = torch.arange(p)
        part[g, :p] = 0
        at = p
        for j in range(how.group):
            c = lengths[first + j]
            shared[g, at : at + c] = torch.tensor(ids[first + j][p : p + c], dtype=torch.long)
            positions[g, at : at + c] = torch.arange(p, p + c)
            part[g, at : at + c] = j + 1
            if c:  # its first token is predicted by the prompt's last position, the rest by its own tokens
                predictor += [g * longest + p - 1] + [g * longest + at + t for t in range(c - 1)]
                keep[g, p - 1] = True
                keep[g, at : at + c - 1] = True
            at += c
    causal = torch.ones(longest, longest, dtype=torch.bool).tril()
    query, key = part[:, :, None], part[:, None, :]
    allowed = causal & (((key == 0) & (query >= 0)) | (key == query))  # padding sees padding: no empty softmax row
    mask = allowed.unsqueeze(1)
    if how.additive:
        mask = torch.zeros(mask.shape, dtype=how.dtype).masked_fill(~mask, torch.finfo(how.dtype).min)
    kept_index = keep.flatten().cumsum(0) - 1
    picks = kept_index[torch.tensor(predictor, dtype=torch.long)]
    inputs = {"input_ids": shared, "attention_mask": mask, "position_ids": positions}
    return SharedRows({k: v.to(device) for k, v in inputs.items()}, keep.to(device), picks.to(device))
