"""What is being planned: the recipe's parts the memory model reads (RecipeFacts), one way to run it
(Setup, the knobs the search turns), and how the training code holds its tensors (Implementation)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from finetune import adapters
from finetune.config.schema import RecipeConfig
from finetune.declarations.strategies import Strategy, planned
from finetune.declarations.techniques import TECHNIQUES, Modes
from finetune.model.varlen import auto_cuts_packed_rows
from finetune.model.vision import VISION_TOWER
from finetune.plan.images import processor_max_pixels
from finetune.plan.shape import LinearGroup, ModelShape


@dataclass(frozen=True)
class Setup(Modes):
    """One way to run a recipe: the knobs the search turns, and the sequence length. The memory
    techniques' fields come from finetune/declarations/techniques.py's Modes, under the recipe's names:
    a new technique adds none here."""

    batch_size: int
    grad_accum: int
    gpus: int = 1
    seq_len: int = 2048
    # ddp: a full copy per GPU; fsdp: layers sharded; zero2 | zero3: DeepSpeed ZeRO (declarations/zero_config.py)
    sharding: str = "ddp"
    cpu_offload: bool = False  # fsdp: the shards (weights, grads, optimizer state) live in host RAM; zero3: the weights
    sequences_per_example: int = 1  # preference pairs: chosen and rejected in one forward (finetune/declarations/objectives.py)
    reference_passes: int = 0  # dpo: forwards without gradients (adapter off) per micro-batch, for the reference
    head_in_chunks: bool = True  # the objective's loss can chunk its head (declarations/objectives.py): not the preference ones
    sampled_tokens: int = 0  # grpo: train.max_new_tokens sampled for each row before its forward (0: nothing sampled)
    iterations: int = 1  # grpo: train.num_iterations, the optimizer steps that train each sampling's completions
    # The grid, as the split declarations name its dimensions (declarations/splits.py: each split's `dim`).
    pp: int = 1  # pipeline stages: gpus = stages x replicas, each rank planned apart (finetune/plan/stages.py)
    pipeline_schedule: str = "1f1b"
    virtual_stages: int = 1
    pipeline_layers: tuple[int, ...] = ()  # decoder layers per stage; (): even (distributed.pipeline_layers)
    tp: int = 1  # tensor-parallel ranks: gpus = ranks x replicas (finetune/plan/stages.py)
    cp: int = 1  # context-parallel ranks: gpus = ranks x replicas, each rank seq/N + 1 tokens (finetune/plan/context.py)
    cp_mode: str = "ring"  # ring | ulysses
    sp: bool = False  # distributed.sequence_parallel: a tensor-parallel rank's residual stream is 1/tp of the positions
    vp: bool = False  # distributed.vocab_parallel: a tensor-parallel rank holds 1/tp of the embedding and head rows
    positions_split: int = 1  # what a rank's plan divides the residual stream's positions by (plan/stages.py sets tp)
    fp32_absmax: tuple[str, ...] = ()  # linears whose double-quant absmax a rank keeps in fp32 (tensor parallelism's row shares)
    tables_at_load: int = 1  # the vocabulary tables load this many times larger than they train (vocab_parallel cuts them)

    @property
    def strategy(self) -> Strategy:
        """The declaration of `sharding` (declarations/strategies.py): what it partitions, where it loads."""
        return planned(self.sharding)

    @property
    def partitions_weights(self) -> bool:
        """The base weights are split over the GPUs (FSDP, ZeRO-3), gathered a layer at a time."""
        return self.strategy.partitions_weights and self.gpus > 1

    @property
    def rows(self) -> int:
        """Sequences in one forward: the micro-batch's examples times the sequences of each."""
        return self.batch_size * self.sequences_per_example

    @property
    def prefill(self) -> tuple[int, int]:
        """(rows, tokens each) of an online objective's prefill: objectives/sampling.shared_prefill runs each prompt's
        tokens but its last once, its completions then share the cache (the last token goes with the first decode
        step); one completion a prompt: every row, whole."""
        if self.sampled_tokens and self.sequences_per_example > 1 and self.prompt_len > 1:
            return self.batch_size, self.prompt_len - 1
        return self.rows, self.prompt_len

    @property
    def prompt_len(self) -> int:
        """The longest prompt an online objective samples from: data/prompts.py drops a prompt that leaves no room
        for sampled_tokens within seq_len."""
        return max(self.seq_len - self.sampled_tokens, 1)

    @property
    def global_batch(self) -> int:
        """Examples per optimizer step: a pipeline's stages (a split layer's ranks, a split sequence's) share their
        micro-batches, its replicas do not."""
        return self.batch_size * self.grad_accum * self.gpus // self.ranks_per_replica

    @property
    def ranks_per_replica(self) -> int:
        """The GPUs one copy of the model spans: its pipeline stages x tensor-parallel x context-parallel ranks."""
        return self.pp * self.tp * self.cp

    @property
    def loss_rows(self) -> int:
        """Target positions whose logits exist at once: one chunk when the head runs chunked (chunked,
        liger, or auto outside ZeRO-3, as objectives/loss.CausalLMLoss.use_memory decides), else 0 (all of them).
        Preference losses never chunk: every response token's logits at once, whatever memory.loss says."""
        partitioned = self.strategy.partitions_root and self.gpus > 1  # ZeRO-3: the head a partition after forward
        modes = self.loss in ("chunked", "liger") or (self.loss == "auto" and not partitioned)
        chunked = self.head_in_chunks and modes
        return self.loss_chunk if chunked else 0

    def mlp_tiles(self, hidden: int) -> int:
        """Tiles each decoder MLP runs in at this sequence length (1: whole), as finetune.memory.tiled_mlp decides."""
        from finetune.memory.tiled_mlp import tiles_for

        return tiles_for(self.tiled_mlp, self.seq_len, hidden)

    def checkpointed_layers(self, layers: int) -> int:
        """How many of `layers` decoder layers recompute in backward (model/load.py checkpoints index % k == 0)."""
        return 0 if self.checkpoint_every <= 0 else math.ceil(layers / self.checkpoint_every)

    @property
    def offload_rank(self) -> int:
        """How much this setup leans on host RAM and the host link; ties in step time go to the lowest."""
        return int(self.cpu_offload) + sum(t.host_rank(self) for t in TECHNIQUES)


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
    unquantized_bytes: int | None = (
        None  # None: compute dtype (model/load.py does not upcast); 4: peft's prepare_model_for_kbit_training
    )
    loss: str = "gather"  # gather: objectives/loss.py's target-row fp32 CE; full_fp32: HF logits.float(); chunked: torchtune compiled chunked CE
    optimizer_states: int = 2  # AdamW: exp_avg and exp_avg_sq, in the adapters' dtype


DEFAULT_IMPL = Implementation()


@dataclass(frozen=True)
class RecipeFacts:
    """The parts of a recipe the memory model reads (a RecipeConfig, or a published run's settings)."""

    quant_bits: int | None
    double_quant: bool
    lora_r: int | None  # None: full fine-tuning
    lora_target: str | tuple[str, ...]
    lora_dropout: float
    dora: bool  # lora.method=dora (a published run's setting; `method` names any other)
    compute_bytes: int  # 2 for bf16/fp16, 4 for fp32
    # CUDA's fused dropout keeps a bool mask; the CPU kernel keeps a mask tensor of the input's dtype.
    dropout_mask_bytes: int = 1
    method: str | None = None  # lora.method (finetune/adapters/); None: dora or lora, as `dora` says
    packed: bool = False  # data.packing: rows of several examples, told apart by position_ids
    attention: str = "auto"  # model.attn_implementation
    compiled: bool = False  # train.compile (the search leaves out what it cannot run with)
    max_pixels: int | None = None  # data.max_pixels, else a local processor's own (plan/images.py)
    adapts_vision: bool = False  # lora.target lists vision_tower: LoRA inside the vision tower

    def attention_mask(self, rows: int) -> bool:
        """Whether attention gets a (rows, 1, T, T) bool mask: padding in a batch, or packed rows
        (transformers turns restarting position_ids into a block-causal mask under sdpa and eager;
        auto plans as the loader resolves it). flash_attention_2 and varlen (cut points only) and flex_attention (a
        block mask of 128 x 128 tiles) hold none, nor context parallelism's split attention (parallel/context.py:
        the 2D padding mask at most)."""
        unmasked = ("flash_attention_2", "flex_attention", "varlen", "context_parallel")
        return (rows > 1 or self.packed) and self.attention not in unmasked

    @property
    def lora(self) -> bool:
        """An adapter trains (False: full fine-tuning)."""
        return self.lora_r is not None

    @property
    def adapter(self) -> adapters.AdapterMethod:
        """The adapter method's planner facts (trained magnitudes, base weights read when wrapping)."""
        return adapters.get(self.method or ("dora" if self.dora else "lora"))

    @classmethod
    def from_config(cls, cfg: RecipeConfig, precision: str, on_gpu: bool = True, varlen_ok: bool = True) -> RecipeFacts:
        lora = cfg.lora
        target = "all-linear" if lora is None else lora.target if isinstance(lora.target, str) else tuple(lora.target)
        compute_bytes = 4 if precision == "fp32" else 2
        attention = cfg.model.attn_implementation
        packed, seq, device = cfg.data.packing, cfg.data.max_seq_len, "cuda" if on_gpu else "cpu"
        if attention == "auto" and auto_cuts_packed_rows(packed, seq, device, compute_bytes, varlen_ok):
            attention = "varlen"  # as the loader resolves auto for packed rows (model/load.py)
        return cls(
            quant_bits=cfg.quant.bits,
            double_quant=cfg.quant.double_quant,
            lora_r=lora.r if lora else None,
            lora_target=target,
            lora_dropout=lora.dropout if lora else 0.0,
            dora=bool(lora and lora.adapter.name == "dora"),
            compute_bytes=compute_bytes,
            dropout_mask_bytes=1 if on_gpu else compute_bytes,
            method=lora.adapter.name if lora else None,
            packed=cfg.data.packing,
            attention=attention,
            compiled=cfg.train.compile,
            max_pixels=cfg.data.max_pixels or processor_max_pixels(cfg.model.path),
            adapts_vision=isinstance(target, tuple) and VISION_TOWER in target,
        )


def lora_targets(shape: ModelShape, target: str | tuple[str, ...]) -> list[LinearGroup]:
    """The decoder linears peft wraps: 'all-linear' is every linear but the output head."""
    import re

    if target == "all-linear":
        return list(shape.linears)
    if isinstance(target, str):  # peft: a string is a regex over full module names; match its short names
        return [g for g in shape.linears if re.search(target, g.name)]
    return [g for g in shape.linears if g.name in target]


def _sharding_label(s: Setup) -> str:
    if s.pp > 1:
        interleaved = f" x {s.virtual_stages} virtual" if s.pipeline_schedule == "interleaved_1f1b" else ""
        replicas = s.gpus // (s.pp * s.tp * s.cp)
        split = (f" x {s.cp} context-parallel ranks ({s.cp_mode})" if s.cp > 1 else "") + (
            f" x {s.tp} tensor-parallel ranks" if s.tp > 1 else ""
        )
        return f" (pipeline: {s.pp} stages{interleaved}{split} x {replicas} replica{'s' if replicas > 1 else ''}, {s.pipeline_schedule})"
    if s.tp > 1:
        replicas = s.gpus // (s.tp * s.cp)
        parts = f" x {s.cp} context-parallel ranks ({s.cp_mode})" if s.cp > 1 else ""
        sp = (", sequence parallel" if s.sp else "") + (", vocabulary parallel" if s.vp else "")
        return f" (tensor parallel: {s.tp} ranks{parts} x {replicas} replica{'s' if replicas > 1 else ''}{sp})"
    if s.cp > 1:
        replicas = s.gpus // s.cp
        many = f"{replicas} replica{'s' if replicas > 1 else ''}"
        return f" (context parallel, {s.cp_mode}: each sequence over {s.cp} ranks x {many}){_sharded_label(s)}"
    return s.strategy.describe(s.cpu_offload, s.optimizer_offload) if s.gpus > 1 else ""


def _sharded_label(s: Setup) -> str:
    """' (FSDP)' and its offload where the weights are sharded over the processes (cp x FSDP), else ''."""
    return s.strategy.describe(s.cpu_offload, s.optimizer_offload) if s.strategy.wraps_layers else ""


def _sequences_label(s: Setup) -> str:
    if s.sampled_tokens:
        n, new, passes = s.sequences_per_example, s.sampled_tokens, s.reference_passes
        more = f", + {passes} forward{'s' if passes > 1 else ''} without gradients" if passes else ""
        return f"{n} completions of each sampled, up to {new} new tokens ({s.rows} rows per forward{more}), "
    return f"pairs ({s.rows} sequences per forward{', + a reference forward' if s.reference_passes else ''}), "


def describe_setup(s: Setup) -> str:
    ckpt = {1: "all layers", 0: "off"}.get(s.checkpoint_every, f"every {s.checkpoint_every} layers")
    offload = [label for t in TECHNIQUES if (label := t.offload_label(s))]
    return (
        f"{s.gpus} GPU{'s' if s.gpus > 1 else ''}{_sharding_label(s)}, "
        f"batch {s.batch_size} x accum {s.grad_accum} (global {s.global_batch}), seq {s.seq_len}, "
        + (_sequences_label(s) if s.sequences_per_example > 1 else "")
        + f"checkpointing {ckpt}"
        + (f", offload: {', '.join(offload)}" if offload else "")
        + (f", loss in chunks of {s.loss_chunk}" if s.loss_rows else "")
        + (f", MLP in {s.tiled_mlp} tiles" if isinstance(s.tiled_mlp, int) and s.tiled_mlp > 1 else "")
    )
