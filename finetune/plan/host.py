"""What a setup needs beside the GPU: host RAM per process (loading, pinned stores) and disk (the download,
checkpoints, the adapter, a streamed-weights file)."""

from __future__ import annotations

from typing import Any

from finetune.gpus import GiB
from finetune.plan.activations import Activations
from finetune.plan.inputs import Implementation, RecipeFacts, Setup
from finetune.plan.shape import ModelShape
from finetune.plan.terms import pinned_block_bytes

HOST_BASELINE_BYTES = 3 * GiB  # python + torch + CUDA libraries + tokenizer, per process
DEFAULT_SHARD_BYTES = 5 * 10**9  # transformers' default max_shard_size when the model's shards cannot be seen


RATED_TB_WRITTEN = 600  # a 1 TB consumer NVMe disk's rated endurance (TBW): what activation_offload=disk wears


def disk_wear_note(setup: Setup, parked: int) -> str:
    """What activation_offload=disk writes a step (parked: a process's bytes a micro-batch), against a disk's rating."""
    written = parked * setup.grad_accum
    return (
        f"activation_offload=disk: each process writes {written / 1e9:,.0f} GB a step to the disk (and reads it back): a "
        f"consumer NVMe disk rated for {RATED_TB_WRITTEN} TB written lasts ~{RATED_TB_WRITTEN * 1e12 / written:,.0f} "
        "steps of one process's writes (processes sharing a disk divide that); host RAM (activation_offload=true) "
        "wears nothing"
    )


def disk_needs(
    shape: ModelShape,
    st: Any,
    setup: Setup,
    impl: Implementation,
    keep_checkpoints: int,
    model_on_disk: bool,
    parked: int = 0,
) -> dict[str, int]:
    """Disk by part; st: memory.py's static terms (what sits on each GPU: weights, adapters, optimizer state); parked:
    the checkpointed inputs every process parks at once (activation_offload=disk)."""
    state_bytes = st.trainable * st.adapter_bytes * (1 + impl.optimizer_states)
    return {
        "download": 0 if model_on_disk else shape.total_params * 2,
        "checkpoints": keep_checkpoints * state_bytes,
        "adapter": st.trainable * st.adapter_bytes,
        # the file also holds the kept layers' weights (memory.device_layers) that went there while loading
        "streamed_weights": st.streamed_store + (st.q_weight if setup.device_layers else 0)
        if setup.base_weights == "disk"
        else 0,
        "parked_activations": parked,
    }


def host_ram_needs(
    shape: ModelShape,
    recipe: RecipeFacts,
    setup: Setup,
    st: Any,
    act: Activations,
    fsdp: bool,
    shard_bytes: int | None,
    pinned_blocks: bool = False,
    loads_on_gpu: bool = False,
) -> tuple[dict[str, int], bool]:
    """(host RAM per process by part, with "total"; whether disk mode captures 4-bit weights while loading).

    Loading streams one shard at a time. Streaming loads (and quantizes) the whole model in CPU RAM
    (trainer: it would not fit the GPU even for a moment), then moves its layers to the store;
    base_weights=disk with 4-bit weights sends each one to the file as bitsandbytes quantizes it
    (stream.DiskStore.capture), so only the resident parts are ever in RAM. FSDP: every process
    builds (and quantizes) the whole model in CPU RAM, then shards it; the heap it frees is given
    back (release_free_heap), so the shards it keeps come after that peak, not on top of it.
    DoRA reads them, PiSSA rewrites them, when it wraps the model (trainer/build.py: no capture then).
    pinned_blocks (a GPU run): each pinned store takes a power-of-two block (terms.pinned_block_bytes).
    loads_on_gpu (memory.device_layers, memory.streaming_loads_on_gpu): the model loads on the GPU, one shard in RAM.
    """
    shard = shard_bytes or min(DEFAULT_SHARD_BYTES, shape.total_params * 2)
    captured = setup.base_weights == "disk" and recipe.quant_bits == 4 and not recipe.adapter.wrap_touches_base
    if fsdp:
        loading = shard + st.whole_model
    elif loads_on_gpu:
        loading = shard
    else:
        # the tables go to host RAM after loading; memory.device_layers' weights to the GPU (q_weight: theirs)
        resident = st.q_const + st.unquantized * setup.tables_at_load + st.host_tables + st.q_weight
        loading = shard + ((resident + (0 if captured else st.streamed_store)) if setup.streams_weights else 0)
    streamed_pinned = st.streamed_store if setup.base_weights == "cpu" else 0
    tables = st.host_tables
    if pinned_blocks:  # the pinned stores: each linear's weight, the head's (the embedding table is plain RAM)
        streamed_pinned = st.linear_blocks if streamed_pinned else 0
        tables = tables - st.host_head + pinned_block_bytes(st.host_head)
    pinned = streamed_pinned + act.host_ram + st.host_optimizer + st.offloaded + tables
    parts = {
        "libraries": HOST_BASELINE_BYTES,
        "loading": loading,
        "streamed_weights": streamed_pinned,
        "activations": act.host_ram,
        "optimizer": st.host_optimizer,
        "fsdp_shards": st.offloaded,
        "vocab_tables": tables,
    }
    return {**parts, "total": HOST_BASELINE_BYTES + max(loading, pinned)}, captured
