"""Base model and tokenizer: quantize (bitsandbytes), wrap with peft adapters (lora.method), checkpointing.

from finetune import load_recipe, load_tokenizer, load_model
cfg = load_recipe("demo-cpu")
tok = load_tokenizer(cfg)
model = load_model(cfg, precision="fp32")
"""

from __future__ import annotations

import json
import os
import re
import sys
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import torch

from finetune.config.schema import RecipeConfig, resolve_path
from finetune.errors import ModelError, exception_line
from finetune.hardware import resolve_precision, torch_dtype
from finetune.model import moe, varlen, vision
from finetune.model.partial import Split, only_placed
from finetune.model.targets import linear_layer_names


def model_source(cfg: RecipeConfig) -> str:
    return resolve_path(cfg.model.path)


def tokenizer_source(cfg: RecipeConfig) -> str:
    return resolve_path(cfg.model.tokenizer or cfg.model.path)


def looks_like_hub_id(value: str) -> bool:
    """'org/name' or 'name' (e.g. gpt2) that is not an existing local path."""
    return bool(re.fullmatch(r"[\w.-]+(/[\w.-]+)?", value)) and not value.startswith(".") and not Path(value).exists()


def config_json_problem(folder: Path) -> str | None:
    """What makes folder/config.json unusable (absent, unreadable, not a JSON object), or None when it reads."""
    path = folder / "config.json"
    if not path.is_file():
        return f"'{folder}' has no config.json"
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        return f"'{path}' is not valid JSON ({exc.msg} at line {exc.lineno}, column {exc.colno})"
    except (OSError, UnicodeDecodeError) as exc:
        return f"'{path}' cannot be read ({exc})"
    if not isinstance(config, dict):
        return f"'{path}' holds a JSON {type(config).__name__}, not a model configuration (a JSON object)"
    return None


DAMAGED_CONFIG_HINT = (
    "the model folder is damaged: restore its config.json from where the model came from "
    "(download it again, or save_pretrained it again)"
)


def raise_for_model_config(folder: Path, key: str = "model.path", missing_ok: bool = False) -> None:
    """ModelError naming config.json when a local model folder's config.json is damaged (or absent, unless missing_ok).

    Checked before transformers reads it: transformers reports a broken config.json
    as whatever it was loading at the time (a tokenizer, a model), not as the file.
    """
    if not folder.is_dir() or (missing_ok and not (folder / "config.json").exists()):
        return
    problem = config_json_problem(folder)
    if problem:
        raise ModelError(f"{key}: {problem}", hint=DAMAGED_CONFIG_HINT)


def check_model_source(cfg: RecipeConfig, key: str = "model.path") -> list[str]:
    """Problems with model.path that can be found without loading weights."""
    src = model_source(cfg)
    if Path(src).is_dir():
        if not (Path(src) / "config.json").is_file():
            return [
                f"{key}: directory '{src}' has no config.json; point it at a Hugging Face model directory (save_pretrained output)."
            ]
        problem = config_json_problem(Path(src))
        return [f"{key}: {problem}; {DAMAGED_CONFIG_HINT}."] if problem else []
    if Path(src).exists():
        return [f"{key}: '{src}' is a file; expected a model directory or a hub id like 'Qwen/Qwen2.5-7B'."]
    if looks_like_hub_id(src):
        return []
    return [
        f"{key}: '{cfg.model.path}' is neither a local directory (cwd: {os.getcwd()}) nor a hub id of the form org/name. "
        "Pass an absolute path or a hub id."
    ]


def load_tokenizer(cfg: RecipeConfig):
    """The tokenizer, with a pad token guaranteed (labels are masked by position, so pad == eos is harmless here)."""
    from transformers import AutoTokenizer

    src = tokenizer_source(cfg)
    # A tokenizer folder without config.json is fine (an adapter's); a broken one fails AutoTokenizer.
    raise_for_model_config(Path(src), "model.path" if src == model_source(cfg) else "model.tokenizer", missing_ok=True)
    try:
        tok = AutoTokenizer.from_pretrained(src, revision=cfg.model.revision, trust_remote_code=cfg.model.trust_remote_code)
    except Exception as exc:  # transformers raises many types (OSError, ValueError, HF errors)
        raise ModelError(
            f"model.tokenizer: could not load a tokenizer from '{src}': {str(exc).splitlines()[0]}",
            hint="check the path (a directory with tokenizer.json / tokenizer_config.json) or hub id; "
            "set model.tokenizer=... if the tokenizer lives elsewhere",
        ) from None
    if tok.eos_token_id is None:
        raise ModelError(
            f"tokenizer at '{src}' has no eos_token; fine-tuned models could never learn to stop.",
            hint="use a tokenizer with an EOS token (set eos_token in tokenizer_config.json)",
        )
    if tok.pad_token_id is None:
        # Padding positions get label -100 by position in the collator, never by id,
        # so reusing EOS (or UNK) as pad cannot stop EOS from being trained.
        tok.pad_token = tok.unk_token if tok.unk_token is not None else tok.eos_token
    config = model_config(cfg, quiet=True)
    if config is not None and vision.is_vision_language(config):
        vision.attach_processor(tok, model_source(cfg), cfg.model.revision, cfg.model.trust_remote_code, cfg.data.max_pixels)
    elif cfg.data.max_pixels is not None:
        raise ModelError(f"data.max_pixels is set, but '{src}' is not a vision-language model", hint="remove data.max_pixels")
    return tok


def model_config(cfg: RecipeConfig, quiet: bool = False) -> Any:
    """model.path's config (config.json alone); None when quiet and it cannot be read (loading says why)."""
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(
            model_source(cfg), revision=cfg.model.revision, trust_remote_code=cfg.model.trust_remote_code
        )
    except Exception:
        if quiet:
            return None
        raise


def quantization_config(
    cfg: RecipeConfig, compute_dtype: torch.dtype, storage_dtype: torch.dtype | None = None, skip: list[str] | None = None
):
    """BitsAndBytesConfig for quant.bits, or None. storage_dtype is set when FSDP must shard the 4-bit weights;
    skip: modules left unquantized (a vision-language model's vision side; None: bitsandbytes' defaults)."""
    if cfg.quant.bits is None:
        return None
    from transformers import BitsAndBytesConfig

    if cfg.quant.bits == 8:
        return BitsAndBytesConfig(load_in_8bit=True, llm_int8_skip_modules=skip)
    kwargs: dict[str, Any] = {}
    if storage_dtype is not None:
        kwargs["bnb_4bit_quant_storage"] = storage_dtype
    return BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type=cfg.quant.quant_type,
        bnb_4bit_use_double_quant=cfg.quant.double_quant,
        bnb_4bit_compute_dtype=compute_dtype,
        llm_int8_skip_modules=skip,
        **kwargs,
    )


def default_device() -> torch.device:
    if torch.cuda.is_available():
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return torch.device("cpu")


# Unlike peft.prepare_model_for_kbit_training we do not upcast every non-quantized
# weight (embeddings, head, norms) to fp32: on a 7B model with a 150k vocabulary
# that costs ~2 GB of a 24 GB card for no measurable gain (norms already compute
# in fp32 inside Llama-style RMSNorm). We freeze, enable checkpointing, and let
# peft keep the adapters themselves in fp32.
def load_base_model(
    cfg: RecipeConfig,
    precision: str | None = None,
    device: torch.device | None = None,
    shardable: bool = False,
    placement: dict[str, Any] | None = None,
    split: Split | None = None,
):
    """The (quantized) base model on `device`, frozen, without adapters.

    shardable: 4-bit weights stored in the compute dtype (bnb_4bit_quant_storage), which FSDP needs.
    placement: {module name: device or "meta"}, every top-level module named: a pipeline stage's
    modules on its device, the rest on the meta device, never read (finetune/parallel/pipeline.py).
    split: a tensor-parallel rank's share (model/partial.Split): its narrowed config, its slices read.
    """
    precision = precision or resolve_precision(cfg.precision)
    dtype = torch_dtype(precision)
    if precision == "fp16" and cfg.lora is None and cfg.quant.bits is None:
        # Full fine-tuning under fp16: the GradScaler cannot unscale fp16 gradients,
        # so trained weights stay fp32 and autocast runs the matmuls in fp16.
        dtype = torch.float32
    device = device or default_device()
    src = model_source(cfg)
    raise_for_model_config(Path(src))
    attention, note = choose_attention(cfg, device, dtype, compute_bytes=torch_dtype(precision).itemsize)
    config = model_config(cfg, quiet=True)
    image_text = config is not None and vision.is_vision_language(config)
    skip = vision.not_quantized(config, cfg.model.vision_tower) if image_text and cfg.quant.bits else None
    # 4-bit: bitsandbytes quantizes nn.Linear weights; the fused 3-D experts of MoE models are
    # quantized here as they load (finetune/model/moe.py), else they would stay 16-bit.
    fused_4bit = moe.quantizing_experts(cfg.quant.quant_type, cfg.quant.double_quant) if cfg.quant.bits == 4 else nullcontext()
    try:
        with fused_4bit, only_placed(placement, split):
            model = vision.model_class(config).from_pretrained(
                src,
                **({"config": split.config} if split is not None else {}),
                revision=cfg.model.revision,
                dtype=dtype,
                quantization_config=quantization_config(cfg, dtype, dtype if shardable else None, skip),
                device_map=placement or {"": device},
                attn_implementation=attention,
                trust_remote_code=cfg.model.trust_remote_code,
                use_kernels=False,  # transformers >= 5.25 would swap in Hub kernels: code nobody chose to trust
            )
    except Exception as exc:
        first = str(exc).splitlines()[0]
        if attention and (attention in first or "attention" in first.lower()):
            raise ModelError(
                f"model.attn_implementation={attention}: {first}",
                hint="set model.attn_implementation=auto (the fastest this model supports) or eager",
            ) from None
        raise ModelError(
            f"model.path: could not load a causal LM from '{src}': {first}",
            hint="check model.path; models with custom code need model.trust_remote_code=true (only for sources you trust)",
        ) from None
    if moe.attach(model) and (shardable or cfg.memory.base_weights != "device"):
        raise ModelError(
            f"model.path: '{src}' is a mixture-of-experts model whose fused experts finetune stores 4-bit itself; "
            + (
                "FSDP does not shard them" if shardable else f"memory.base_weights={cfg.memory.base_weights} does not stream them"
            ),
            hint="train it on one GPU (or with distributed.strategy=ddp) with memory.base_weights=device",
        )
    if placement:
        model.__dict__.pop("hf_device_map", None)  # one device: nothing for accelerate to dispatch
    model.finetune_attention_note = note  # a plain attribute for the trainer to print
    model.config.use_cache = False  # the KV cache is useless in training and costs memory
    for p in model.parameters():
        p.requires_grad_(False)
    keep_4bit_numerics(model)
    return model


def causal_lm_class(cfg: RecipeConfig) -> tuple[Any, Any]:
    """(the transformers class that loads model.path, its config) from config.json alone; raises where it
    cannot be looked up (custom code, an unreadable config)."""
    from transformers import AutoConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING, MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING

    config = AutoConfig.from_pretrained(
        model_source(cfg), revision=cfg.model.revision, trust_remote_code=cfg.model.trust_remote_code
    )
    classes = MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING if vision.is_vision_language(config) else MODEL_FOR_CAUSAL_LM_MAPPING
    return classes[type(config)], config


def choose_attention(
    cfg: RecipeConfig, device: torch.device, dtype: torch.dtype, compute_bytes: int | None = None
) -> tuple[str | None, str | None]:
    """(attn_implementation to load with, a one-line note when auto fell back from sdpa).

    auto: flash_attention_2 on a CUDA device with flash-attn installed and a 16-bit dtype, else
    sdpa, else eager, as the model's class says it supports them; packed rows get varlen where it is
    faster than a masked row (varlen.auto_cuts_packed_rows: CUDA in 16-bit, a CPU from 1024 tokens).
    varlen (finetune/model/varlen.py) is registered with transformers here, unless the model's attention
    needs what it does not compute. A model class we cannot look up (custom code) gets None:
    transformers' own default.
    """
    wanted = cfg.model.attn_implementation
    if wanted not in ("auto", varlen.NAME):
        return wanted, None
    try:
        cls, config = causal_lm_class(cfg)
    except Exception as exc:  # noqa: BLE001 - custom code or an unreachable config: loading reports real problems
        if wanted == varlen.NAME:
            return varlen.register(), None
        return (
            None,
            f"note: attn_implementation=auto could not look up the model's class ({exception_line(exc)}); transformers' default",
        )
    if wanted == varlen.NAME:
        why = varlen.unsupported(config)
        if why:
            raise ModelError(f"model.attn_implementation=varlen: {why}", hint="set model.attn_implementation=auto (or sdpa)")
        return varlen.register(), None
    import importlib.util

    flash = (
        device.type == "cuda" and dtype in (torch.float16, torch.bfloat16) and importlib.util.find_spec("flash_attn") is not None
    )
    if flash and getattr(cls, "_supports_flash_attn", False):
        return "flash_attention_2", None
    varlen_ok = varlen.runs(cls, config)
    compute_bytes = compute_bytes or dtype.itemsize  # the matmuls' precision (fp16 autocast over fp32 weights: 2)
    if varlen.auto_cuts_packed_rows(cfg.data.packing, cfg.data.max_seq_len, device.type, compute_bytes, varlen_ok):
        where = "on CUDA in 16-bit" if device.type == "cuda" else "on a CPU"
        note = f"note: packed rows attend per example, no T x T mask (model.attn_implementation=auto picks varlen {where})"
        return varlen.register(), note
    if getattr(cls, "_supports_sdpa", False):
        return "sdpa", None
    return "eager", f"note: {cls.__name__} does not support sdpa attention; using eager (model.attn_implementation=auto)"


def keep_4bit_numerics(model) -> None:
    """Make bitsandbytes compute 4-bit layers the same way in eval as in training.

    On CPUs with AVX512-BF16, bitsandbytes repacks a Linear4bit's weight the first
    time it runs in eval mode without grad, and computes from then on in a different
    (bf16-based) kernel: logits move by ~1e-2, eval loss no longer matches training,
    merge verification compares against the wrong model, and the repacked weight
    stays repacked when training resumes. We keep the one kernel the adapter was
    trained with.
    """
    for module in model.modules():
        if hasattr(module, "support_avx512bf16_for_cpu"):
            module.support_avx512bf16_for_cpu = False


def base_of(model) -> Any:
    """The transformers model inside peft's wrapper (the model itself when it is not wrapped)."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def decoder_layers(
    model, purpose: str = "distributed.strategy=fsdp", fallback: str = "use distributed.strategy=ddp"
) -> list[torch.nn.Module]:
    """The repeated blocks (the model's own `_no_split_modules` classes) of the language model: what FSDP shards and
    offload streams (a vision-language model's vision blocks stay with the root)."""
    base = base_of(model)
    names, beside = set(getattr(base, "_no_split_modules", None) or []), vision.modules_beside_language(base)
    layers = [m for m in model.modules() if type(m).__name__ in names and id(m) not in beside]
    if not layers:
        raise ModelError(
            f"{purpose}: found no decoder layers in {type(base).__name__} (it names no _no_split_modules)", hint=fallback
        )
    return layers


def enable_gradient_checkpointing(model, every: int = 1) -> None:
    """Recompute the activations of every `every`-th decoder layer in backward (1: all layers)."""
    # Non-reentrant checkpointing works with frozen inputs and with FSDP; the
    # reentrant variant needs input grads hacks and breaks with some wrappers.
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.enable_input_require_grads()
    if every > 1:
        # transformers checks each layer's own flag (GradientCheckpointingLayer), so a
        # layer left out here keeps its activations and skips the recomputation.
        for i, layer in enumerate(decoder_layers(model, "memory.activation_checkpointing", "use all or none")):
            layer.gradient_checkpointing = i % every == 0  # type: ignore[assignment]  # a bool attribute of the layer


def checkpoint_with(model, function) -> int:
    """Make `function` (torch.utils.checkpoint.checkpoint's signature) the one every checkpointing
    module calls, as transformers' own _set_gradient_checkpointing does; returns how many take it.
    memory/apply.py hands it the offloaded checkpoint that parks each layer's input in host RAM."""
    modules = [m for m in model.modules() if hasattr(m, "gradient_checkpointing")]
    for module in modules:
        module._gradient_checkpointing_func = function
    return len(modules)


def compile_decoder_layers(model) -> int:
    """train.compile: torch.compile each decoder layer in place (module names and state_dict as they
    were); the layers compile at their first call. How many were compiled."""
    import torch._inductor.config as inductor

    # Compiled dropout would draw other masks than eager's (inductor's own random ops): with eager's,
    # a compiled run gives an uncompiled run's numbers, and either resumes the other's checkpoints.
    # A process-wide inductor setting, needed when the layers compile (at their first call).
    inductor.fallback_random = True
    layers = decoder_layers(model, "train.compile", "set train.compile=false")
    for layer in layers:
        layer.compile()
    return len(layers)


def checkpointed_layers(model) -> list[int]:
    """Indices of the decoder layers whose activations are recomputed in backward."""
    return [i for i, layer in enumerate(decoder_layers(model)) if getattr(layer, "gradient_checkpointing", False)]


def lora_targets(cfg: RecipeConfig) -> str | list[str]:
    target = cfg.lora.target if cfg.lora else "all-linear"
    return target


def peft_arguments(cfg: RecipeConfig) -> dict[str, Any]:
    """The adapter's size as peft's LoraConfig (and adapter_config.json) names it."""
    assert cfg.lora is not None
    return {"r": cfg.lora.r, "lora_alpha": cfg.lora.alpha}


def wrap_lora(cfg: RecipeConfig, model):
    """Add peft adapters of lora.method (finetune/adapters/) on cfg.lora.target. Returns the PeftModel.

    MoE models (finetune/model/moe.py): `all-linear` leaves the routers and the fused experts
    out; `experts` in a lora.target list adapts the experts through peft's target_parameters."""
    from peft import LoraConfig, get_peft_model

    assert cfg.lora is not None
    modules, params = moe.split_targets(model, lora_targets(cfg))
    if vision.is_vision_language(model.config):
        modules = vision.lora_modules(model, lora_targets(cfg))
    peft_cfg = LoraConfig(
        **peft_arguments(cfg),
        lora_dropout=0.0 if params else cfg.lora.dropout,  # peft refuses dropout with target_parameters: set below
        target_modules=modules,
        target_parameters=params or None,
        bias="none",
        task_type="CAUSAL_LM",
        **cfg.lora.adapter.peft_kwargs,
    )
    try:
        wrapped = get_peft_model(model, peft_cfg)
    except ValueError as exc:
        names = linear_layer_names(model)
        raise ModelError(
            f"lora.target={cfg.lora.target!r}: {str(exc).splitlines()[0]}",
            hint=f"use 'all-linear' or a list of module names; this model's linear layers: {', '.join(names)}",
        ) from None
    remapped = set(getattr(wrapped.peft_config["default"], "target_parameters", None) or ()) - set(params)
    if remapped:
        # peft (>= 0.19, transformers 5) reads gate_proj/up_proj/down_proj/w1/w2/w3/gate on some MoE
        # architectures as their transformers-4 expert names and adapts the fused experts instead.
        raise ModelError(
            f"lora.target={cfg.lora.target!r}: peft adapts the fused experts ({sorted(remapped)[0]}, ...) of "
            f"{type(model).__name__} for dense MLP names in the target (its transformers-4 compatibility mapping)",
            hint="list the modules to adapt without gate_proj/up_proj/down_proj (e.g. [q_proj, k_proj, v_proj, o_proj]) "
            "and add `experts` to adapt the experts",
        )
    if params and cfg.lora.dropout:
        moe.set_linear_dropout(wrapped, cfg.lora.dropout)  # the experts' fold cannot take dropout
    return wrapped


def head_owner(model) -> torch.nn.Module | None:
    """The module that owns the LM head: the *ForCausalLM (or *ForConditionalGeneration) inside
    peft's and DDP's wrappers, which only forward to it."""
    for module in model.modules():
        if "lm_head" in module._modules and hasattr(module, "config"):
            return module
    return None


def takes_boolean_logits_to_keep(model) -> bool:
    """Whether the causal LM slices its hidden states with transformers' slice_logits_to_keep,
    which takes a boolean (batch, seq) mask (newer releases); older model code slices
    hidden_states[:, keep, :] and would fail only after running the whole decoder."""
    owner = head_owner(model)
    if owner is None or not type(owner).__name__.endswith("ForCausalLM"):
        return False
    source = sys.modules.get(type(owner).__module__)
    return source is not None and hasattr(source, "slice_logits_to_keep")


def compute_device(model) -> torch.device:
    """Where the model computes: its first parameter not in host RAM (memory.embeddings=cpu keeps
    the vocabulary tables there, so the first parameter alone, as `model.device`, can say cpu)."""
    devices = [p.device for p in model.parameters()]
    return next((d for d in devices if d.type != "cpu"), devices[0] if devices else torch.device("cpu"))


def count_parameters(model) -> tuple[int, int]:
    """(trainable, total) parameter counts; 4-bit weights count as their logical element count."""
    trainable = total = 0
    for p in model.parameters():
        n = p.numel()
        if getattr(p, "quant_state", None) is not None:  # bnb Params4bit packs two values per byte (meta: unpacked)
            n = int(torch.Size(p.quant_state.shape).numel())
        total += n
        if p.requires_grad:
            trainable += n
    return trainable, total


def load_model(
    cfg: RecipeConfig,
    precision: str | None = None,
    device: torch.device | None = None,
    shardable: bool = False,
    placement: dict[str, Any] | None = None,
    split: Split | None = None,
):
    """Base model -> frozen, quantized per cfg.quant -> LoRA. The memory techniques (activation checkpointing
    among them) are memory/apply.py's, for a model that trains.
    placement, split: see load_base_model (LoRA of meta modules is drawn as on one process, then left on meta)."""
    model = load_base_model(cfg, precision=precision, device=device, shardable=shardable, placement=placement, split=split)
    if cfg.lora is not None:
        model = wrap_lora(cfg, model)
    else:
        for p in model.parameters():
            p.requires_grad_(True)
    return model
