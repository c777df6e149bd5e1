"""Export a finished run: the adapter alone, or a merged standalone model checked against the adapter.

    finetune export runs/demo-cpu --out exports/demo                 # adapter + tokenizer + recipe
    finetune export runs/demo-cpu --out exports/demo-merged --merge --dtype bf16

    from finetune.export.run import export_run
    result = export_run("runs/demo-cpu", "exports/demo-merged", merge=True, dtype="bf16")
    result.metadata["verification"]["max_abs_diff"]

A merge streams the base checkpoint tensor by tensor (finetune.model.shards): each
weight is read, merged (W + scale * B @ A in fp32) when it has a LoRA, cast to
the export dtype and written, so memory holds one tensor at a time, never the
model. When the run was QLoRA the adapter was trained against the 4-bit base,
that is against dequantize(quantize(W)), not W: every weight that was quantized
in training is round-tripped through bitsandbytes' quantize_4bit/dequantize_4bit
with the settings the loaded base really used, then the adapter is added.

Every merge is verified: logits of the merged model, loaded by vanilla
transformers, against the model as trained (base quantized as in the recipe +
adapter) on a few prompts. The largest difference and the tolerance go into
finetune_export.json; beyond it the export fails and leaves nothing at --out.
"""

from __future__ import annotations

import gc
import json
import shutil
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import torch

from finetune.data import get_format
from finetune.data.images import image_inputs, processor_of
from finetune.errors import ExportError, MergeCheckFailed
from finetune.export.merge import (  # noqa: F401 - the API
    Lora,
    Quant4,
    expert_loras,
    merged_weight,
    quantized_weights,
    read_adapter,
    stream_merge,
)
from finetune.export.serving import vllm_line, vllm_note
from finetune.hardware import DTYPES, torch_dtype
from finetune.model import vision
from finetune.model.load import DAMAGED_CONFIG_HINT, config_json_problem, default_device, model_config, model_source
from finetune.model.shards import weight_files
from finetune.runs.checkpoint import atomic_dir, write_json
from finetune.runs.evaluate import prompt_ids
from finetune.runs.open import (
    Run,
    check_adapter_config,
    check_device_memory,
    inference_precision,
    load_trained,
    open_run,
    remote_code_notice,
)

METADATA = "finetune_export.json"
EXPORT_DTYPES = tuple(DTYPES)  # bf16, fp16, fp32

# Largest |merged - as-trained| logit difference allowed, as a fraction of the largest
# |logit|, by the coarsest dtype involved (export dtype or compute precision). fp32:
# only summation order differs (measured ~1e-6 on the tiny model, 4-bit base included).
# fp16/bf16: one rounding of every merged weight, 2^-11 / 2^-8 relative, compounded
# over the layers (measured in benchmarks/README.md).
TOLERANCE = {"fp32": 1e-4, "fp16": 1e-2, "bf16": 5e-2}

# Plain prompts, rendered in the run's data.format like any training prompt.
VERIFY_PROMPTS = (
    "Write one sentence about the sea.",
    "List three prime numbers, then add them up.",
    "def fibonacci(n):",
)
IMAGE_PROMPT = "What is in the picture?"  # a vision-language model's fourth prompt, with a picture (check_prompts)


@dataclass
class ExportResult:
    out: Path
    metadata: dict[str, Any] = field(default_factory=dict)


# --------------------------------------------------------------------------- streaming merge


def base_weights_dir(run: Run) -> Path:
    """The directory holding the base checkpoint's files (hub ids: the local HF cache, fetched if needed)."""
    if not run.is_adapter:
        return run.weights_dir
    src = model_source(run.cfg)
    if Path(src).is_dir():
        return Path(src)
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(src, revision=run.cfg.model.revision, allow_patterns=["*.json", "*.safetensors"]))
    except Exception as exc:  # offline, unknown repo, no permission: huggingface_hub raises several types
        raise ExportError(
            f"model.path: cannot get the files of '{src}' to merge into: {str(exc).splitlines()[0]}",
            hint="download the model (huggingface-cli download ...) or set model.path to a local copy in recipe.yaml",
        ) from None


def read_base_config(base_dir: Path, run: Run) -> dict[str, Any]:
    """The base checkpoint's config.json, which the merged model is described by; ExportError naming it otherwise."""
    problem = config_json_problem(base_dir)
    if problem is None:
        return json.loads((base_dir / "config.json").read_text(encoding="utf-8"))
    if not run.is_adapter:  # a full fine-tune: the run wrote the whole model, config.json included
        raise ExportError(f"{problem}; the merge needs it (it describes the exported model)", hint=DAMAGED_CONFIG_HINT)
    raise ExportError(
        f"model.path: {problem}; the merge needs the base model's config.json (it describes the merged model)",
        hint=f"{DAMAGED_CONFIG_HINT}, or set model.path in '{run.path / 'recipe.yaml'}' to a complete copy of the base model",
    )


def check_merge_fits(run: Run, base_dir: Path, device: torch.device) -> None:
    """Stop before any work when the merge check's merged model (unquantized, in the compute precision) exceeds the GPU."""
    merged = run.cfg.model_copy(
        update={
            "model": run.cfg.model.model_copy(update={"path": str(base_dir)}),  # the shape the merge writes
            "quant": run.cfg.quant.model_copy(update={"bits": None}),
            "lora": None,
        }
    )
    fix = (
        "pass --device cpu: the check then runs from CPU RAM and streams layers from disk beyond --verify-memory-gib "
        "(the merge itself always streams on the CPU)"
    )
    check_device_memory(merged, inference_precision(run.cfg, device), device, "the merge check's merged model", fix)


def write_model_config(base_config: dict[str, Any], base_dir: Path, out_dir: Path, dtype_name: str) -> None:
    config = dict(base_config)
    config["dtype"] = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}[dtype_name]
    config.pop("torch_dtype", None)  # the pre-v4.56 name of the same field; two values could disagree
    write_json(out_dir / "config.json", config)
    if (base_dir / "generation_config.json").is_file():
        shutil.copyfile(base_dir / "generation_config.json", out_dir / "generation_config.json")
    if "auto_map" in config:
        # A custom architecture: config.json names classes in the model folder's own Python files
        # (and those may import their neighbours); the merged model loads only with them beside it.
        for code in base_dir.glob("*.py"):
            shutil.copyfile(code, out_dir / code.name)


# --------------------------------------------------------------------------- verification


@torch.no_grad()
def prompt_logits(
    model, prompts: list[list[int]], device: torch.device, images: list[dict[str, torch.Tensor]] | None = None
) -> list[torch.Tensor]:
    """Each prompt's logits (fp32, on the CPU), one forward per prompt; images: each one's image inputs (a VLM)."""
    # `device` is passed, not read off a parameter: offloaded layers sit on the meta device until used.
    extra = images or [{} for _ in prompts]
    return [
        model(input_ids=torch.tensor([ids], device=device), **{k: v.to(device) for k, v in x.items()}).logits[0].float().cpu()
        for ids, x in zip(prompts, extra)
    ]


def check_prompts(fmt: str, tokenizer) -> tuple[list[list[int]], list[dict[str, torch.Tensor]]]:
    """The check's prompts (ids) and each one's image inputs. A vision-language model gets one more, with a
    picture: its projector (and its vision tower) only run on one, so text alone would miss their adapters."""
    prompts = [prompt_ids(p, fmt, tokenizer) for p in VERIFY_PROMPTS]
    processor = processor_of(tokenizer)
    if processor is None:
        return prompts, [{} for _ in prompts]
    import tempfile

    from PIL import Image

    with tempfile.TemporaryDirectory(prefix="finetune-check-") as tmp:
        picture = str(Path(tmp) / "check.png")  # a fixed gradient: the same pixels in every check
        Image.frombytes(
            "RGB", (64, 48), bytes((x * 4 + c * 60) % 256 for _y in range(48) for x in range(64) for c in range(3))
        ).save(picture)
        prompts.append(prompt_ids(IMAGE_PROMPT, fmt, tokenizer, images=[picture]))
        pictures: list[list[str]] = [[] for _ in VERIFY_PROMPTS] + [[picture]]
        images = [image_inputs(processor, torch.tensor([ids]), [p]) for ids, p in zip(prompts, pictures)]
    return prompts, images


def max_abs_diff(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    """The largest |a - b| over every prompt's logits."""
    return max(float((x - y).abs().max()) for x, y in zip(a, b))


@dataclass
class Reference:
    """What the verifier needs from the model as trained, gathered before the merge so it can be freed first."""

    prompts: list[list[int]]
    images: list[dict[str, torch.Tensor]]  # each prompt's image inputs ({} for text; a VLM's last prompt has a picture)
    logits: list[torch.Tensor]  # base + adapter, as trained
    base_logits: list[torch.Tensor] | None  # adapter disabled: how far the adapter moves the logits
    quantized: dict[str, Quant4]
    precision: str
    tokenizer: Any
    device: torch.device | None = None  # where both models run (None: default_device())
    trust_remote_code: bool = False  # the user's opt-in, which the merged model (a custom architecture) needs too
    expert_lora: dict[str, list[Lora]] = field(default_factory=dict)  # LoRA on fused MoE experts (peft ParamWrapper)


def reference(run: Run, device: torch.device | None = None) -> Reference:
    device = device or default_device()
    precision = inference_precision(run.cfg, device)
    model, tokenizer = load_trained(run, precision=precision, device=device)
    prompts, images = check_prompts(run.cfg.data.format, tokenizer)
    logits = prompt_logits(model, prompts, device, images)
    base_logits = None
    if run.is_adapter:
        with model.disable_adapter():
            base_logits = prompt_logits(model, prompts, device, images)
    quantized, experts = quantized_weights(model), expert_loras(model)
    del model  # the merge that follows must not share memory with a whole model
    gc.collect()
    return Reference(
        prompts, images, logits, base_logits, quantized, precision, tokenizer, device, run.cfg.model.trust_remote_code, experts
    )


def available_memory_bytes() -> int | None:
    """MemAvailable from /proc/meminfo (Linux): what can be allocated without swapping; None elsewhere."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def verify(ref: Reference, merged_dir: Path, dtype_name: str, max_memory: int | None = None) -> dict[str, Any]:
    """Compare the merged model (loaded by vanilla transformers) with the model as trained; a dict for the metadata.

    The merged model is loaded in the compute precision. When that would take more
    than `max_memory` bytes of CPU RAM (default: half of what is available), its
    layers stay on disk and accelerate loads each one as the forward reaches it:
    the same logits (tested), a bounded footprint, slower.
    """
    import tempfile

    from transformers import AutoConfig

    device = ref.device or default_device()
    weights = sum(f.stat().st_size for f in weight_files(merged_dir))
    need = weights * torch_dtype(ref.precision).itemsize // DTYPES[dtype_name].itemsize
    budget = max_memory if max_memory is not None else (available_memory_bytes() or need * 2) // 2
    with tempfile.TemporaryDirectory(prefix="finetune-offload-") as offload:
        placement: dict[str, Any] = {"device_map": {"": device}}
        if device.type == "cpu" and need > budget:
            placement = {"device_map": "auto", "max_memory": {"cpu": budget}, "offload_folder": offload}
        config = AutoConfig.from_pretrained(str(merged_dir), trust_remote_code=ref.trust_remote_code)
        model = (
            vision.model_class(config)
            .from_pretrained(
                str(merged_dir),
                dtype=torch_dtype(ref.precision),
                trust_remote_code=ref.trust_remote_code,
                use_kernels=False,  # the merged weights' own numbers: no Hub kernel swapped in (transformers >= 5.25 would)
                **placement,
            )
            .eval()
        )
        got = prompt_logits(model, ref.prompts, device, ref.images)
        del model
        gc.collect()
    coarsest = max((dtype_name, ref.precision), key=TOLERANCE.__getitem__)
    scale = max(1.0, max(float(x.abs().max()) for x in ref.logits))
    tolerance = TOLERANCE[coarsest] * scale
    max_diff = max_abs_diff(got, ref.logits)
    effect = max_abs_diff(ref.base_logits, ref.logits) if ref.base_logits is not None else None
    return {
        "prompts": len(ref.prompts),
        "prompts_with_images": sum("pixel_values" in x for x in ref.images),
        "offloaded": placement["device_map"] == "auto",  # layers streamed from disk to fit max_memory
        "compared": f"merged model ({dtype_name} weights, {ref.precision} compute) vs the run's model as trained",
        "max_abs_diff": max_diff,
        "tolerance": tolerance,
        "tolerance_rule": f"{TOLERANCE[coarsest]:g} ({coarsest}) x max(1, max |logit|)",
        "adapter_effect": effect,  # max |logit change| the adapter makes: a merge that dropped it differs this much
        "distinguishes_unmerged": effect is None or effect > tolerance,
        "passed": max_diff <= tolerance,
    }


# --------------------------------------------------------------------------- export


def _prompt_template(fmt: str) -> Any:
    f = get_format(fmt)
    if f.chat:
        return "the tokenizer's chat template (chat_template.jinja), rendered with add_generation_prompt=True"
    return f.prompt_template


def check_destination(out: Path, run: Run, overwrite: bool) -> None:
    out_r, run_r = out.resolve(), run.path.resolve()
    if out_r == run_r or run_r.is_relative_to(out_r) or out_r.is_relative_to(run.weights_dir.resolve()):
        raise ExportError(f"--out '{out}' overlaps the run '{run.path}'", hint="export to a directory outside the run")
    if out.exists() and not out.is_dir():
        raise ExportError(f"--out '{out}' is a file", hint="choose a directory path that does not exist yet")
    entries = sorted(p.name for p in out.iterdir()) if out.is_dir() else []
    if not entries:
        return
    if not overwrite:
        raise ExportError(
            f"--out '{out}' exists and is not empty ({', '.join(entries[:5])})",
            hint="choose a new directory, or pass --overwrite to replace a previous export there",
        )
    if METADATA not in entries:
        raise ExportError(
            f"--out '{out}' is not empty and is not a finetune export ({', '.join(entries[:5])}); --overwrite only replaces exports",
            hint="choose a new or empty directory",
        )


def export_run(
    run_dir: str | Path,
    out: str | Path,
    merge: bool = False,
    dtype: str | None = None,
    overwrite: bool = False,
    say: Callable[[str], None] = print,
    verify_max_memory: int | None = None,
    device: torch.device | None = None,
    trust_remote_code: bool = False,
) -> ExportResult:
    """Adapter export (merge=False) or verified merged export of the finished run at run_dir. See the module doc.

    verify_max_memory: CPU bytes the verification may load the merged model into before
    it streams layers from disk instead (default: half the available memory).
    device: where the merge check runs both models (default: the first GPU, else the CPU).
    trust_remote_code: run code from the model's folder; the run's recipe.yaml cannot switch it on.
    """
    from finetune import __version__

    run = open_run(run_dir, trust_remote_code=trust_remote_code)
    notice = remote_code_notice(run)
    if notice and merge:  # an adapter export copies files and loads no model
        say(notice)
    out = Path(out)
    if dtype is not None and dtype not in EXPORT_DTYPES:
        raise ExportError(f"--dtype '{dtype}' is not an export dtype", hint=f"use one of {', '.join(EXPORT_DTYPES)}")
    check_destination(out, run, overwrite)
    cfg = run.cfg
    meta: dict[str, Any] = {
        "format": 1,
        "finetune_version": __version__,
        "run_dir": str(run.path.resolve()),
        "base_model": model_source(cfg),
        "data_format": cfg.data.format,
        "prompt_template": _prompt_template(cfg.data.format),
    }
    if not merge:
        return _export_adapter(run, out, meta, say)
    base_dir, base_config, dtype = mergeable(run, dtype)
    loras = read_adapter(run.weights_dir) if run.is_adapter else {}
    device = device or default_device()
    check_merge_fits(run, base_dir, device)
    say("merge: computing reference logits of the run as trained (the check's prompts)")
    ref = reference(run, device)
    with atomic_dir(out) as tmp:
        say(
            f"merge: streaming {base_dir} -> {out} ({dtype}, {len(loras) + len(ref.expert_lora)} LoRA weights, {len(ref.quantized)} 4-bit weights)"
        )
        model_type = str(base_config.get("model_type", ""))
        image_text = processor_of(ref.tokenizer)  # a vision-language model: its older checkpoint names, its processor
        renamed = partial(vision.loaded_names, model_config(cfg)) if image_text is not None else None
        stats = stream_merge(base_dir, tmp, DTYPES[dtype], loras, ref.quantized, ref.expert_lora, model_type, renamed)
        write_model_config(base_config, base_dir, tmp, dtype)
        (image_text or ref.tokenizer).save_pretrained(tmp)
        shutil.copyfile(run.path / "recipe.yaml", tmp / "recipe.yaml")
        say("merge: loading the merged model with transformers to check its logits")
        check = verify(ref, tmp, dtype, max_memory=verify_max_memory)
        _say_check(check, out, say)
        meta.update(
            kind="merged" if run.is_adapter else "full",
            dtype=dtype,
            quantization={
                "bits": cfg.quant.bits,
                "quant_type": cfg.quant.quant_type,
                "double_quant": cfg.quant.double_quant,
                "note": "merged into dequantize(quantize(W)), the weights the adapter was trained against",
            }
            if ref.quantized
            else None,
            merge=stats,
            verification=check,
        )
        meta["vllm"] = {"servable": True, "command": f"vllm serve {out}"}  # a plain model: no LoRA limits apply
        write_json(tmp / METADATA, meta)
    auto = "AutoModelForImageTextToText" if image_text is not None else "AutoModelForCausalLM"
    say(f"merged model exported to {out} (load: {auto}.from_pretrained('{out}'))")
    say(f"  vLLM:       {meta['vllm']['command']}")
    return ExportResult(out, meta)


def _export_adapter(run: Run, out: Path, meta: dict[str, Any], say: Callable[[str], None]) -> ExportResult:
    """The adapter files, tokenizer and recipe, copied as they are (no model loaded)."""
    if not run.is_adapter:
        raise ExportError(
            f"'{run.path}' is a full fine-tune: it has no adapter to export on its own",
            hint="pass --merge to export the whole model (cast to --dtype and verified)",
        )
    adapter_config = json.loads((run.weights_dir / "adapter_config.json").read_text(encoding="utf-8"))
    with atomic_dir(out) as tmp:
        for f in run.weights_dir.iterdir():
            if f.is_file():
                shutil.copyfile(f, tmp / f.name)
        shutil.copyfile(run.path / "recipe.yaml", tmp / "recipe.yaml")
        meta["kind"] = "adapter"
        meta["vllm"] = vllm_note(adapter_config, meta["base_model"], out)
        write_json(tmp / METADATA, meta)
    say(f"adapter exported to {out} (load: PeftModel.from_pretrained(base, '{out}'))")
    say(vllm_line(meta["vllm"]))
    return ExportResult(out, meta)


def _say_check(check: dict[str, Any], out: Path, say: Callable[[str], None]) -> None:
    """Report the merge check; MergeCheckFailed (nothing written) when it failed."""
    verdict = "passed" if check["passed"] else "FAILED"
    say(
        f"merge check {verdict}: max |logit diff| {check['max_abs_diff']:.3g} vs tolerance {check['tolerance']:.3g} "
        f"({check['prompts']} prompts{', one with a picture' if check.get('prompts_with_images') else ''}; the adapter itself moves logits by up to {check['adapter_effect'] or 0:.3g}"
        + ("; merged layers streamed from disk to stay within the memory budget)" if check["offloaded"] else ")")
    )
    if not check["distinguishes_unmerged"]:
        say(
            "warning: the adapter changes the logits less than the tolerance, so this check cannot tell a merged model from the base"
        )
    if not check["passed"]:
        raise MergeCheckFailed(
            f"merged model differs from base + adapter: max |logit diff| {check['max_abs_diff']:.4g} > "
            f"tolerance {check['tolerance']:.4g} ({check['tolerance_rule']}); nothing was written to '{out}'",
            hint="try --dtype fp32 to rule out rounding; if fp32 fails too the base checkpoint on disk is not the "
            "one the run trained on (model.path / revision changed?)",
        )


def mergeable(run: Run, dtype: str | None) -> tuple[Path, dict[str, Any], str]:
    """(base checkpoint folder, its config.json, the export dtype), or ExportError saying why this run cannot merge."""
    cfg = run.cfg
    if cfg.quant.bits == 8 and run.is_adapter:
        raise ExportError(
            "quant.bits=8: an 8-bit run cannot be merged into a standalone model that computes what it computed "
            "(LLM.int8 multiplies outlier features in 16-bit at run time, from activations no weight captures)",
            hint="export the adapter alone (drop --merge), or train with quant.bits=4 or null",
        )
    base_dir = base_weights_dir(run)
    base_config = read_base_config(base_dir, run)
    if "quantization_config" in base_config:
        raise ExportError(
            f"the base checkpoint in '{base_dir}' is stored quantized ({base_config['quantization_config'].get('quant_method')}); "
            "merging needs its unquantized weights",
            hint="point model.path in recipe.yaml at the original 16-bit model the quantized one was made from",
        )
    dtype = dtype or {"bfloat16": "bf16", "float16": "fp16"}.get(
        str(base_config.get("dtype") or base_config.get("torch_dtype")), "fp32"
    )
    if run.is_adapter:
        check_adapter_config(run)
    return base_dir, base_config, dtype
