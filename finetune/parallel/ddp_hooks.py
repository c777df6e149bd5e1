"""The DDP communication hooks of distributed.grad_compression (rules and defaults: declarations/compression.py).

    hook = register(ddp_model, cfg)              # Parallel.prepare; a PowerSGD, or None (none/fp16/bf16)
    tensors, scalars = hook.state_dict()         # PowerSGD: this rank's state, for its checkpoint
    attached(model).load_state_dict(tensors, scalars, own_rank=True)   # resume (model: the unwrapped one)

bf16/fp16: each gradient bucket cast to 16 bits for the all-reduce and back (torch's
fp16_compress_hook algorithm). torch's bf16_compress_hook refuses anything but NCCL >= 2.10, by the
hook's name, though gloo (torch 2.13) sums bf16 as well: one hook of ours serves both.

powersgd: torch's PowerSGD hook. Its state lives between steps, per rank: the error feedback, the
warm-started P and Q, its step counter and the generator that seeds new Qs; torch keys it by DDP
bucket index. DDP regroups its buckets after the first step of every launch (by the order gradients
became ready), so a resumed launch's first steps see other parameters under an index than the saved
state was for (torch's own state would add one parameter's error feedback to another's gradient).
Here the state goes to per-parameter pieces whenever the grouping changes, and into checkpoints as
such; a bucket's state is rebuilt from the pieces of the parameters it holds, so a resumed run
continues bitwise.
"""

from __future__ import annotations

import math
from typing import Any, cast
from weakref import WeakKeyDictionary

import numpy as np
import torch
import torch.distributed as dist

from finetune.config.schema import RecipeConfig
from finetune.declarations.compression import powersgd_warmup

# A column of zeros (a LoRA A's gradient is zero while its B is still at its zero init, e.g. at lr 0
# in warm-up) would divide 0 by 0 in the orthogonalisation and put NaN into the error feedback for
# good. 1e-12 turns that into 0 and is far below the norm of any gradient column that matters.
ORTHOGONALIZATION_EPSILON = 1e-12
KINDS = ("error", "p", "q")  # per parameter: error feedback, then its P and Q factors

_ATTACHED: WeakKeyDictionary[torch.nn.Module, PowerSGD] = WeakKeyDictionary()


def register(ddp_model, cfg: RecipeConfig) -> PowerSGD | None:
    """Register distributed.grad_compression's hook on a DDP-wrapped model (before its first backward).
    PowerSGD's state is returned, and found again by attached(the unwrapped model) to restore it."""
    method = cfg.distributed.grad_compression
    if method in ("fp16", "bf16"):
        ddp_model.register_comm_hook(None, cast_hook(torch.float16 if method == "fp16" else torch.bfloat16))
        return None
    if method != "powersgd":
        return None
    hook = PowerSGD(ddp_model.module, cfg.distributed.powersgd_rank, powersgd_warmup(cfg))
    ddp_model.register_comm_hook(hook, powersgd_hook)
    _ATTACHED[ddp_model.module] = hook
    return hook


def attached(model) -> PowerSGD | None:
    """The PowerSGD state registered for this (unwrapped) model, if any."""
    return _ATTACHED.get(model)


# The hooks carry no annotations: DDP compares them with the classes, and `from __future__ import
# annotations` makes them strings.
def cast_hook(dtype: torch.dtype):
    def hook(group, bucket):
        buffer = bucket.buffer()
        # Divided before the sum (as torch's hooks do): N ranks' fp16 sum stays within fp16's range.
        low = buffer.to(dtype).div_(dist.get_world_size(group))

        def back(fut: torch.futures.Future) -> torch.Tensor:
            return buffer.copy_(fut.value()[0])

        return dist.all_reduce(low, group=group, async_op=True).get_future().then(back)

    hook.__name__ = f"{str(dtype).removeprefix('torch.')}_cast_hook"
    return hook


def powersgd_hook(hook, bucket):
    from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import powerSGD_hook

    index, before = bucket.index(), hook.place(bucket)
    fut = powerSGD_hook(hook.state, bucket)
    if before is None:
        return fut

    def keep_finite(fut: torch.futures.Future) -> torch.Tensor:
        # An inf/NaN gradient (an fp16 GradScaler overflow, a bad batch) makes the trainer skip or
        # stop the step; in the error feedback and the warm-started P/Q it would stay for good.
        # The result is the same on every rank (all-reduced factors), so all roll back together.
        reduced = fut.value()
        if not bool(torch.isfinite(reduced).all()):
            hook.roll_back(index, before)
        return reduced

    return fut.then(keep_finite)


class PowerSGD:
    """torch's PowerSGDState, with its state kept per parameter across bucket regroupings and resumes."""

    def __init__(self, module: torch.nn.Module, rank: int, warmup_steps: int):
        from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import PowerSGDState

        self.state = PowerSGDState(
            process_group=None,
            matrix_approximation_rank=rank,
            start_powerSGD_iter=warmup_steps,
            orthogonalization_epsilon=ORTHOGONALIZATION_EPSILON,
            random_seed=0,  # the same on every rank: all draw the same random Q
        )
        self.names = {id(p): name for name, p in module.named_parameters() if p.requires_grad}
        self.layouts: dict[int, tuple[tuple[str, tuple[int, ...]], ...]] = {}  # what each bucket's state is for
        self.pieces: dict[str, torch.Tensor] = {}  # "kind.param" not in any bucket's state (yet)

    def _dicts(self) -> dict[str, dict[int, torch.Tensor]]:
        s = self.state
        return {"error": s.error_dict, "p": s.p_memory_dict, "q": s.q_memory_dict}

    def place(self, bucket: dist.GradBucket) -> dict[str, torch.Tensor] | None:
        """Before torch's hook reduces `bucket`: give it the state of the parameters it holds now.
        Returns that state as it is before the step (None for a plain all-reduce step)."""
        if self.state.iter < self.state.start_powerSGD_iter:
            return None  # plain all-reduce: no state is read
        index = bucket.index()
        layout = tuple((self.names[id(p)], tuple(p.shape)) for p in bucket.parameters())
        if self.layouts.get(index) != layout:
            self._regroup(index, layout, bucket.buffer())
        # torch replaces the error tensor but writes P and Q in place: those are copied (small).
        held = self._dicts()
        return {k: held[k][index] if k == "error" else held[k][index].clone() for k in KINDS if index in held[k]}

    def roll_back(self, index: int, before: dict[str, torch.Tensor]) -> None:
        for kind, held in self._dicts().items():
            if kind in before:
                held[index] = before[kind]
            else:  # the bucket's first compressed step: torch draws its Q afresh next time
                held.pop(index, None)

    def _regroup(self, index: int, layout, buffer: torch.Tensor) -> None:
        """Bucket `index` holds other parameters than its state is for (a new launch, or DDP regrouped)."""
        # Buckets are reduced in index order, so those from `index` on have not run this step:
        # their state (built for the old grouping) goes to per-parameter pieces first.
        for old in [i for i in self.layouts if i >= index]:
            self.pieces.update(self._pieces_of(old))
            del self.layouts[old]
            for held in self._dicts().values():
                held.pop(old, None)
        self._join(index, layout, buffer)

    def _pieces_of(self, index: int) -> dict[str, torch.Tensor]:
        """Views of bucket `index`'s state, per parameter ("kind.name")."""
        offsets = _offsets(self.layouts[index], self.state)
        out: dict[str, torch.Tensor] = {}
        for kind, held in self._dicts().items():
            flat = held.get(index)
            if flat is None:
                continue
            for name, (start, length) in offsets[kind].items():
                out[f"{kind}.{name}"] = flat[start : start + length]
        return out

    def _join(self, index: int, layout, buffer: torch.Tensor) -> None:
        """Bucket `index`'s state from the pieces of the parameters it now holds."""
        self.layouts[index] = layout
        offsets = _offsets(layout, self.state)
        found: dict[str, list[torch.Tensor | None]] = {}
        for kind in KINDS:
            found[kind] = []
            for name, (_, length) in offsets[kind].items():
                piece = self.pieces.pop(f"{kind}.{name}", None)
                if piece is None or piece.numel() != length:  # not held yet, or saved with another shape
                    piece = torch.zeros(length) if kind == "error" else None  # no error yet is zero error
                found[kind].append(piece)
        # P and Q go together or not at all: without them torch draws a fresh Q for this bucket, as on
        # its first compressed step.
        whole = [k for k in KINDS if k == "error" or all(p is not None for p in found["p"] + found["q"])]
        held = self._dicts()
        for kind in whole:
            parts = [p for p in found[kind] if p is not None]
            held[kind][index] = torch.cat(parts).to(buffer.device, buffer.dtype) if parts else buffer.new_empty(0)

    # ------------------------------------------------------------------ checkpoints

    def state_dict(self) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        """(tensors, JSON scalars) of this rank's state, on the CPU."""
        tensors = dict(self.pieces)
        for index in self.layouts:
            tensors.update(self._pieces_of(index))
        s = self.state
        _, keys, pos, has_gauss, cached_gaussian = cast(tuple, s.rng.get_state())  # legacy=True: a tuple
        tensors = {k: v.detach().cpu().clone() for k, v in tensors.items()}
        tensors["rng_keys"] = torch.from_numpy(keys.astype(np.int64))
        scalars = {
            "iter": s.iter,
            "rng_pos": int(pos),
            "rng_has_gauss": int(has_gauss),
            "rng_cached_gaussian": float(cached_gaussian),
            "total_numel_before_compression": s.total_numel_before_compression,
            "total_numel_after_compression": s.total_numel_after_compression,
            "next_stats_report": s.next_stats_report,
        }
        return tensors, scalars

    def load_state_dict(self, tensors: dict[str, torch.Tensor], scalars: dict[str, Any], own_rank: bool) -> None:
        """own_rank=False: the state of another rank (a run saved on fewer processes): its step counter,
        generator and P/Q (equal on every rank) are right here, its error feedback is not."""
        s = self.state
        for held in self._dicts().values():
            held.clear()
        self.layouts = {}
        self.pieces = {k: v for k, v in tensors.items() if k.split(".", 1)[0] in KINDS}
        if not own_rank:
            self.pieces = {k: v for k, v in self.pieces.items() if not k.startswith("error.")}
        keys = tensors["rng_keys"].numpy().astype(np.uint32)
        s.rng.set_state(("MT19937", keys, scalars["rng_pos"], scalars["rng_has_gauss"], scalars["rng_cached_gaussian"]))
        s.iter = int(scalars["iter"])
        s.total_numel_before_compression = int(scalars["total_numel_before_compression"])
        s.total_numel_after_compression = int(scalars["total_numel_after_compression"])
        s.next_stats_report = int(scalars["next_stats_report"])


def _offsets(layout, state) -> dict[str, dict[str, tuple[int, int]]]:
    """Where each parameter's pieces lie in a bucket's flat state: {kind: {name: (start, length)}}.

    Mirrors torch's powerSGD_hook: the error covers the bucket's gradients in order; a gradient
    (n x m once flattened past dim 0) is factored only when that sends fewer numbers by
    min_compression_rate, and the factored ones' P (n x r) and Q (m x r) follow one another
    grouped by (n, m) in order of first appearance, r = min(n, m, rank).
    """
    out: dict[str, dict[str, tuple[int, int]]] = {kind: {} for kind in KINDS}
    groups: dict[tuple[int, int], list[str]] = {}
    start = 0
    for name, shape in layout:
        numel = math.prod(shape)
        out["error"][name] = (start, numel)
        start += numel
        n = shape[0]
        m = numel // n
        r = min(n, m, state.matrix_approximation_rank)
        if (n + m) * r * state.min_compression_rate < n * m:
            groups.setdefault((n, m), []).append(name)
    p = q = 0
    for (n, m), names in groups.items():
        r = min(n, m, state.matrix_approximation_rank)
        for name in names:
            out["p"][name], out["q"][name] = (p, n * r), (q, m * r)
            p, q = p + n * r, q + m * r
    return out
