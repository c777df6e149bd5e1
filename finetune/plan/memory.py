"""Per-GPU memory of one setup: every tensor a step keeps, with the reason for each term, plus
host RAM and disk (`estimate`). What each tensor costs follows from how this toolkit trains
(model/load.py, trainer/)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from finetune.declarations.splits import CONTEXT, SPLITS
from finetune.gpus import GiB, GpuSpec
from finetune.plan.activations import OFFLOAD_LAYERS_IN_FLIGHT, Activations, activation_terms  # noqa: F401 - re-exported
from finetune.plan.host import DEFAULT_SHARD_BYTES, HOST_BASELINE_BYTES, disk_needs, disk_wear_note, host_ram_needs  # noqa: F401 - re-exported
from finetune.plan.images import ImageTerms, image_components, image_note, image_terms
from finetune.plan.inputs import DEFAULT_IMPL, Implementation, RecipeFacts, Setup
from finetune.plan.shape import ModelShape
from finetune.plan.speed import NVME_READ_GBPS, step_time
from finetune.plan.terms import (  # noqa: F401 - NF4_BLOCK*, quantized_bytes: re-exported with the rest of the model
    NF4_BLOCK,
    NF4_BLOCK2,
    Sampling,
    Transient,
    adapts_experts,
    backward_working_bytes_per_token,
    expert_stack_saved_bytes,
    expert_weight_bytes,
    layer_saved_bytes_per_token,
    loss_peak_bytes,
    mlp_saved_bytes_per_token,
    pinned_block_bytes,
    quantized_bytes,
    sampling_terms,
    trainable_params,
    transient_terms,
)

# One set of constants for every prediction (CLI, preflight, validation); each says where it comes from.
# These are the memory ones; speed.py, fitting.py and check.py hold the others.
CUDA_CONTEXT_BYTES = 512 * 1024**2  # CUDA context + cuBLAS workspace: ~0.3-0.6 GiB on Ampere/Hopper drivers
ALLOCATOR_SLACK = 0.10  # caching-allocator reserved / allocated - 1: block rounding and fragmentation
STREAMED_LAYERS_RESIDENT = 3  # memory/stream.py: the layer computing, the prefetched next one, and in backward the one finishing


# `plan --json` prints the planner's own fields around the memory modes (Setup inherits those first),
# in the order it always has: these, then the modes in their declared order, then the rest.
_JSON_FIRST = ("batch_size", "grad_accum", "gpus", "checkpoint_every", "seq_len", "sharding", "cpu_offload")


# The grid's dimensions under the names a recipe gives them (plan --json's setup speaks the recipe's words).
_JSON_NAMES = {
    **{split.dim: split.field for split in SPLITS},
    "cp_mode": f"{CONTEXT.field}_mode",
    "sp": "sequence_parallel",
    "vp": "vocab_parallel",
}


def _in_json_order(setup: dict[str, Any]) -> dict[str, Any]:
    rank = {key: i for i, key in enumerate(_JSON_FIRST)}
    named = {_JSON_NAMES.get(key, key): value for key, value in setup.items()}
    return dict(sorted(named.items(), key=lambda kv: rank.get(kv[0], len(rank))))


@dataclass
class Component:
    key: str
    label: str
    bytes: int
    in_peak: bool = True  # transient components of the phase that is not the peak are listed, not summed
    note: str = ""


@dataclass
class Estimate:
    shape: ModelShape
    setup: Setup
    gpu: GpuSpec | None
    components: list[Component]
    peak_phase: str
    peak_allocated_bytes: int
    peak_bytes: int
    step_time_s: float
    step_time_parts: dict[str, float]
    host_ram_bytes: int
    disk_bytes: int
    trainable_params: int
    impl: Implementation = DEFAULT_IMPL
    notes: list[str] = field(default_factory=list)
    host_ram_parts: dict[str, int] = field(default_factory=dict)  # per process; host_ram_bytes is for all of them
    disk_parts: dict[str, int] = field(default_factory=dict)
    loads_whole_model: bool = False  # FSDP and streaming build the whole quantized model in host RAM while loading
    loads_on_gpu: bool = False  # streaming with memory.device_layers loads on the GPU, then moves the streamed layers

    @property
    def memory_bytes(self) -> int | None:
        return self.gpu.memory_bytes if self.gpu else None

    @property
    def fits(self) -> bool:
        return self.memory_bytes is None or self.peak_bytes <= self.memory_bytes

    @property
    def headroom_bytes(self) -> int | None:
        return None if self.memory_bytes is None else self.memory_bytes - self.peak_bytes

    @property
    def peak_reserved_bytes(self) -> int:
        """What torch.cuda.max_memory_reserved() would show: allocated plus allocator slack."""
        return self.peak_allocated_bytes + self.component("allocator_slack")

    def component(self, key: str) -> int:
        return next((c.bytes for c in self.components if c.key == key), 0)

    def to_dict(self) -> dict[str, Any]:
        return {
            "model": self.shape.source,
            "gpu": self.gpu.name if self.gpu else None,
            "gpu_memory_bytes": self.memory_bytes,
            "setup": _in_json_order(asdict(self.setup)),
            "components": {c.key: c.bytes for c in self.components},
            "in_peak": [c.key for c in self.components if c.in_peak],
            "peak_phase": self.peak_phase,
            "peak_allocated_bytes": self.peak_allocated_bytes,
            "peak_reserved_bytes": self.peak_reserved_bytes,
            "peak_bytes": self.peak_bytes,
            "fits": self.fits,
            "headroom_bytes": self.headroom_bytes,
            "step_time_s": self.step_time_s,
            "step_time_parts_s": self.step_time_parts,
            "tokens_per_s": self.tokens_per_step / self.step_time_s if self.step_time_s else None,
            "host_ram_bytes": self.host_ram_bytes,
            "host_ram_parts": self.host_ram_parts,
            "disk_bytes": self.disk_bytes,
            "disk_parts": self.disk_parts,
            "trainable_params": self.trainable_params,
            "total_params": self.shape.total_params,
            "notes": self.notes,
        }

    @property
    def tokens_per_step(self) -> int:
        return self.setup.global_batch * self.setup.seq_len


@dataclass
class _Static:
    """What sits on each GPU (or host) whatever the step does: weights, adapters, grads, optimizer state."""

    q_weight: int
    q_const: int
    unquantized: int
    whole_model: int  # as loaded, before sharding or streaming
    trainable: int
    adapter_bytes: int
    lora: int
    grads: int
    optim: int
    gathered: int = 0  # FSDP: two layers gathered at a time
    streamed_resident: int = 0  # base_weights=cpu|disk: the layers on the GPU
    streamed_store: int = 0  # base_weights=cpu|disk: the layers in host RAM or the file
    ddp_buckets: int = 0
    offloaded: int = 0  # FSDP cpu_offload: every shard in host RAM
    host_optimizer: int = 0  # optimizer_offload: HostAdamW's fp32 copies in host RAM
    host_tables: int = 0  # memory.embeddings=cpu: the vocabulary tables in host RAM
    host_head: int = 0  # of those, the head's store (a tied table's only one): pinned, and what visits the GPU
    linear_blocks: int = 0  # the decoder linears' packed weights as pinned blocks (base_weights=cpu on a GPU)

    @property
    def on_gpu(self) -> int:
        return (
            self.q_weight
            + self.q_const
            + self.streamed_resident
            + self.unquantized
            + self.lora
            + self.grads
            + self.optim
            + self.ddp_buckets
            + self.gathered
        )


def _static_terms(shape: ModelShape, recipe: RecipeFacts, setup: Setup, impl: Implementation, fsdp: bool) -> _Static:
    b, n_gpu, L = recipe.compute_bytes, max(setup.gpus, 1), shape.layers
    unq_bytes = impl.unquantized_bytes or b
    q_weight = q_const = linear_blocks = 0
    for g in shape.linears:
        double = recipe.double_quant and g.name not in setup.fp32_absmax
        w, c = quantized_bytes(g.in_features * g.out_features, g.out_features, recipe.quant_bits, double, b)
        q_weight += w * g.count
        q_const += c * g.count
        linear_blocks += pinned_block_bytes(w) * g.count  # memory/stream.py pins each linear's weight on its own
    unquantized = (shape.embedding_params + shape.head_params + shape.other_params) * unq_bytes
    w, c, u = expert_weight_bytes(shape, recipe)  # MoE: every expert (finetune/model/moe.py)
    q_weight, q_const, unquantized = q_weight + w, q_const + c, unquantized + u
    on_host = setup.embeddings == "cpu"
    host_tables = (shape.embedding_params + shape.head_params) * unq_bytes if on_host else 0
    trainable = trainable_params(shape, recipe)
    adapter_bytes = impl.adapter_bytes if recipe.lora else (4 if b == 4 else b)
    grads = trainable * adapter_bytes
    t = _Static(
        q_weight,
        q_const,
        unquantized,
        q_weight + q_const + unquantized,
        trainable,
        adapter_bytes,
        lora=grads if recipe.lora else 0,
        grads=grads,
        optim=grads * impl.optimizer_states,
        host_tables=host_tables,
        host_head=shape.head_matmul_params * unq_bytes if on_host else 0,
        linear_blocks=linear_blocks,
    )
    t.unquantized -= host_tables
    strategy, multi = setup.strategy, n_gpu > 1
    zero = multi and strategy.deepspeed
    if fsdp:
        # Decoder layers are sharded; FSDP's root unit (embeddings, head, final norm) stays whole,
        # ZeRO-3 partitions those too. Two layers are gathered at a time (the running one and the
        # prefetched one; ZeRO-3's prefetch bucket is smaller than a 7B+ layer: the same bound).
        t.gathered = int(2 * (t.q_weight + t.q_const) / L)
        t.q_weight, t.q_const = int(t.q_weight / n_gpu), int(t.q_const / n_gpu)
        t.lora, t.grads, t.optim = t.lora // n_gpu, t.grads // n_gpu, t.optim // n_gpu
        t.unquantized = t.unquantized // n_gpu if strategy.partitions_root else t.unquantized
    # ZeRO-2: gradients and optimizer state partitioned, every weight whole on every GPU
    elif multi and strategy.partitions_optimizer:
        t.grads, t.optim = t.grads // n_gpu, t.optim // n_gpu
    elif setup.streams_weights:
        # memory.base_weights=cpu|disk (memory/stream.py): the decoder linears' packed weights wait on the host
        # and at most three layers' worth are on the GPU; their quantization constants stay resident.
        # memory.device_layers keep theirs on the GPU: only the others stream.
        streamed = L - min(setup.device_layers, L)
        t.streamed_store = int(t.q_weight * streamed / L)
        t.streamed_resident = int(min(STREAMED_LAYERS_RESIDENT, streamed) * t.q_weight / L)
        t.linear_blocks = int(t.linear_blocks * streamed / L)
        t.q_weight -= t.streamed_store
    t.ddp_buckets = t.grads if (multi and strategy.replicates) else 0  # DDP's all-reduce buckets mirror the gradients
    if zero and fsdp and setup.cpu_offload:
        # offload_params: the weight partitions wait in host RAM; gathered to the GPU as each layer runs.
        t.offloaded = t.q_weight + t.q_const + t.lora + t.unquantized
        t.q_weight = t.q_const = t.lora = t.unquantized = 0
    elif fsdp and setup.cpu_offload:
        # FSDP's CPUOffloadPolicy: every shard (4-bit weights, adapters, their gradients and AdamW
        # state) stays in host RAM; the GPU holds only what is gathered for the running layers.
        t.offloaded = t.q_weight + t.q_const + t.lora + t.grads + t.optim
        t.q_weight = t.q_const = t.lora = t.grads = t.optim = 0
    if setup.optimizer_offload and (zero or not setup.cpu_offload):
        # HostAdamW (memory/optimizer_offload.py), or ZeRO's offload_optimizer (its partition): an fp32 copy of each
        # trainable weight, its fp32 gradient and both fp32 moments live in host RAM (pinned); the GPU
        # keeps the weights and their gradients.
        t.host_optimizer = (trainable // n_gpu if multi and strategy.partitions_optimizer else trainable) * 4 * 4
        t.optim = 0
    return t


# Of the free memory kept free when a streaming run loads on the GPU first (trainer/build.py): loading allocates its
# tensors once each (little fragmentation); the margin holds the largest weight's 16-bit copy before it is quantized.
LOAD_ON_GPU_MARGIN = 0.05


def load_bytes(setup: Setup, st: _Static) -> int:
    """What a process holds on its device when it loads its (share of the) model whole: every decoder layer's 4-bit
    weights and absmax, the tables as loaded (before vocab_parallel cuts them; the norms counted alike, a rounding),
    the adapter."""
    tables = st.unquantized * setup.tables_at_load + st.host_tables  # memory.embeddings=cpu moves them after the load
    return st.q_weight + st.streamed_store + st.q_const + tables + st.lora


def streaming_loads_on_gpu(setup: Setup, st: _Static, card_bytes: int) -> bool:
    """memory.device_layers: the model loads on the GPU when its whole (share) fits there with LOAD_ON_GPU_MARGIN
    free, and only the streamed layers move to host RAM (memory/stream.py), which never holds the kept ones."""
    fits = load_bytes(setup, st) <= (1 - LOAD_ON_GPU_MARGIN) * (card_bytes - CUDA_CONTEXT_BYTES)  # free: no context
    return setup.streams_weights and setup.device_layers > 0 and fits


def estimate(
    shape: ModelShape,
    recipe: RecipeFacts,
    setup: Setup,
    gpu: GpuSpec | None,
    impl: Implementation = DEFAULT_IMPL,
    *,
    keep_checkpoints: int = 2,
    model_on_disk: bool = False,
    shard_bytes: int | None = None,
    held: float = 1.0,
    attention_buffers: int = 0,
    attention_rebuilt: int = 0,
) -> Estimate:
    """Per-GPU memory, step time, host RAM and disk of one setup. gpu=None: a CPU run (no CUDA terms).
    held: micro-batches whose saved activations wait for their backward at once (a pipeline rank: plan/stages.py).
    attention_buffers: a split attention's buffers while one layer's attention runs (context parallelism,
    plan/context.py), with attention_rebuilt, what of that layer and its gradients is alive then: a third phase."""
    n_gpu = max(setup.gpus, 1)
    fsdp = setup.partitions_weights  # FSDP or ZeRO-3: the base weights are split over the GPUs
    unq_bytes = impl.unquantized_bytes or recipe.compute_bytes
    st = _static_terms(shape, recipe, setup, impl, fsdp)
    one = activation_terms(shape, recipe, setup, gpu, st.trainable)  # a micro-batch's (what each step moves, m times)
    act = one.times(held)
    tr = transient_terms(shape, recipe, setup, impl, st.host_head)
    gen = sampling_terms(shape, recipe, setup, impl.adapter_bytes)
    b, tower = recipe.compute_bytes, shape.tower
    img = image_terms(tower, recipe.max_pixels, setup.rows, setup.seq_len, b, recipe.adapts_vision, setup.checkpoint_every > 0)
    phases = _phases(st, act, tr, gen, attention_rebuilt, attention_buffers, img or ImageTerms(0, 0, 0, 0, 0, 0))
    running = max(phases, key=lambda k: phases[k])  # ties: the first (the loss phase, as before)
    peak_alloc = phases[running]
    # ZeRO-3 builds its engine from the whole model on each GPU (our loader places it with a
    # device_map, which zero.Init refuses) and partitions it then: offload cannot lower that.
    start = st.whole_model if setup.strategy.starts_whole_on_gpu and n_gpu > 1 else 0
    phase = "start" if start > peak_alloc else running
    peak_alloc = max(peak_alloc, start)
    slack = int(ALLOCATOR_SLACK * peak_alloc) if gpu is not None else 0
    context = CUDA_CONTEXT_BYTES if gpu is not None else 0
    split = (attention_rebuilt, attention_buffers)
    comps = _components(shape, recipe, setup, st, act, tr, gen, unq_bytes, running, split, slack, context)
    comps[-2:-2] = [Component(*c) for c in image_components(img, running)] if img else []  # before slack and context
    step, parts = step_time(
        shape,
        recipe,
        setup,
        gpu,
        st.trainable,
        st.q_weight + st.q_const + st.offloaded,
        st.adapter_bytes,
        fsdp,
        streamed_bytes=st.streamed_store,
        activation_bytes=act.host,
        parked_bytes=one.disk,
        exposed_bytes=tr.head_visit + (setup.rows * setup.seq_len * shape.hidden * recipe.compute_bytes if tr.head_visit else 0),
    )
    fsdp_loads = setup.strategy.loads_whole_on_host and n_gpu > 1  # ZeRO loads on the GPU: one shard at a time in RAM
    on_gpu = gpu is not None and streaming_loads_on_gpu(setup, st, gpu.memory_bytes)
    host_parts, captured = host_ram_needs(shape, recipe, setup, st, act, fsdp_loads, shard_bytes, gpu is not None, on_gpu)
    disk_parts = disk_needs(shape, st, setup, impl, keep_checkpoints, model_on_disk, parked=act.disk * n_gpu)
    return Estimate(
        shape=shape,
        setup=setup,
        gpu=gpu,
        components=comps,
        peak_phase=phase,
        peak_allocated_bytes=peak_alloc,
        peak_bytes=peak_alloc + slack + context,
        step_time_s=step,
        step_time_parts=parts,
        host_ram_bytes=host_parts.pop("total") * n_gpu,
        disk_bytes=sum(disk_parts.values()),
        trainable_params=st.trainable,
        impl=impl,
        notes=_notes(setup, gpu, st, start, one.disk) + ([image_note(img, setup.seq_len, recipe.max_pixels)] if img else []),
        host_ram_parts=host_parts,
        disk_parts=disk_parts,
        loads_whole_model=(setup.streams_weights and not captured and not on_gpu) or fsdp_loads,
        loads_on_gpu=on_gpu,
    )


def _streamed_label(layers: int, kept: int) -> str:
    streamed = layers - min(kept, layers)
    if not kept:
        return f"base weights streamed ({min(STREAMED_LAYERS_RESIDENT, layers)} of {layers} layers)"
    return f"base weights streamed ({min(STREAMED_LAYERS_RESIDENT, streamed)} of {streamed} at once; {kept} layers kept)"


def _phases(
    st: _Static, act: Activations, tr: Transient, gen: Sampling, rebuilt: int, buffers: int, img: ImageTerms
) -> dict[str, int]:
    """Bytes allocated at each moment of a step that can be its peak, over what every moment holds (st.on_gpu)."""
    saved = act.saved + img.pixels + img.saved  # a VLM's pixel values stay with the batch, its tower's saved tensors too
    phase_loss = st.on_gpu + saved + tr.mask + tr.final_norm + tr.loss + tr.head_visit
    phase_backward = st.on_gpu + saved + tr.mask + act.recompute + tr.working + tr.dequant
    # A layer's attention runs backward after its MLP's (whose tensors are gone by then): only with buffers of its own
    # can that moment be the step's peak.
    phase_attention = st.on_gpu + saved + tr.mask + rebuilt + buffers + tr.dequant
    # An online objective samples the step's completions before its first forward, when the last step's
    # zero_grad(set_to_none=True) has freed the gradients and nothing is saved for backward; its matmuls dequantize.
    phase_sampling = st.on_gpu - st.grads + gen.peak + tr.dequant + tr.head_visit
    return {
        "loss": phase_loss,
        "backward": phase_backward,
        "attention": phase_attention if buffers else 0,
        "sampling": phase_sampling if gen.peak else 0,
        "vision": st.on_gpu + img.pixels + img.saved + img.forward if img.forward else 0,  # before the language model runs
    }


def _components(
    shape: ModelShape,
    recipe: RecipeFacts,
    setup: Setup,
    st: _Static,
    act: Activations,
    tr: Transient,
    gen: Sampling,
    unq_bytes: int,
    phase: str,
    split: tuple[int, int],
    slack: int,
    context: int,
) -> list[Component]:
    """Every term of the estimate, labelled (split: a split attention's rebuilt tensors and buffers)."""
    loss_peak, backward, sampling = phase == "loss", phase == "backward", phase == "sampling"
    return [
        Component("weights_quantized", f"base weights ({_quant_label(recipe)})", st.q_weight),
        Component(
            "weights_streamed",
            _streamed_label(shape.layers, setup.device_layers),
            st.streamed_resident,
        ),
        Component("quant_constants", "quantization constants (absmax)", st.q_const),
        Component(
            "weights_unquantized",
            ("norms, biases" if st.host_tables else "embeddings, head, norms, biases")
            + (", vision tower" if shape.vision_params else "")
            + f" ({_dtype_label(unq_bytes)})",
            st.unquantized,
        ),
        Component(
            "lora_weights", f"LoRA weights ({_dtype_label(st.adapter_bytes)})" if recipe.lora else "trained weights", st.lora
        ),
        Component("gradients", "gradients of trained weights", st.grads, in_peak=not sampling),
        Component("optimizer_state", "AdamW state (2 moments)", st.optim),
        Component("ddp_buckets", "DDP all-reduce buckets", st.ddp_buckets),
        Component("fsdp_gathered", "FSDP gathered layers (2)", st.gathered),
        *_sampling_components(setup, gen, sampling),
        Component("activations", act.label, act.saved, in_peak=not sampling),
        Component("attention_mask", "attention mask (padded or packed rows)", tr.mask, in_peak=not sampling),
        Component("logits_loss", "logits and loss buffers", tr.loss, in_peak=loss_peak),
        Component("final_norm", "final norm input (fp32)", tr.final_norm, in_peak=loss_peak),
        Component("head_visit", "LM head visiting from host RAM for the loss", tr.head_visit, in_peak=loss_peak or sampling),
        Component("recompute_layer", "one layer recomputed in backward", act.recompute, in_peak=backward),
        Component("backward_working", "backward gradients of one layer", tr.working, in_peak=backward),
        Component(
            "attention_rebuilt", "one layer's attention inputs and gradients in backward", split[0], in_peak=phase == "attention"
        ),
        Component("context_buffers", _split_label(setup), split[1], in_peak=phase == "attention"),
        Component("dequant_buffer", "dequantized weight of one matmul", tr.dequant, in_peak=not loss_peak),
        Component("allocator_slack", f"allocator fragmentation ({ALLOCATOR_SLACK:.0%})", slack),
        Component("cuda_context", "CUDA context and cuBLAS workspace", context),
    ]


def _sampling_components(setup: Setup, gen: Sampling, in_peak: bool) -> list[Component]:
    """An online objective's KV cache and generate's buffers, at the larger of its two peaks (terms.Sampling)."""
    rows, prompt = setup.rows, setup.prompt_len
    if gen.prefills_at_peak:
        prompts, fed = setup.prefill  # (each prompt once, its completions sharing its cache)
        return [
            Component("kv_cache", f"KV cache, sampling ({prompts} x {fed} prompt tokens)", gen.prompt_cache, in_peak=in_peak),
            Component("sampling_buffers", "sampling: one layer's prefill of the prompts", gen.prefill, in_peak=in_peak),
        ]
    tokens = prompt + setup.sampled_tokens - 1
    return [
        Component("kv_cache", f"KV cache, sampling ({rows} x {tokens} tokens)", gen.cache, in_peak=in_peak),
        Component("sampling_buffers", "sampling: logits, probabilities, cache growth", gen.decode, in_peak=in_peak),
    ]


def _notes(setup: Setup, gpu: GpuSpec | None, st: _Static, zero3_start: int = 0, parked: int = 0) -> list[str]:
    """parked: the bytes each process writes to disk a micro-batch (activation_offload=disk)."""
    notes = [disk_wear_note(setup, parked)] if parked else []
    if zero3_start:
        notes.append(
            f"ZeRO-3 starts from the whole model on each GPU ({gib(zero3_start)}) and partitions it when the engine "
            "is built: the peak is at least that, offload or not (why ZeRO-3 + QLoRA + CPU offload can need more GPU "
            "memory than its training terms; FSDP loads in CPU RAM and moves only its shards)"
        )
    if gpu is not None and gpu.name == "custom":
        notes.append(f"unknown GPU: speed assumed {gpu.bf16_tflops:.0f} TFLOPs, {gpu.bandwidth_gbps:.0f} GB/s")
    if setup.base_weights == "disk":
        notes.append(
            f"base_weights=disk: step time assumes reads from the NVMe disk at {NVME_READ_GBPS:g} GB/s; with "
            f"{gib(st.streamed_store)} of free RAM for the page cache the file stays cached and streams like base_weights=cpu"
        )
    return notes


def _split_label(setup: Setup) -> str:
    if setup.cp_mode == "ulysses":
        return "Ulysses all-to-all buffers (q, k, v, out sent and received)"
    return "ring attention buffers (K/V blocks in flight, fp32 accumulators)"


def _quant_label(recipe: RecipeFacts) -> str:
    if recipe.quant_bits == 4:
        return "NF4, double quant" if recipe.double_quant else "NF4"
    return "int8" if recipe.quant_bits == 8 else _dtype_label(recipe.compute_bytes)


def _dtype_label(nbytes: int) -> str:
    return {2: "bf16", 4: "fp32", 1: "int8"}.get(nbytes, f"{nbytes} B")


def gib(n: float) -> str:
    return f"{n / GiB:.2f} GiB"
