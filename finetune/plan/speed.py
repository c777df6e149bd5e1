"""Step time: compute, NF4 dequantization, GPU-link communication, host-link copies and an online objective's sampling
of one optimizer step."""

from __future__ import annotations

from dataclasses import dataclass

# One set of constants for every prediction (CLI, preflight, validation); each says where it comes from.
# These are the speed ones; memory.py, fitting.py and check.py hold the others.
MATMUL_EFFICIENCY = 0.45  # fraction of dense bf16 peak that LoRA training matmuls reach (MFU of tuned 7B runs: 0.35-0.55)
BANDWIDTH_EFFICIENCY = 0.75  # fraction of spec memory bandwidth reached by the NF4 dequantize kernels
LINK_EFFICIENCY = 0.8  # fraction of link bandwidth reached by NCCL collectives and host copies
# Host link: GpuSpec.pcie_gbps, the effective one-direction rate of pinned copies (PCIe 4.0 x16:
# ~25 GB/s of 32; PCIe 5.0: ~50). memory.base_weights=disk reads a memory-mapped file: when its
# pages are not in the page cache the NVMe disk sets the rate (PCIe 4.0 NVMe sequential read).
NVME_READ_GBPS = 3.5
NVME_WRITE_GBPS = 2.0  # sustained writes of a consumer NVMe disk past its cache (activation_offload=disk's parked inputs)
HOST_ADAMW_GBPS = 10.0  # host-memory traffic torch's CPU AdamW sustains (an assumption; desktop DDR4/DDR5)
HOST_ADAMW_BYTES_PER_PARAM = 64  # fp32 weight, grad and 2 moments, read and written over AdamW's elementwise passes


@dataclass(frozen=True)
class TokenFlops:
    """FLOPs per token of one micro-batch, by what they are for."""

    forward: float  # the first pass over the model: its matmuls (LoRA's included) and attention
    model: float  # what training needs: forward, backward (input gradients through frozen weights, weight
    # gradients of what trains) and DPO's reference forwards. MFU's numerator (finetune/trainer/profiling.py)
    recompute: float  # what memory modes add: checkpointed layers, chunked-head and MLP-tile replays in backward


def token_flops(shape, recipe, setup, trainable, seq_len: float | None = None) -> TokenFlops:
    """FLOPs per token of a micro-batch of `setup` (matmuls and attention; norms and elementwise ops are noise).
    seq_len: the length attention spans, setup.seq_len unless given (a run's mean row length)."""
    T = setup.seq_len if seq_len is None else seq_len
    # MoE: a token multiplies by its active experts only (memory holds them all: memory.py).
    matmul_params = shape.linear_params + shape.active_expert_params + shape.head_matmul_params
    lora_flops = 2 * trainable if recipe.lora else 0
    fwd = 2 * matmul_params + lora_flops
    attn_fwd = 2 * T * shape.heads * shape.head_dim * shape.layers  # QK^T and AV, causal half
    ckpt = setup.checkpointed_layers(shape.layers) / shape.layers  # the share of layers replayed
    # Backward of a frozen weight computes only the input gradient (1x forward); attention
    # backward is ~2x its forward; checkpointing replays the decoder forward once more.
    model = fwd * 2 + attn_fwd * 3 + (lora_flops if recipe.lora else 2 * fwd)
    # DPO's reference: the forward again, adapter off (grpo's passes: once a sampling, which serves `iterations` steps)
    model += setup.reference_passes / setup.iterations * (fwd + attn_fwd)
    recompute = (fwd + attn_fwd) * ckpt
    if setup.loss_rows:  # the chunked head runs again in backward to remake each chunk's logits
        recompute += 2 * shape.head_matmul_params
    if setup.mlp_tiles(shape.hidden) > 1 and not shape.experts:  # each MLP tile runs again in backward (not MoE's)
        recompute += 2 * 3 * shape.hidden * shape.intermediate * shape.layers
    return TokenFlops(forward=fwd + attn_fwd, model=model, recompute=recompute)


def _micro_batch_seconds(shape, recipe, setup, gpu, trainable) -> tuple[float, float, float, float]:
    """(compute, dequantize, forward, recompute) seconds of one micro-batch on one GPU, nothing moved over a link.

    forward: the first pass over the layer stack (its matmuls, attention and one dequantize pass),
    the rest of compute + dequantize being the recompute and backward. recompute: the part of
    compute that memory modes add (what MFU does not count)."""
    tokens = setup.rows * setup.seq_len
    flops = token_flops(shape, recipe, setup, trainable)
    rate = gpu.bf16_tflops * 1e12 * MATMUL_EFFICIENCY
    compute = tokens * (flops.model + flops.recompute) / rate
    dequant = 0.0
    one_pass = 0.0
    if recipe.quant_bits:
        # Each pass over a 4-bit weight reads it (0.5 B/param), writes it in bf16 (2) and the matmul reads that (2).
        one_pass = shape.linear_params * 4.5 / (gpu.bandwidth_gbps * 1e9 * BANDWIDTH_EFFICIENCY)
        # MoE (4-bit only; int8 leaves experts 16-bit): finetune/model/moe.py dequantizes a layer's
        # whole expert stack once per forward and keeps it for backward, where a linear dequantizes again.
        experts = (shape.expert_params if recipe.quant_bits == 4 else 0) * 4.5 / (gpu.bandwidth_gbps * 1e9 * BANDWIDTH_EFFICIENCY)
        ckpt = setup.checkpointed_layers(shape.layers) / shape.layers
        dequant = (2 + ckpt + setup.reference_passes) * one_pass + (1 + ckpt + setup.reference_passes) * experts
        one_pass += experts
    forward = tokens * flops.forward / rate + one_pass
    return compute, dequant, forward, tokens * flops.recompute / rate


def sampling_seconds(
    shape, recipe, setup, gpu, trainable, adapter_bytes: int, streamed_bytes: int = 0, gathered_s: float = 0.0
) -> float:
    """Seconds to sample one micro-batch's completions (objectives/sampling.py: HF generate with a KV cache), every
    row to setup.sampled_tokens (an upper bound). The prefill is one forward over each prompt once (Setup.prefill),
    compute-bound like training's (the head at the last position only: logits_to_keep=1). Then a forward per further token, of one token
    a row: its matmuls are small, so a step takes the longer of its FLOPs and its memory traffic, the weights read
    once (4-bit ones dequantized first: the rows are more than one, bitsandbytes' gemv is for a single token) and the
    KV cache three times (DynamicCache's torch.cat reads it and writes it anew, attention reads it). Every forward
    copies the weights it does not hold, overlapped with its compute: streamed base weights over the host link,
    FSDP's gathers (gathered_s: one pass's; every rank steps until the last is done)."""
    new = setup.sampled_tokens
    if not new or gpu is None:
        return 0.0
    rows, prompt, steps = setup.rows, setup.prompt_len, new - 1
    rate = gpu.bf16_tflops * 1e12 * MATMUL_EFFICIENCY
    bandwidth = gpu.bandwidth_gbps * 1e9 * BANDWIDTH_EFFICIENCY
    per_token = token_flops(shape, recipe, setup, trainable, seq_len=prompt).forward  # its attention: the causal half
    head = 2 * shape.head_matmul_params
    quantized = (shape.linear_params + (shape.expert_params if recipe.quant_bits == 4 else 0)) if recipe.quant_bits else 0
    dense = shape.linear_params + shape.expert_params - quantized + shape.head_matmul_params
    adapter = trainable * adapter_bytes if recipe.lora else 0
    weights = quantized * 4.5 + dense * recipe.compute_bytes + adapter  # what every forward reads
    prefilled, fed = setup.prefill  # each prompt once: its last token then goes with the first decode step
    prefill = (prefilled * fed * (per_token - head) + prefilled * head) / rate + quantized * 4.5 / bandwidth
    last = fed < prompt
    spans = steps * prompt + steps * (steps + 1) / 2 + (prompt if last else 0)  # positions each decoded token attends to
    steps += last
    attention = 4 * shape.heads * shape.head_dim * shape.layers  # QK^T and AV per position attended
    matmuls = per_token - 2 * prompt * shape.heads * shape.head_dim * shape.layers
    flops = rows * (steps * matmuls + spans * attention)
    traffic = steps * weights + 3 * rows * shape.kv_bytes(recipe.compute_bytes) * spans
    on_gpu = prefill + max(flops / rate, traffic / bandwidth)
    link = min(NVME_READ_GBPS, gpu.pcie_gbps) if setup.base_weights == "disk" else gpu.pcie_gbps
    return max(on_gpu, (steps + 1) * max(streamed_bytes / (link * 1e9), gathered_s))  # every forward, the prefill's too


def forward_seconds(shape, recipe, setup, gpu, trainable) -> float:
    return _micro_batch_seconds(shape, recipe, setup, gpu, trainable)[2]


def predicted_mfu(step_time_s: float, parts: dict[str, float]) -> float:
    """MFU a plan predicts: the model's FLOPs of a step (compute less recomputation, at MATMUL_EFFICIENCY
    of the peak) over what the GPU could do at its peak in the whole step (dequantization, links, optimizer)."""
    return MATMUL_EFFICIENCY * (parts["compute"] - parts["recompute"]) / step_time_s if step_time_s else 0.0


def step_time(
    shape,
    recipe,
    setup,
    gpu,
    trainable,
    quantized_weight_bytes,
    adapter_bytes,
    fsdp,
    *,
    streamed_bytes: int = 0,
    activation_bytes: int = 0,
    exposed_bytes: int = 0,
    parked_bytes: int = 0,
) -> tuple[float, dict[str, float]]:
    """Seconds per optimizer step: compute at MATMUL_EFFICIENCY of dense bf16 peak, NF4 dequantization
    at BANDWIDTH_EFFICIENCY of memory bandwidth, gradient all-reduce (DDP) or weight all-gather (FSDP)
    over the GPU link, and host-link copies of the offload modes. CPU runs (gpu=None) get 0: the plan
    is for GPUs.

    streamed_bytes: base weights streamed per pass over the layer stack (base_weights=cpu|disk);
    activation_bytes: saved activations sent to host RAM per micro-batch (activation offload);
    parked_bytes: of those, what goes on to files and comes back per micro-batch (activation_offload=disk);
    exposed_bytes: copies per micro-batch that wait for nothing to overlap them (memory.embeddings=cpu:
    the head's visit, made when the loss needs it, and the looked-up embedding rows).
    An online objective's sampling (sampling_seconds) comes before each micro-batch's forward."""
    if gpu is None:
        return 0.0, {}
    compute, dequant, forward, recompute = _micro_batch_seconds(shape, recipe, setup, gpu, trainable)
    host_link = gpu.pcie_gbps * 1e9
    micro, transfer, exposed = _with_host_copies(
        shape, setup, gpu, compute + dequant, forward, streamed_bytes, activation_bytes, parked_bytes
    )
    # Copies that nothing overlaps add whole.
    micro, transfer, exposed = (x + exposed_bytes / host_link for x in (micro, transfer, exposed))
    n = setup.gpus
    link = gpu.link_gbps(range(n)) * 1e9 * LINK_EFFICIENCY  # the nodes' link when the GPUs span nodes
    comm = gathered = 0.0  # gathered: seconds one pass's gathers (or host copies of the shards) take
    ckpt = setup.checkpointed_layers(shape.layers) / shape.layers
    if n > 1 and fsdp:
        gathered = quantized_weight_bytes * (n - 1) / link  # each pass gathers the whole layer stack
        gather = (2 + ckpt) * gathered
        micro = max(micro, gather)  # FSDP prefetch overlaps the gathers with compute
        comm = 2 * (n - 1) / n * trainable * adapter_bytes / link
    elif n > 1:
        comm = 2 * (n - 1) / n * trainable * adapter_bytes / link  # ring all-reduce of the gradients, once a step
    optimizer = 4 * trainable * adapter_bytes * 4 / (gpu.bandwidth_gbps * 1e9 * BANDWIDTH_EFFICIENCY)
    if fsdp and setup.cpu_offload:
        # Each pass copies this GPU's weight shards host->GPU; gradients go back once a step;
        # AdamW runs on the CPU.
        n_share = max(n, 1)
        gathered = max(gathered, quantized_weight_bytes / n_share / host_link)
        h2d = (2 + ckpt) * quantized_weight_bytes / n_share / host_link
        micro = max(micro, h2d)
        comm += trainable * adapter_bytes / n_share / host_link
        optimizer = 4 * trainable * adapter_bytes * 4 / n_share / (HOST_ADAMW_GBPS * 1e9)
    elif setup.optimizer_offload:
        # HostAdamW: gradients to the host, the fp32 AdamW step there, updated weights back; not overlapped.
        optimizer = 2 * trainable * adapter_bytes / host_link + trainable * HOST_ADAMW_BYTES_PER_PARAM / (HOST_ADAMW_GBPS * 1e9)
    parts = {
        "compute": compute * setup.grad_accum,
        "recompute": recompute * setup.grad_accum,  # of compute: what memory modes replay (not in MFU)
        "dequantize": dequant * setup.grad_accum,
        "communication": comm,
        "optimizer": optimizer,
        "host_transfer": transfer * setup.grad_accum,
        "host_transfer_exposed": exposed * setup.grad_accum,
        # an online objective samples every micro-batch's completions first (the loop's Loss.prepare), once for
        # num_iterations steps (a step's share)
        "sampling": sampling_seconds(shape, recipe, setup, gpu, trainable, adapter_bytes, streamed_bytes, gathered)
        * setup.grad_accum
        / setup.iterations,
    }
    return micro * setup.grad_accum + comm + optimizer + parts["sampling"], parts


def _with_host_copies(
    shape, setup, gpu, micro: float, forward: float, streamed_bytes: int, activation_bytes: int, parked_bytes: int = 0
):
    """(micro-batch seconds with the offload modes' copies, seconds of copies, seconds they add)."""
    if not (streamed_bytes or activation_bytes):
        return micro, 0.0, 0.0
    host_link = gpu.pcie_gbps * 1e9
    # Copies run on a side stream while layers compute, so a layer takes max(its compute, its copy):
    # summed over uniform layers, max(compute of the pass, copies of the pass). The head and loss
    # are counted in with the layers (a slight over-statement of the overlap); nothing hides the
    # copy of the first layer of each pass (it has no layer before it).
    weights_rate = min(NVME_READ_GBPS * 1e9, host_link) if setup.base_weights == "disk" else host_link
    weights = streamed_bytes / weights_rate  # once in forward, once in the recompute before backward
    first_layer = weights / shape.layers
    acts = activation_bytes / host_link
    backward = micro - forward
    # Forward: weights come in while activations go out (PCIe is full duplex). Backward: the offloaded activations
    # come back on the compute stream, so those copies add to the time.
    # activation_offload=disk: a thread writes the parked inputs in forward and reads them back ahead in backward, on
    # the disk the streamed weights come from too (base_weights=disk): the same overlap, at the disk's rates.
    on_disk = weights if setup.base_weights == "disk" else 0.0
    sharing = min(max(setup.gpus, 1), gpu.gpus_per_node or max(setup.gpus, 1))  # a node's processes: one disk
    written, read = (sharing * parked_bytes / (rate * 1e9) for rate in (NVME_WRITE_GBPS, NVME_READ_GBPS))
    with_copies = (
        max(forward, weights, acts, on_disk + written) + first_layer + max(backward, weights, on_disk + read) + first_layer + acts
    )
    return with_copies, 2 * weights + 2 * acts + written + read, with_copies - micro
