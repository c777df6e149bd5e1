"""Memory planner: per-GPU memory and step time of a recipe, before any weight is read.

    from finetune.plan import plan_recipe, fit
    plan = plan_recipe(cfg, find_gpu("rtx4090"), gpus=1)
    print(plan.report())                 # breakdown, peak, verdict, host RAM/disk, step time
    best = fit(cfg, find_gpu("rtx4090"), max_gpus=2)   # fastest setup that fits

Parameter counts come from the model's own config.json: the model is built on
the meta device (no memory, no weights) and every parameter is counted by the
kind of module that holds it. What each tensor costs follows from how this
toolkit trains (model.py, trainer.py), written out in `estimate` below with the
reason for every term. The model was checked against measured CPU allocations
(tests/test_plan_measured.py) and against published GPU peaks of other
frameworks (docs/plan.md; tests/test_plan_published.py).
"""

from __future__ import annotations

import math
import os
from dataclasses import asdict, dataclass, field, replace
from functools import lru_cache
from itertools import product
from pathlib import Path
from typing import Any, Callable

from finetune.config import RecipeConfig
from finetune.errors import FinetuneError, PlanError
from finetune.gpus import GiB, GpuSpec
from finetune.model import model_source

# ----------------------------------------------------------------------------- constants
# One set for every prediction (CLI, preflight, validation); each says where it comes from.

CUDA_CONTEXT_BYTES = 512 * 1024**2  # CUDA context + cuBLAS workspace: ~0.3-0.6 GiB on Ampere/Hopper drivers
ALLOCATOR_SLACK = 0.10  # caching-allocator reserved / allocated - 1: block rounding and fragmentation
FIT_HEADROOM = 0.10  # --fit keeps 10% of the card free: the model's error on published runs reaches ~15%
REFUSE_FACTOR = 1.10  # `finetune run` refuses when the predicted peak exceeds 1.1 x device memory
MATMUL_EFFICIENCY = 0.45  # fraction of dense bf16 peak that LoRA training matmuls reach (MFU of tuned 7B runs: 0.35-0.55)
BANDWIDTH_EFFICIENCY = 0.75  # fraction of spec memory bandwidth reached by the NF4 dequantize kernels
LINK_EFFICIENCY = 0.8  # fraction of link bandwidth reached by NCCL collectives and host copies
HOST_BASELINE_BYTES = 3 * GiB  # python + torch + CUDA libraries + tokenizer, per process
# Host link: GpuSpec.pcie_gbps, the effective one-direction rate of pinned copies (PCIe 4.0 x16:
# ~25 GB/s of 32; PCIe 5.0: ~50). memory.base_weights=disk reads a memory-mapped file: when its
# pages are not in the page cache the NVMe disk sets the rate (PCIe 4.0 NVMe sequential read).
NVME_READ_GBPS = 3.5
HOST_ADAMW_GBPS = 10.0  # host-memory traffic torch's CPU AdamW sustains (an assumption; desktop DDR4/DDR5)
HOST_ADAMW_BYTES_PER_PARAM = 64  # fp32 weight, grad and 2 moments, read and written over AdamW's elementwise passes
STREAMED_LAYERS_RESIDENT = 3  # stream.py: the layer computing, the prefetched next one, and in backward the one finishing
OFFLOAD_LAYERS_IN_FLIGHT = 2  # activation offload: the layer being copied out (forward) or back (backward) and the next
DEFAULT_SHARD_BYTES = 5 * 10**9  # transformers' default max_shard_size when the model's shards cannot be seen
NF4_BLOCK, NF4_BLOCK2 = 64, 256  # bitsandbytes 4-bit block size, and double-quant block size of the absmax


# ----------------------------------------------------------------------------- model shape


@dataclass(frozen=True)
class LinearGroup:
    """All decoder linears of one short name (q_proj, ...): shape and how many there are."""

    name: str
    in_features: int
    out_features: int
    count: int
    bias: bool


@dataclass(frozen=True)
class ModelShape:
    """Everything the memory model needs from config.json, counted on a meta-device model."""

    source: str
    model_type: str
    layers: int
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    tied_embeddings: bool
    linears: tuple[LinearGroup, ...]  # decoder linears: what bitsandbytes quantizes and LoRA targets
    embedding_params: int
    head_params: int  # 0 when the head is tied to the embedding
    other_params: int  # norms, biases, anything not in a quantizable linear
    total_params: int

    @property
    def linear_params(self) -> int:
        return sum(g.in_features * g.out_features * g.count for g in self.linears)

    @property
    def largest_linear(self) -> int:
        return max((g.in_features * g.out_features for g in self.linears), default=0)

    def group(self, name: str) -> LinearGroup | None:
        return next((g for g in self.linears if g.name == name), None)


def _read_config(source: str, trust_remote_code: bool, revision: str | None):
    from transformers import AutoConfig

    local = Path(source)
    if local.is_dir() and not (local / "config.json").is_file():
        raise PlanError(
            f"model config: '{source}' has no config.json",
            hint="point model.path at a Hugging Face model directory (with config.json), or a hub id",
        )
    try:
        return AutoConfig.from_pretrained(source, trust_remote_code=trust_remote_code, revision=revision)
    except Exception as exc:  # transformers raises OSError, ValueError, JSON errors, hub errors
        offline = os.environ.get("HF_HUB_OFFLINE") == "1"
        how = (
            "HF_HUB_OFFLINE=1 is set and the config is not in the HF cache: download it once "
            f"(`huggingface-cli download {source} config.json`) or point model.path at a local directory"
            if offline and not local.exists()
            else "check model.path (a local directory with config.json, or a hub id you can reach); "
            "models with custom code need model.trust_remote_code=true"
        )
        raise PlanError(f"model config: cannot read config.json of '{source}': {str(exc).splitlines()[0]}", hint=how) from None


@lru_cache(maxsize=32)
def read_model_shape(source: str, trust_remote_code: bool = False, revision: str | None = None) -> ModelShape:
    """Count every parameter of the model at `source` by module kind, on the meta device (no weights read)."""
    import torch
    from accelerate import init_empty_weights
    from transformers import AutoModelForCausalLM

    config = _read_config(source, trust_remote_code, revision)
    try:
        with init_empty_weights():
            model = AutoModelForCausalLM.from_config(config, trust_remote_code=trust_remote_code)
    except Exception as exc:
        raise PlanError(
            f"model config: cannot build a causal LM from the config.json of '{source}': {str(exc).splitlines()[0]}",
            hint="the planner needs a model transformers knows (AutoModelForCausalLM); custom code needs model.trust_remote_code=true",
        ) from None
    head = model.get_output_embeddings()
    embed = model.get_input_embeddings()
    tied = head is not None and embed is not None and head.weight is embed.weight
    groups: dict[str, list[Any]] = {}
    counted: set[int] = set()
    other = 0
    for name, module in model.named_modules():
        if module is head or module is embed:
            continue
        if isinstance(module, torch.nn.Linear):
            groups.setdefault(name.rsplit(".", 1)[-1], []).append(module)
            counted.add(id(module.weight))
            if module.bias is not None:
                other += module.bias.numel()  # bitsandbytes keeps biases in the compute dtype
                counted.add(id(module.bias))
    head_params = 0 if (tied or head is None) else head.weight.numel()
    if head is not None:
        counted.add(id(head.weight))
    embedding_params = embed.weight.numel() if embed is not None else 0
    if embed is not None:
        counted.add(id(embed.weight))
    total = 0
    for p in model.parameters():  # parameters() yields a tied weight once
        total += p.numel()
        if id(p) not in counted:
            other += p.numel()
    linears = []
    for short, mods in groups.items():
        shapes = {(m.in_features, m.out_features) for m in mods}
        for fin, fout in sorted(shapes):
            same = [m for m in mods if (m.in_features, m.out_features) == (fin, fout)]
            linears.append(LinearGroup(short, fin, fout, len(same), same[0].bias is not None))
    text = getattr(config, "get_text_config", lambda: config)()
    heads = int(getattr(text, "num_attention_heads"))
    hidden = int(getattr(text, "hidden_size"))
    return ModelShape(
        source=source,
        model_type=str(getattr(config, "model_type", "?")),
        layers=int(getattr(text, "num_hidden_layers")),
        hidden=hidden,
        intermediate=int(getattr(text, "intermediate_size", 4 * hidden)),
        heads=heads,
        kv_heads=int(getattr(text, "num_key_value_heads", None) or heads),
        head_dim=int(getattr(text, "head_dim", None) or hidden // heads),
        vocab=int(getattr(text, "vocab_size")),
        tied_embeddings=tied,
        linears=tuple(linears),
        embedding_params=embedding_params,
        head_params=head_params,
        other_params=other,
        total_params=total,
    )


# ----------------------------------------------------------------------------- what is being planned


@dataclass(frozen=True)
class Setup:
    """One way to run a recipe: the knobs the search turns, and the sequence length.

    A new memory mode is a field here, a Knob in KNOBS, its terms in `estimate`
    and `step_time`, and its recipe key in `setup_of` / `changes_of`.
    """

    batch_size: int
    grad_accum: int
    gpus: int = 1
    checkpoint_every: int = 1  # memory.activation_checkpointing: 1 all layers, 0 none, k every k-th layer
    seq_len: int = 2048
    sharding: str = "ddp"  # ddp: a full copy per GPU; fsdp: layers sharded over the GPUs
    cpu_offload: bool = False  # fsdp: the shards (weights, grads, optimizer state) live in host RAM
    activation_offload: bool = False  # memory.activation_offload: saved activations wait in pinned host RAM
    base_weights: str = "device"  # memory.base_weights: device | cpu | disk (cpu/disk stream one layer at a time)
    optimizer_offload: bool = False  # memory.optimizer_offload: AdamW state and fp32 step in host RAM

    @property
    def global_batch(self) -> int:
        return self.batch_size * self.grad_accum * self.gpus

    @property
    def streams_weights(self) -> bool:
        return self.base_weights != "device"

    def checkpointed_layers(self, layers: int) -> int:
        """How many of `layers` decoder layers recompute in backward (model.py checkpoints index % k == 0)."""
        return 0 if self.checkpoint_every <= 0 else math.ceil(layers / self.checkpoint_every)

    @property
    def offload_rank(self) -> int:
        """How much this setup leans on host RAM and the host link; ties in step time go to the lowest."""
        return (int(self.activation_offload) + int(self.optimizer_offload) + int(self.cpu_offload)
                + {"device": 0, "cpu": 2, "disk": 3}.get(self.base_weights, 3))


@dataclass(frozen=True)
class Implementation:
    """How the training code holds its tensors. DEFAULT is this toolkit.

    Published measurements come from other frameworks; their rows in the
    validation state these inputs as the source describes its run (dtype of
    the adapters, upcast of unquantized weights, loss kernel). The memory model
    itself is the same for every row.
    """

    name: str = "finetune"
    adapter_bytes: int = 4  # peft keeps LoRA weights fp32 (autocast feeds them compute-dtype inputs)
    unquantized_bytes: int | None = None  # None: compute dtype (model.py does not upcast); 4: peft's prepare_model_for_kbit_training
    loss: str = "gather"  # gather: trainer.py's target-row fp32 CE; full_fp32: HF logits.float(); chunked: torchtune compiled chunked CE
    optimizer_states: int = 2  # AdamW: exp_avg and exp_avg_sq, in the adapters' dtype


DEFAULT_IMPL = Implementation()


@dataclass(frozen=True)
class Recipe:
    """The parts of a recipe the memory model reads (a RecipeConfig, or a published run's settings)."""

    quant_bits: int | None
    double_quant: bool
    lora_r: int | None  # None: full fine-tuning
    lora_target: str | tuple[str, ...]
    lora_dropout: float
    dora: bool
    compute_bytes: int  # 2 for bf16/fp16, 4 for fp32
    # CUDA's fused dropout keeps a bool mask; the CPU kernel keeps a mask tensor of the input's dtype.
    dropout_mask_bytes: int = 1

    @classmethod
    def from_config(cls, cfg: RecipeConfig, precision: str, on_gpu: bool = True) -> Recipe:
        lora = cfg.lora
        target = "all-linear" if lora is None else lora.target if isinstance(lora.target, str) else tuple(lora.target)
        return cls(
            quant_bits=cfg.quant.bits,
            double_quant=cfg.quant.double_quant,
            lora_r=lora.r if lora else None,
            lora_target=target,
            lora_dropout=lora.dropout if lora else 0.0,
            dora=bool(lora and lora.dora),
            compute_bytes=4 if precision == "fp32" else 2,
            dropout_mask_bytes=1 if on_gpu else (4 if precision == "fp32" else 2),
        )


def lora_targets(shape: ModelShape, target: str | tuple[str, ...]) -> list[LinearGroup]:
    """The decoder linears peft wraps: 'all-linear' is every linear but the output head."""
    import re

    if target == "all-linear":
        return list(shape.linears)
    if isinstance(target, str):  # peft: a string is a regex over full module names; match its short names
        return [g for g in shape.linears if re.search(target, g.name)]
    return [g for g in shape.linears if g.name in target]


# ----------------------------------------------------------------------------- the estimate


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
    loads_whole_model: bool = False  # streaming builds the whole quantized model in host RAM while loading

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
            "setup": asdict(self.setup),
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


def quantized_bytes(numel: int, out_features: int, bits: int | None, double_quant: bool, compute_bytes: int) -> tuple[int, int]:
    """(weight bytes, quantization-constant bytes) of one linear weight as bitsandbytes stores it."""
    if bits is None:
        return numel * compute_bytes, 0
    if bits == 8:  # LLM.int8: int8 weight + one fp32 scale per output row
        return numel, out_features * 4
    blocks = math.ceil(numel / NF4_BLOCK)
    if double_quant:
        # absmax quantized to uint8 per 64-block; its own fp32 absmax per 256 of those,
        # a 256-entry fp32 code table and an fp32 offset.
        constants = blocks + math.ceil(blocks / NF4_BLOCK2) * 4 + 256 * 4 + 4
    else:
        constants = blocks * 4
    return (numel + 1) // 2, constants


def layer_saved_bytes_per_token(shape: ModelShape, recipe: Recipe, batch_size: int) -> int:
    """Bytes autograd keeps per token for one decoder layer (Llama-style: RMSNorm, attention, gated MLP).

    Worked out from what each op saves for backward, and checked against
    saved_tensors_hooks on real models (tests/test_plan_measured.py):
      RMSNorm (x2)       its input upcast to fp32 (4h); the fp32 variance is per token only
      q/k after RoPE, v, attention output: compute dtype (flash / memory-efficient SDPA save
                         no T x T matrix), plus the fp32 log-sum-exp per head
      GQA                with padding in the batch (batch_size > 1) transformers repeats k/v to
                         every head before SDPA (no GQA kernel under a mask), so k and v cost h each
      gated MLP          gate (SiLU input), SiLU output, up: three intermediate-sized tensors
      base linears       nothing: a frozen (quantized) weight needs only itself for the input grad
      LoRA               each wrapped linear's input: with dropout a fresh copy plus its mask per
                         linear; without, the shared input once (q/k/v share one, gate/up one); the
                         o_proj input is a contiguous copy of the attention output; and lora_A's
                         r-wide output, which lora_B keeps
    """
    b = recipe.compute_bytes
    h, f, lse = shape.hidden, shape.intermediate, shape.heads * 4
    qd = shape.heads * shape.head_dim
    kvd = shape.kv_heads * shape.head_dim
    if shape.kv_heads < shape.heads and batch_size > 1:
        kvd = qd
    total = 2 * 4 * h  # two RMSNorms
    total += b * (qd + 2 * kvd + qd) + lse  # SDPA: q, k, v, out
    total += 3 * b * f  # MLP
    if recipe.lora_r is None:
        return total + b * (h + qd + h + f)  # full fine-tuning: every linear saves its input for the weight grad
    inputs = {"q_proj": ("attn_in", h), "k_proj": ("attn_in", h), "v_proj": ("attn_in", h), "o_proj": ("o_in", qd),
              "gate_proj": ("mlp_in", h), "up_proj": ("mlp_in", h), "down_proj": ("down_in", f)}
    shared: dict[str, int] = {}
    for g in lora_targets(shape, recipe.lora_target):
        source, width = inputs.get(g.name, (g.name, g.in_features))
        per_layer = g.count / shape.layers
        total += int(b * recipe.lora_r * per_layer)
        if recipe.lora_dropout > 0:
            total += int((b + recipe.dropout_mask_bytes) * width * per_layer)  # dropout output + mask, per wrapped linear
        else:
            shared[source] = width
    return total + b * sum(shared.values())


def backward_working_bytes_per_token(shape: ModelShape, recipe: Recipe) -> int:
    """Gradients alive while one layer runs backward: the residual-stream grads and the MLP's."""
    b = recipe.compute_bytes
    return b * (3 * shape.hidden + 3 * shape.intermediate) + 4 * shape.hidden  # + the fp32 RMSNorm grad


def loss_peak_bytes(tokens: int, vocab: int, logits_bytes: int, impl: Implementation) -> int:
    """Peak of the logits and the cross-entropy, for `tokens` positions that all carry a target.

    gather (trainer.loss_sum_and_count): logits, the gathered target rows (copy), their fp32
      upcast and the fp32 log-softmax in forward; in backward the saved log-softmax and two
      fp32 gradients of it: 12 bytes a logit in bf16.
    full_fp32 (transformers' loss): fp32 logits kept by the output, saved log-softmax, and its
      two fp32 gradients: 16 bytes a logit.
    chunked (torchtune, compiled): bf16 logits kept for backward plus one fp32 chunk of 8: ~3.
    """
    n = tokens * vocab
    if impl.loss == "full_fp32":
        return 16 * n
    if impl.loss == "chunked":
        return 2 * n + 8 * n // 8
    upcast = 4 if logits_bytes < 4 else 0
    return max(logits_bytes * n + logits_bytes * n + upcast * n + 4 * n, 12 * n)


def trainable_params(shape: ModelShape, recipe: Recipe) -> int:
    """LoRA A and B of every targeted linear (+ DoRA magnitudes); full fine-tuning: every parameter."""
    if not recipe.lora_r:
        return shape.total_params
    targets = lora_targets(shape, recipe.lora_target)
    extra = sum(g.out_features * g.count for g in targets) if recipe.dora else 0
    return sum(recipe.lora_r * (g.in_features + g.out_features) * g.count for g in targets) + extra


def estimate(
    shape: ModelShape,
    recipe: Recipe,
    setup: Setup,
    gpu: GpuSpec | None,
    impl: Implementation = DEFAULT_IMPL,
    *,
    keep_checkpoints: int = 2,
    model_on_disk: bool = False,
    shard_bytes: int | None = None,
) -> Estimate:
    """Per-GPU memory, step time, host RAM and disk of one setup. gpu=None: a CPU run (no CUDA terms)."""
    b = recipe.compute_bytes
    n_gpu = max(setup.gpus, 1)
    fsdp = setup.sharding == "fsdp" and n_gpu > 1
    L, T, B = shape.layers, setup.seq_len, setup.batch_size
    tokens = B * T
    unq_bytes = impl.unquantized_bytes or b

    # Static: weights, adapters, their grads and optimizer state.
    q_weight = q_const = 0
    for g in shape.linears:
        w, c = quantized_bytes(g.in_features * g.out_features, g.out_features, recipe.quant_bits, recipe.double_quant, b)
        q_weight += w * g.count
        q_const += c * g.count
    unquantized = (shape.embedding_params + shape.head_params + shape.other_params) * unq_bytes
    trainable = trainable_params(shape, recipe)
    adapter_bytes = impl.adapter_bytes if recipe.lora_r else (4 if b == 4 else b)
    lora = trainable * adapter_bytes if recipe.lora_r else 0
    grads = trainable * adapter_bytes
    optim = trainable * adapter_bytes * impl.optimizer_states
    layer_fraction = 1.0
    gathered = 0
    streamed_resident = streamed_store = 0
    if fsdp:
        # Decoder layers are sharded; the root unit (embeddings, head, final norm) stays whole.
        # Two layers are gathered at a time (the running one and the prefetched one).
        layer_fraction = 1.0 / n_gpu
        gathered = int(2 * (q_weight + q_const) / L)
        q_weight, q_const = int(q_weight / n_gpu), int(q_const / n_gpu)
        lora, grads, optim = lora // n_gpu, grads // n_gpu, optim // n_gpu
    elif setup.streams_weights:
        # memory.base_weights=cpu|disk (stream.py): the decoder linears' packed weights wait on the host
        # and at most three layers' worth are on the GPU; their quantization constants stay resident.
        streamed_store = q_weight
        streamed_resident = int(min(STREAMED_LAYERS_RESIDENT, L) * q_weight / L)
        q_weight = 0
    ddp_buckets = grads if (n_gpu > 1 and not fsdp) else 0  # DDP's all-reduce buckets mirror the gradients
    offloaded = 0
    if fsdp and setup.cpu_offload:
        # FSDP's CPUOffloadPolicy: every shard (4-bit weights, adapters, their gradients and AdamW
        # state) stays in host RAM; the GPU holds only what is gathered for the running layers.
        offloaded = q_weight + q_const + lora + grads + optim
        q_weight = q_const = lora = grads = optim = 0
    host_optimizer = 0
    if setup.optimizer_offload and not setup.cpu_offload:
        # HostAdamW (offload.py): an fp32 copy of each trainable weight, its fp32 gradient and both fp32
        # moments live in host RAM (pinned); the GPU keeps the weights and their gradients.
        host_optimizer = (trainable // n_gpu if fsdp else trainable) * 4 * 4
        optim = 0

    # Activations. model.py checkpoints layers whose index is a multiple of k: they keep only their
    # input; the others keep every activation they save.
    per_layer = layer_saved_bytes_per_token(shape, recipe, B)
    checkpointed = setup.checkpointed_layers(L)
    input_only = tokens * b * shape.hidden  # a checkpointed layer's input, kept for the recompute
    full_layer = tokens * per_layer
    layers_saved = checkpointed * input_only + (L - checkpointed) * full_layer
    recompute = full_layer if checkpointed else 0  # one layer's activations, rebuilt during its backward
    host_activations = 0
    if setup.activation_offload and checkpointed < L:
        # offload.py moves what autograd saves, as forward makes it, on a side stream, and brings it
        # back as backward reaches it. transformers holds a checkpointed layer's input inside the
        # checkpoint, outside autograd's saved tensors, so those inputs stay on the GPU: only the
        # layers that keep all their activations (checkpointing none or every k-th) offload. On the
        # GPU: the layers in flight, plus the copies that fall behind when a layer saves more than
        # the link carries while the next one computes (1 - compute/transfer of a layer per layer).
        moved = (L - checkpointed) * full_layer
        host_activations = moved
        backlog = 0.0
        if gpu is not None:
            copy_s = full_layer / (gpu.pcie_gbps * 1e9)
            compute_s = forward_seconds(shape, recipe, setup, gpu, trainable) / L
            backlog = max(0.0, 1 - compute_s / copy_s) * (L - checkpointed)
        in_flight = int((min(OFFLOAD_LAYERS_IN_FLIGHT, L - checkpointed) + backlog) * full_layer)
        layers_saved = checkpointed * input_only + min(moved, in_flight)
    # The head's and the loss's buffers are not moved: they are made right before backward needs them.
    saved = layers_saved + 2 * T * shape.head_dim * b  # + RoPE cos and sin, shared by the layers
    final_norm = tokens * 4 * shape.hidden
    logits_bytes = unq_bytes if impl.loss != "chunked" else b
    loss = loss_peak_bytes(tokens, shape.vocab, logits_bytes, impl)
    working = tokens * backward_working_bytes_per_token(shape, recipe)
    dequant = shape.largest_linear * b if recipe.quant_bits else 0  # the weight dequantized for one matmul
    mask = B * T * T if B > 1 else 0  # bool 4D attention mask transformers builds when the batch is padded

    static = q_weight + q_const + streamed_resident + unquantized + lora + grads + optim + ddp_buckets + gathered
    phase_loss = static + saved + mask + final_norm + loss
    phase_backward = static + saved + mask + recompute + working + dequant
    loss_peak = phase_loss >= phase_backward
    peak_alloc = max(phase_loss, phase_backward)
    on_gpu = gpu is not None
    slack = int(ALLOCATOR_SLACK * peak_alloc) if on_gpu else 0
    context = CUDA_CONTEXT_BYTES if on_gpu else 0
    where = {"cpu": "CPU RAM", "disk": "a file on disk"}.get(setup.base_weights, "")
    if checkpointed == L:
        kept = " (checkpointed layer inputs)"
    elif checkpointed == 0:
        kept = " (all layers)"
    else:
        kept = f" ({checkpointed} checkpointed layers' inputs, all of {L - checkpointed} others)"
    comps = [
        Component("weights_quantized", f"base weights ({_quant_label(recipe)})", q_weight),
        Component("weights_streamed", f"base weights streamed ({min(STREAMED_LAYERS_RESIDENT, L)} of {L} layers)",
                  streamed_resident),
        Component("quant_constants", "quantization constants (absmax)", q_const),
        Component("weights_unquantized", f"embeddings, head, norms, biases ({_dtype_label(unq_bytes)})", unquantized),
        Component("lora_weights", f"LoRA weights ({_dtype_label(adapter_bytes)})" if recipe.lora_r else "trained weights", lora),
        Component("gradients", "gradients of trained weights", grads),
        Component("optimizer_state", "AdamW state (2 moments)", optim),
        Component("ddp_buckets", "DDP all-reduce buckets", ddp_buckets),
        Component("fsdp_gathered", "FSDP gathered layers (2)", gathered),
        Component("activations", ("activations in flight to/from host RAM" if setup.activation_offload
                                  else "activations kept for backward") + kept, saved),
        Component("attention_mask", "padded-batch attention mask", mask),
        Component("logits_loss", "logits and loss buffers", loss, in_peak=loss_peak),
        Component("final_norm", "final norm input (fp32)", final_norm, in_peak=loss_peak),
        Component("recompute_layer", "one layer recomputed in backward", recompute, in_peak=not loss_peak),
        Component("backward_working", "backward gradients of one layer", working, in_peak=not loss_peak),
        Component("dequant_buffer", "dequantized weight of one matmul", dequant, in_peak=not loss_peak),
        Component("allocator_slack", f"allocator fragmentation ({ALLOCATOR_SLACK:.0%})", slack),
        Component("cuda_context", "CUDA context and cuBLAS workspace", context),
    ]
    peak = peak_alloc + slack + context

    step, parts = step_time(
        shape, recipe, setup, gpu, trainable, q_weight + q_const + offloaded, adapter_bytes, fsdp,
        streamed_bytes=streamed_store, activation_bytes=host_activations,
    )
    shard = shard_bytes or min(DEFAULT_SHARD_BYTES, shape.total_params * 2)
    # Loading streams one shard at a time. Streaming loads (and quantizes) the whole model in CPU RAM
    # (trainer.py: it would not fit the GPU even for a moment), then moves its layers to the store;
    # base_weights=disk with 4-bit weights sends each one to the file as bitsandbytes quantizes it
    # (stream.DiskStore.capture), so only the resident parts are ever in RAM.
    captured = setup.base_weights == "disk" and recipe.quant_bits == 4
    loading = shard + ((q_const + unquantized + (0 if captured else streamed_store)) if setup.streams_weights else 0)
    pinned = (streamed_store if setup.base_weights == "cpu" else 0) + host_activations + host_optimizer
    host = HOST_BASELINE_BYTES + max(loading, pinned) + offloaded  # per process; offloaded FSDP shards stay
    host_parts = {"libraries": HOST_BASELINE_BYTES, "loading": loading, "streamed_weights": streamed_store if setup.base_weights == "cpu" else 0,
                  "activations": host_activations, "optimizer": host_optimizer, "fsdp_shards": offloaded}
    state_bytes = trainable * adapter_bytes * (1 + impl.optimizer_states)
    disk_parts = {
        "download": 0 if model_on_disk else shape.total_params * 2,
        "checkpoints": keep_checkpoints * state_bytes,
        "adapter": trainable * adapter_bytes,
        "streamed_weights": streamed_store if setup.base_weights == "disk" else 0,
    }
    disk = sum(disk_parts.values())
    notes = []
    if gpu is not None and gpu.name == "custom":
        notes.append(f"unknown GPU: speed assumed {gpu.bf16_tflops:.0f} TFLOPs, {gpu.bandwidth_gbps:.0f} GB/s")
    if setup.base_weights == "disk":
        notes.append(
            f"base_weights=disk: step time assumes reads from the NVMe disk at {NVME_READ_GBPS:g} GB/s; with "
            f"{gib(streamed_store)} of free RAM for the page cache the file stays cached and streams like base_weights=cpu"
        )
    return Estimate(
        shape=shape, setup=setup, gpu=gpu, components=comps, peak_phase="loss" if loss_peak else "backward",
        peak_allocated_bytes=peak_alloc, peak_bytes=peak, step_time_s=step, step_time_parts=parts,
        host_ram_bytes=host * n_gpu, disk_bytes=disk, trainable_params=trainable, impl=impl, notes=notes,
        host_ram_parts=host_parts, disk_parts=disk_parts, loads_whole_model=setup.streams_weights and not captured,
    )


def _micro_batch_seconds(shape, recipe, setup, gpu, trainable) -> tuple[float, float, float]:
    """(compute, dequantize, forward) seconds of one micro-batch on one GPU, nothing moved over a link.

    forward: the first pass over the layer stack (its matmuls, attention and one dequantize pass),
    the rest of compute + dequantize being the recompute and backward."""
    T = setup.seq_len
    tokens = setup.batch_size * T
    matmul_params = shape.linear_params + (shape.head_params or shape.embedding_params)
    lora_flops = 2 * trainable if recipe.lora_r else 0
    fwd = 2 * matmul_params + lora_flops
    attn_fwd = 2 * T * shape.heads * shape.head_dim * shape.layers  # QK^T and AV, causal half
    ckpt = setup.checkpointed_layers(shape.layers) / shape.layers  # the share of layers replayed
    # Backward of a frozen weight computes only the input gradient (1x forward); attention
    # backward is ~2x its forward; checkpointing replays the decoder forward once more.
    per_token = fwd * (2 + ckpt) + attn_fwd * (3 + ckpt) + (lora_flops if recipe.lora_r else 2 * fwd)
    rate = gpu.bf16_tflops * 1e12 * MATMUL_EFFICIENCY
    compute = tokens * per_token / rate
    dequant = 0.0
    one_pass = 0.0
    if recipe.quant_bits:
        # Each pass over a 4-bit weight reads it (0.5 B/param), writes it in bf16 (2) and the matmul reads that (2).
        one_pass = shape.linear_params * 4.5 / (gpu.bandwidth_gbps * 1e9 * BANDWIDTH_EFFICIENCY)
        dequant = (2 + ckpt) * one_pass
    forward = tokens * (fwd + attn_fwd) / rate + one_pass
    return compute, dequant, forward


def forward_seconds(shape, recipe, setup, gpu, trainable) -> float:
    return _micro_batch_seconds(shape, recipe, setup, gpu, trainable)[2]


def step_time(shape, recipe, setup, gpu, trainable, quantized_weight_bytes, adapter_bytes, fsdp, *,
              streamed_bytes: int = 0, activation_bytes: int = 0) -> tuple[float, dict[str, float]]:
    """Seconds per optimizer step: compute at MATMUL_EFFICIENCY of dense bf16 peak, NF4 dequantization
    at BANDWIDTH_EFFICIENCY of memory bandwidth, gradient all-reduce (DDP) or weight all-gather (FSDP)
    over the GPU link, and host-link copies of the offload modes. CPU runs (gpu=None) get 0: the plan
    is for GPUs.

    streamed_bytes: base weights streamed per pass over the layer stack (base_weights=cpu|disk);
    activation_bytes: saved activations sent to host RAM per micro-batch (activation_offload)."""
    if gpu is None:
        return 0.0, {}
    compute, dequant, forward = _micro_batch_seconds(shape, recipe, setup, gpu, trainable)
    micro = compute + dequant
    host_link = gpu.pcie_gbps * 1e9
    transfer = exposed = 0.0
    if streamed_bytes or activation_bytes:
        # Copies run on a side stream while layers compute, so a layer takes max(its compute, its copy):
        # summed over uniform layers, max(compute of the pass, copies of the pass). The head and loss
        # are counted in with the layers (a slight over-statement of the overlap); nothing hides the
        # copy of the first layer of each pass (it has no layer before it).
        weights_rate = min(NVME_READ_GBPS * 1e9, host_link) if setup.base_weights == "disk" else host_link
        weights = streamed_bytes / weights_rate  # once in forward, once in the recompute before backward
        first_layer = weights / shape.layers
        acts = activation_bytes / host_link
        backward = micro - forward
        # Forward: weights come in while activations go out (PCIe is full duplex). Backward: offload.py
        # copies saved tensors back on the compute stream, so those copies add to the time.
        with_copies = max(forward, weights, acts) + first_layer + max(backward, weights) + first_layer + acts
        transfer = 2 * weights + 2 * acts
        exposed = with_copies - micro
        micro = with_copies
    n = setup.gpus
    link = gpu.interconnect_gbps * 1e9 * LINK_EFFICIENCY
    comm = 0.0
    ckpt = setup.checkpointed_layers(shape.layers) / shape.layers
    if n > 1 and fsdp:
        gather = (2 + ckpt) * quantized_weight_bytes * n * (n - 1) / n / link  # each pass gathers the whole layer stack
        micro = max(micro, gather)  # FSDP prefetch overlaps the gathers with compute
        comm = 2 * (n - 1) / n * trainable * adapter_bytes / link
    elif n > 1:
        comm = 2 * (n - 1) / n * trainable * adapter_bytes / link  # ring all-reduce of the gradients, once a step
    optimizer = 4 * trainable * adapter_bytes * 4 / (gpu.bandwidth_gbps * 1e9 * BANDWIDTH_EFFICIENCY)
    if fsdp and setup.cpu_offload:
        # Each pass copies this GPU's weight shards host->GPU; gradients go back once a step;
        # AdamW runs on the CPU.
        n_share = max(n, 1)
        h2d = (2 + ckpt) * quantized_weight_bytes / n_share / host_link
        micro = max(micro, h2d)
        comm += trainable * adapter_bytes / n_share / host_link
        optimizer = 4 * trainable * adapter_bytes * 4 / n_share / (HOST_ADAMW_GBPS * 1e9)
    elif setup.optimizer_offload:
        # HostAdamW: gradients to the host, the fp32 AdamW step there, updated weights back; not overlapped.
        optimizer = 2 * trainable * adapter_bytes / host_link + trainable * HOST_ADAMW_BYTES_PER_PARAM / (HOST_ADAMW_GBPS * 1e9)
    parts = {"compute": compute * setup.grad_accum, "dequantize": dequant * setup.grad_accum, "communication": comm,
             "optimizer": optimizer, "host_transfer": transfer * setup.grad_accum, "host_transfer_exposed": exposed * setup.grad_accum}
    return micro * setup.grad_accum + comm + optimizer, parts


def _quant_label(recipe: Recipe) -> str:
    if recipe.quant_bits == 4:
        return "NF4, double quant" if recipe.double_quant else "NF4"
    return "int8" if recipe.quant_bits == 8 else _dtype_label(recipe.compute_bytes)


def _dtype_label(nbytes: int) -> str:
    return {2: "bf16", 4: "fp32", 1: "int8"}.get(nbytes, f"{nbytes} B")


# ----------------------------------------------------------------------------- a recipe on a GPU


def plan_precision(cfg: RecipeConfig, gpu: GpuSpec | None) -> str:
    """The precision the run would use on `gpu` (precision=auto follows hardware.resolve_precision's rule)."""
    if cfg.precision != "auto":
        return cfg.precision
    if gpu is None:
        from finetune.hardware import resolve_precision

        return resolve_precision("auto")
    return "bf16" if gpu.supports_bf16 else "fp16"


def model_shape_of(cfg: RecipeConfig) -> ModelShape:
    return read_model_shape(model_source(cfg), cfg.model.trust_remote_code, cfg.model.revision)


def _shard_bytes(cfg: RecipeConfig) -> int | None:
    """The largest weight file of a local model directory (host RAM while loading), if visible."""
    src = Path(model_source(cfg))
    files = list(src.glob("*.safetensors")) if src.is_dir() else []
    return max((f.stat().st_size for f in files), default=None)


def setup_of(cfg: RecipeConfig, gpus: int = 1) -> Setup:
    return Setup(
        batch_size=cfg.train.batch_size,
        grad_accum=cfg.train.grad_accum,
        gpus=gpus,
        checkpoint_every=cfg.memory.checkpoint_every,
        seq_len=cfg.data.max_seq_len,
        # auto runs DDP unless a replica does not fit (finetune.distributed.resolve_strategy).
        sharding="fsdp" if cfg.distributed.strategy == "fsdp" and gpus > 1 else "ddp",
        cpu_offload=cfg.distributed.cpu_offload and cfg.distributed.strategy == "fsdp" and gpus > 1,
        activation_offload=cfg.memory.activation_offload,
        base_weights=cfg.memory.base_weights,
        optimizer_offload=cfg.memory.optimizer_offload,
    )


def recipe_value(knob: str, value: Any) -> Any:
    """A Setup value as its recipe key takes it (checkpoint_every 1/0/k -> all/none/k)."""
    if knob == "checkpoint_every":
        return {1: "all", 0: "none"}.get(value, value)
    return value


def plan_recipe(cfg: RecipeConfig, gpu: GpuSpec | None, gpus: int = 1, setup: Setup | None = None) -> Estimate:
    shape = model_shape_of(cfg)
    recipe = Recipe.from_config(cfg, plan_precision(cfg, gpu), on_gpu=gpu is not None)
    return estimate(
        shape, recipe, setup or setup_of(cfg, gpus), gpu,
        keep_checkpoints=cfg.checkpoint.keep_last or 1,
        model_on_disk=Path(model_source(cfg)).is_dir(),
        shard_bytes=_shard_bytes(cfg),
    )


# ----------------------------------------------------------------------------- search


@dataclass(frozen=True)
class Knob:
    """One thing the search may change. `recipe_key` is the recipe key it writes (None: the launch command)."""

    name: str  # a Setup field
    recipe_key: str | None
    candidates: Callable[[Setup, int], list[Any]]  # (the recipe's setup, max GPUs) -> values to try


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _checkpoint_choices(s: Setup, _: int) -> list[int]:
    # none, every 4th, every 2nd, all: each step keeps more activations and replays fewer layers.
    return sorted({0, 4, 2, 1, s.checkpoint_every})


# The search keeps the fastest setup that fits; every offload mode costs time on the host link
# (step_time), so it wins only when nothing faster fits, and an exact tie goes to the setup with
# the lower Setup.offload_rank. base_weights=disk is tried only when the recipe has it: it frees
# the same GPU memory as cpu, more slowly (it is for hosts whose RAM cannot pin the weights).
KNOBS: list[Knob] = [
    Knob("gpus", None, lambda s, max_gpus: list(range(1, max_gpus + 1))),
    # FSDP only means something on more than one GPU; candidates() drops fsdp x 1 GPU.
    Knob("sharding", "distributed.strategy", lambda s, max_gpus: ["ddp", "fsdp"] if max_gpus > 1 else [s.sharding]),
    Knob("cpu_offload", "distributed.cpu_offload", lambda s, max_gpus: [False, True] if max_gpus > 1 else [s.cpu_offload]),
    Knob("checkpoint_every", "memory.activation_checkpointing", _checkpoint_choices),
    Knob("batch_size", "train.batch_size", lambda s, _: _divisors(s.global_batch)),
    Knob("activation_offload", "memory.activation_offload", lambda s, _: [False, True]),
    Knob("optimizer_offload", "memory.optimizer_offload", lambda s, _: [False, True]),
    Knob("base_weights", "memory.base_weights", lambda s, _: sorted({"device", "cpu", s.base_weights}, key=["device", "cpu", "disk"].index)),
]


def runnable(s: Setup, recipe: Recipe | None = None) -> bool:
    """Whether the trainer runs this combination (config.fsdp_problems, config.memory_problems, trainer.py)."""
    if (s.sharding == "fsdp" and s.gpus == 1) or (s.cpu_offload and s.sharding != "fsdp"):
        return False
    if s.activation_offload and s.checkpoint_every == 1:
        return False  # nothing to move: checkpointed layer inputs live inside the checkpoints
    if s.sharding == "fsdp" and (s.streams_weights or s.optimizer_offload):
        return False  # FSDP shards and offloads the weights and optimizer state itself
    if s.streams_weights:
        if s.gpus != 1 or s.checkpoint_every != 1:
            return False  # one process; the recomputation brings each layer back before its backward
        if recipe is not None and (recipe.quant_bits == 8 or recipe.lora_r is None):
            return False
    return True


def candidates(base: Setup, max_gpus: int, recipe: Recipe | None = None) -> list[Setup]:
    """Every runnable setup the knobs allow that keeps the global batch (batch x accum x GPUs)."""
    out = []
    names = [k.name for k in KNOBS]
    for values in product(*(k.candidates(base, max_gpus) for k in KNOBS)):
        s = replace(base, **dict(zip(names, values)))
        if not runnable(s, recipe):
            continue
        per_gpu = base.global_batch / (s.batch_size * s.gpus)
        if per_gpu < 1 or per_gpu != int(per_gpu):
            continue
        out.append(replace(s, grad_accum=int(per_gpu)))
    return out


def search(shape: ModelShape, recipe: Recipe, base: Setup, gpu: GpuSpec, max_gpus: int, host_ram: int | None = None,
           **kw) -> tuple[Estimate | None, list[Estimate]]:
    """(fastest setup that fits with FIT_HEADROOM to spare, or None; every estimate made).
    host_ram: the machine's RAM, when known; offload setups that need more are left out.
    Ties go to less offloading, then fewer GPUs, then more headroom."""
    estimates = [estimate(shape, recipe, s, gpu, **kw) for s in candidates(base, max_gpus, recipe)]
    fitting = [e for e in estimates if e.peak_bytes <= (1 - FIT_HEADROOM) * gpu.memory_bytes
               and (host_ram is None or e.host_ram_bytes <= host_ram or e.setup.offload_rank == 0)]
    best = min(fitting, key=lambda e: (round(e.step_time_s, 6), e.setup.offload_rank, e.setup.gpus, -e.headroom_bytes), default=None)
    return best, estimates


def longest_fitting_seq(shape: ModelShape, recipe: Recipe, base: Setup, gpu: GpuSpec, **kw) -> int:
    """The longest data.max_seq_len at which batch 1 of `base` fits (0: not even 64 tokens)."""
    lo, hi = 0, base.seq_len
    probe = replace(base, batch_size=1, grad_accum=1)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if estimate(shape, recipe, replace(probe, seq_len=mid), gpu, **kw).peak_bytes <= (1 - FIT_HEADROOM) * gpu.memory_bytes:
            lo = mid
        else:
            hi = mid - 1
    return lo if lo >= 64 else 0


def fit(cfg: RecipeConfig, gpu: GpuSpec, max_gpus: int = 1, gpus: int | None = None, host_ram: int | None = None) -> tuple[Estimate, Estimate]:
    """(the recipe as written on `gpus` GPUs, the fastest setup that fits; with host_ram, one whose
    offload also fits that much RAM). Raises PlanError when none fits."""
    shape = model_shape_of(cfg)
    recipe = Recipe.from_config(cfg, plan_precision(cfg, gpu))
    kw = dict(keep_checkpoints=cfg.checkpoint.keep_last or 1, model_on_disk=Path(model_source(cfg)).is_dir(), shard_bytes=_shard_bytes(cfg))
    base = setup_of(cfg, gpus or max_gpus)
    current = estimate(shape, recipe, base, gpu, **kw)
    best, estimates = search(shape, recipe, base, gpu, max_gpus, host_ram=host_ram, **kw)
    if best is None:
        smallest = min(estimates, key=lambda e: e.peak_bytes)
        seq = longest_fitting_seq(shape, recipe, smallest.setup, gpu, **kw)
        static = sum(c.bytes for c in smallest.components if c.key.startswith(("weights", "quant")))
        need = smallest.peak_bytes / (1 - FIT_HEADROOM)
        how = [f"a GPU with at least {gib(need)} (--gpu-mem {math.ceil(need / GiB)}GB)"]
        if seq:
            how.append(f"data.max_seq_len={seq} (fits at batch 1 with the smallest setup)")
        how.append("a smaller lora.r or fewer lora.target modules" if cfg.lora else "LoRA (lora.r=16) instead of full fine-tuning")
        raise PlanError(
            f"no setup of '{cfg.model.path}' at data.max_seq_len={base.seq_len} fits {max_gpus} x {gpu.name} "
            f"({gib(gpu.memory_bytes)} each, {FIT_HEADROOM:.0%} kept free): the smallest needs {gib(smallest.peak_bytes)} per GPU "
            f"({describe_setup(smallest.setup)}; the weights alone take {gib(static)})",
            hint="; or ".join(how),
        )
    return current, best


def changes_of(best: Estimate, base: Setup) -> dict[str, Any]:
    """Recipe keys to write so a run uses `best` (grad_accum follows batch and GPUs)."""
    out: dict[str, Any] = {}
    for knob in KNOBS:
        if knob.recipe_key and getattr(best.setup, knob.name) != getattr(base, knob.name):
            out[knob.recipe_key] = recipe_value(knob.name, getattr(best.setup, knob.name))
    if best.setup.grad_accum != base.grad_accum:
        out["train.grad_accum"] = best.setup.grad_accum
    return out


# ----------------------------------------------------------------------------- text


def gib(n: float) -> str:
    return f"{n / GiB:.2f} GiB"


def describe_setup(s: Setup) -> str:
    ckpt = {1: "all layers", 0: "off"}.get(s.checkpoint_every, f"every {s.checkpoint_every} layers")
    offload = [name for name, on in [("activations", s.activation_offload), ("optimizer", s.optimizer_offload),
                                     (f"base weights streamed from {s.base_weights}", s.streams_weights)] if on]
    return (
        f"{s.gpus} GPU{'s' if s.gpus > 1 else ''}"
        f"{(' (FSDP, CPU offload)' if s.cpu_offload else ' (FSDP)') if s.sharding == 'fsdp' and s.gpus > 1 else ''}, "
        f"batch {s.batch_size} x accum {s.grad_accum} (global {s.global_batch}), seq {s.seq_len}, "
        f"checkpointing {ckpt}" + (f", offload: {', '.join(offload)}" if offload else "")
    )


def report(e: Estimate) -> str:
    """The human-readable plan: per-GPU breakdown, peak, verdict, host RAM, disk, step time."""
    lines = [
        f"model      {e.shape.source} ({e.shape.model_type}, {e.shape.total_params / 1e9:.2f}B parameters, "
        f"{e.trainable_params / 1e6:.1f}M trainable)",
        f"setup      {describe_setup(e.setup)}",
        f"device     {e.gpu.description or e.gpu.name} ({gib(e.gpu.memory_bytes)})" if e.gpu else "device     CPU",
        "",
        "per-GPU memory at the peak (" + ("end of forward: logits and loss" if e.peak_phase == "loss" else "backward of one layer") + "):",
    ]
    for c in e.components:
        if c.bytes == 0:
            continue
        mark = " " if c.in_peak else "~"
        lines.append(f"  {mark} {c.label:<48} {gib(c.bytes):>12}")
    lines.append(f"    {'peak':<48} {gib(e.peak_bytes):>12}")
    lines.append("  (~ = the other phase's transient buffers, not in the peak)")
    if e.gpu is not None:
        room = e.headroom_bytes
        verdict = (f"fits: {gib(room)} headroom ({100 * e.peak_bytes / e.gpu.memory_bytes:.0f}% of {e.gpu.name})" if e.fits
                   else f"does NOT fit: {gib(-room)} over the {gib(e.gpu.memory_bytes)} of {e.gpu.name}")
        lines += ["", f"verdict    {verdict}"]
    lines += _host_lines(e)
    if e.step_time_s:
        p = e.step_time_parts
        lines.append(
            f"step time  ~{e.step_time_s:.2f} s/step, {e.tokens_per_step / e.step_time_s:,.0f} tokens/s "
            f"(compute {p['compute']:.2f} s at {MATMUL_EFFICIENCY:.0%} of {e.gpu.bf16_tflops:g} TFLOPs, "
            f"dequantize {p['dequantize']:.2f} s at {BANDWIDTH_EFFICIENCY:.0%} of {e.gpu.bandwidth_gbps:g} GB/s, "
            f"communication {p['communication']:.2f} s, optimizer {p['optimizer']:.2f} s)"
        )
        if p.get("host_transfer"):
            s = e.setup
            rate = f"{e.gpu.pcie_gbps:g} GB/s (pinned, host link)"
            if s.base_weights == "disk":
                rate = f"{min(NVME_READ_GBPS, e.gpu.pcie_gbps):g} GB/s (NVMe, page cache cold) for weights, " + rate
            lines.append(
                f"host link  {p['host_transfer']:.2f} s/step of copies at {rate}, overlapped layer by layer "
                f"with compute: they add {p['host_transfer_exposed']:.2f} s/step"
            )
    lines += [f"note       {n}" for n in e.notes]
    return "\n".join(lines)


# ----------------------------------------------------------------------------- writing the recipe


def _host_lines(e: Estimate) -> list[str]:
    """Host RAM and disk, with what they hold (host RAM per process is libraries + the larger of
    loading and what stays pinned while training, + FSDP's offloaded shards)."""
    h, d = e.host_ram_parts, e.disk_parts
    if e.loads_whole_model:
        held = " (the whole quantized model is built in CPU RAM first)"
    elif e.setup.streams_weights:
        held = " (one weight shard and the resident weights; 4-bit layers go to the file as they load)"
    else:
        held = " (one weight shard)"
    loading = f"loading {gib(h.get('loading', 0))}{held}"
    pinned = [f"{label} {gib(h[k])}" for k, label in [("streamed_weights", "streamed base weights"), ("activations", "saved activations"),
                                                      ("optimizer", "AdamW state + fp32 weights and grads")] if h.get(k)]
    text = f"libraries {gib(h.get('libraries', 0))} + " + (f"max({loading}; pinned while training: {', '.join(pinned)})" if pinned else loading)
    if h.get("fsdp_shards"):
        text += f" + FSDP shards {gib(h['fsdp_shards'])}"
    per = f", {e.setup.gpus} processes" if e.setup.gpus > 1 else ""
    disk = [f"{label} {gib(d[k])}" for k, label in [("download", "bf16 weights if downloaded"), ("checkpoints", "checkpoints"),
                                                    ("adapter", "adapter"), ("streamed_weights", "streamed-weights file")] if d.get(k)]
    return [f"host RAM   {gib(e.host_ram_bytes)} (per process: {text}{per})", f"disk       {gib(e.disk_bytes)} ({', '.join(disk)})"]


def _yaml_value(value: Any) -> str:
    import yaml

    text = yaml.safe_dump(value, default_flow_style=True, width=10**6).strip()
    return text[: -len("...")].strip() if text.endswith("...") else text


def rewrite_recipe(text: str, values: dict[str, Any], comments: dict[str, str], command: str, header: list[str]) -> str:
    """The recipe `text` with dotted `values` set in place, each changed line commented.

    Keys keep their position and their own comment unless `comments` has a new
    one; missing keys are added under their section (missing sections at the
    end). The first line becomes `# {command}`, followed by `header` lines.
    """
    lines = text.splitlines()
    if lines and lines[0].startswith("#"):
        lines = lines[1:]
    for dotted, value in values.items():
        parts = dotted.split(".")
        comment = comments.get(dotted)
        start, indent = 0, ""
        if len(parts) == 2:
            sec = next((i for i, ln in enumerate(lines) if ln.rstrip().split("#")[0].rstrip() == f"{parts[0]}:"), None)
            if sec is None:
                lines += ["", f"{parts[0]}:"]
                sec = len(lines) - 1
            start, indent = sec + 1, "  "
        end = len(lines)
        if indent:  # the section's block ends at the next line that starts at column 0
            end = next((i for i in range(start, len(lines)) if lines[i].strip() and not lines[i][0].isspace()), len(lines))
        key = parts[-1]
        at = next((i for i in range(start, end) if lines[i].startswith(f"{indent}{key}:")), None)
        if at is None:  # insert at the end of the section's key lines
            last = max((i for i in range(start, end) if lines[i].strip() and not lines[i].lstrip().startswith("#")), default=start - 1)
            at = last + 1
            lines.insert(at, "")
            old_comment = comment or "set by finetune plan"
        else:
            old_comment = lines[at].split("#", 1)[1].strip() if "#" in lines[at] else "set by finetune plan"
            # a block-style value (list items on the following lines) is replaced by a flow-style one
            while at + 1 < len(lines) and lines[at + 1].startswith(indent + "  - "):
                del lines[at + 1]
        body = f"{indent}{key}: {_yaml_value(value)}"
        lines[at] = f"{body:<32} # {comment or old_comment}"
    return "\n".join([f"# {command}", *[f"# {h}" for h in header], *lines]) + "\n"


# ----------------------------------------------------------------------------- preflight


def preflight_memory(cfg: RecipeConfig, refuse: bool = True) -> tuple[list[str], list[str]]:
    """(problems, notes) of the memory estimate before weights are loaded.

    On CUDA a predicted peak above REFUSE_FACTOR x the device's memory is a
    problem (with the fitting setup the search finds), unless `refuse` is off.
    On a CPU the estimate is only a note.
    """
    try:
        return _preflight_memory(cfg, refuse)
    except FinetuneError as exc:  # a stand-in config of an invalid recipe, an unreadable model: reported elsewhere
        return [], [f"memory estimate skipped: {exc.message}"]


def _physical_ram() -> int | None:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):  # not a POSIX system
        return None


def _preflight_memory(cfg: RecipeConfig, refuse: bool) -> tuple[list[str], list[str]]:
    from finetune.gpus import gpu_for_device
    from finetune.hardware import detect_device

    model_shape_of(cfg)
    if detect_device().kind != "cuda":
        e = plan_recipe(cfg, None)
        return [], [f"memory estimate: peak {gib(e.peak_allocated_bytes)} for tensors ({e.peak_phase} phase); checked only on CUDA"]
    import torch

    gpu = gpu_for_device(torch.cuda.get_device_name(0), torch.cuda.get_device_properties(0).total_memory)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    e = plan_recipe(cfg, gpu, gpus=world)
    line = f"memory estimate: peak {gib(e.peak_bytes)} per GPU of {gib(gpu.memory_bytes)} ({gpu.name}, {world} process{'es' if world > 1 else ''})"
    if e.peak_bytes <= REFUSE_FACTOR * gpu.memory_bytes:
        return [], [line + ("" if e.fits else "; tight: it may run out of memory")]
    shape = model_shape_of(cfg)
    recipe = Recipe.from_config(cfg, plan_precision(cfg, gpu))
    best, _ = search(shape, recipe, e.setup, gpu, max_gpus=world, host_ram=_physical_ram())
    if best is not None and best.setup.gpus == world:
        fix = "fits as: " + " ".join(f"{k}={_yaml_value(v)}" for k, v in changes_of(best, e.setup).items())
    else:
        fix = f"no batch/checkpointing/offload setup fits; see `finetune plan RECIPE --gpu-mem {gpu.memory_bytes // GiB}GB --fit`"
    problem = f"{line}: more than {REFUSE_FACTOR:g} x the device memory. {fix}. Pass --skip-memory-check to try anyway."
    return ([problem], []) if refuse else ([], [problem])
