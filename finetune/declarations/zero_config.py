"""distributed.strategy=deepspeed: DeepSpeed ZeRO through accelerate, its rules and its config.

    zero_stage 2       optimizer state and gradients partitioned over the processes (weights whole on each)
    zero_stage 3       the weights partitioned too, gathered layer by layer in forward and backward
    offload_optimizer  cpu | nvme: the optimizer state (and its step: DeepSpeed's CPU Adam) off the GPU
    offload_params     cpu | nvme (stage 3): the weight partitions wait off the GPU between uses
    nvme_dir           the folder (on an NVMe disk) the nvme offloads write to

config asks `problems(cfg)`; parallel/runtime.py builds the accelerator with DeepSpeed's plugin (`ds_config`)
and drives the engine; parallel/distribute.py gathers and scatters its partitioned state for
our checkpoints (whole tensors: a ZeRO run resumes on any number of processes, with DDP, FSDP or one).
"""

from __future__ import annotations

from typing import Any, Literal

from finetune.declarations.strategies import of_recipe
from finetune.errors import ConfigError, Rule, broken

Offload = Literal["none", "cpu", "nvme"]  # where offload_optimizer / offload_params put their tensors
INSTALL = "pip install 'finetune[deepspeed]'"
# The keys of this module and their defaults; an older run's recipe predates them (older_runs._OLDER_RUNS).
DEFAULTS: dict[str, Any] = {"zero_stage": 2, "offload_optimizer": "none", "offload_params": "none", "nvme_dir": None}


def require() -> Any:
    """The deepspeed package, or an error that says how to install it."""
    try:
        import deepspeed
    except ImportError as exc:
        raise ConfigError(
            [f"distributed.strategy=deepspeed needs the deepspeed package ({exc}): {INSTALL}, or use distributed.strategy=fsdp"]
        ) from None
    return deepspeed


def describe(cfg: Any) -> str:
    d = cfg.distributed
    parts = [f"ZeRO-{d.zero_stage}"]
    if d.offload_optimizer != "none":
        parts.append(f"optimizer state on {d.offload_optimizer}")
    if d.offload_params != "none":
        parts.append(f"weights on {d.offload_params}")
    return ", ".join(parts)


def _changed(cfg: Any) -> list[str]:
    """This module's keys the recipe moved from their defaults."""
    return [k for k, default in DEFAULTS.items() if getattr(cfg.distributed, k) != default]


def _zero(cfg: Any) -> bool:
    return of_recipe(cfg).deepspeed


def _nvme(cfg: Any) -> list[str]:
    return [k for k in ("offload_optimizer", "offload_params") if getattr(cfg.distributed, k) == "nvme"]


def _fsdp_keys(cfg: Any) -> list[str]:
    d = cfg.distributed
    return [k for k, v in (("cpu_offload", d.cpu_offload), ("reshard_after_forward", not d.reshard_after_forward)) if v]


# Every rule but the first holds under distributed.strategy=deepspeed only.
RULES: tuple[Rule[Any], ...] = (
    Rule(
        lambda cfg: not _zero(cfg) and bool(_changed(cfg)),
        lambda cfg: (
            f"distributed.{_changed(cfg)[0]} applies to distributed.strategy=deepspeed (it is {cfg.distributed.strategy}). "
            f"Set strategy=deepspeed, or remove {' and '.join('distributed.' + k for k in _changed(cfg))}."
        ),
    ),
    Rule(
        lambda cfg: _zero(cfg) and cfg.distributed.offload_params != "none" and cfg.distributed.zero_stage != 3,
        lambda cfg: (
            f"distributed.offload_params={cfg.distributed.offload_params} offloads the weight partitions of ZeRO-3; "
            "zero_stage=2 keeps whole weights on every GPU. Set distributed.zero_stage=3, or offload_params=none."
        ),
    ),
    Rule(
        lambda cfg: _zero(cfg) and bool(_nvme(cfg)) and cfg.distributed.nvme_dir is None,
        lambda cfg: f"distributed.{_nvme(cfg)[0]}=nvme needs distributed.nvme_dir: a folder on an NVMe disk.",
    ),
    Rule(
        lambda cfg: _zero(cfg) and cfg.distributed.nvme_dir is not None and not _nvme(cfg),
        "distributed.nvme_dir is only used by offload_optimizer=nvme or offload_params=nvme; set one, or remove nvme_dir.",
    ),
    Rule(
        lambda cfg: _zero(cfg) and bool(_fsdp_keys(cfg)),
        lambda cfg: (
            f"distributed.{_fsdp_keys(cfg)[0]} is FSDP's; distributed.strategy=deepspeed offloads with "
            "distributed.offload_optimizer and offload_params (zero_stage=3). Remove it, or use distributed.strategy=fsdp."
        ),
    ),
    Rule(
        lambda cfg: _zero(cfg) and cfg.memory.base_weights != "device",
        lambda cfg: (
            f"distributed.strategy=deepspeed partitions the weights itself; memory.base_weights={cfg.memory.base_weights} "
            "streams them on one process. What works: zero_stage=3 with offload_params=cpu (or nvme), or one GPU with base_weights."
        ),
    ),
    Rule(
        lambda cfg: _zero(cfg) and cfg.train.compile,
        "train.compile under distributed.strategy=deepspeed is not tested yet; set train.compile=false.",
    ),
    Rule(
        lambda cfg: _zero(cfg) and cfg.memory.embeddings != "device",
        "memory.embeddings=cpu keeps the vocabulary tables in one process's host RAM; DeepSpeed's engine places every "
        "parameter itself. Set memory.embeddings=device (ZeRO-3 partitions the tables over the GPUs).",
    ),
    Rule(
        lambda cfg: _zero(cfg) and cfg.memory.optimizer_offload,
        "memory.optimizer_offload is for one process; under distributed.strategy=deepspeed set "
        "distributed.offload_optimizer=cpu (DeepSpeed's CPU Adam steps the partitions in host RAM).",
    ),
    Rule(
        lambda cfg: _zero(cfg) and cfg.lora is None,
        "distributed.strategy=deepspeed with full fine-tuning (lora: null) is not supported yet; use LoRA, or ddp.",
    ),
    Rule(
        lambda cfg: _zero(cfg) and cfg.distributed.zero_stage == 3 and cfg.quant.bits == 8,
        "ZeRO-3 cannot partition 8-bit (int8) weights; use quant.bits=4 or null, or distributed.zero_stage=2.",
    ),
    Rule(
        lambda cfg: _zero(cfg) and cfg.distributed.zero_stage == 3 and cfg.memory.loss in ("chunked", "liger"),
        lambda cfg: (
            f"ZeRO-3: memory.loss={cfg.memory.loss} runs the LM head after the forward, when its weight is "
            "partitioned again; use memory.loss=auto (the head on target positions only) or full."
        ),
    ),
)


def problems(cfg: Any) -> list[str]:
    """What distributed.strategy=deepspeed and its keys cannot run with."""
    return broken(RULES, cfg)


def _offload(device: str, nvme_dir: str | None) -> dict[str, Any]:
    return {"device": device, "pin_memory": True, **({"nvme_path": nvme_dir} if device == "nvme" else {})}


def ds_config(cfg: Any, precision: str, on_gpu: bool = True) -> dict[str, Any]:
    """DeepSpeed's config for this recipe.

    gradient_accumulation_steps is 1: the trainer marks the last micro-batch of each window itself
    (accelerate's sync_gradients -> the engine's accumulation boundary) and scales every loss by the
    window's target tokens, so DeepSpeed must not divide by the number of micro-batches again. It
    averages gradients over processes as DDP does; the trainer multiplies that back (loop.py).
    Clipping is DeepSpeed's (inside engine.step, on the whole partitioned gradient).
    offload_optimizer steps with DeepSpeed's CPU Adam (compiled on first use) on GPU machines; on a
    machine without one the trainer's AdamW already runs on the CPU, and is kept.
    """
    d = cfg.distributed
    zero: dict[str, Any] = {"stage": d.zero_stage, "reduce_bucket_size": "auto"}
    if d.offload_optimizer != "none":
        zero["offload_optimizer"] = _offload(d.offload_optimizer, d.nvme_dir)
    if d.zero_stage == 3:
        zero.update(stage3_prefetch_bucket_size="auto", stage3_param_persistence_threshold="auto")
        if d.offload_params != "none":
            zero["offload_param"] = _offload(d.offload_params, d.nvme_dir)
    return {
        "train_micro_batch_size_per_gpu": cfg.train.batch_size,
        "gradient_accumulation_steps": 1,
        "train_batch_size": "auto",
        "gradient_clipping": cfg.train.max_grad_norm or 0.0,
        "zero_optimization": zero,
        "bf16": {"enabled": precision == "bf16"},
        "fp16": {"enabled": precision == "fp16"},
        "zero_allow_untested_optimizer": True,
        "zero_force_ds_cpu_optimizer": on_gpu,
        "steps_per_print": 2**31 - 1,  # our progress bar and metrics.jsonl say it
    }


def fill_sizes(plugin: Any, model: Any) -> None:
    """The ZeRO sizes accelerate derives from model.config.hidden_size ("auto"), from the text config's when the
    top config has none (a vision-language model's), where accelerate would stop asking for integers."""
    config = getattr(model, "config", None)
    if config is None or getattr(config, "hidden_size", None) is not None or not hasattr(config, "get_text_config"):
        return  # accelerate fills them
    hidden = int(getattr(config.get_text_config(), "hidden_size", 0) or 0)
    if not hidden:
        return  # accelerate names the keys it cannot fill
    zero = plugin.hf_ds_config.config["zero_optimization"]
    sizes = {
        "reduce_bucket_size": hidden * hidden,
        "stage3_prefetch_bucket_size": int(0.9 * hidden * hidden),
        "stage3_param_persistence_threshold": 10 * hidden,
    }
    for key, value in sizes.items():
        if zero.get(key) == "auto":
            zero[key] = value
