"""The ordered apply step: every technique that changes a loaded model, one step each, in the order it must come.

    applied = apply_techniques(model, cfg, device, say, given=False, disk_store=None)
    with applied.activations.saving():          # the forward of each micro-batch
        loss = model(**batch).loss

As torchtitan's parallelize function: the steps run in the order of STEPS, and each step's
`why` says why it stands there. A step looks at the recipe, changes the model or leaves it,
and returns the line the run says about it (or None). Sharding (parallel/) comes later,
on the model these steps return; what the loop holds on to is `Applied`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from finetune.config.schema import RecipeConfig, resolve_offload_dir
from finetune.memory.activation_disk import ParkingFiles
from finetune.memory.activation_offload import ActivationOffload, NoActivationOffload, offloaded_checkpoint
from finetune.memory.host_tables import HostTables
from finetune.memory.optimizer_offload import HostAdamW
from finetune.memory.stream import DiskStore, WeightStream
from finetune.memory.tiled_mlp import tile_mlps
from finetune.metrics import human_bytes
from finetune.model.kernels import apply_kernels
from finetune.model.load import checkpoint_with, compile_decoder_layers, count_parameters, enable_gradient_checkpointing


@dataclass
class Applied:
    """What the training loop holds on to: the weight store (closed after the run) and the context
    every forward runs in (what it saves for backward may wait in host RAM)."""

    stream: WeightStream | None = None  # memory.base_weights=cpu|disk
    activations: ActivationOffload | NoActivationOffload = field(default_factory=NoActivationOffload)
    kernels: str = "none"  # what model.kernels chose (a run records what auto chose: runs/choices.py)
    tiled_mlps: int = 0  # decoder-layer MLPs memory.tiled_mlp tiles
    optimizer: Callable[..., torch.optim.Optimizer] = torch.optim.AdamW  # the recipe's AdamW: in host RAM, or torch's
    loss_memory: tuple[str, int] = ("full", 0)  # memory.loss and its chunk: how the objective runs its head


@dataclass
class Applying:
    """What the steps read, and what they hand on to the loop."""

    cfg: RecipeConfig
    device: torch.device
    given: bool  # the caller built the model (Trainer.from_parts): kernels only when asked
    disk_store: DiskStore | None = None  # memory.base_weights=disk: the file the load already wrote
    applied: Applied = field(default_factory=Applied)


@dataclass(frozen=True)
class Step:
    name: str
    why: str  # why it stands where it does in STEPS
    apply: Callable[[Any, Applying], str | None]


def _checkpointing(model, a: Applying) -> str | None:
    if a.cfg.memory.checkpoint_every:
        enable_gradient_checkpointing(model, a.cfg.memory.checkpoint_every)
    return None


def _kernels(model, a: Applying) -> str | None:
    setting = "none" if a.given and a.cfg.model.kernels == "auto" else a.cfg.model.kernels
    a.applied.kernels = apply_kernels(model, setting, a.device.type)
    if a.applied.kernels == "liger":
        return "kernels: liger-kernel's fused RMSNorm, RoPE and SwiGLU in the decoder layers (model.kernels)"
    if a.applied.kernels == "finetune":
        from finetune.model.fast_lora import triton_note
        from finetune.model.fast_mlp import worth_it

        blocks = ", each gated MLP over them as one" if worth_it(a.device.type) else ""
        return (
            f"kernels: each LoRA'd 4-bit linear as one autograd function{blocks} (model.kernels=finetune), "
            f"with {triton_note(a.device.type)}"
        )
    return None


def _activation_offload(model, a: Applying) -> str | None:
    if a.cfg.memory.activation_offload:
        disk = a.cfg.memory.activation_offload == "disk"  # the checkpointed inputs in files, not host RAM
        files = ParkingFiles(resolve_offload_dir(a.cfg), pinned=a.device.type == "cuda") if disk else None
        a.applied.activations = ActivationOffload(a.device, files=files)
        if a.cfg.memory.checkpoint_every:
            checkpoint_with(model, offloaded_checkpoint)  # each checkpointed layer's input waits in host RAM
    return None


def _tiled_mlp(model, a: Applying) -> str | None:
    tiled = a.applied.tiled_mlps = tile_mlps(model, a.cfg.memory.tiled_mlp)
    if tiled and a.cfg.memory.tiled_mlp != "auto":
        return f"memory: {tiled} decoder-layer MLPs run in {a.cfg.memory.tiled_mlp} tiles of the sequence"
    return None


def _compile(model, a: Applying) -> str | None:
    if a.cfg.train.compile:
        return f"compile: {compile_decoder_layers(model)} decoder layers compile at their first step (torch.compile)"
    return None


def _optimizer_offload(model, a: Applying) -> str | None:
    a.applied.optimizer = HostAdamW if a.cfg.memory.optimizer_offload else torch.optim.AdamW
    return None


def _chunked_loss(model, a: Applying) -> str | None:
    a.applied.loss_memory = (a.cfg.memory.loss, a.cfg.memory.loss_chunk)  # the objective takes it (Loss.use_memory)
    return None


def _summary(model, a: Applying) -> str | None:
    return model_summary(a.cfg, model)


def _stream(model, a: Applying) -> str | None:
    if a.cfg.memory.base_weights != "device":
        a.applied.stream = WeightStream.attach(
            model,
            a.cfg.memory.base_weights,
            a.device,
            resolve_offload_dir(a.cfg),
            store=a.disk_store,
            device_layers=a.cfg.memory.device_layers,
        )
    return None  # the loop says where the weights went once the accelerator has placed the model


def _host_tables(model, a: Applying) -> str | None:
    if a.cfg.memory.embeddings != "cpu":
        return None
    tables = HostTables.attach(model, a.device)
    visits = (
        f"; the LM head visits {a.device} for the loss" if tables.head is not None else ""
    )  # (a first pipeline stage has none)
    return f"memory: {human_bytes(tables.parked_bytes)} of frozen vocabulary tables live in host RAM{visits}"


STEPS = (
    Step(
        "activation checkpointing",
        "marks the decoder layers that recompute in backward and gives them torch's checkpoint, which offload replaces",
        _checkpointing,
    ),
    Step("kernels", "fused modules replace the model's own before any wrapper below captures them", _kernels),
    Step(
        "activation offload",
        "sets the layers' checkpoint function, which tiling's checkpoints run inside",
        _activation_offload,
    ),
    Step("tiled MLP", "wraps the MLPs' forward, after kernels replaced their activations", _tiled_mlp),
    Step("compile", "compiles each decoder layer as every wrapper above left it", _compile),
    Step("summary", "counts parameters while they are still on the model (the store takes them next)", _summary),
    Step("streaming", "moves the frozen layer weights to their store; the model is complete by now", _stream),
    Step("host tables", "after the stream, whose model.to(device) would bring the tables back", _host_tables),
    Step(
        "optimizer offload", "AdamW over the trainable parameters the model now holds, its state in host RAM", _optimizer_offload
    ),
    Step("chunked loss", "the head and loss over chunks of targets: the objective runs it, on this model", _chunked_loss),
)


def weights_capture(cfg: RecipeConfig) -> DiskStore | None:
    """memory.base_weights=disk: the file the load writes the 4-bit weights into as bitsandbytes quantizes them (the
    whole quantized model, ~37 GB for 70B, is never in RAM, not even while loading); None where nothing is captured
    (DoRA reads and PiSSA rewrites every base weight when it wraps the model). The one step that acts while loading."""
    if cfg.memory.base_weights != "disk" or (cfg.lora is not None and cfg.lora.adapter.wrap_touches_base):
        return None
    return DiskStore(resolve_offload_dir(cfg))


def apply_techniques(
    model,
    cfg: RecipeConfig,
    device: torch.device,
    say: Callable[[str], None],
    given: bool = False,
    disk_store: DiskStore | None = None,
) -> Applied:
    """Apply STEPS in order; what the loop keeps of them."""
    applying = Applying(cfg, device, given, disk_store)
    for step in STEPS:
        line = step.apply(model, applying)
        if line:
            say(line)
    return applying.applied


def model_summary(cfg: RecipeConfig, model) -> str:
    trainable, total = count_parameters(model)
    quant = f"{cfg.quant.bits}-bit {cfg.quant.quant_type if cfg.quant.bits == 4 else 'int8'}" if cfg.quant.bits else "unquantized"
    return f"model: {total:,} parameters ({quant} base), {trainable:,} trainable ({100 * trainable / max(total, 1):.2f}%)"
