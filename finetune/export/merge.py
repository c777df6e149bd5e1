"""The merge itself: a PEFT adapter read for merging, 4-bit round trips, and a streaming merge that
holds one tensor in memory at a time (export/run.py checks and describes what it writes).

    loras = read_adapter(run.weights_dir)                 # {base weight name: Lora}
    stats = stream_merge(base_dir, out_dir, torch.bfloat16, loras, quantized)
    merged = MergedTensors(base_dir, loras, quantized)     # or one merged tensor at a time, for another writer (GGUF)
    weight = merged.tensor("model.layers.0.mlp.up_proj.weight")

Each weight is read, merged (W + scale * B @ A in fp32; DoRA-rescaled; PiSSA on its residual)
when it has a LoRA, round-tripped through bitsandbytes' 4-bit quantization when training saw
it quantized, cast to the export dtype and written.

MoE experts: the checkpoint holds one tensor per expert and projection (experts.3.gate_proj.weight)
that transformers 5 fuses into 3-D parameters on load (experts.gate_up_proj); training quantized
and adapted the fused parameter (finetune/model/moe.py). Such a parameter is rebuilt from
its pieces (expert_pieces: transformers' own conversion mapping), round-tripped and merged whole,
and written back as the pieces: one fused parameter in memory at a time.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from finetune.errors import ExportError
from finetune.model import moe
from finetune.model.shards import DTYPES as FILE_DTYPES
from finetune.model.shards import NAMES, ShardWriter, read_header, read_tensor, weight_files, write_index

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
    # peft's ParamWrappers of fused expert parameters (target_parameters): read off the trained model
    # instead (expert_loras), which knows which wrapper holds which parameter.
    experts = {name.rpartition(".")[0] for name in config.get("target_parameters") or ()}
    parts: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in load_file(str(adapter_dir / "adapter_model.safetensors")).items():
        m = _LORA_KEY.fullmatch(key)
        if m is None:
            raise ExportError(f"'{adapter_dir}': tensor '{key}' is not a LoRA A/B/magnitude weight", hint=fix)
        if re.sub(r"(\.base_layer)+$", "", m["module"]) in experts:
            continue
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
    """{weight name as in the checkpoint: Quant4} for every 4-bit weight of a (PEFT-wrapped) loaded model;
    fused MoE expert parameters under their model name (experts.gate_up_proj): stream_merge finds their pieces."""
    found = {}
    for name, module in model.named_modules():
        # A peft LoRA layer and its base_layer show the same weight; both map to one checkpoint name.
        state = getattr(getattr(module, "weight", None), "quant_state", None)
        if state is None:
            continue
        name = name.removeprefix("base_model.model.").removesuffix(".base_layer")
        found[f"{name}.weight"] = Quant4(state.dtype, state.blocksize, state.quant_type, state.nested)
    for name, state in moe.quant_states(model).items():
        found[name] = Quant4(state.dtype, state.blocksize, state.quant_type, state.nested)
    return found


def expert_loras(model) -> dict[str, list[Lora]]:
    """{fused expert parameter: one Lora per expert} of a trained model's peft ParamWrappers, such that
    scale * B_e @ A_e is what peft's get_delta_weight adds to expert e's (out, in) slice."""
    found = {}
    for name, module in model.named_modules():
        if type(module).__name__ != "ParamWrapper" or "default" not in module.lora_A:
            continue
        if getattr(module.get_base_layer(), "is_transposed", False):
            raise ExportError(
                f"'{name}': LoRA on experts stored (experts, in, out) is not merged here",
                hint="merge with peft instead: PeftModel.from_pretrained(base, ADAPTER).merge_and_unload()",
            )
        e, A, B = module.num_experts, module.lora_A["default"].weight.detach(), module.lora_B["default"].weight.detach()
        A_e = A.reshape(e, -1, A.shape[-1])  # peft: rows of A are (expert, rank)
        B_e = B.reshape(B.shape[0], -1, e)  # columns of B are (rank, expert)
        scale = float(module.scaling["default"])
        found[f"{moe.plain_name(name)}.{module.parameter_name}"] = [Lora(A_e[i], B_e[:, :, i], scale) for i in range(e)]
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


# --------------------------------------------------------------------------- fused MoE experts


@dataclass(frozen=True)
class Piece:
    """One checkpoint tensor of a fused expert parameter: expert `expert`, the `part`-th of its concatenation."""

    fused: str
    expert: int
    part: int


def expert_pieces(model_type: str, names: list[str]) -> dict[str, Piece]:
    """{checkpoint tensor: Piece} for the tensors transformers fuses into 3-D expert parameters on load
    (its conversion mapping: stack the experts, concatenate gate and up), renamed as transformers renames them."""
    from transformers.conversion_mapping import get_checkpoint_conversion_mapping

    transforms = get_checkpoint_conversion_mapping(model_type) or []
    found = {}
    for name in names:
        key, piece = name, None
        for transform in transforms:
            key, pattern = transform.rename_source_key(key)
            ops = [(type(op).__name__, getattr(op, "dim", None)) for op in getattr(transform, "operations", ())]
            if pattern is None or not ops:
                continue  # no match, or a plain renaming
            if ops not in ([("MergeModulelist", 0)], [("MergeModulelist", 0), ("Concatenate", 1)]):
                raise ExportError(
                    f"'{name}': transformers builds {key} from it with {ops}, a layout the merge does not rebuild",
                    hint="merge with peft instead: PeftModel.from_pretrained(base, ADAPTER).merge_and_unload()",
                )
            expert = re.search(re.escape(pattern).replace(r"\*", r"(\d+)"), name)
            assert expert is not None, (name, pattern)
            piece = (int(expert[1]), transform.source_patterns.index(pattern))
        if piece is not None:
            found[name] = Piece(key, *piece)
    return found


def _merged_pieces(names: list[str], pieces: dict[str, Piece], read, lora: list[Lora] | None, quant: Quant4 | None):
    """{piece: merged fp32 tensor} of one fused parameter: rebuilt from its pieces (read(name) -> tensor) as
    transformers builds it, round-tripped and adapted as training saw it, and split back."""
    order = sorted(names, key=lambda n: (pieces[n].expert, pieces[n].part))
    parts = 1 + max(pieces[n].part for n in order)
    tensors = [read(n) for n in order]
    bounds = [0]
    for t in tensors[:parts]:  # each part's rows in the concatenation (gate, then up)
        bounds.append(bounds[-1] + t.shape[0])
    stack = torch.stack([torch.cat(tensors[e * parts : (e + 1) * parts]) for e in range(len(order) // parts)])
    del tensors
    w = _add_experts((quant.roundtrip(stack) if quant is not None else stack).float(), lora)
    return {n: w[pieces[n].expert, bounds[pieces[n].part] : bounds[pieces[n].part + 1]].clone() for n in order}


def _add_experts(w: torch.Tensor, lora: list[Lora] | None) -> torch.Tensor:
    """A fused (experts, out, in) fp32 weight plus each expert's scale * B @ A, in place."""
    for e, expert in enumerate(lora or ()):
        w[e].addmm_(expert.B.float(), expert.A.float(), alpha=expert.scale)
    return w


# --------------------------------------------------------------------------- streaming merge


class MergedTensors:
    """The merged model's tensors, each read from the base checkpoint and merged when asked for, so that a
    writer (safetensors shards, a GGUF file) holds one tensor at a time; a fused MoE expert parameter is
    rebuilt from its pieces (model_type's conversion mapping says which) and its other pieces kept until asked."""

    def __init__(
        self,
        base_dir: Path,
        loras: dict[str, Lora],
        quantized: dict[str, Quant4],
        expert_lora: dict[str, list[Lora]] | None = None,
        model_type: str = "",
        renamed: Callable[[list[str]], dict[str, str]] | None = None,
    ):
        self.files = weight_files(base_dir)
        self.headers = [read_header(f) for f in self.files]
        self.where = {name: h for h in self.headers for name in h.tensors}
        # The adapter and the 4-bit weights are named as loaded, the files as stored (renamed: a VLM's older layout).
        stored = {loaded: name for name, loaded in (renamed(sorted(self.where)) if renamed else {}).items()}
        loras, quantized = {stored.get(k, k): v for k, v in loras.items()}, {stored.get(k, k): v for k, v in quantized.items()}
        self.base_dir, self.loras, self.quantized, self.expert_lora = base_dir, loras, quantized, expert_lora or {}
        fused = (set(quantized) | set(self.expert_lora)) - set(self.where)
        pieces = expert_pieces(model_type, sorted(self.where)) if fused else {}
        self.pieces = {n: p for n, p in pieces.items() if p.fused in fused}
        wanted = set(loras) | set(quantized) | set(self.expert_lora)
        absent = sorted(wanted - set(self.where) - {p.fused for p in self.pieces.values()})
        if absent:
            raise ExportError(
                f"the base checkpoint in '{base_dir}' has no tensor '{absent[0]}' (+{len(absent) - 1} more) that the "
                "adapter or the 4-bit base needs; its tensor names differ from the loaded model's",
                hint="merge with peft instead: PeftModel.from_pretrained(base, ADAPTER).merge_and_unload()",
            )
        self.ready: dict[str, torch.Tensor] = {}  # merged pieces of a fused parameter not asked for yet
        self.merged = 0  # weights the adapter was added to

    def read(self, name: str) -> torch.Tensor:
        """The base checkpoint's tensor, as stored."""
        with self.where[name].path.open("rb") as f:
            return read_tensor(f, self.where[name], name)

    def tensor(self, name: str) -> torch.Tensor:
        """name's tensor of the merged model: fp32 when merged or round-tripped through 4 bits, else as stored."""
        if name in self.pieces and name not in self.ready:
            group = self.pieces[name].fused
            mine = [n for n, p in self.pieces.items() if p.fused == group]
            lora, quant = self.expert_lora.get(group), self.quantized.get(group)
            self.ready.update(_merged_pieces(mine, self.pieces, self.read, lora, quant))
            self.merged += group in self.expert_lora
        tensor = self.ready.pop(name) if name in self.pieces else self.read(name)
        if name in self.loras or name in self.quantized or name in self.expert_lora:  # (a 3-D expert parameter stored fused)
            tensor = merged_weight(tensor, self.loras.get(name), self.quantized.get(name))
            tensor = _add_experts(tensor, self.expert_lora.get(name))
            self.merged += name in self.loras or name in self.expert_lora
        return tensor


def stream_merge(
    base_dir: Path,
    out_dir: Path,
    dtype: torch.dtype,
    loras: dict[str, Lora],
    quantized: dict[str, Quant4],
    expert_lora: dict[str, list[Lora]] | None = None,
    model_type: str = "",
    renamed: Callable[[list[str]], dict[str, str]] | None = None,
) -> dict[str, int]:
    """Write base + adapter to out_dir as safetensors shards mirroring the base's, one tensor in memory at a time
    (a fused MoE expert parameter: its pieces, model_type's conversion mapping says which). renamed: the
    checkpoint names whose loaded names differ -> those (a vision-language model's older layout)."""
    merged = MergedTensors(base_dir, loras, quantized, expert_lora, model_type, renamed)
    files = merged.files
    weight_map: dict[str, str] = {}
    total = 0
    for i, header in enumerate(merged.headers):
        shard = "model.safetensors" if len(files) == 1 else f"model-{i + 1:05d}-of-{len(files):05d}.safetensors"
        plan = [
            (name, NAMES[dtype] if FILE_DTYPES[e["dtype"]].is_floating_point else e["dtype"], e["shape"])
            for name, e in header.tensors.items()
        ]
        with ShardWriter(out_dir / shard, plan) as writer:
            for name in header.tensors:
                tensor = merged.tensor(name)
                writer.write(name, tensor.to(dtype) if tensor.is_floating_point() else tensor)
                del tensor  # before the next read: one weight in memory, not two
        total += writer.nbytes
        weight_map.update(dict.fromkeys(header.tensors, shard))
    if len(files) > 1:
        write_index(out_dir, weight_map, total)
    return {"tensors": len(weight_map), "merged": merged.merged, "requantized": len(quantized), "bytes": total}
