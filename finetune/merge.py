"""The merge itself: a PEFT adapter read for merging, 4-bit round trips, and a streaming merge that
holds one tensor in memory at a time (export.py checks and describes what it writes).

    loras = read_adapter(run.weights_dir)                 # {base weight name: Lora}
    stats = stream_merge(base_dir, out_dir, torch.bfloat16, loras, quantized)

Each weight is read, merged (W + scale * B @ A in fp32; DoRA-rescaled; PiSSA on its residual)
when it has a LoRA, round-tripped through bitsandbytes' 4-bit quantization when training saw
it quantized, cast to the export dtype and written.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

import torch

from finetune.errors import ExportError
from finetune.shards import DTYPES as FILE_DTYPES
from finetune.shards import NAMES, ShardWriter, read_header, read_tensor, weight_files, write_index

# --------------------------------------------------------------------------- the adapter, read for merging


@dataclass
class Lora:
    A: torch.Tensor  # (r, in)
    B: torch.Tensor  # (out, r)
    scale: float
    magnitude: torch.Tensor | None = None  # DoRA: per-output-row norm the merged row is rescaled to
    residual_rank: int = 0  # PiSSA: the adapter was trained on W minus its top-r singular part (finetune/adapters/pissa.py)


_LORA_KEY = re.compile(
    r"base_model\.model\.(?P<module>.+)\.(?P<part>lora_A\.weight|lora_B\.weight|lora_magnitude_vector(\.weight)?)"
)
# adapter_config.json options the streaming merge does not implement; peft's own merge_and_unload does.
_UNSUPPORTED = (
    "rank_pattern",
    "alpha_pattern",
    "modules_to_save",
    "layer_replication",
    "trainable_token_indices",
    "lora_bias",
    "use_qalora",
    "use_bdlora",
    "alora_invocation_tokens",
    "target_parameters",
    "fan_in_fan_out",
)


def read_adapter(adapter_dir: Path) -> dict[str, Lora]:
    """{base weight name: Lora} from a PEFT LoRA/DoRA/rsLoRA/PiSSA adapter directory."""
    from safetensors.torch import load_file

    config = json.loads((adapter_dir / "adapter_config.json").read_text(encoding="utf-8"))
    fix = "merge with peft instead: PeftModel.from_pretrained(base, ADAPTER).merge_and_unload()"
    if config.get("peft_type") != "LORA":
        raise ExportError(f"'{adapter_dir}' is a {config.get('peft_type')} adapter; the merge handles LoRA/DoRA only", hint=fix)
    used = [k for k in _UNSUPPORTED if config.get(k)]
    if used:
        raise ExportError(f"'{adapter_dir}' uses {', '.join(used)}, which the streaming merge does not implement", hint=fix)
    r, alpha = config["r"], config["lora_alpha"]
    scale = alpha / math.sqrt(r) if config.get("use_rslora") else alpha / r
    init = str(config.get("init_lora_weights", True)).lower()
    if init.startswith("pissa") and init != "pissa":
        raise ExportError(
            f"'{adapter_dir}' is a PiSSA adapter initialised by a randomized SVD ({init}): the base it was trained on "
            "(W minus that SVD's top-r part) cannot be recomputed from W, so no merge can reproduce it",
            hint="convert it to a LoRA adapter where it was trained, with peft's "
            "save_pretrained(path_initial_model_for_weight_conversion=...) and the adapter as initialised",
        )
    residual_rank = r if init == "pissa" else 0
    parts: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in load_file(str(adapter_dir / "adapter_model.safetensors")).items():
        m = _LORA_KEY.fullmatch(key)
        if m is None:
            raise ExportError(f"'{adapter_dir}': tensor '{key}' is not a LoRA A/B/magnitude weight", hint=fix)
        parts.setdefault(m["module"], {})[m["part"].split(".")[0]] = tensor
    out = {}
    for module, p in parts.items():
        if "lora_A" not in p or "lora_B" not in p:
            raise ExportError(f"'{adapter_dir}': module '{module}' lacks lora_A or lora_B (damaged adapter?)")
        out[f"{module}.weight"] = Lora(p["lora_A"], p["lora_B"], scale, p.get("lora_magnitude_vector"), residual_rank)
    return out


# --------------------------------------------------------------------------- quantization round trip


@dataclass(frozen=True)
class Quant4:
    """How bitsandbytes quantized one weight when the run's base was loaded (read off the live Params4bit)."""

    dtype: torch.dtype  # the dtype the weight was cast to before quantizing
    blocksize: int
    quant_type: str
    double_quant: bool

    def roundtrip(self, weight: torch.Tensor) -> torch.Tensor:
        """dequantize(quantize(W)): the weight the adapter was trained against."""
        import bitsandbytes.functional as bnbf

        packed, state = bnbf.quantize_4bit(
            weight.to(self.dtype), blocksize=self.blocksize, compress_statistics=self.double_quant, quant_type=self.quant_type
        )
        return bnbf.dequantize_4bit(packed, state)


def quantized_weights(model) -> dict[str, Quant4]:
    """{weight name as in the checkpoint: Quant4} for every 4-bit weight of a (PEFT-wrapped) loaded model."""
    found = {}
    for name, module in model.named_modules():
        # A peft LoRA layer and its base_layer show the same weight; both map to one checkpoint name.
        state = getattr(getattr(module, "weight", None), "quant_state", None)
        if state is None:
            continue
        name = name.removeprefix("base_model.model.").removesuffix(".base_layer")
        found[f"{name}.weight"] = Quant4(state.dtype, state.blocksize, state.quant_type, state.nested)
    return found


def merged_weight(weight: torch.Tensor, lora: Lora | None, quant: Quant4 | None) -> torch.Tensor:
    """The fp32 weight of the merged model: (dequant(quant(W)) if quantized else W) + scale * B @ A, DoRA-rescaled."""
    w = (quant.roundtrip(weight) if quant is not None else weight).float()
    if lora is None:
        return w
    if lora.residual_rank:
        # PiSSA: training ran on the residual W - U_r S_r V_r^T (peft's pissa_init, an exact SVD), not on W.
        u, s, vh = torch.linalg.svd(w, full_matrices=False)
        k = lora.residual_rank
        w.sub_((u[:, :k] * s[:k]) @ vh[:k])
    w.addmm_(lora.B.float(), lora.A.float(), alpha=lora.scale)  # in place: no second weight-sized buffer
    if lora.magnitude is not None:
        # DoRA: each output row of W + scale*BA is rescaled to the learned magnitude (peft's merge, with the
        # norm of the unmerged weight plus delta, which is what we hold here).
        w.mul_((lora.magnitude.float() / torch.linalg.norm(w, dim=1)).unsqueeze(1))
    return w


# --------------------------------------------------------------------------- streaming merge


def stream_merge(
    base_dir: Path,
    out_dir: Path,
    dtype: torch.dtype,
    loras: dict[str, Lora],
    quantized: dict[str, Quant4],
) -> dict[str, int]:
    """Write base + adapter to out_dir as safetensors shards mirroring the base's, one tensor in memory at a time."""
    files = weight_files(base_dir)
    headers = [read_header(f) for f in files]
    on_disk = {name for h in headers for name in h.tensors}
    absent = sorted((set(loras) | set(quantized)) - on_disk)
    if absent:
        raise ExportError(
            f"the base checkpoint in '{base_dir}' has no tensor '{absent[0]}' (+{len(absent) - 1} more) that the adapter "
            "or the 4-bit base needs; its tensor names differ from the loaded model's",
            hint="merge with peft instead: PeftModel.from_pretrained(base, ADAPTER).merge_and_unload()",
        )
    weight_map: dict[str, str] = {}
    total = merged = 0
    for i, header in enumerate(headers):
        shard = "model.safetensors" if len(files) == 1 else f"model-{i + 1:05d}-of-{len(files):05d}.safetensors"
        plan = [
            (name, NAMES[dtype] if FILE_DTYPES[e["dtype"]].is_floating_point else e["dtype"], e["shape"])
            for name, e in header.tensors.items()
        ]
        with header.path.open("rb") as fh, ShardWriter(out_dir / shard, plan) as writer:
            for name in header.tensors:
                tensor = read_tensor(fh, header, name)
                if name in loras or name in quantized:
                    tensor = merged_weight(tensor, loras.get(name), quantized.get(name))
                    merged += name in loras
                writer.write(name, tensor.to(dtype) if tensor.is_floating_point() else tensor)
                del tensor  # before the next read: one weight in memory, not two
        total += writer.nbytes
        weight_map.update(dict.fromkeys(header.tensors, shard))
    if len(files) > 1:
        write_index(out_dir, weight_map, total)
    return {"tensors": len(weight_map), "merged": merged, "requantized": len(quantized), "bytes": total}
