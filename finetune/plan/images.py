"""What a vision-language model's images cost a step: how many tokens one image is, the pixel values a
micro-batch carries, and the vision tower's forward over them (frozen: nothing kept for backward, one
block's tensors at a time; adapted through lora.target: each block's input, or all its tensors).

The worst micro-batch is planned, as for text: every row full, here of images at data.max_pixels (or the
processor's own size), as many whole images as data.max_seq_len holds. The unit the tower encodes at
once is an image (Qwen2-VL, LLaVA, Gemma 3) or a tile of one (Idefics3: an image is split in tiles).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# Qwen2-VL / Qwen2.5-VL's published preprocessor_config.json (max_pixels): the processor's own bound when neither
# data.max_pixels nor a local preprocessor_config.json gives one. 16384 image tokens of 28 x 28 pixels.
QWEN_VL_MAX_PIXELS = 12845056
PIXEL_BYTES = 4  # processors return fp32 pixel values; the tower casts them to the compute dtype


@dataclass(frozen=True)
class VisionShape:
    """A vision tower as the plan needs it, from config.json's vision_config."""

    layers: int
    hidden: int
    intermediate: int
    patch: int  # pixels along a patch's side
    values_per_patch: int  # numbers one patch carries in: channels x patch^2 (x frames, Qwen2-VL)
    merge: int  # tower positions per language-model token (Qwen2-VL's 2 x 2 merge; Gemma 3's 4 x 4 pooling)
    fixed_tokens: int = 0  # a fixed-size tower's tokens per image or tile; 0: sized by area (max_pixels)
    extra_positions: int = 0  # a class token the tower adds to each image (CLIP: 1), dropped before the projector
    keeps_hidden_states: bool = False  # LLaVA reads an inner layer (vision_feature_layer): every layer's output kept
    gated: bool = False  # a gated MLP (Qwen2.5-VL: gate, up and their product alive at once)

    def tokens_per_image(self, max_pixels: int | None) -> int:
        """Language-model tokens of one image (or tile) at its largest."""
        if self.fixed_tokens:
            return self.fixed_tokens
        return (max_pixels or QWEN_VL_MAX_PIXELS) // (self.patch * self.patch * self.merge)

    def positions_per_image(self, max_pixels: int | None) -> int:
        return self.tokens_per_image(max_pixels) * self.merge + self.extra_positions


def vision_shape(config: Any, gated: bool = False) -> VisionShape | None:
    """The vision tower of a vision-language config (None: none, or one whose geometry is not known here);
    gated: its MLP has a gate projection (read off the model's modules: configs do not say)."""
    v = getattr(config, "vision_config", None)
    if v is None or not getattr(v, "patch_size", None):
        return None
    patch = int(v.patch_size)
    hidden = int(getattr(v, "embed_dim", None) or v.hidden_size)  # Qwen2-VL: embed_dim (hidden_size is its output)
    intermediate = int(getattr(v, "intermediate_size", None) or hidden * getattr(v, "mlp_ratio", 4))
    layers = int(getattr(v, "depth", None) or v.num_hidden_layers)
    channels = int(getattr(v, "in_chans", None) or getattr(v, "in_channels", None) or getattr(v, "num_channels", None) or 3)
    merge = getattr(v, "spatial_merge_size", None)
    if merge:  # Qwen2-VL family: sized by area, 2 x 2 patches merged into a token, 2 frames per patch
        frames = int(getattr(v, "temporal_patch_size", 1) or 1)
        values = channels * patch * patch * frames
        return VisionShape(layers, hidden, intermediate, patch, values, int(merge) ** 2, gated=gated)
    if not getattr(v, "image_size", None):
        return None
    positions = (int(v.image_size) // patch) ** 2
    scale = getattr(config, "scale_factor", None)  # Idefics3: pixel shuffle of scale x scale positions into a token
    tokens = getattr(config, "mm_tokens_per_image", None) or (positions // int(scale) ** 2 if scale else positions)
    return VisionShape(
        layers,
        hidden,
        intermediate,
        patch,
        values_per_patch=channels * patch * patch,
        merge=max(positions // int(tokens), 1),
        fixed_tokens=int(tokens),
        extra_positions=1 if getattr(v, "model_type", "") == "clip_vision_model" else 0,
        keeps_hidden_states=getattr(config, "vision_feature_layer", None) is not None,
        gated=gated,
    )


def processor_max_pixels(source: str) -> int | None:
    """max_pixels of a local model folder's preprocessor_config.json (Qwen2-VL family), else None."""
    path = Path(source) / "preprocessor_config.json"
    if not path.is_file():
        return None
    data = json.loads(path.read_text(encoding="utf-8"))
    size = data.get("size") or {}
    value = data.get("max_pixels") or (size.get("longest_edge") if isinstance(size, dict) else None)
    return int(value) if value else None


@dataclass(frozen=True)
class ImageTerms:
    """A micro-batch's images at their most (bytes on the GPU; counts for the plan's note)."""

    tokens_per_image: int
    images: int  # images (or tiles) in the micro-batch
    positions: int  # what the tower encodes: every image's patches
    pixels: int  # the pixel values, held from the batch's arrival to the step's end
    forward: int  # the tower's forward at its largest: one block's tensors (frozen) over every image
    saved: int  # kept for backward: 0 when frozen (lora.target adds vision_tower: its activations)


def image_terms(
    vision: VisionShape | None,
    max_pixels: int | None,
    rows: int,
    seq_len: int,
    compute_bytes: int,
    adapted: bool,
    checkpointed: bool,
) -> ImageTerms | None:
    """The images of `rows` rows of seq_len tokens, each holding as many whole images as fit. adapted: LoRA in the
    tower (its blocks' activations kept for backward: each block's input when checkpointed, else all its tensors)."""
    if vision is None:
        return None
    v, b = vision, compute_bytes
    tokens = v.tokens_per_image(max_pixels)
    images = rows * (seq_len // tokens)  # 0 when one image is longer than a row: every example with one is dropped
    positions = images * v.positions_per_image(max_pixels)
    pixels = positions * v.values_per_patch * PIXEL_BYTES
    # One block's tensors alive at once, per position: 8 hidden widths (input, residual, norm, q, k, v, rotated or
    # split copies; sdpa's kernels keep no scores) and the MLP's 2 intermediate ones (3 gated). Measured on the CPU
    # in fp32 (tests/test_plan_images.py): 0.75-0.97 of this for Qwen2-VL, Qwen2.5-VL, CLIP and SigLIP towers.
    block = positions * (8 * v.hidden + (3 if v.gated else 2) * v.intermediate) * b
    cast = positions * v.values_per_patch * b if b != PIXEL_BYTES else 0  # the pixel values in the compute dtype
    kept = (v.layers + 1) * positions * v.hidden * b if v.keeps_hidden_states else 0  # embeddings + every block's
    forward = block + cast + kept
    per_block = v.hidden if checkpointed else 8 * v.hidden + 4 * v.intermediate  # attention's 8 widths + the MLP's 4
    saved = v.layers * positions * per_block * b if adapted else 0
    return ImageTerms(tokens, images, positions, pixels, forward, saved)


def image_components(img: ImageTerms, phase: str) -> list[tuple[str, str, int, bool]]:
    """(key, label, bytes, in the peak) of the estimate's image terms; phase: the step's peak one."""
    return [
        ("pixel_values", f"pixel values ({img.images} images, {img.positions} patches)", img.pixels, True),
        ("vision_activations", "vision tower activations (LoRA in it)", img.saved, phase != "sampling"),
        ("vision_forward", "vision tower forward (one block over every image)", img.forward, phase == "vision"),
    ]


def image_note(img: ImageTerms, seq_len: int, max_pixels: int | None) -> str:
    """What one image costs, and the warning when none fits a row."""
    size = f"data.max_pixels {max_pixels}" if max_pixels else "its processor's size"
    if img.images == 0:
        return (
            f"one image is up to {img.tokens_per_image} tokens at {size}, more than data.max_seq_len {seq_len}: an example "
            "with such an image is dropped as too long (raise data.max_seq_len or lower data.max_pixels)"
        )
    return (
        f"images: up to {img.tokens_per_image} tokens each at {size}; planned as rows full of them "
        f"({img.images} a micro-batch, {img.positions} patches through the vision tower)"
    )
