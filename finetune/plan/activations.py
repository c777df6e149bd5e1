"""What the decoder layers keep for backward, on the GPU and (activation_offload) in host RAM:
checkpointed inputs, whole layers, one layer rebuilt in backward, one MLP tile."""

from __future__ import annotations

from dataclasses import dataclass

from finetune.gpus import GpuSpec
from finetune.plan.inputs import RecipeFacts, Setup
from finetune.plan.shape import ModelShape
from finetune.plan.speed import forward_seconds
from finetune.plan.terms import (
    expert_stack_saved_bytes,
    layer_saved_bytes_per_token,
    mlp_saved_bytes_per_token,
    pinned_block_bytes,
)

OFFLOAD_LAYERS_IN_FLIGHT = 2  # activation offload: the layer being copied out (forward) or back (backward) and the next
# (for checkpointed layers' inputs: the one recomputing and the one prefetched for the recomputation after it)
# activation_offload=disk: checkpointed inputs in host RAM at once, the one being written (forward) or read back
# ahead (backward) and the one copied to or from the GPU (memory/activation_disk.py)
DISK_BLOCKS_IN_FLIGHT = 2


@dataclass
class Activations:
    saved: int  # kept for backward on the GPU (or in flight to host RAM)
    recompute: int  # one layer's activations, rebuilt during its backward
    host: int  # activation_offload: what waits in host RAM (bytes copied)
    label: str  # what they are and which layers keep what
    host_ram: int = 0  # the host RAM that takes: on a GPU each checkpointed input is a pinned block (pinned_block_bytes)
    disk: int = 0  # activation_offload=disk: the checkpointed inputs parked in files (bytes written and read back)
    staging: int = 0  # of host_ram, activation_offload=disk's blocks in flight: as many whatever waits for backward

    def times(self, held: float) -> Activations:
        """The terms of `held` micro-batches waiting for their backward at once (a pipeline rank's)."""
        n = {k: int(getattr(self, k) * held) for k in ("saved", "host", "disk")}
        host_ram = int((self.host_ram - self.staging) * held) + self.staging
        return Activations(recompute=self.recompute, label=self.label, host_ram=host_ram, staging=self.staging, **n)


def activation_terms(shape: ModelShape, recipe: RecipeFacts, setup: Setup, gpu: GpuSpec | None, trainable: int) -> Activations:
    """model/load.py checkpoints layers whose index is a multiple of k: they keep only their input; the
    others keep every activation they save."""
    b, L, T, B = recipe.compute_bytes, shape.layers, setup.seq_len, setup.rows  # sequences per forward
    tokens = B * T
    checkpointed = setup.checkpointed_layers(L)
    # Sequence parallelism (setup.positions_split): the residual stream, so a checkpointed layer's input and the two
    # norms' fp32 inputs, is 1/N of the positions; what the split linears see is gathered whole.
    n = setup.positions_split
    input_only = tokens * b * shape.hidden // n  # a checkpointed layer's input, kept for the recompute
    norms_kept = tokens * 2 * 4 * shape.hidden * (n - 1) // n  # the norms' inputs other ranks hold
    full_layer = tokens * layer_saved_bytes_per_token(shape, recipe, B) - norms_kept + expert_stack_saved_bytes(shape, recipe)
    rebuilt = full_layer  # what one layer's recomputation holds
    tiles = 1 if shape.experts else setup.mlp_tiles(shape.hidden)  # memory/tiled_mlp.py leaves MoE blocks whole
    if tiles > 1:
        # memory.tiled_mlp: each MLP tile is a checkpoint, so a layer keeps only the MLP's input, and
        # one tile's intermediate (gate, SiLU, up; down_proj's LoRA input) exists at a time.
        mlp = tokens * mlp_saved_bytes_per_token(shape, recipe)
        mlp_input = tokens * b * shape.hidden  # gathered whole under sequence parallelism
        full_layer = full_layer - mlp + mlp_input
        rebuilt = rebuilt - mlp + mlp_input + mlp // tiles
    layers_saved = checkpointed * input_only + (L - checkpointed) * full_layer
    host = host_ram = disk = staging = 0
    if setup.activation_offload:
        # memory/activation_offload.py moves what autograd saves, as forward makes it, on a side stream, and brings it
        # back as backward reaches it: all of it for the layers that are not checkpointed, the input
        # of each checkpointed one (activation_offload.offloaded_checkpoint; its recomputation's input comes back one
        # layer ahead, on the side stream). On the GPU: the layers in flight (out in forward, back in
        # backward), plus the copies that fall behind when a layer saves more than the link carries
        # while the next one computes. The first layer's input stays: it is the embeddings' output,
        # a leaf that trains (enable_input_require_grads), which autograd holds until backward anyway.
        kept, parked = L - checkpointed, max(checkpointed - 1, 0)
        host = kept * full_layer + parked * input_only
        block = pinned_block_bytes(input_only) if gpu is not None else input_only
        if setup.activation_offload == "disk":  # the parked inputs in files: host RAM holds the blocks in flight
            disk, staging = parked * input_only, min(parked, DISK_BLOCKS_IN_FLIGHT) * block
            host_ram = kept * full_layer + staging
        else:
            host_ram = kept * full_layer + parked * block
        compute_s = forward_seconds(shape, recipe, setup, gpu, trainable) / L if gpu is not None else 0.0
        first = input_only if checkpointed else 0
        layers_saved = _in_flight(full_layer, kept, compute_s, gpu) + first + _in_flight(input_only, parked, compute_s, gpu)
    # The head's and the loss's buffers are not moved: they are made right before backward needs them.
    saved = layers_saved + 2 * T * shape.head_dim * b  # + RoPE cos and sin, shared by the layers
    if checkpointed == L:
        which = " (checkpointed layer inputs)"
    elif checkpointed == 0:
        which = " (all layers)"
    else:
        which = f" ({checkpointed} checkpointed layers' inputs, all of {L - checkpointed} others)"
    label = ("activations in flight to/from host RAM" if setup.activation_offload else "activations kept for backward") + which
    # In fp32 a recomputed layer's first RMSNorm keeps the layer's input itself (no upcast copy):
    # that is the checkpointed input, counted already. Without checkpointing only a tile is rebuilt.
    recompute = rebuilt - (input_only if b == 4 else 0) if checkpointed else rebuilt - full_layer
    return Activations(saved, recompute, host, label, host_ram, disk, staging)


def _in_flight(per_layer: int, layers: int, compute_s: float, gpu: GpuSpec | None) -> int:
    """Of `layers` layers offloading `per_layer` bytes each, what is on the GPU at the peak: the
    OFFLOAD_LAYERS_IN_FLIGHT being copied, plus a backlog of 1 - compute/copy of a layer per layer."""
    backlog = 0.0
    if gpu is not None and layers:
        copy_s = per_layer / (gpu.pcie_gbps * 1e9)
        backlog = max(0.0, 1 - compute_s / copy_s) * layers
    return int(min(layers, (min(OFFLOAD_LAYERS_IN_FLIGHT, layers) + backlog)) * per_layer)
