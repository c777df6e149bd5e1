"""A merged model as one GGUF file, written by llama.cpp's own `gguf` package (GGUFWriter).

    family = gguf_family(config)                  # ExportError for a family not written here, before any work
    stats = write_gguf(MergedTensors(base_dir, loras, quantized), path, config, "q8_0", name, lambda w: add_vocab(w, tok_dir, ...))

What llama.cpp's convert_hf_to_gguf.py does for these families, and no more: tensor names from
gguf's own name map (gguf.get_tensor_name_map), the architecture's hyperparameters as metadata,
Llama's q_proj/k_proj rows permuted from HF's rotary layout (halves) to GGML's (interleaved
pairs), Gemma's norm weights stored + 1 (GGML scales by w, HF's Gemma by 1 + w), Phi-3's fused
qkv_proj and gate_up_proj kept fused (gguf's attn_qkv, ffn_up), Qwen2-MoE's and Qwen3-MoE's
per-expert tensors stacked in expert order into one 3-D tensor per layer and projection
(ffn_gate_exps, ffn_up_exps, ffn_down_exps), with the router (ffn_gate_inp), Qwen2-MoE's shared
expert (ffn_*_shexp, its gate squeezed to 1-D as ffn_gate_inp_shexp) and the expert counts and
sizes as metadata; Llama 3.1-3.3's llama3 rope scaling as a generated F32 rope_freqs.weight, first
(export/gguf_rope.py; other scaled rope types refused); 1-D tensors and routers kept F32, and the rest converted by gguf.quants. A model transformers' GGUF loader would read back with other
values than its own (Family.reader_fixed) is refused, since the read-back check could not pass.
Tensors are merged, converted and written one at a time, straight from the base checkpoint
(export/merge.py's MergedTensors; header, metadata and tensor index first, then each tensor), so
memory holds one tensor and its GGUF bytes (a stacked expert tensor: its GGUF bytes, filled one
expert at a time), and nothing is staged on disk.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from finetune.errors import ExportError
from finetune.export.gguf_rope import ROPE_FREQS, check_rope, rope_freqs, rope_sections
from finetune.export.merge import MergedTensors

INSTALL_HINT = "pip install 'finetune[gguf]' (llama.cpp's gguf package, which writes and reads the file)"

# --gguf-type: (gguf.GGMLQuantizationType of 2-D weights, gguf.LlamaFileType of the file)
GGUF_TYPES = {
    "f16": ("F16", "MOSTLY_F16"),
    "bf16": ("BF16", "MOSTLY_BF16"),
    "q8_0": ("Q8_0", "MOSTLY_Q8_0"),
    "f32": ("F32", "ALL_F32"),
}
K_QUANT_HINT = "llama-quantize {src} {dst} Q4_K_M"  # k-quants need llama.cpp's importance-aware C++ quantizer


@dataclass(frozen=True)
class Family:
    arch: str  # gguf.MODEL_ARCH member
    permute_qk: bool  # llama.cpp's LlamaModel.permute: GGML's rope rotates adjacent pairs, HF's rotates halves
    norm_shift: float = 0.0  # Gemma: HF's RMSNorm scales by (1 + w), GGML's by w; llama.cpp's converter stores w + 1
    # (config key, value) transformers' GGUF loader cannot read from the file and takes from its config class:
    # a model with another value would be read back wrongly, so the check could not pass
    reader_fixed: tuple[tuple[str, Any], ...] = ()
    alternate_sliding: int = 0  # every n-th layer full attention, the rest sliding (the loader's default layer_types)


# model_type -> how llama.cpp converts it (Mistral is converted as LLAMA by llama.cpp too)
FAMILIES = {
    "llama": Family("LLAMA", permute_qk=True),
    "mistral": Family("LLAMA", permute_qk=True),
    "qwen2": Family("QWEN2", permute_qk=False),
    "qwen3": Family("QWEN3", permute_qk=False, reader_fixed=(("head_dim", 128),)),
    "gemma2": Family(
        "GEMMA2",
        permute_qk=False,
        norm_shift=1.0,
        reader_fixed=(("query_pre_attn_scalar", 256), ("attn_logit_softcapping", 50.0), ("final_logit_softcapping", 30.0)),
        alternate_sliding=2,
    ),
    "gemma3_text": Family(
        "GEMMA3",
        permute_qk=False,
        norm_shift=1.0,
        reader_fixed=(
            ("query_pre_attn_scalar", 256),
            ("attn_logit_softcapping", None),
            ("final_logit_softcapping", None),
            ("rope_local_base_freq", 10000.0),
        ),
        alternate_sliding=6,
    ),
    "phi3": Family("PHI3", permute_qk=False, reader_fixed=(("partial_rotary_factor", 1.0),)),
    # The reader reads the expert counts but neither expert size (llama.cpp's expert_feed_forward_length and
    # expert_shared_feed_forward_length): it takes its config class's, Qwen1.5-MoE-A2.7B's and Qwen3-30B-A3B's.
    "qwen2_moe": Family(
        "QWEN2MOE",
        permute_qk=False,
        reader_fixed=(
            ("moe_intermediate_size", 1408),
            ("shared_expert_intermediate_size", 5632),
            ("norm_topk_prob", False),
            ("decoder_sparse_step", 1),
            ("mlp_only_layers", []),
            ("qkv_bias", True),
            ("use_sliding_window", False),
        ),
    ),
    "qwen3_moe": Family(
        "QWEN3MOE",
        permute_qk=False,
        reader_fixed=(
            ("moe_intermediate_size", 768),
            ("norm_topk_prob", True),
            ("decoder_sparse_step", 1),
            ("mlp_only_layers", []),
            ("attention_bias", False),
            ("use_sliding_window", False),
        ),
    ),
}
_CONVERT = "export with --merge and convert the merged model with llama.cpp's convert_hf_to_gguf.py"


def import_gguf():
    """The gguf package, or ExportError with the install line (an optional extra)."""
    try:
        import gguf
    except ImportError:
        raise ExportError("--gguf needs the 'gguf' package, which is not installed", hint=INSTALL_HINT) from None
    return gguf


_IN_ROPE = {"partial_rotary_factor": (0, 1.0), "rope_local_base_freq": (-1, 10000.0)}  # key: (rope section, default)


def _config_value(config: dict[str, Any], key: str) -> Any:
    """config[key], or where transformers 5 keeps it: in rope_parameters (Gemma 3's sliding theta: the last section)."""
    if key in config or key not in _IN_ROPE:
        return config.get(key)
    section, default = _IN_ROPE[key]
    return rope_sections(config)[section].get("rope_theta" if key == "rope_local_base_freq" else key, default)


def _check_reader_fixed(config: dict[str, Any], family: Family, where: str) -> None:
    """ExportError when the model has a value transformers' GGUF loader would not read back (see Family.reader_fixed)."""
    fixed = list(family.reader_fixed)
    if family.alternate_sliding:
        n = family.alternate_sliding
        default = ["full_attention" if (i + 1) % n == 0 else "sliding_attention" for i in range(int(config["num_hidden_layers"]))]
        fixed.append(("layer_types", default))
    for key, value in fixed:
        if key in config or key in _IN_ROPE:
            if _config_value(config, key) != value:
                raise ExportError(
                    f"{where}: {key} is {_config_value(config, key)!r}, but transformers' GGUF loader, which checks the "
                    f"file, reads every {config['model_type']} GGUF back with {value!r}, so --gguf cannot check this model",
                    hint=_CONVERT,
                )


def gguf_family(config: dict[str, Any], where: str) -> Family:
    """The family of the base model's config.json, or ExportError naming those this export writes."""
    model_type = str(config.get("model_type", ""))
    family = FAMILIES.get(model_type)
    if family is None:
        raise ExportError(
            f"{where}: model_type '{model_type}' is not a family --gguf writes (supported: {', '.join(FAMILIES)})",
            hint=_CONVERT,
        )
    check_rope(config, family.arch, where)  # llama3 (Llama 3.1-3.3) is written as rope_freqs; other scaled types refused
    _check_reader_fixed(config, family, where)
    return family


def arch_name(family: Family) -> str:
    """gguf's name of the family's architecture ('llama', 'gemma2'...): general.architecture, the keys' prefix."""
    gguf = import_gguf()
    return gguf.MODEL_ARCH_NAMES[getattr(gguf.MODEL_ARCH, family.arch)]


def _head_dim(config: dict[str, Any]) -> int:
    return int(config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"])


def add_hyperparameters(writer, config: dict[str, Any], family: Family, gguf_type: str, name: str) -> None:
    """The architecture's metadata, as llama.cpp's converter writes it for this family."""
    gguf = import_gguf()
    rope = rope_sections(config)[0]
    writer.add_name(name)
    writer.add_context_length(int(config["max_position_embeddings"]))
    writer.add_embedding_length(int(config["hidden_size"]))
    writer.add_block_count(int(config["num_hidden_layers"]))
    writer.add_feed_forward_length(int(config["intermediate_size"]))
    writer.add_head_count(int(config["num_attention_heads"]))
    writer.add_head_count_kv(int(config.get("num_key_value_heads") or config["num_attention_heads"]))
    writer.add_rope_freq_base(float(rope.get("rope_theta", config.get("rope_theta", 10000.0))))
    writer.add_layer_norm_rms_eps(float(config["rms_norm_eps"]))
    writer.add_vocab_size(int(config["vocab_size"]))
    head_dim = _head_dim(config)
    if family.permute_qk or family.arch == "PHI3":
        writer.add_rope_dimension_count(int(head_dim * _config_value(config, "partial_rotary_factor")))
    if config.get("head_dim") or head_dim != config["hidden_size"] // config["num_attention_heads"]:
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
    if config.get("sliding_window") and (family.alternate_sliding or family.arch == "PHI3"):
        writer.add_sliding_window(int(config["sliding_window"]))
    if n_experts(config):
        _add_expert_sizes(writer, config)
    if family.arch == "GEMMA2":
        writer.add_attn_logit_softcapping(float(config.get("attn_logit_softcapping", 50.0)))
        writer.add_final_logit_softcapping(float(config.get("final_logit_softcapping", 30.0)))
    writer.add_file_type(getattr(gguf.LlamaFileType, GGUF_TYPES[gguf_type][1]))
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)


def n_experts(config: dict[str, Any]) -> int:
    """An MoE's expert count (transformers 5 saves Qwen's num_experts as num_local_experts); 0 for a dense model."""
    return int(config.get("num_experts") or config.get("num_local_experts") or 0)


def _add_expert_sizes(writer, config: dict[str, Any]) -> None:
    """An MoE's expert count, active experts and expert sizes, as llama.cpp's Qwen2MoeModel writes them."""
    writer.add_expert_count(n_experts(config))
    writer.add_expert_used_count(int(config["num_experts_per_tok"]))
    writer.add_expert_feed_forward_length(int(config["moe_intermediate_size"]))
    if config.get("shared_expert_intermediate_size"):
        writer.add_expert_shared_feed_forward_length(int(config["shared_expert_intermediate_size"]))


def permute_rotary(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """HF's rotary layout (each head's rows: first halves, then second halves) to GGML's (pairs side by side)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _prepare(name: str, tensor: torch.Tensor, config: dict[str, Any], family: Family) -> torch.Tensor:
    if family.permute_qk and name.endswith(("q_proj.weight", "q_proj.bias")):
        return permute_rotary(tensor, int(config["num_attention_heads"]))
    if family.permute_qk and name.endswith(("k_proj.weight", "k_proj.bias")):
        return permute_rotary(tensor, int(config.get("num_key_value_heads") or config["num_attention_heads"]))
    if family.norm_shift and name.endswith("norm.weight"):
        return tensor.float() + family.norm_shift  # in fp32, as stored: w + 1 rounded once, in the file's type
    return tensor


# llama.cpp's converter keeps the routers F32 (a token's expert choice flips on small rounding)
F32_ALWAYS = ("ffn_gate_inp.weight", "ffn_gate_inp_shexp.weight")


def tensor_type(gguf, shape: list[int], gguf_type: str, target: str = ""):
    """The GGML type of one tensor: norms, biases and routers stay F32 (as llama.cpp's converter keeps them);
    a row length a Q8_0 block does not divide falls back to F16 (as llama.cpp's converter does)."""
    qtype = getattr(gguf.GGMLQuantizationType, GGUF_TYPES[gguf_type][0])
    if len(shape) < 2 or target.endswith(F32_ALWAYS):
        return gguf.GGMLQuantizationType.F32
    block = gguf.GGML_QUANT_SIZES[qtype][0]
    if shape[-1] % block:
        return gguf.GGMLQuantizationType.F16
    return qtype


@dataclass(frozen=True)
class Planned:
    """One GGUF tensor: the checkpoint tensors it is made of (one, or every expert's piece in expert order)."""

    sources: tuple[str, ...]
    target: str
    qtype: Any
    shape: list[int]
    stacked: bool = False


# A per-expert checkpoint tensor (Qwen2/3-MoE): llama.cpp stacks each layer's projection over the experts
_EXPERT = re.compile(r"(?P<layer>.+\.mlp\.experts)\.(?P<expert>\d+)\.(?P<proj>gate_proj|up_proj|down_proj)\.weight")


def _grouped(names: list[str], n_experts: int) -> list[tuple[str, tuple[str, ...]]]:
    """[(name gguf maps, its checkpoint tensors)] in file order: each layer's projection over all experts is one
    stacked tensor (layer.mlp.experts.gate_proj.weight, experts in index order) where its first piece is."""
    groups: dict[str, dict[int, str]] = {}
    for name in names:
        m = _EXPERT.fullmatch(name)
        key = f"{m['layer']}.{m['proj']}.weight" if m else name
        groups.setdefault(key, {})[int(m["expert"]) if m else -1] = name
    out: list[tuple[str, tuple[str, ...]]] = []
    for key, pieces in groups.items():
        if -1 in pieces:
            out.append((key, (pieces[-1],)))
        elif sorted(pieces) != list(range(n_experts)):
            raise ExportError(f"'{key}': the checkpoint has experts {sorted(pieces)}, not 0..{n_experts - 1}", hint=_CONVERT)
        else:
            out.append((key, tuple(pieces[e] for e in range(n_experts))))
    return out


def _plan(merged: MergedTensors, config: dict[str, Any], family: Family, gguf_type: str) -> list[Planned]:
    """The GGUF's tensors in file order; ExportError for a tensor gguf has no name for."""
    gguf = import_gguf()
    arch = getattr(gguf.MODEL_ARCH, family.arch)
    names = gguf.get_tensor_name_map(arch, int(config["num_hidden_layers"]))
    tied = bool(config.get("tie_word_embeddings"))
    shapes = {name: [int(n) for n in e["shape"]] for header in merged.headers for name, e in header.tensors.items()}
    plan = []
    if (factors := rope_freqs(config)) is not None:  # first, as llama.cpp's converter writes its extra tensors
        plan.append(Planned((), ROPE_FREQS, gguf.GGMLQuantizationType.F32, list(factors.shape)))
    for name, sources in _grouped(list(shapes), n_experts(config)):
        if tied and name == "lm_head.weight":
            continue  # llama.cpp writes no output.weight for tied embeddings (the reader ties it back)
        target = names.get_name(name, try_suffixes=(".weight", ".bias"))
        if target is None:
            raise ExportError(f"the merged model's tensor '{name}' has no name in gguf's {family.arch} tensor map", hint=_CONVERT)
        shape = shapes[sources[0]]
        stacked = _EXPERT.fullmatch(sources[0]) is not None
        if stacked:
            shape = [len(sources), *shape]
        elif target.endswith("ffn_gate_inp_shexp.weight"):
            shape = shape[-1:]  # (1, hidden) squeezed, as llama.cpp's converter writes it and llama.cpp reads it
        plan.append(Planned(sources, target, tensor_type(gguf, shape, gguf_type, target), shape, stacked))
    return plan


CHUNK_ELEMENTS = 1 << 22  # rows converted at a time (16 MiB of fp32): the fp32 copy of a whole bf16 embedding never exists


def gguf_bytes(tensor: torch.Tensor, qtype) -> np.ndarray:
    """The tensor's bytes as GGML type qtype, converted from fp32 a few rows at a time into one output buffer
    (GGML's types are row-wise: the same bytes as converting it whole)."""
    gguf = import_gguf()
    rows = tensor.reshape(-1, tensor.shape[-1]) if tensor.dim() else tensor.reshape(1, 1)
    out = np.empty(gguf.quant_shape_to_byte_shape(list(rows.shape), qtype), dtype=np.uint8)
    step = max(1, CHUNK_ELEMENTS // rows.shape[1])
    for i in range(0, rows.shape[0], step):
        out[i : i + step] = gguf.quants.quantize(rows[i : i + step].float().numpy(), qtype).view(np.uint8)
    return out


def _stacked_bytes(merged: MergedTensors, t: Planned) -> np.ndarray:
    """A stacked expert tensor's GGUF bytes, filled one expert's merged piece at a time (GGML's types are row-wise,
    so expert e's bytes are the stack's e-th slice)."""
    gguf = import_gguf()
    out = np.empty(gguf.quant_shape_to_byte_shape(t.shape, t.qtype), dtype=np.uint8)
    for e, source in enumerate(t.sources):
        out[e] = gguf_bytes(merged.tensor(source), t.qtype)
    return out


def write_gguf(
    merged: MergedTensors,
    path: Path,
    config: dict[str, Any],
    gguf_type: str,
    name: str,
    vocab: Callable[[Any], None],
) -> dict[str, Any]:
    """Write the merged model as one GGUF at path, each tensor merged, converted and written before the next is
    read (header, metadata and tensor index first, then the data); vocab(writer) adds the tokenizer."""
    gguf = import_gguf()
    family = gguf_family(config, str(merged.base_dir / "config.json"))
    plan = _plan(merged, config, family, gguf_type)
    writer = gguf.GGUFWriter(str(path), arch_name(family))
    add_hyperparameters(writer, config, family, gguf_type, name)
    vocab(writer)
    for t in plan:
        # Every type as raw bytes: gguf computes the element shape back from the byte shape.
        byte_shape = gguf.quant_shape_to_byte_shape(t.shape, t.qtype)
        writer.add_tensor_info(t.target, byte_shape, np.dtype(np.uint8), math.prod(byte_shape), raw_dtype=t.qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    counts: dict[str, int] = {}
    for t in plan:
        if not t.sources:  # computed from the config, not the checkpoint (rope_freqs)
            data = gguf_bytes(rope_freqs(config), t.qtype)  # type: ignore[arg-type]
        elif t.stacked:
            data = _stacked_bytes(merged, t)
        else:
            tensor = _prepare(t.sources[0], merged.tensor(t.sources[0]), config, family).reshape(t.shape)
            data = gguf_bytes(tensor, t.qtype)
            del tensor  # before the write: the merged tensor and its bytes are the only weights in memory
        writer.write_tensor_data(data)
        del data
        counts[t.qtype.name] = counts.get(t.qtype.name, 0) + 1
    writer.close()
    return {"tensors": len(plan), "types": counts, "bytes": path.stat().st_size, "arch": writer.arch}
