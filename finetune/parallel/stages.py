"""A pipeline's stages: the modules a stage runs, what each rank loads, and windows shaped for the engine.

    placement = stage_placement(layout, layers, tied, device)    # what this rank loads (the rest: meta)
    stage = Stage(decoder, lo, hi, first, last)                   # decoder layers [lo, hi) as one module
    joined = pad_window(batches, max_seq_len)                     # one tensor shape between stages

The schedules that run them, and the room the loop asks: parallel/pipeline.py.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

from finetune.data import IGNORE_INDEX
from finetune.declarations.layout import Layout


@contextmanager
def _swapped(decoder: nn.Module, **parts: nn.Module):
    """The decoder with some of its submodules replaced for one forward (the stage's layers, no norm)."""
    kept = {name: getattr(decoder, name) for name in parts}
    for name, part in parts.items():
        setattr(decoder, name, part)
    try:
        yield decoder
    finally:
        for name, part in kept.items():
            setattr(decoder, name, part)


class Stage(nn.Module):
    """Decoder layers [lo, hi): the first stage embeds input ids, the last applies the final norm.
    Only the stage's layers are registered here (what the pipeline engine sees of it); the decoder
    it runs through is held outside the module tree."""

    def __init__(self, decoder: Any, lo: int, hi: int, first: bool, last: bool):
        super().__init__()
        self.layers = nn.ModuleList(list(decoder.layers)[lo:hi])
        self.first, self.last = first, last
        self._decoder = [decoder]  # a list: not a submodule
        # Per micro-batch of the window, what its forward takes besides tensors (cp x pp: its context part, for every
        # attention call); the room sets it, and the schedule's `micro` (each row's micro-batch) picks one.
        self.given: list[dict[str, Any]] = []

    def forward(
        self,
        x: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        micro: torch.Tensor | None = None,
    ) -> torch.Tensor:
        decoder = self._decoder[0]
        inputs = {"input_ids": x} if self.first else {"inputs_embeds": x}
        parts: dict[str, nn.Module] = {"layers": self.layers}
        if not self.last:
            parts["norm"] = nn.Identity()
        given = self.given[int(micro[0])] if micro is not None else {}
        with _swapped(decoder, **parts):
            out = decoder(**inputs, attention_mask=attention_mask, position_ids=position_ids, use_cache=False, **given)
        return out.last_hidden_state


# Windows are padded to a multiple of this many tokens: the engine infers the shapes it sends with one
# extra forward per new shape, so lengths are bucketed (a few shapes per run, not one per step).
PAD_TO = 64


def pad_window(batches: list[dict[str, torch.Tensor]], longest: int) -> dict[str, torch.Tensor]:
    """The window's micro-batches as one batch, right-padded to a multiple of PAD_TO (at most `longest`,
    data.max_seq_len, unless a row is longer): the engine sends tensors of one shape between stages.
    Padding trains nothing and no real token sees it (causal attention; packed rows: padding is a
    segment of its own, positions 0, 1, ... as the Collator gives it), so each micro-batch computes
    what it computes alone. Packed rows carry position_ids and no attention_mask."""
    rows_max = max(b["input_ids"].shape[1] for b in batches)
    length = max(rows_max, min(-(-rows_max // PAD_TO) * PAD_TO, longest))
    packed = "position_ids" in batches[0]
    fill = {"input_ids": 0, "labels": IGNORE_INDEX, **({"position_ids": 0} if packed else {"attention_mask": 0})}
    joined = {}
    for key, value in fill.items():
        joined[key] = torch.cat([nn.functional.pad(b[key], (0, length - b[key].shape[1]), value=value) for b in batches])
    ramp = torch.arange(length, device=joined["input_ids"].device)
    if packed:  # the padding its own segment: positions 0, 1, ... from where each row's content ends
        widths = torch.cat([torch.full((b["input_ids"].shape[0],), b["input_ids"].shape[1]) for b in batches])
        after = (ramp.unsqueeze(0) - widths.to(ramp.device).unsqueeze(1)).clamp(min=0)
        joined["position_ids"] = torch.where(
            ramp.unsqueeze(0) < widths.to(ramp.device).unsqueeze(1), joined["position_ids"], after
        )
    else:
        joined["position_ids"] = ramp.expand(joined["input_ids"].shape[0], -1).contiguous()
    return joined


def _model_inputs(window: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """What every stage is called with besides its input: the mask (none for packed rows) and positions."""
    return {k: window[k] for k in ("attention_mask", "position_ids") if k in window}


def _padded_rows(batch: dict[str, torch.Tensor], rows: int) -> dict[str, torch.Tensor]:
    """A batch grown to `rows` rows with rows that train nothing (a short last eval batch): the schedule
    splits a window into micro-batches of equal rows."""
    extra = rows - batch["input_ids"].shape[0]
    if extra <= 0:
        return batch
    fill = {"input_ids": 0, "labels": IGNORE_INDEX, "attention_mask": 1}
    grown = {
        k: torch.cat([v, torch.full((extra, v.shape[1]), fill[k], dtype=v.dtype, device=v.device)])
        for k, v in batch.items()
        if k in fill
    }
    if "position_ids" in batch:  # packed rows: each added row one segment
        ramp = torch.arange(batch["position_ids"].shape[1], device=batch["position_ids"].device)
        grown["position_ids"] = torch.cat([batch["position_ids"], ramp.expand(extra, -1)])
    return grown


def _padded_pairs(batch: dict[str, torch.Tensor], rows: int) -> dict[str, torch.Tensor]:
    """A batch of pairs (chosen rows, then rejected ones) grown to `rows` pairs with filler pairs at the end of
    each half, so that the halves stay aligned; the loss counts only the real ones (head_loss's real)."""
    half = batch["input_ids"].shape[0] // 2
    if half >= rows:
        return batch
    grown = (
        _padded_rows({k: v[:half] for k, v in batch.items()}, rows),
        _padded_rows({k: v[half:] for k, v in batch.items()}, rows),
    )
    return {k: torch.cat([grown[0][k], grown[1][k]]) for k in grown[0]}


def _untrained(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A micro-batch of the same shape that counts nothing (fills the last eval window)."""
    return {**batch, "labels": torch.full_like(batch["labels"], IGNORE_INDEX)}


def stage_placement(layout: Layout, layers: int, tied: bool, device: torch.device) -> dict[str, Any]:
    """The loader's device_map for this rank: its stages' decoder layers, the embeddings on the first
    stage (and on the last when the head shares their weight), the final norm and head on the last, on
    `device`; every other module on the meta device, never read. Names of the families in
    layout.FAMILIES, which all lay out model.embed_tokens, model.layers.N, model.norm, model.rotary_emb, lm_head."""
    stages = layout.stages_of_rank
    held = {i for s in stages for i in range(*layout.layer_range(s, layers))}
    first, last = 0 in stages, layout.stage_count - 1 in stages
    place = {
        "model.embed_tokens": device if first or (last and tied) else "meta",
        **{f"model.layers.{i}": device if i in held else "meta" for i in range(layers)},
        "model.norm": device if last else "meta",
        "model.rotary_emb": device,  # angles only: every stage computes its own
        "lm_head": device if last else "meta",
    }
    return place


def balanced_layers(cfg: Any, world: int, device: torch.device) -> tuple[int, ...]:
    """distributed.pipeline_layers=auto: the planner's balanced split for this GPU (any on a CPU: its peaks
    are compared, not checked against a card)."""
    from finetune.gpus import gpu_for_device
    from finetune.plan.recipe import planning_inputs, setup_of
    from finetune.plan.stages import balanced_layers as balanced

    gpu = None
    if device.type == "cuda":
        gpu = gpu_for_device(torch.cuda.get_device_name(device), torch.cuda.get_device_properties(device).total_memory)
    shape, facts, kw = planning_inputs(cfg, gpu)
    return balanced(shape, facts, setup_of(cfg, world), gpu, **kw)
