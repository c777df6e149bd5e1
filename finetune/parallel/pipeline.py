"""Pipeline parallelism on torch.distributed.pipelining: each rank runs its stages' decoder layers,
micro-batches pass between ranks, the schedule (GPipe, 1F1B, interleaved 1F1B) orders them.

    pipeline = Pipeline(model, layout, cfg, device)
    loss_sum = pipeline.train_window(batches, objective, scale)   # forward + backward of the whole window
    pipeline.sum_gradients(params)                                # every rank then holds the whole gradient

A stage runs the model's own decoder forward (its masks, rotary angles, checkpointed layers) with the
decoder's layers swapped for the stage's, the embeddings used only by the first stage and the final
norm only by the last; the last stage's output goes to the objective's head_loss (the chunked loss
kept). Each rank keeps the whole model and adapter in this release: it computes only its stages'
gradients, and an all-reduce over every rank gives each the whole gradient, so every rank steps the
same whole adapter, and checkpoints, eval and exact match run as on one process. (Loading only a
stage's weights is the next step: docs/design.md.) Layout and rules: parallel/layout.py.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from finetune.data import IGNORE_INDEX
from finetune.errors import TrainingError
from finetune.model.load import head_owner
from finetune.parallel.layout import Layout


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

    def forward(self, x: torch.Tensor, attention_mask: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        decoder = self._decoder[0]
        inputs = {"input_ids": x} if self.first else {"inputs_embeds": x}
        parts: dict[str, nn.Module] = {"layers": self.layers}
        if not self.last:
            parts["norm"] = nn.Identity()
        with _swapped(decoder, **parts):
            out = decoder(**inputs, attention_mask=attention_mask, position_ids=position_ids, use_cache=False)
        return out.last_hidden_state


# Windows are padded to a multiple of this many tokens: the engine infers the shapes it sends with one
# extra forward per new shape, so lengths are bucketed (a few shapes per run, not one per step).
PAD_TO = 64


def pad_window(batches: list[dict[str, torch.Tensor]], longest: int) -> dict[str, torch.Tensor]:
    """The window's micro-batches as one batch, right-padded to a multiple of PAD_TO (at most `longest`,
    data.max_seq_len, unless a row is longer): the engine sends tensors of one shape between stages.
    Padding is masked and trains nothing, and under causal attention no real token sees it, so each
    micro-batch computes what it computes alone."""
    rows_max = max(b["input_ids"].shape[1] for b in batches)
    length = max(rows_max, min(-(-rows_max // PAD_TO) * PAD_TO, longest))
    fill = {"input_ids": 0, "labels": IGNORE_INDEX, "attention_mask": 0}
    joined = {}
    for key, value in fill.items():
        joined[key] = torch.cat([nn.functional.pad(b[key], (0, length - b[key].shape[1]), value=value) for b in batches])
    rows = joined["input_ids"].shape[0]
    joined["position_ids"] = torch.arange(length, device=joined["input_ids"].device).expand(rows, -1).contiguous()
    return joined


class Pipeline:
    """This rank's stages and the schedule that runs them; rebuilt when the window's shape changes."""

    def __init__(self, model: nn.Module, layout: Layout, cfg: Any, device: torch.device):
        self.layout, self.cfg, self.device = layout, cfg, device
        owner: Any = head_owner(model)
        if owner is None or not hasattr(owner, "model") or not hasattr(owner.model, "layers"):
            raise TrainingError(
                "distributed.pipeline_parallel: found no decoder (model.model.layers) to split into stages",
                hint="set distributed.pipeline_parallel=1",
            )
        self.owner, self.decoder = owner, owner.model  # the *ForCausalLM (head, config) and its decoder
        n = len(self.decoder.layers)
        self.stages = [
            Stage(self.decoder, *layout.layer_range(s, n), first=s == 0, last=s == layout.stage_count - 1)
            for s in layout.stages_of_rank
        ]
        self.group = self._pipe_group()
        self._schedules: dict[tuple[int, ...], Any] = {}  # one per window shape
        self._step: tuple[Any, float] = (None, 1.0)  # this step's objective and loss scale

    def _pipe_group(self):
        """One process group per pipeline (a replica's stages); every rank creates every group, in order."""
        layout = self.layout
        if layout.replicas == 1:
            return None  # the default group is the pipeline
        mine = None
        for replica in range(layout.replicas):
            ranks = [s * layout.replicas + replica for s in range(layout.pp)]
            group = dist.new_group(ranks)
            if replica == layout.replica:
                mine = group
        return mine

    @property
    def is_last(self) -> bool:
        return any(s.last for s in self.stages)

    def describe(self) -> str:
        d, layout = self.cfg.distributed, self.layout
        layers = len(self.decoder.layers) // layout.stage_count
        m = self.cfg.train.grad_accum
        idle = (layout.pp - 1) / layout.virtual_stages / (m + (layout.pp - 1) / layout.virtual_stages)
        return (
            f"pipeline: {layout.stage_count} stages of {layers} layers over {layout.pp} processes x {layout.replicas} "
            f"replica{'s' if layout.replicas > 1 else ''}, {d.pipeline_schedule}, {m} micro-batches per step (ideal idle time {idle:.0%}; "
            "raise train.grad_accum to shrink it)"
        )

    def _schedule_for(self, shape: tuple[int, ...]) -> Any:
        """The schedule for windows of this shape, built on first use (the engine then infers what it sends)."""
        if shape in self._schedules:
            return self._schedules[shape]
        from torch.distributed import pipelining as pp

        layout, d = self.layout, self.cfg.distributed
        stages: list[Any] = [
            pp.PipelineStage(stage, index, layout.stage_count, self.device, group=self.group)
            for stage, index in zip(self.stages, layout.stages_of_rank)
        ]
        m = self.cfg.train.grad_accum
        schedule: Any
        if d.pipeline_schedule == "interleaved_1f1b":
            schedule = pp.ScheduleInterleaved1F1B(stages, n_microbatches=m, loss_fn=self._loss, scale_grads=False)
        else:
            kind = pp.ScheduleGPipe if d.pipeline_schedule == "gpipe" else pp.Schedule1F1B
            schedule = kind(stages[0], n_microbatches=m, loss_fn=self._loss, scale_grads=False)
        self._schedules[shape] = schedule
        return schedule

    def _loss(self, hidden: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """The last stage's loss of one micro-batch (summed over its targets), scaled for backward."""
        objective, scale = self._step
        loss, _ = objective.head_loss(self.owner, hidden, labels)
        return loss * scale

    def train_window(self, batches: list[dict[str, torch.Tensor]], objective, scale: float) -> float:
        """Forward and backward of the window's micro-batches through the stages, each micro-batch's summed
        loss multiplied by `scale` (1 / the window's units). The summed loss on the last stage, else 0."""
        window = pad_window(batches, self.cfg.data.max_seq_len)
        schedule = self._schedule_for(tuple(window["input_ids"].shape))
        self._step = (objective, scale)
        args = (window["input_ids"],) if 0 in self.layout.stages_of_rank else ()
        kwargs = {"attention_mask": window["attention_mask"], "position_ids": window["position_ids"]}
        if not self.is_last:
            schedule.step(*args, **kwargs)
            return 0.0
        losses: list[torch.Tensor] = []  # each micro-batch's loss as _loss returned it (scaled)
        schedule.step(*args, target=window["labels"], losses=losses, **kwargs)
        return sum(float(loss.detach()) for loss in losses) / scale

    @staticmethod
    def sum_gradients(params: list[nn.Parameter]) -> None:
        """Every rank's gradients summed over all ranks: the stages' (each a different part of the
        adapter; the others hold none) and the replicas' (the same part, other examples)."""
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat)
        offset = 0
        for p in params:
            n = p.numel()
            p.grad = flat[offset : offset + n].view_as(p).clone()
            offset += n
