"""FSDP2's room: torch's `fully_shard` over each decoder layer, then the root; every rank holds a shard of
the weights, gradients and AdamW state, and checkpoints gather them whole.

Applied here rather than through accelerate's plugin because accelerate only offers FSDP on GPUs: one
code path, the same on CPU (gloo, tested) and GPU (NCCL). QLoRA under FSDP stores the 4-bit weights in
the compute dtype (bnb_4bit_quant_storage), so FSDP shards and all-gathers them like any other tensor;
bitsandbytes re-attaches each weight's quantization state from its module after the all-gather.
"""

from __future__ import annotations

from contextlib import nullcontext
from typing import Any

import torch

from finetune.config.schema import RecipeConfig, fsdp_problems
from finetune.hardware import release_free_heap
from finetune.model.load import decoder_layers
from finetune.parallel import waits
from finetune.parallel.room import Room, data_parallel_line


class FSDP(Room):
    name = "fsdp"
    replicates = False
    sharded = True
    wraps_layers = True

    @classmethod
    def problems(cls, cfg: RecipeConfig, accelerator) -> list[str]:
        """What FSDP cannot run when `auto` chose it (an explicit fsdp is refused by the recipe's own checks)."""
        return fsdp_problems(cfg, "FSDP (chosen by distributed.strategy=auto)") if cfg.distributed.strategy == "auto" else []

    def describe(self) -> str:
        return data_parallel_line(self)

    def load_device(self, device: torch.device, streaming: bool) -> torch.device:
        """CPU RAM, and only this rank's shard moves to the GPU: a whole 4-bit 70B model (~37 GB) would not fit
        one 24 GB card even for a moment."""
        return torch.device("cpu")

    def shard(self, model, compute_dtype: torch.dtype):
        """Sharded before the optimizer exists (its state is then sharded too)."""
        shard_model(model, self.cfg, compute_dtype)
        place_sharded(model, self.accelerator.device, keep_params_on_cpu=self.cfg.distributed.cpu_offload)
        release_free_heap()  # the whole model each process loaded, now that it keeps only its shards
        return model

    def prepare(self, model, optimizer):
        return model, self.accelerator.prepare(optimizer)  # accelerate would wrap the model in DDP

    def gradient_sync(self, model, last: bool):
        """Only the window's last micro-batch reduce-scatters gradients."""
        model.set_requires_gradient_sync(last)
        return nullcontext()

    def full_states(self, model, optimizer) -> tuple[dict[str, torch.Tensor] | None, dict[str, Any] | None]:
        return full_trainable_state(model), full_optimizer_state(optimizer)

    def full_weights(self, model) -> dict[str, torch.Tensor] | None:
        return full_trainable_state(model)


def time_gathers() -> None:
    """FSDP2's collectives, timed (parallel/waits.py: the straggler watch takes them out of a rank's compute): a unit's
    all-gather as it is issued and waited for (a CPU's gloo blocks in the first, a GPU's compute stream in the second)
    and its gradients' reduce-scatter. Private methods of torch's: where this torch lacks one, its waits stay in the
    compute."""
    from torch.distributed.fsdp._fully_shard import _fsdp_param_group

    group = getattr(_fsdp_param_group, "FSDPParamGroup", None)
    for name in ("unshard", "wait_for_unshard", "post_backward"):
        method = getattr(group, name, None)
        if method is not None and not getattr(method, "timed", False):
            setattr(group, name, _timed(method))


def _timed(method: Any) -> Any:
    def timed(self, *args: Any, **kwargs: Any) -> Any:
        with waits.collective(self.device):
            return method(self, *args, **kwargs)

    timed.timed = True  # type: ignore[attr-defined]  # wrapped once per process, however many models shard
    return timed


def shard_model(model, cfg: RecipeConfig, compute_dtype: torch.dtype) -> Any:
    """FSDP2: shard each decoder layer, then the rest (embeddings, head, norms) as the root group.

    One all-gather per layer keeps at most ~one layer unsharded at a time;
    reshard_after_forward=false trades that memory for not gathering again in backward (the root never reshards
    between its forward and backward).
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
    time_gathers()
    for layer in decoder_layers(model):
        fully_shard(layer, reshard_after_forward=d.reshard_after_forward, mp_policy=mp, offload_policy=offload)
    # The root (embeddings, head, norms) stays gathered from its forward to the end of backward, as FSDP2 keeps a
    # root by default: backward needs it first anyway, and the chunked loss runs the head after the forward.
    fully_shard(model, reshard_after_forward=False, mp_policy=mp, offload_policy=offload)
    if hasattr(model, "set_reduce_scatter_unused_params"):  # where this torch has it
        # A parameter one rank never used (a vision tower without images, an expert no token chose) reduce-scatters
        # as zeros: every rank's reduce-scatter then holds the same tensors.
        model.set_reduce_scatter_unused_params(True)
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
