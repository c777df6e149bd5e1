"""The human-readable plan: per-GPU breakdown, peak, verdict, host RAM, disk, step time."""

from __future__ import annotations

from finetune.plan.inputs import describe_setup
from finetune.plan.memory import Estimate, gib
from finetune.plan.speed import BANDWIDTH_EFFICIENCY, MATMUL_EFFICIENCY, NVME_READ_GBPS, NVME_WRITE_GBPS, predicted_mfu


def _nodes(e: Estimate) -> str:
    """How the GPUs sit in nodes, when they fill several (plan --nodes)."""
    assert e.gpu is not None
    nodes = e.gpu.nodes_of(e.setup.gpus)
    if nodes <= 1:
        return ""
    return f", {e.gpu.gpus_per_node} per node x {nodes} nodes linked at {e.gpu.node_link_gbps * 8:g} Gbit/s"


def report(e: Estimate) -> str:
    """The human-readable plan: per-GPU breakdown, peak, verdict, host RAM, disk, step time."""
    lines = [
        f"model      {e.shape.source} ({e.shape.model_type}, {e.shape.total_params / 1e9:.2f}B parameters, "
        f"{e.trainable_params / 1e6:.1f}M trainable)",
        f"setup      {describe_setup(e.setup)}",
        f"device     {e.gpu.description or e.gpu.name} ({gib(e.gpu.memory_bytes)}){_nodes(e)}" if e.gpu else "device     CPU",
        "",
        "per-GPU memory at the peak ("
        + {
            "loss": "end of forward: logits and loss",
            "start": "start: the whole model, before ZeRO-3 partitions it",
            "attention": "backward of one layer's split attention",
            "sampling": "sampling the completions, before the forward",
        }.get(e.peak_phase, "backward of one layer")
        + "):",
    ]
    for c in e.components:
        if c.bytes == 0:
            continue
        mark = " " if c.in_peak else "~"
        lines.append(f"  {mark} {c.label:<48} {gib(c.bytes):>12}")
    lines.append(f"    {'peak':<48} {gib(e.peak_bytes):>12}")
    lines.append("  (~ = the other phase's transient buffers, not in the peak)")
    if e.gpu is not None:
        room = e.headroom_bytes or 0
        verdict = (
            f"fits: {gib(room)} headroom ({100 * e.peak_bytes / e.gpu.memory_bytes:.0f}% of {e.gpu.name})"
            if e.fits
            else f"does NOT fit: {gib(-room)} over the {gib(e.gpu.memory_bytes)} of {e.gpu.name}"
        )
        lines += ["", f"verdict    {verdict}"]
    lines += _host_lines(e)
    if e.step_time_s and e.gpu is not None:
        p = e.step_time_parts
        # MFU counts the model's FLOPs only: time spent replaying (checkpointing, chunks, tiles) lowers it.
        replayed = f", {p['recompute']:.2f} s of it recomputation" if p["recompute"] >= 0.005 else ""
        lines.append(
            f"step time  ~{e.step_time_s:.2f} s/step, {e.tokens_per_step / e.step_time_s:,.0f} tokens/s, "
            f"MFU {predicted_mfu(e.step_time_s, p):.0%} (compute {p['compute']:.2f} s at {MATMUL_EFFICIENCY:.0%} of "
            f"{e.gpu.bf16_tflops:g} TFLOPs{replayed}, "
            f"dequantize {p['dequantize']:.2f} s at {BANDWIDTH_EFFICIENCY:.0%} of {e.gpu.bandwidth_gbps:g} GB/s, "
            f"communication {p['communication']:.2f} s, optimizer {p['optimizer']:.2f} s)"
        )
        if p.get("sampling"):
            s = e.setup
            lines.append(
                f"sampling   {p['sampling']:.2f} s/step of it: {s.grad_accum} x {s.rows} completions of up to {s.sampled_tokens} "
                "tokens, a token per forward (each reads the weights and the KV cache; the prompts' prefill computes)"
            )
        if "pipeline_bubble" in p or "tensor_allreduce" in p or "context_traffic" in p:  # what splitting adds to a step
            said = []
            if "pipeline_bubble" in p:
                said.append(f"the bubble {p['pipeline_bubble']:.2f} s/step, sends between stages {p['pipeline_p2p']:.2f} s/step")
            if "tensor_allreduce" in p:
                said.append(f"all-reduces inside each layer {p['tensor_allreduce']:.2f} s/step")
            if "context_traffic" in p:
                how = "ring K/V passes" if e.setup.cp_mode == "ring" else "Ulysses all-to-alls"
                said.append(
                    f"{how} {p['context_traffic']:.2f} s/step on the GPU link, {p['context_exposed']:.2f} s/step not hidden"
                )
            split = ", ".join(said)
            lines.append(f"split      {split} (in the step time above)")
        if p.get("host_transfer"):
            s = e.setup
            rate = f"{e.gpu.pcie_gbps:g} GB/s (pinned, host link)"
            if s.base_weights == "disk":
                rate = f"{min(NVME_READ_GBPS, e.gpu.pcie_gbps):g} GB/s (NVMe, page cache cold) for weights, " + rate
            if s.activation_offload == "disk":
                rate += f", {NVME_WRITE_GBPS:g} / {NVME_READ_GBPS:g} GB/s (NVMe write / read) for parked inputs"
            overlap = "" if p["host_transfer_exposed"] >= p["host_transfer"] else ", overlapped layer by layer with compute"
            lines.append(
                f"host link  {p['host_transfer']:.2f} s/step of copies at {rate}{overlap}: "
                f"they add {p['host_transfer_exposed']:.2f} s/step"
            )
    lines += [f"note       {n}" for n in e.notes]
    return "\n".join(lines)


def strategy_table(rows: list[tuple[str, Estimate]]) -> str:
    """`finetune plan --gpus N`: per-GPU peak, verdict, step time and host RAM of each strategy."""
    n = rows[0][1].setup.gpus
    lines = [f"strategies on {n} GPUs (the recipe's memory.* modes; distributed.strategy=... to switch):"]
    for label, e in rows:
        verdict = "" if e.gpu is None else ("fits" if e.fits else "does NOT fit")
        step = f"~{e.step_time_s:.2f} s/step" if e.step_time_s else ""
        # tokens/s too: a pipeline's stages share one global batch, so its steps hold fewer rows than DDP's
        rate = f"{e.tokens_per_step / e.step_time_s:>7,.0f} tok/s" if e.step_time_s else ""
        lines.append(
            f"  {label:<44} peak {gib(e.peak_bytes):>10}  {verdict:<12} {step:<15}{rate:<14} host RAM {gib(e.host_ram_bytes)}"
        )
    return "\n".join(lines)


def _host_lines(e: Estimate) -> list[str]:
    """Host RAM and disk, with what they hold (host RAM per process is libraries + the larger of
    loading and what stays in RAM while training: pinned offload buffers, FSDP's offloaded shards)."""
    h, d = e.host_ram_parts, e.disk_parts
    if e.loads_on_gpu:
        held = " (one weight shard: the model loads on the GPU, its streamed layers then move to host RAM)"
    elif e.loads_whole_model:
        held = " (each process builds the whole model in CPU RAM first)"
    elif e.setup.streams_weights:
        held = " (one weight shard and the resident weights; 4-bit layers go to the file as they load)"
    else:
        held = " (one weight shard)"
    loading = f"loading {gib(h.get('loading', 0))}{held}"
    kept = [
        f"{label} {gib(h[k])}"
        for k, label in [
            ("streamed_weights", "streamed base weights"),
            ("activations", "saved activations"),
            ("optimizer", "AdamW state + fp32 weights and grads"),
            ("fsdp_shards", "offloaded weight shards (FSDP, ZeRO-3)"),
            ("vocab_tables", "embeddings and head"),
        ]
        if h.get(k)
    ]
    text = f"libraries {gib(h.get('libraries', 0))} + " + (
        f"max({loading}; kept while training: {', '.join(kept)})" if kept else loading
    )
    per = f", {e.setup.gpus} processes" if e.setup.gpus > 1 else ""
    nodes = e.gpu.nodes_of(e.setup.gpus) if e.gpu else 1
    per += f"; {gib(e.host_ram_bytes / nodes)} on each of {nodes} nodes" if nodes > 1 else ""
    disk = [
        f"{label} {gib(d[k])}"
        for k, label in [
            ("download", "bf16 weights if downloaded"),
            ("checkpoints", "checkpoints"),
            ("adapter", "adapter"),
            ("streamed_weights", "streamed-weights file"),
            ("parked_activations", "parked checkpointed inputs"),
        ]
        if d.get(k)
    ]
    return [
        f"host RAM   {gib(e.host_ram_bytes)} (per process: {text}{per})",
        f"disk       {gib(e.disk_bytes)} ({', '.join(disk)})",
    ]
