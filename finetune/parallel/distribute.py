"""Choosing a launch's data-parallel strategy, and reading whole checkpoint states back into sharded ones.

    strategy = resolve_strategy(cfg, world_size)      # "single" | "ddp" | "fsdp" | "deepspeed": runtime.ROOMS' key
    load_full_trainable_state(model, weights, view)   # a checkpoint's whole tensors into (sharded) parameters

Checkpoints hold full tensors whatever the strategy: adapter and optimizer state are gathered on save by
each room (fsdp.py, zero.py, pipeline.py, tensor.py; they are small for LoRA) and re-sharded here on load,
so a run saved on N processes resumes on M, with DDP, FSDP or neither.
"""

from __future__ import annotations

import os
from typing import Any

import torch

from finetune.config.schema import RecipeConfig
from finetune.declarations.splits import SPLITS
from finetune.declarations.strategies import of_recipe


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


def vision_problems(cfg: RecipeConfig, world: int) -> list[str]:
    """What a launch of `world` processes cannot run with a vision-language model yet (DDP, FSDP, ZeRO-2 can)."""
    from finetune.model import vision
    from finetune.model.load import model_config

    config = model_config(cfg, quiet=True) if world > 1 else None  # None: a single process, or no config.json here
    if config is None or not vision.is_vision_language(config):
        return []
    out = []
    if of_recipe(cfg).partitions_root:  # ZeRO-3: every parameter partitioned, the vision tower too
        out.append(
            "distributed.strategy=deepspeed with zero_stage=3 and a vision-language model: a rank whose micro-batch "
            "has no image skips the vision tower's parameter gathers another rank runs (a collective mismatch; "
            "seen on 2 processes). Use distributed.strategy=fsdp (its vision tower stays whole) or zero_stage=2"
        )
    for split in SPLITS:
        if split.asked(cfg):
            out.append(f"{split.said(cfg)}: not supported for vision-language models yet; use fsdp")
    return out


def is_sharded(model) -> bool:
    """FSDP, or ZeRO-3 (whose parameters carry a ds_id): every rank must run each forward together."""
    from torch.distributed.fsdp import FSDPModule

    return isinstance(model, FSDPModule) or hasattr(next(model.parameters(), None), "ds_id")


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
