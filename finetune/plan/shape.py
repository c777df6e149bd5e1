"""The model's shape: every parameter of config.json's model, counted by the kind of module that holds it.

The model is built on the meta device (no memory, no weights). Linears are grouped
by short name (q_proj, ...): what bitsandbytes quantizes and LoRA targets. Mixture-of-experts
models' fused 3-D expert parameters (transformers 5: experts.gate_up_proj, experts.down_proj)
are grouped the same way with their expert count and how many of them each token runs through:
every expert is in memory, only the active ones compute.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

from finetune.errors import PlanError
from finetune.model import varlen, vision
from finetune.plan.images import VisionShape, vision_shape


@dataclass(frozen=True)
class LinearGroup:
    """All decoder linears of one short name (q_proj, ...): shape and how many there are."""

    name: str
    in_features: int
    out_features: int
    count: int
    bias: bool


@dataclass(frozen=True)
class ExpertGroup:
    """One fused expert parameter of every MoE layer (experts.gate_up_proj, ...): each expert's matrix."""

    name: str
    experts: int
    in_features: int
    out_features: int
    count: int  # MoE layers
    active: int  # experts a token runs through (config.num_experts_per_tok)

    @property
    def params(self) -> int:
        return self.experts * self.in_features * self.out_features * self.count


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
    other_params: int  # norms, biases, routers, a VLM's vision side: anything not in a quantizable linear or an expert
    total_params: int
    experts: tuple[ExpertGroup, ...] = ()  # MoE: fused expert parameters (finetune/model/moe.py stores them 4-bit)
    varlen_ok: bool = True  # finetune/model/varlen.py can run this model's attention
    vision_params: int = 0  # a vision-language model's vision tower and projector (in other_params: never quantized)
    tower: VisionShape | None = None  # its vision tower's geometry: what images cost (plan/images.py)

    @property
    def linear_params(self) -> int:
        return sum(g.in_features * g.out_features * g.count for g in self.linears)

    @property
    def expert_params(self) -> int:
        """Every expert's weights: what memory holds."""
        return sum(g.params for g in self.experts)

    @property
    def active_expert_params(self) -> int:
        """The experts' weights one token multiplies by: what compute costs."""
        return sum(g.active * g.in_features * g.out_features * g.count for g in self.experts)

    @property
    def active_params(self) -> int:
        return self.total_params - self.expert_params + self.active_expert_params

    @property
    def expert_layer_params(self) -> int:
        """One MoE layer's expert stack: what is dequantized at once (finetune/model/moe.py)."""
        return sum(g.experts * g.in_features * g.out_features for g in self.experts)

    @property
    def head_matmul_params(self) -> int:
        """The LM head's weight (the embedding table's when tied); 0 for a pipeline stage without the head."""
        return self.head_params or (self.embedding_params if self.tied_embeddings else 0)

    @property
    def largest_linear(self) -> int:
        return max((g.in_features * g.out_features for g in self.linears), default=0)

    def kv_bytes(self, compute_bytes: int) -> int:
        """K and V of one token in every layer, as transformers' DynamicCache keeps them (kv_heads: not repeated)."""
        return 2 * self.layers * self.kv_heads * self.head_dim * compute_bytes

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

    config = _read_config(source, trust_remote_code, revision)
    try:
        with init_empty_weights():
            model = vision.model_class(config).from_config(config, trust_remote_code=trust_remote_code)
    except Exception as exc:
        raise PlanError(
            f"model config: cannot build a model from the config.json of '{source}': {str(exc).splitlines()[0]}",
            hint="the planner needs a model transformers knows (AutoModelForCausalLM); custom code needs model.trust_remote_code=true",
        ) from None
    head = model.get_output_embeddings()
    embed = model.get_input_embeddings()
    tied = head is not None and embed is not None and head.weight is embed.weight
    groups: dict[str, list[Any]] = {}
    counted: set[int] = set()
    other = 0
    text = getattr(config, "get_text_config", lambda: config)()
    experts = _expert_groups(model, text, counted)
    # A vision-language model's vision tower and projector stay in the compute dtype, frozen (model/vision.py):
    # counted with the other parameters, not as linears to quantize or adapt.
    beside = tuple(f"{n}." for n in vision.vision_modules(config)) if vision.is_vision_language(config) else ()
    for name, module in model.named_modules():
        if module is head or module is embed or (beside and name.startswith(beside)):
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
    vision_params = sum(p.numel() for n, p in model.named_parameters() if beside and n.startswith(beside))
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
    heads, hidden = int(text.num_attention_heads), int(text.hidden_size)
    intermediate = int(getattr(text, "intermediate_size", 4 * hidden))
    if experts:
        # What one token's MLP computes: its active experts (plus a shared expert), each of the expert
        # width; the activation terms (finetune/plan/terms.py) read this like a dense MLP's width.
        width = getattr(text, "moe_intermediate_size", None) or intermediate
        intermediate = experts[0].active * int(width) + int(getattr(text, "shared_expert_intermediate_size", 0) or 0)
    return ModelShape(
        source=source,
        model_type=str(getattr(config, "model_type", "?")),
        layers=int(text.num_hidden_layers),
        hidden=hidden,
        intermediate=intermediate,
        heads=heads,
        kv_heads=int(getattr(text, "num_key_value_heads", None) or heads),
        head_dim=int(getattr(text, "head_dim", None) or hidden // heads),
        vocab=int(text.vocab_size),
        tied_embeddings=tied,
        linears=tuple(linears),
        embedding_params=embedding_params,
        head_params=head_params,
        other_params=other,
        total_params=total,
        experts=experts,
        varlen_ok=varlen.runs(type(model), config),
        vision_params=vision_params,
        tower=_tower(model, config, beside),
    )


def _tower(model, config, beside: tuple[str, ...]) -> VisionShape | None:
    """A VLM's vision tower geometry (plan/images.py); its MLP gated when a gate projection is among its modules."""
    if not beside:
        return None
    return vision_shape(config, gated=any(n.startswith(beside) and n.endswith("gate_proj") for n, _ in model.named_modules()))


def _expert_groups(model, text, counted: set[int]) -> tuple[ExpertGroup, ...]:
    """The fused expert parameters, grouped by name and shape (their ids added to `counted`)."""
    from finetune.model.moe import is_expert_param

    found: dict[tuple[str, int, int, int], int] = {}
    for module in model.modules():
        for attr, p in module._parameters.items():
            if not is_expert_param(module, p):
                continue
            counted.add(id(p))
            e, a, b = p.shape
            # (experts, out, in) unless the module says it stores (experts, in, out) (gpt-oss)
            fin, fout = (a, b) if getattr(module, "is_transposed", False) else (b, a)
            key = (attr, int(e), int(fin), int(fout))
            found[key] = found.get(key, 0) + 1
    top_k = getattr(text, "num_experts_per_tok", None) or getattr(text, "experts_per_token", None)
    return tuple(ExpertGroup(name, e, fin, fout, n, int(top_k or e)) for (name, e, fin, fout), n in sorted(found.items()))
