"""Data parallelism: which strategy a run uses, FSDP2 sharding, and full (gathered) state for checkpoints.

    strategy = resolve_strategy(cfg, world_size)      # "single" | "ddp" | "fsdp"
    shard_model(model, cfg)                           # FSDP2: each decoder layer, then the root
    state = full_trainable_state(model)               # every rank calls; full tensors, names as unsharded

DDP comes from accelerate's prepare(). FSDP2 is torch's own `fully_shard`, applied
here rather than through accelerate's plugin because accelerate only offers FSDP on
GPUs: one code path, the same on CPU (gloo, tested) and GPU (NCCL).

QLoRA under FSDP stores the 4-bit weights in the compute dtype
(bnb_4bit_quant_storage), so FSDP can shard and all-gather them like any other
tensor; bitsandbytes re-attaches each weight's quantization state from its module
after the all-gather.

Checkpoints hold full tensors whatever the strategy: adapter and optimizer state
are gathered on save (they are small for LoRA) and re-sharded on load, so a run
saved on N processes resumes on M, with DDP, FSDP or neither.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import torch

from finetune.config.schema import RecipeConfig, fsdp_problems
from finetune.errors import ConfigError
from finetune.model.load import decoder_layers


def resolve_strategy(cfg: RecipeConfig, world_size: int, device: torch.device | None = None) -> str:
    """distributed.strategy for this launch: single process, DDP (replicas) or FSDP (shards).

    auto: DDP, unless a CUDA device would not hold a full replica by the memory plan
    (then FSDP, which divides weights and optimizer state by the number of processes).
    """
    if world_size <= 1:
        return "single"
    chosen = cfg.distributed.strategy
    if chosen != "auto":
        return chosen
    if device is not None and device.type == "cuda":
        from finetune.gpus import gpu_for_device
        from finetune.plan import plan_recipe

        props = torch.cuda.get_device_properties(device)
        try:
            estimate = plan_recipe(cfg, gpu_for_device(props.name, props.total_memory), gpus=1)
        except Exception as err:  # noqa: BLE001 - a model the planner cannot read (custom code) still trains
            if int(os.environ.get("RANK", "0")) == 0:
                print(
                    f"note: distributed.strategy=auto runs DDP (a whole replica per GPU) without a memory plan: {err}. "
                    "Set distributed.strategy=fsdp if a replica does not fit one GPU.",
                    flush=True,
                )
            return "ddp"
        if not estimate.fits:
            return "fsdp"
    return "ddp"


def check_strategy(cfg: RecipeConfig, strategy: str, world: int) -> None:
    """Refuse what FSDP cannot run when `auto` chose it (an explicit fsdp is refused by the recipe's own checks),
    and what a vision-language model cannot run with yet."""
    problems = fsdp_problems(cfg, "FSDP (chosen by distributed.strategy=auto)") if strategy == "fsdp" else []
    problems += vision_problems(cfg, world)
    if problems:
        raise ConfigError(problems)


def vision_problems(cfg: RecipeConfig, world: int) -> list[str]:
    """What a launch of `world` processes cannot run with a vision-language model yet (DDP, FSDP, ZeRO-2 can)."""
    from finetune.model import vision
    from finetune.model.load import model_config

    d = cfg.distributed
    config = model_config(cfg, quiet=True) if world > 1 else None  # None: a single process, or no config.json here
    if config is None or not vision.is_vision_language(config):
        return []
    out = []
    if d.strategy == "deepspeed" and d.zero_stage == 3:
        out.append(
            "distributed.strategy=deepspeed with zero_stage=3 and a vision-language model: a rank whose micro-batch "
            "has no image skips the vision tower's parameter gathers another rank runs (a collective mismatch; "
            "seen on 2 processes). Use distributed.strategy=fsdp (its vision tower stays whole) or zero_stage=2"
        )
    for key in ("pipeline_parallel", "tensor_parallel", "context_parallel"):
        if getattr(d, key) > 1:
            out.append(f"distributed.{key}={getattr(d, key)}: not supported for vision-language models yet; use fsdp")
    return out


def shard_model(model, cfg: RecipeConfig, compute_dtype: torch.dtype) -> Any:
    """FSDP2: shard each decoder layer, then the rest (embeddings, head, norms) as the root group.

    One all-gather per layer keeps at most ~one layer unsharded at a time;
    reshard_after_forward=false trades that memory for not gathering again in backward.
    """
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

    d = cfg.distributed
    mp = MixedPrecisionPolicy(
        # Parameters are gathered in the compute dtype; gradients are reduced in fp32 so that
        # summing N ranks' bf16 gradients loses nothing. (The 4-bit storage already is the
        # compute dtype, so its bytes pass through uncast.)
        param_dtype=compute_dtype if compute_dtype != torch.float32 else None,
        reduce_dtype=torch.float32,
    )
    offload = CPUOffloadPolicy() if d.cpu_offload else OffloadPolicy()
    for layer in decoder_layers(model):
        fully_shard(layer, reshard_after_forward=d.reshard_after_forward, mp_policy=mp, offload_policy=offload)
    fully_shard(model, reshard_after_forward=d.reshard_after_forward, mp_policy=mp, offload_policy=offload)
    if hasattr(model, "generate"):
        # generate() calls the inner model, never the root's forward: without this the root's
        # parameters (embeddings, head) stay sharded during generation, and the embedding
        # lookup fails on a DTensor. Every rank must then generate together (evaluate.generate).
        from torch.distributed.fsdp import register_fsdp_forward_method

        register_fsdp_forward_method(model, "generate")
    return model


def place_sharded(model, device: torch.device, keep_params_on_cpu: bool) -> None:
    """Move a sharded model (loaded in CPU RAM) to its device: this rank's parameter shards, the
    buffers, and bitsandbytes' quantization states (absmax), which live on modules, not parameters.

    With keep_params_on_cpu (distributed.cpu_offload) the shards stay in CPU RAM; FSDP copies each
    layer's to the GPU when it runs. On a CPU device nothing moves.
    """
    if device.type == "cpu":
        return
    if not keep_params_on_cpu:
        model.to(device)
    else:
        for module in model.modules():
            for name, buf in list(module.named_buffers(recurse=False)):
                module._buffers[name] = buf.to(device)
    for module in model.modules():
        for holder in (module, getattr(module, "weight", None)):
            state = getattr(holder, "quant_state", None)
            if state is not None and hasattr(state, "to"):
                state.to(device)


def is_sharded(model) -> bool:
    """FSDP, or ZeRO-3 (whose parameters carry a ds_id): every rank must run each forward together."""
    from torch.distributed.fsdp import FSDPModule

    return isinstance(model, FSDPModule) or hasattr(next(model.parameters(), None), "ds_id")


def full_tensor(t: torch.Tensor) -> torch.Tensor:
    """A DTensor gathered whole (a collective: every rank must call), or the tensor itself."""
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


def full_trainable_state(model) -> dict[str, torch.Tensor]:
    """{name: full tensor on CPU} of the trained parameters, as an unsharded model would name them."""
    return {n: full_tensor(p.detach()).cpu() for n, p in model.named_parameters() if p.requires_grad}


def full_optimizer_state(optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """optimizer.state_dict() with every sharded state tensor gathered whole, in a fixed order on all ranks."""
    sd = optimizer.state_dict()
    state = {
        idx: {k: (full_tensor(v).cpu() if torch.is_tensor(v) else v) for k, v in sorted(s.items())}
        for idx, s in sorted(sd["state"].items())
    }
    return {"state": state, "param_groups": sd["param_groups"]}


def held_indices(model) -> list[int] | None:
    """The optimizer indices (positions among the trainable parameters, as one process numbers them) of
    the parameters this process holds, or None when it holds them all. A pipeline stage holds only its
    own; the others wait on the meta device (finetune/parallel/pipeline.py)."""
    trainable = [p for p in model.parameters() if p.requires_grad]
    held = [i for i, p in enumerate(trainable) if not p.is_meta]
    return None if len(held) == len(trainable) else held


def held_optimizer_state(full_state: dict[str, Any], held: list[int]) -> dict[str, Any]:
    """A whole optimizer state (as saved, one parameter group) cut to the parameters this process holds."""
    state = {local: full_state["state"][index] for local, index in enumerate(held) if index in full_state["state"]}
    (group,) = full_state["param_groups"]
    return {"state": state, "param_groups": [{**group, "params": list(range(len(held)))}]}


def _like(full: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """`full` laid out like `target`: sharded the same way when target is a DTensor."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    if isinstance(target, DTensor) and full.shape == target.shape:
        # Every rank read the same file: no data needs to travel (src_data_rank=None slices locally).
        return distribute_tensor(full.to(target.device, target.dtype), target.device_mesh, target.placements, src_data_rank=None)
    return full


def shard_optimizer_state(optimizer: torch.optim.Optimizer, full_state: dict[str, Any]) -> dict[str, Any]:
    """A full optimizer state dict (as saved) re-laid out for this optimizer's (possibly sharded) parameters."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    state = {}
    for idx, s in full_state["state"].items():
        p = params[int(idx)]
        state[idx] = {k: (_like(v, p) if torch.is_tensor(v) and v.dim() > 0 else v) for k, v in s.items()}
    return {"state": state, "param_groups": full_state["param_groups"]}


def load_full_trainable_state(model, weights: dict[str, torch.Tensor], view: dict[str, torch.Tensor]) -> None:
    """Copy full tensors into (possibly sharded) parameters; `view` maps each key of `weights` to its parameter."""
    from torch.distributed.tensor import DTensor

    with torch.no_grad():
        for key, full in weights.items():
            target = view[key]
            if isinstance(target, DTensor):
                target.to_local().copy_(_like(full, target).to_local())  # type: ignore[attr-defined]  # _like keeps DTensors
            else:
                target.copy_(full)


# --------------------------------------------------------------------------- DeepSpeed ZeRO
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
