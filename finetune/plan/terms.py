"""What one tensor, token or layer costs in bytes, from what each op saves for backward, what sampling holds
(an online objective's KV cache) and how bitsandbytes stores weights; memory.py adds them up into a setup's estimate."""

from __future__ import annotations

import math
from dataclasses import dataclass

from finetune.adapters.base import EXPERTS
from finetune.plan.inputs import Implementation, RecipeFacts, Setup, lora_targets
from finetune.plan.shape import ModelShape

NF4_BLOCK, NF4_BLOCK2 = 64, 256  # bitsandbytes 4-bit block size, and double-quant block size of the absmax


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


def mlp_saved_bytes_per_token(shape: ModelShape, recipe: RecipeFacts) -> int:
    """The MLP's share of layer_saved_bytes_per_token: gate, SiLU and up (intermediate-sized), and
    down_proj's input when LoRA wraps it (what a tiled MLP holds for one tile only)."""
    b, f = recipe.compute_bytes, shape.intermediate
    wrapped = {g.name for g in lora_targets(shape, recipe.lora_target)} if recipe.lora else set()
    return 3 * b * f + (b * f if not recipe.lora or "down_proj" in wrapped else 0)


def layer_saved_bytes_per_token(shape: ModelShape, recipe: RecipeFacts, batch_size: int) -> int:
    """Bytes autograd keeps per token for one decoder layer (Llama-style: RMSNorm, attention, gated MLP).

    Worked out from what each op saves for backward, and checked against
    saved_tensors_hooks on real models (tests/test_plan_measured.py):
      RMSNorm (x2)       its input upcast to fp32 (4h); the fp32 variance is per token only
      q/k after RoPE, v, attention output: compute dtype (flash / memory-efficient SDPA save
                         no T x T matrix), plus the fp32 log-sum-exp per head
      GQA                under an attention mask (RecipeFacts.attention_mask) transformers repeats k/v to
                         every head before SDPA (no GQA kernel under a mask), so k and v cost h each
      gated MLP          gate (SiLU input), SiLU output, up: three intermediate-sized tensors
      base linears       nothing: a frozen (quantized) weight needs only itself for the input grad
      LoRA               each wrapped linear's input: with dropout a fresh copy plus its mask per
                         linear; without, the shared input once (q/k/v share one, gate/up one; o_proj's
                         is the attention output, counted: SDPA's output is laid out so that its
                         transpose is contiguous already); and lora_A's r-wide output, which lora_B keeps
    """
    b = recipe.compute_bytes
    h, f, lse = shape.hidden, shape.intermediate, shape.heads * 4
    qd = shape.heads * shape.head_dim
    kvd = shape.kv_heads * shape.head_dim
    if shape.kv_heads < shape.heads and recipe.attention_mask(batch_size):
        kvd = qd
    total = 2 * 4 * h  # two RMSNorms
    total += b * (qd + 2 * kvd + qd) + lse  # SDPA: q, k, v, out
    total += 3 * b * f  # MLP
    if not recipe.lora:
        return total + b * (h + qd + h + f)  # full fine-tuning: every linear saves its input for the weight grad
    inputs = {
        "q_proj": ("attn_in", h),
        "k_proj": ("attn_in", h),
        "v_proj": ("attn_in", h),
        "o_proj": ("o_in", qd),
        "gate_proj": ("mlp_in", h),
        "up_proj": ("mlp_in", h),
        "down_proj": ("down_in", f),
    }
    shared: dict[str, int] = {}
    for g in lora_targets(shape, recipe.lora_target):
        source, width = inputs.get(g.name, (g.name, g.in_features))
        per_layer = g.count / shape.layers
        total += int(b * (recipe.lora_r or 0) * per_layer)
        if recipe.lora_dropout > 0:
            total += int((b + recipe.dropout_mask_bytes) * width * per_layer)  # dropout output + mask, per wrapped linear
        elif source != "o_in":  # o_proj's input is the attention output SDPA keeps (its transpose is a view)
            shared[source] = width
    return total + b * sum(shared.values())


def pinned_block_bytes(n: int) -> int:
    """Host RAM a pinned tensor of n bytes takes: torch's pinned-memory allocator
    (CachingHostAllocator) rounds each block up to a power of two."""
    return 1 << (n - 1).bit_length() if n > 0 else 0


def backward_working_bytes_per_token(shape: ModelShape, recipe: RecipeFacts, mlp_tiles: int = 1) -> int:
    """Gradients alive at the peak of one layer's backward, its MLP's (the rest of the layer's saved
    tensors are still held then): the gradient of the layer's output and two intermediate-sized
    gradients of the MLP, of one tile under memory.tiled_mlp (each tile is a checkpoint that runs
    its backward alone). Measured on the CPU (tests/test_plan_measured.py)."""
    b = recipe.compute_bytes
    return b * shape.hidden + 2 * b * shape.intermediate // mlp_tiles


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


def trainable_params(shape: ModelShape, recipe: RecipeFacts) -> int:
    """LoRA A and B of every targeted linear (+ DoRA magnitudes), and of every expert when lora.target
    lists `experts` (peft's ParamWrapper: r x experts rows of A, columns of B); full fine-tuning: every parameter."""
    if not recipe.lora:
        return shape.total_params
    r = recipe.lora_r or 0
    targets = lora_targets(shape, recipe.lora_target)
    extra = sum(g.out_features * g.count for g in targets) if recipe.adapter.trains_magnitude else 0
    if adapts_experts(recipe):
        extra += sum(r * g.experts * (g.in_features + g.out_features) * g.count for g in shape.experts)
    return sum(r * (g.in_features + g.out_features) * g.count for g in targets) + extra


def adapts_experts(recipe: RecipeFacts) -> bool:
    """lora.target lists `experts`: LoRA on the fused expert parameters (finetune/model/moe.py)."""
    return recipe.lora and not isinstance(recipe.lora_target, str) and EXPERTS in recipe.lora_target


def expert_weight_bytes(shape: ModelShape, recipe: RecipeFacts) -> tuple[int, int, int]:
    """(4-bit weight, quantization-constant, compute-dtype bytes) of an MoE model's experts. finetune/model/moe.py
    stores each fused expert parameter 4-bit as one tensor; under quant.bits=8 (bitsandbytes converts
    nn.Linear only) or null they stay in the compute dtype."""
    b = recipe.compute_bytes
    if recipe.quant_bits == 8:
        return 0, 0, shape.expert_params * b
    sizes = [
        (quantized_bytes(e.params // e.count, e.out_features, recipe.quant_bits, recipe.double_quant, b), e.count)
        for e in shape.experts
    ]
    return sum(w * n for (w, _), n in sizes), sum(c * n for (_, c), n in sizes), 0


def expert_stack_saved_bytes(shape: ModelShape, recipe: RecipeFacts) -> int:
    """What an MoE layer keeps for its backward besides activations: the expert stack its matmuls read,
    when it is a tensor of its own (4-bit experts dequantized for the layer's forward, or W + LoRA
    folded by peft); autograd holds it until the layer's backward. 16-bit experts without LoRA: the
    parameters themselves. With LoRA on the experts, backward adds the stack's gradient (transient)."""
    own = recipe.quant_bits == 4 or adapts_experts(recipe)
    return shape.expert_layer_params * recipe.compute_bytes if own else 0


@dataclass
class Transient:
    """Buffers that exist in one phase of the step only: the loss phase's, or one layer's backward."""

    mask: int  # bool 4D attention mask transformers builds when the batch is padded
    final_norm: int  # the final norm's fp32 input
    loss: int  # logits and loss buffers (memory.loss chunked or auto: one chunk of target positions)
    working: int  # gradients while one layer runs backward
    dequant: int  # the weight dequantized for one matmul (LoRA on MoE experts: the gradient of a layer's stack)
    head_visit: int  # memory.embeddings=cpu: the LM head's copy on the GPU while the loss runs


def transient_terms(shape: ModelShape, recipe: RecipeFacts, setup: Setup, impl: Implementation, head_visit: int) -> Transient:
    """The training forward's and backward's one-phase buffers of a micro-batch (setup.rows x setup.seq_len tokens)."""
    b, T, B = recipe.compute_bytes, setup.seq_len, setup.rows  # sequences per forward
    tokens = B * T
    # every position a target (the worst case); an online objective's head runs on the completions only (grpo's
    # boolean logits_to_keep), at most sampled_tokens a row
    targets = B * min(T, setup.sampled_tokens) if setup.sampled_tokens else tokens
    logits_bytes = (impl.unquantized_bytes or b) if impl.loss != "chunked" else b
    head = shape.head_matmul_params > 0  # a pipeline rank without the last stage computes no loss
    return Transient(
        mask=B * T * T if recipe.attention_mask(B) else 0,
        final_norm=tokens * 4 * shape.hidden // setup.positions_split if head else 0,  # sequence parallel: a share
        loss=loss_peak_bytes(min(targets, setup.loss_rows) if setup.loss_rows else targets, shape.vocab, logits_bytes, impl)
        if head
        else 0,
        working=tokens * backward_working_bytes_per_token(shape, recipe, 1 if shape.experts else setup.mlp_tiles(shape.hidden)),
        dequant=max(shape.largest_linear * b if recipe.quant_bits else 0, shape.expert_layer_params * b * adapts_experts(recipe)),
        head_visit=head_visit,
    )


@dataclass(frozen=True)
class Sampling:
    """What generate holds while it samples a micro-batch's completions (objectives/sampling.py: a KV cache, no
    autograd), at its two peaks: the prefill's last layer, and the last decode step."""

    prompt_cache: int  # every layer's K and V of the prompts, after the prefill
    cache: int  # at the last decode step: the prompt and every sampled token but the last
    prefill: int  # one layer's forward over the prompts (prefill_bytes_per_token) and the attention mask
    decode: int  # a step's logits and probabilities, or one layer's K or V copied as the cache grows, at their larger

    @property
    def prefills_at_peak(self) -> bool:
        return self.prompt_cache + self.prefill > self.cache + self.decode

    @property
    def peak(self) -> int:
        return max(self.prompt_cache + self.prefill, self.cache + self.decode)


def sampling_terms(shape: ModelShape, recipe: RecipeFacts, setup: Setup, adapter_bytes: int) -> Sampling:
    """generate's buffers for setup.rows rows of setup.prompt_len prompt tokens (the longest kept) and
    setup.sampled_tokens new ones each: every row runs to the last (an upper bound; HF pads the rows that end).
    A decode step peaks at the larger of two moments. transformers' DynamicCache grows by torch.cat, so one tensor's
    old and new copies meet while the last step's fp32 logits and probabilities are still alive; then the head makes
    the last position's logits (generate passes logits_to_keep=1), copied to fp32 and turned into probabilities
    before the last step's are let go (temperature 1, top_p 1: no warper's copies). Measured on the CPU
    (tests/test_plan_generation.py)."""
    if not setup.sampled_tokens:
        return Sampling(0, 0, 0, 0)
    b, rows, prompt = recipe.compute_bytes, setup.rows, setup.prompt_len
    positions = prompt + setup.sampled_tokens - 1  # the last token sampled is never fed back
    per_token = rows * shape.kv_bytes(b)
    # Each prompt prefilled once (Setup.prefill), its cache then repeated for its completions: a copy no larger than
    # the decode's cache.
    prefilled, fed = setup.prefill
    mask = prefilled * fed * fed if recipe.attention_mask(prefilled) else 0  # bool (rows, 1, P, P): left-padded prompts
    prefill = prefilled * fed * prefill_bytes_per_token(shape, recipe, adapter_bytes) + mask
    grown = rows * (positions - 1) * shape.kv_heads * shape.head_dim * b  # the old copy, one position shorter
    decode = max(grown + rows * shape.vocab * 2 * 4, rows * shape.vocab * (b + 3 * 4))
    return Sampling(prefilled * shape.kv_bytes(b) * fed, per_token * positions, prefill, decode)


def prefill_bytes_per_token(shape: ModelShape, recipe: RecipeFacts, adapter_bytes: int) -> int:
    """Bytes per token alive at the peak of one layer's forward without autograd (generate's prefill), at its MLP's
    up_proj: the SiLU output and up_proj's result; where LoRA wraps it, peft's copy of that result and lora_B's output
    and its scaled copy in the adapter's dtype, and its input cast to that dtype; the embeddings' output, the
    layer's input, the attention's residual sum and the normed MLP input; RoPE's cos and sin.
    Measured on the CPU (tests/test_plan_generation.py)."""
    b, f, h = recipe.compute_bytes, shape.intermediate, shape.hidden
    targets = lora_targets(shape, recipe.lora_target) if recipe.lora else []
    mlp = f * (2 * b + 2 * adapter_bytes) if any(g.out_features >= f for g in targets) else 3 * b * f
    cast = adapter_bytes * h if targets and adapter_bytes != b else 0
    return mlp + cast + 4 * b * h + 2 * b * shape.head_dim
