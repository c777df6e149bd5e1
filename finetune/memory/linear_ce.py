"""Linear cross-entropy that never holds the logits of more than one chunk of positions.

    loss_sum = chunked_linear_cross_entropy(hidden, lm_head, targets, chunk_rows=4096)

The logits of a 128k vocabulary at 8k positions are 4 GiB in bf16 and twice that
upcast to fp32 for the loss: on one 24 GB card, more than the whole 4-bit 8B model.
Here the LM head and the loss run together over chunks of target positions; each
chunk is a checkpoint, so its logits exist only while its loss is computed and again,
one chunk at a time, while backward recomputes them. The log-sum-exp is taken in
fp32. Any head works (a LoRA-wrapped or 4-bit one too: it is called as a module; one split along
the vocabulary over a tensor-parallel group gives its columns and their loss, parallel/vocab.py),
and a model's own transform of the logits (Gemma's soft-capping, Cohere's and
Granite's scales) is applied per chunk.

Ideas from torchtune's chunked loss, Liger's fused linear cross-entropy and Apple's
cut-cross-entropy; this is our own, on torch.utils.checkpoint.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

LogitsTransform = Callable[[torch.Tensor], torch.Tensor]


def logits_transform(config) -> LogitsTransform | None:
    """What a model's causal-LM forward does to the head's output before returning it, or None.

    Known forms only; chunked_head_matches checks the result against the model itself on the first
    chunked batch (CausalLMLoss._reproduces_logits), so an unknown form falls back to the full logits."""
    config = config.get_text_config() if hasattr(config, "get_text_config") else config
    cap = getattr(config, "final_logit_softcapping", None)
    if cap:
        return lambda logits: torch.tanh(logits / cap) * cap
    scale = getattr(config, "logit_scale", None)  # Cohere: logits * logit_scale
    if scale not in (None, 1, 1.0) and isinstance(scale, (int, float)):
        return lambda logits: logits * scale
    multiplier = getattr(config, "lm_head_multiplier", None)  # Falcon-H1: logits * lm_head_multiplier
    if multiplier not in (None, 1, 1.0) and isinstance(multiplier, (int, float)):
        return lambda logits: logits * multiplier
    scaling = getattr(config, "logits_scaling", None)  # Granite divides by it; HyperCLOVAX multiplies
    if scaling not in (None, 1, 1.0) and isinstance(scaling, (int, float)):
        if "granite" in str(getattr(config, "model_type", "")):
            return lambda logits: logits / scaling
        return lambda logits: logits * scaling
    return None


@torch.no_grad()
def chunked_head_matches(model, owner: torch.nn.Module, device: torch.device, tokens: int = 8) -> bool:
    """Whether the head + logits_transform reproduce the model's own logits, on a short probe in eval
    mode (no dropout; the random generators are left as they were)."""
    head: Any = owner.lm_head
    transform = logits_transform(owner.config)
    ids = torch.arange(1, tokens + 1, device=device).unsqueeze(0)
    capture = CaptureHead()
    was_training = model.training
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        model.eval()
        try:
            real = model(input_ids=ids, use_cache=False).logits[0].float()
            owner.lm_head = capture
            try:
                model(input_ids=ids, use_cache=False)
            finally:
                owner.lm_head = head
        finally:
            model.train(was_training)
    if capture.hidden is None:
        return False
    ours = head(capture.hidden.reshape(-1, capture.hidden.shape[-1]))
    ours = (transform(ours) if transform else ours).float()
    if ours.shape != real.shape:  # e.g. a model that cuts padded vocabulary entries off
        return False
    return bool(torch.allclose(ours, real, rtol=1e-3, atol=1e-3 * max(1.0, float(real.abs().max()))))


def _chunk_logps(
    hidden: torch.Tensor, targets: torch.Tensor, head: torch.nn.Module, transform: LogitsTransform | None, temperature: float
) -> torch.Tensor:
    logits = head(hidden)
    logits = (transform(logits) if transform is not None else logits).float() / temperature
    return -F.cross_entropy(logits, targets, reduction="none")


def _chunk_loss(
    hidden: torch.Tensor, targets: torch.Tensor, head: torch.nn.Module, transform: LogitsTransform | None
) -> torch.Tensor:
    split = getattr(head, "vocab_split", None)  # a head split along the vocabulary (parallel/vocab.py): its columns
    logits = head(hidden) if split is None else split.local_logits(hidden)
    if transform is not None:
        logits = transform(logits)
    if split is not None:
        return split.loss_sum(logits, targets)
    return F.cross_entropy(logits.float(), targets, reduction="sum")


def chunked_linear_cross_entropy(
    hidden: torch.Tensor,
    head: torch.nn.Module,
    targets: torch.Tensor,
    chunk_rows: int,
    transform: LogitsTransform | None = None,
) -> torch.Tensor:
    """Summed cross-entropy of head(hidden) against targets, chunk_rows positions at a time.

    hidden: (n, hidden_size) states of the positions that predict a target; targets: (n,).
    Equal to F.cross_entropy(head(hidden).float(), targets, reduction="sum") within fp32
    rounding, gradients included (hidden, the head's weight, adapters on the head).
    """
    if hidden.shape[0] != targets.shape[0]:
        raise ValueError(f"hidden has {hidden.shape[0]} positions, targets {targets.shape[0]}")
    if hidden.shape[0] == 0:  # the head on no rows: its adapters' gradients zeros, as the full path's (FSDP
        return _chunk_loss(hidden, targets, head, transform)  # reduce-scatters only gradients that exist)
    total: torch.Tensor | None = None
    for start in range(0, hidden.shape[0], chunk_rows):
        h, t = hidden[start : start + chunk_rows], targets[start : start + chunk_rows]
        # preserve_rng_state: dropout of an adapter on the head draws the same mask again in backward.
        part = checkpoint(_chunk_loss, h, t, head, transform, use_reentrant=False, preserve_rng_state=True)
        total = part if total is None else total + part
    assert total is not None
    return total


def chunked_token_logps(
    hidden: torch.Tensor,
    head: torch.nn.Module,
    targets: torch.Tensor,
    chunk_rows: int,
    transform: LogitsTransform | None = None,
    temperature: float = 1.0,
) -> torch.Tensor:
    """Each target's log-probability under head(hidden) / temperature, (n,) in fp32, chunk_rows positions at a time
    (GRPO's per-token terms): F.log_softmax(head(hidden).float() / temperature)[targets] within fp32 rounding,
    gradients included, with one chunk's logits alive at a time (each chunk a checkpoint, as above)."""
    if hidden.shape[0] != targets.shape[0]:
        raise ValueError(f"hidden has {hidden.shape[0]} positions, targets {targets.shape[0]}")
    if hidden.shape[0] == 0:  # no positions: an empty result still in the graph (the adapters' zero gradients)
        return _chunk_logps(hidden, targets, head, transform, temperature)
    parts = [
        checkpoint(
            _chunk_logps,
            hidden[a : a + chunk_rows],
            targets[a : a + chunk_rows],
            head,
            transform,
            temperature,
            use_reentrant=False,
            preserve_rng_state=True,
        )  # fmt: skip
        for a in range(0, hidden.shape[0], chunk_rows)
    ]
    return parts[0] if len(parts) == 1 else torch.cat(parts)


class CaptureHead(torch.nn.Module):
    """Stands in for lm_head during the decoder's forward: keeps the states the head would have
    been given and returns no logits (a (..., 0) tensor), so the model computes none."""

    def __init__(self) -> None:
        super().__init__()
        self.hidden: torch.Tensor | None = None

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        self.hidden = hidden
        return hidden[..., :0]  # no logits, but in the graph: FSDP's root hooks its backward on the forward's output


def states_before_head(model, owner: torch.nn.Module, inputs: dict[str, Any]) -> tuple[torch.Tensor, Any]:
    """(the states the model hands its LM head, the model's output, whose logits are empty): the model run with
    CaptureHead standing in for owner.lm_head, which the chunked losses then run themselves."""
    head, capture = owner.lm_head, CaptureHead()
    owner.lm_head = capture
    try:
        out = model(**inputs)
    finally:
        owner.lm_head = head
    assert capture.hidden is not None, "the model never called its lm_head"
    return capture.hidden, out


def liger_fused_loss():
    """liger-kernel's fused linear cross-entropy (summed), for memory.loss=liger on CUDA."""
    try:
        from liger_kernel.transformers.fused_linear_cross_entropy import LigerFusedLinearCrossEntropyLoss
    except ImportError:
        return None
    return LigerFusedLinearCrossEntropyLoss(reduction="sum")


def fusable_head(head: torch.nn.Module) -> bool:
    """A plain linear head (no adapter on it, not quantized): what a fused kernel can take the weight of."""
    return type(head) is torch.nn.Linear and type(head.weight) is torch.nn.Parameter
