"""DeepSpeed ZeRO's room (distributed.strategy=deepspeed; its keys: zero_config.py): the engine partitions
AdamW state and gradients (ZeRO-2) and the weights too (ZeRO-3) over the processes, and steps inside the last
micro-batch's backward; checkpoints gather every partition whole, per parameter, in torch's layout."""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import nullcontext
from typing import Any

import torch

from finetune.config.schema import RecipeConfig
from finetune.declarations import zero_config
from finetune.parallel.room import Room


def accelerator_for(cfg: RecipeConfig, precision: str, mixed: str, timeout: Any, cpu: bool):
    """accelerate's Accelerator with DeepSpeed's plugin for this recipe (mixed: accelerate's name of precision)."""
    from accelerate import Accelerator, PartialState
    from accelerate.utils import DeepSpeedPlugin

    zero_config.require()
    if cpu:
        # accelerate turns DeepSpeed off for cpu=True, and without it finds no backend on a machine
        # with no GPU: the process group is made for CPUs first (gloo, torchrun's ranks), and
        # DeepSpeed (its CPU accelerator) runs on it.
        PartialState(cpu=True, **timeout.to_kwargs())
    plugin = DeepSpeedPlugin(hf_ds_config=zero_config.ds_config(cfg, precision, on_gpu=not cpu), zero3_init_flag=False)
    accelerator = Accelerator(mixed_precision=mixed, deepspeed_plugin=plugin, kwargs_handlers=[timeout])
    # accelerate tells transformers about ZeRO-3 at once, and from_pretrained then refuses the
    # device_map our loader places the model with: the weights load whole, and ZeRO-3 partitions
    # them when the engine is built (Zero.prepare tells transformers again).
    from transformers.integrations import unset_hf_deepspeed_config

    unset_hf_deepspeed_config()
    return accelerator


class Zero(Room):
    name = "deepspeed"
    replicates = False
    updates_in_backward = True  # a non-finite step is then skipped only by fp16's loss scaler

    def __init__(self, accelerator, cfg, layout, mesh=None) -> None:
        super().__init__(accelerator, cfg, layout, mesh)
        self._groups: list[list[torch.nn.Parameter]] = []  # the optimizer's parameters, as built

    @classmethod
    def problems(cls, cfg: RecipeConfig, accelerator) -> list[str]:
        if accelerator.distributed_type == "DEEPSPEED":
            return []
        return [  # make_accelerator builds DeepSpeed's accelerator from the recipe: a given one lacks it
            "distributed.strategy=deepspeed needs the accelerator built with the recipe (finetune.parallel.runtime."
            f"make_accelerator(precision, cfg)); this one runs {accelerator.distributed_type}."
        ]

    @property
    def sharded(self) -> bool:  # type: ignore[override]  # ZeRO-3 partitions the weights, ZeRO-2 does not
        return self.cfg.distributed.zero_stage == 3

    @property
    def partitions_root(self) -> bool:  # type: ignore[override]  # ZeRO-3 partitions every parameter
        return self.sharded

    def describe(self) -> str:
        return f"parallel: deepspeed over {self.accelerator.num_processes} processes ({zero_config.describe(self.cfg)})"

    def prepare(self, model, optimizer):
        """ZeRO replaces the optimizer's parameters with flat partitions: its state is read and written per
        parameter through the parameters as built (zero_full_optimizer_state, zero_load)."""
        self._groups = [list(g["params"]) for g in optimizer.param_groups]
        self.accelerator.state.deepspeed_plugin.set_deepspeed_weakref()  # transformers: ZeRO-3 from now on
        zero_config.fill_sizes(self.accelerator.state.deepspeed_plugin, model)
        model, optimizer = self.accelerator.prepare(model, optimizer)
        zero_optimizer(optimizer).finetune_param_groups = self._groups  # for checkpoint.load_checkpoint
        return model, optimizer

    def unwrap(self, model):
        return self.accelerator.unwrap_model(model)

    def gradient_sync(self, model, last: bool):
        """accelerate's sync_gradients marks the engine's accumulation boundary, where its backward steps
        (clipping, the update, zeroed gradients; optimizer.step() is then a no-op)."""
        self.accelerator.gradient_state._set_sync_gradients(last)
        return nullcontext()

    def full_states(self, model, optimizer) -> tuple[dict[str, torch.Tensor] | None, dict[str, Any] | None]:
        return zero_full_weights(self.unwrap(model)), zero_full_optimizer_state(zero_optimizer(optimizer), self._groups)

    def full_weights(self, model) -> dict[str, torch.Tensor] | None:
        return zero_full_weights(model)


# ------------------------------------------------------------------ whole states
# The engine keeps each trainable weight's fp32 master copy and optimizer state as slices of flat
# per-rank partitions. A checkpoint holds them whole, per parameter, in torch's optimizer layout:
# deepspeed.utils' safe_get/set_full_* gather and scatter one parameter at a time (collectives:
# every rank calls them, in the same order). Cheap for LoRA, whose trainable state is small.


def zero_optimizer(optimizer) -> Any | None:
    """DeepSpeed's ZeRO optimizer (inside accelerate's wrapper), or None for any other optimizer."""
    while optimizer is not None and not type(optimizer).__module__.startswith("deepspeed.runtime.zero"):
        optimizer = getattr(optimizer, "optimizer", None)
    return optimizer


def zero_full_weights(model) -> dict[str, torch.Tensor]:
    """{name: whole fp32 master weight on CPU} of the trained parameters of the engine's module."""
    from deepspeed.utils import safe_get_full_fp32_param

    return {n: safe_get_full_fp32_param(p).detach().cpu() for n, p in model.named_parameters() if p.requires_grad}


def _state_keys(base: torch.optim.Optimizer) -> tuple[list[str], Any]:
    """(the per-element state keys of the optimizer stepping the flat partitions, its step), or ([], None)
    before its first step. torch's AdamW keeps step as a tensor, DeepSpeed's CPU Adam as an int."""
    state = next((s for s in base.state.values() if "step" in s), None)
    if state is None:
        return [], None
    return sorted(k for k, v in state.items() if torch.is_tensor(v) and v.dim() > 0), state["step"]


def zero_full_optimizer_state(zero_opt, groups: Sequence[Sequence[torch.nn.Parameter]]) -> dict[str, Any]:
    """The optimizer state as torch's optimizer.state_dict() of the original parameter `groups` would hold it."""
    from deepspeed.utils import safe_get_full_optimizer_state

    base = zero_opt.optimizer
    keys, step = _state_keys(base)
    state: dict[int, dict[str, Any]] = {}
    param_groups, idx = [], 0
    for hyper, params in zip(base.param_groups, groups):
        param_groups.append({**{k: v for k, v in hyper.items() if k != "params"}, "params": list(range(idx, idx + len(params)))})
        for p in params:
            if keys:
                full = {k: safe_get_full_optimizer_state(p, k).detach().cpu() for k in keys}
                state[idx] = {"step": torch.tensor(float(step), dtype=torch.float32), **full}
            idx += 1
    return {"state": state, "param_groups": param_groups}


def _prime_zero_state(zero_opt) -> None:
    """A fresh engine's optimizer has no state until its first step, and the whole-tensor setters write
    into it: one step at lr 0 on zero gradients creates it (Adam: moments 0, weights unchanged)."""
    base = zero_opt.optimizer
    stage3 = hasattr(zero_opt, "fp32_partitioned_groups_flat")
    # ZeRO-3 hands its optimizer one sub-group's partition at a time (param_groups hold none between steps).
    flats = zero_opt.fp32_partitioned_groups_flat if stage3 else zero_opt.single_partition_of_fp32_groups
    lrs, had_grad = [g["lr"] for g in base.param_groups], [f.grad is not None for f in flats]
    for g in base.param_groups:
        g["lr"] = 0.0
    for f in flats:
        f.grad = torch.zeros_like(f) if f.grad is None else f.grad.zero_()
    if stage3:
        for sub_group in range(len(flats)):
            zero_opt._optimizer_step(sub_group)
    else:
        base.step()
    for g, lr in zip(base.param_groups, lrs):
        g["lr"] = lr
    for f, had in zip(flats, had_grad):
        f.grad = f.grad if had else None
    if hasattr(zero_opt, "_lazy_init_hp_params_optimizer_state"):  # ZeRO-2 links its per-parameter views at the first step
        zero_opt._lazy_init_hp_params_optimizer_state()


def zero_load(
    zero_opt,
    groups: Sequence[Sequence[torch.nn.Parameter]],
    weights: Sequence[tuple[torch.nn.Parameter, torch.Tensor]],
    full_state: dict[str, Any],
) -> None:
    """Whole weights (parameter, tensor) and a whole optimizer state (as saved) into a ZeRO engine:
    each rank keeps its partitions. A collective: every rank calls with the same files."""
    import deepspeed
    from deepspeed.utils import safe_set_full_fp32_param, safe_set_full_optimizer_state

    params = [p for group in groups for p in group]
    for p, full in weights:
        safe_set_full_fp32_param(p, full.to(torch.float32))
    zero3 = [(p, full) for p, full in weights if hasattr(p, "ds_id")]
    with deepspeed.zero.GatheredParameters([p for p, _ in zero3], modifier_rank=0):  # re-partitioned on exit
        with torch.no_grad():
            for p, full in weights:  # the working copy (ZeRO-2: whole on every rank) the forward uses
                p.data.copy_(full.to(p.device, p.dtype))
    base, saved = zero_opt.optimizer, {int(k): v for k, v in full_state["state"].items()}
    for group, hyper in zip(base.param_groups, full_state["param_groups"]):
        group.update({k: v for k, v in hyper.items() if k != "params"})
    if not saved:
        return  # saved before the first step: nothing to restore
    if not base.state:
        _prime_zero_state(zero_opt)
    keys, _ = _state_keys(base)
    for idx, p in enumerate(params):
        for k in keys:
            safe_set_full_optimizer_state(p, saved[idx][k].to(torch.float32), k)
    step = float(saved[0]["step"])
    for s in base.state.values():
        s["step"] = s["step"].fill_(step) if torch.is_tensor(s["step"]) else int(step)
