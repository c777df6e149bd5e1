"""Scaled rotary embeddings in a GGUF: Llama 3.1 / 3.2 / 3.3's rope_type "llama3", as llama.cpp writes it.

    check_rope(config, "LLAMA", where)    # ExportError for a rope type --gguf does not write, before any work
    factors = rope_freqs(config)          # the F32 rope_freqs.weight tensor (head_dim / 2 values), or None
    model = ...; apply_file_rope(model, file_rope_factors(path))   # the reader's rotary angles as llama.cpp's
    rope_check(path, config)              # the file's factors and metadata vs transformers' own llama3 rope

llama.cpp's convert_hf_to_gguf.py (LlamaModel.generate_extra_tensors) writes llama3 scaling as one tensor,
rope_freqs.weight, and no rope.scaling.* metadata: per rotary pair i the factor f_i that divides the default
angle (ggml_rope_ext's freq_factors: theta_i = pos * freq_base^(-2i/n_rot) / f_i), so f_i is transformers'
default inv_freq over its llama3 inv_freq: 1 where the wavelength is under original_max_position_embeddings /
high_freq_factor, `factor` over original_max_position_embeddings / low_freq_factor, 1 / ((1 - s) / factor + s)
between. The converter reads original_max_position_embeddings from the config's top level (8192 when absent,
as in Meta's Llama 3.1 / 3.2 configs, whose rope_scaling says 8192 too); we read it where transformers does,
from the rope parameters, so the file holds the angles the run trained with.

transformers' GGUF loader reads neither the tensor nor any llama3 metadata: it rebuilds default rope from
rope.freq_base and rope.dimension_count. The check therefore divides the reader's own default inv_freq (from
the file's metadata) by the file's rope_freqs, as ggml's rope does, before comparing logits (so a wrong or
missing rope_freqs fails the logits check), and compares the file's rope_freqs with the factors computed by
transformers' ROPE_INIT_FUNCTIONS["llama3"] from the run's config (a value check of its own). What only
llama.cpp would confirm: that its kernel applies freq_factors to GGML's interleaved pairs as described.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np
import torch

from finetune.errors import ExportError

ROPE_FREQS = "rope_freqs.weight"
# rope type -> the gguf architectures whose llama.cpp converter writes it (LlamaModel's generate_extra_tensors)
WRITTEN: dict[str, tuple[str, ...]] = {"default": ("*",), "llama3": ("LLAMA",)}
LLAMA3_DEFAULTS = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
_CONVERT = "export with --merge and convert the merged model with llama.cpp's convert_hf_to_gguf.py"


def rope_sections(config: dict[str, Any]) -> list[dict[str, Any]]:
    """The rotary parameters, one dict per attention kind (Gemma 3: full attention first, then sliding)."""
    rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
    if "full_attention" in rope:
        return [rope["full_attention"], *(v for k, v in rope.items() if k != "full_attention")]
    return [rope]


def rope_type(section: dict[str, Any]) -> str:
    return str(section.get("rope_type", section.get("type", "default")))


def check_rope(config: dict[str, Any], arch: str, where: str) -> None:
    """ExportError for a rope type --gguf does not write for this architecture (yarn, longrope, linear, dynamic...)."""
    for section in rope_sections(config):
        kind = rope_type(section)
        if arch in WRITTEN.get(kind, ()) or "*" in WRITTEN.get(kind, ()):
            continue
        written = "llama3 for Llama" if kind == "llama3" else "llama3 (Llama 3.1-3.3)"
        raise ExportError(
            f"{where}: rope type '{kind}' (scaled rotary embeddings) is not written by --gguf for {arch} (it writes {written})",
            hint=_CONVERT,
        )


def _head_dim(config: dict[str, Any]) -> int:
    return int(config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"])


def _llama3(config: dict[str, Any]) -> dict[str, Any] | None:
    section = rope_sections(config)[0]
    return {**LLAMA3_DEFAULTS, **section} if rope_type(section) == "llama3" else None


def rope_freqs(config: dict[str, Any]) -> torch.Tensor | None:
    """llama.cpp's per-pair rope factors for a llama3-scaled model (F32, head_dim / 2), None for default rope."""
    rope = _llama3(config)
    if rope is None:
        return None
    dim = _head_dim(config)
    base = float(rope.get("rope_theta", config.get("rope_theta", 10000.0)))
    factor, low, high = float(rope["factor"]), float(rope["low_freq_factor"]), float(rope["high_freq_factor"])
    old_context = float(rope["original_max_position_embeddings"])
    factors = []
    for freq in 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)):
        wavelen = 2 * math.pi / float(freq)
        if wavelen < old_context / high:
            factors.append(1.0)
        elif wavelen > old_context / low:
            factors.append(factor)
        else:
            smooth = (old_context / wavelen - low) / (high - low)
            factors.append(1 / ((1 - smooth) / factor + smooth))
    return torch.tensor(factors, dtype=torch.float32)


def transformers_factors(config: dict[str, Any]) -> torch.Tensor:
    """The same factors from transformers' own rope code (default inv_freq / llama3 inv_freq): what the run computed."""
    from transformers import CONFIG_MAPPING
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    cfg = CONFIG_MAPPING[config["model_type"]].from_dict(config)
    scaled, _ = ROPE_INIT_FUNCTIONS["llama3"](cfg, "cpu")
    theta = float(cfg.rope_parameters["rope_theta"])
    dim = _head_dim(config)
    default = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    return default / scaled


def file_rope_factors(path: Path) -> np.ndarray | None:
    """The file's rope_freqs.weight as float32, or None when it has none."""
    from gguf import GGUFReader

    tensor = next((t for t in GGUFReader(str(path)).tensors if t.name == ROPE_FREQS), None)
    return None if tensor is None else np.array(tensor.data, dtype=np.float32).reshape(-1)


def apply_file_rope(model: torch.nn.Module, factors: np.ndarray | None) -> int:
    """Divide the reader's rotary inv_freq (default rope from the file's metadata) by the file's factors, as ggml's
    rope does with freq_factors; the number of rotary modules changed."""
    if factors is None:
        return 0
    changed = 0
    for module in model.modules():
        inv_freq = getattr(module, "inv_freq", None)
        if isinstance(inv_freq, torch.Tensor):
            scaled = inv_freq / torch.from_numpy(factors).to(inv_freq.device, inv_freq.dtype)
            module.inv_freq = scaled  # a registered buffer: assignment keeps it one
            module.original_inv_freq = scaled.clone()
            changed += 1
    return changed


def rope_check(path: Path, config: dict[str, Any]) -> dict[str, Any]:
    """The file's rope scaling vs the run's config: rope_freqs present exactly when the run's rope is llama3, equal to
    transformers' llama3 factors, and no rope.scaling metadata (llama.cpp would scale the angles again)."""
    from gguf import GGUFReader

    rope = _llama3(config)
    got = file_rope_factors(path)
    scaling_keys = sorted(k for k in GGUFReader(str(path)).fields if ".rope.scaling." in k)
    check: dict[str, Any] = {"rope_type": rope_type(rope_sections(config)[0]), "rope_freqs_in_file": got is not None}
    check["rope_scaling_metadata"] = scaling_keys
    if rope is None:
        check["passed"] = got is None and not scaling_keys
        return check
    want = transformers_factors(config).numpy()
    diff = float(np.abs(got - want).max()) if got is not None and got.shape == want.shape else None
    check.update(
        {
            "parameters": {k: rope[k] for k in LLAMA3_DEFAULTS},
            "expected_from": "transformers ROPE_INIT_FUNCTIONS['llama3'] on the run's config (default / scaled inv_freq)",
            "factors": None if got is None else [round(float(x), 6) for x in got],
            "max_abs_diff": diff,
            "passed": diff is not None and diff <= 1e-5 * float(np.abs(want).max()) and not scaling_keys,
        }
    )
    return check
