"""Vision-language models (Gemma 3, LLaVA, Idefics3/SmolVLM, Qwen2-VL ...): what differs from a causal LM.

    is_vision_language(config)           the family's image-text class (AutoModelForImageTextToText) loads it
    vision_modules(config)               ["model.vision_tower", "model.multi_modal_projector"]: all but the language model
    not_quantized(config, vision_tower)  what bitsandbytes leaves in the compute dtype (the head; the vision side
                                         unless model.vision_tower=4bit)
    lora_modules(model, target)          peft target_modules on the language model only; `vision_tower` and
                                         `projector` in a lora.target list add those
    attach_processor(tokenizer, source)  the processor (AutoProcessor) rides on the tokenizer to the data code

The vision tower is frozen like every base weight; only adapters train.
"""

from __future__ import annotations

import re
from typing import Any

import torch

from finetune.errors import ModelError

VISION_TOWER, PROJECTOR = "vision_tower", "projector"  # lora.target entries that add the vision side
_PROJECTORS = ("multi_modal_projector", "connector", "merger")  # how the families name what maps image features
_LANGUAGE = ("language_model", "text_model")  # and their language model (Idefics3: text_model)


def is_vision_language(config: Any) -> bool:
    """A config the image-text auto class knows and that has a vision tower (Gemma 3 4B+, not Gemma 3 1B)."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES

    return config.model_type in MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES and getattr(config, "vision_config", None) is not None


def model_class(config: Any) -> Any:
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    return AutoModelForImageTextToText if is_vision_language(config) else AutoModelForCausalLM


def _skeleton(config: Any) -> Any:
    """The model on the meta device: its module names, no weights."""
    from transformers import AutoModelForImageTextToText

    with torch.device("meta"):
        return AutoModelForImageTextToText.from_config(config)


def _beside_language(model: Any) -> list[tuple[str, Any]] | None:
    """(name, module) of model.model's children other than its language model (vision tower, projector); None
    when the model keeps no language model there (a text model, or a family finetune does not know)."""
    inner = getattr(model, "model", None)
    if inner is None or not any(hasattr(inner, name) for name in _LANGUAGE):
        return None
    return [(name, child) for name, child in inner.named_children() if name not in _LANGUAGE]


def vision_modules(config: Any) -> list[str]:
    """Full names of the modules beside the language model (vision tower, projector), from the config alone."""
    model = _skeleton(config)
    parts = _beside_language(model)
    if parts is None:
        raise ModelError(
            f"{type(model).__name__} keeps its language model where finetune does not look (model.{'/'.join(_LANGUAGE)})",
            hint="this vision-language family is not supported yet; README's vision section lists those that are",
        )
    return [f"model.{name}" for name, _ in parts]


def modules_beside_language(model: Any) -> set[int]:
    """The ids of every module in a loaded vision-language model's vision tower and projector; empty for a text
    model. Their blocks are not decoder layers: FSDP must not shard them apart (a rank whose micro-batch has no
    image would skip their all-gathers while another ran them), nor checkpointing count them."""
    return {id(m) for _, child in _beside_language(model) or [] for m in child.modules()}


def loaded_names(config: Any, names: list[str]) -> dict[str, str]:
    """{checkpoint tensor name: the loaded model's parameter name} for the names that differ, as transformers'
    loader renames them (LLaVA's and Gemma 3's checkpoints keep the older language_model.model.* layout)."""
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import WeightConverter, WeightRenaming, rename_source_key

    model = _skeleton(config)
    transforms = get_model_conversion_mapping(model)
    renamings = [t for t in transforms if isinstance(t, WeightRenaming)]
    converters = [t for t in transforms if isinstance(t, WeightConverter)]
    meta = model.state_dict()
    out = {}
    for name in names:
        loaded, _ = rename_source_key(name, renamings, converters, model.base_model_prefix, meta)
        if loaded != name:
            out[name] = loaded
    return out


def not_quantized(config: Any, vision_tower: str) -> list[str] | None:
    """bitsandbytes' llm_int8_skip_modules: None (its defaults) when the vision side is quantized too, else the
    head and every vision module (a list replaces the defaults, so the head is named again)."""
    if vision_tower == "4bit":
        return None
    return ["lm_head", *vision_modules(config)]


def lora_modules(model: Any, target: str | list[str]) -> str:
    """peft target_modules as one regex over full module names: the language model's linear layers that
    lora.target names (all-linear: all but the head), plus the vision tower's or projector's when listed."""
    wanted = [target] if isinstance(target, str) else list(target)
    extra = {VISION_TOWER, PROJECTOR} & set(wanted)
    short = [t for t in wanted if t not in (VISION_TOWER, PROJECTOR)]
    head = model.get_output_embeddings()
    names: list[str] = []
    extra_found: set[str] = set()
    for name, module in model.named_modules():
        if not _is_linear(module) or module is head:
            continue
        if any(part in _LANGUAGE for part in name.split(".")):
            place = "language"
        elif any(p in name.split(".") for p in _PROJECTORS):
            place = PROJECTOR
        else:
            place = VISION_TOWER
        leaf = name.rsplit(".", 1)[-1]
        language_match = place == "language" and ("all-linear" in short or leaf in short)
        if language_match or place in extra:
            names.append(name)
            extra_found.add(place)
    if extra - extra_found:  # Gemma 3's projector is a bare weight matrix: LoRA would adapt nothing there
        raise ModelError(
            f"lora.target lists {sorted(extra - extra_found)}, but {type(model).__name__} has no linear layer there to adapt",
            hint="leave it out of lora.target (its weights stay frozen)",
        )
    if not names:
        raise ModelError(
            f"lora.target={target!r} names no linear layer of {type(model).__name__}'s language model",
            hint="use all-linear, or names such as q_proj, v_proj (add `vision_tower` / `projector` to adapt those)",
        )
    return "^(" + "|".join(re.escape(n) for n in names) + ")$"


def _is_linear(module: torch.nn.Module) -> bool:
    # bitsandbytes' Linear4bit is an nn.Linear subclass; so is peft's nothing (not wrapped yet here).
    return isinstance(module, torch.nn.Linear)


def limit_pixels(processor: Any, max_pixels: int) -> None:
    """data.max_pixels on a processor that sizes images by area (its size's longest_edge counts pixels, as
    Qwen2-VL's does); a ModelError naming the processor's own size rule elsewhere."""
    images = processor.image_processor
    size = getattr(images, "size", None)
    if getattr(images, "merge_size", None) is None or size is None or size.get("longest_edge") is None:
        raise ModelError(
            f"data.max_pixels={max_pixels}: {type(images).__name__} does not size images by area (its size: {dict(size or {})})",
            hint="remove data.max_pixels and set the image size in the model folder's preprocessor_config.json",
        )
    images.size = {**{k: v for k, v in dict(size).items() if v is not None}, "longest_edge": max_pixels}


def attach_processor(
    tokenizer: Any, source: str, revision: str | None, trust_remote_code: bool, max_pixels: int | None = None
) -> None:
    """Load the model's processor and hang it on the tokenizer, which every data function already takes
    (finetune.data.images.processor_of reads it back)."""
    from transformers import AutoProcessor

    try:
        import PIL  # noqa: F401  (images are read with it; transformers' image processors take PIL images)
    except ImportError:
        raise ModelError(
            f"model.path: '{source}' is a vision-language model, and reading its images needs Pillow, which is not installed",
            hint="pip install 'finetune[vision]'",
        ) from None
    try:
        processor = AutoProcessor.from_pretrained(source, revision=revision, trust_remote_code=trust_remote_code)
    except ImportError as exc:
        raise ModelError(
            f"model.path: the processor of '{source}' needs a package that is not installed: {str(exc).strip().splitlines()[0]}",
            hint="install it (Qwen2-VL's processor needs torchvision: pip install torchvision matching your torch)",
        ) from None
    except Exception as exc:  # transformers raises many types for a folder without a processor
        raise ModelError(
            f"model.path: '{source}' is a vision-language model, but its processor could not be loaded: "
            f"{str(exc).splitlines()[0]}",
            hint="the folder needs the processor's files (preprocessor_config.json, processor_config.json, tokenizer)",
        ) from None
    if getattr(processor, "image_token", None) is None or not hasattr(processor, "image_processor"):
        raise ModelError(
            f"model.path: the processor of '{source}' ({type(processor).__name__}) has no image token or image processor",
            hint="this vision-language family is not supported yet; README's vision section lists those that are",
        )
    if max_pixels is not None:
        limit_pixels(processor, max_pixels)
    processor.tokenizer = tokenizer  # one tokenizer: the pad token and chat template the run sets are the processor's
    tokenizer.finetune_processor = processor
