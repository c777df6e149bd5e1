"""Tiny random-init vision-language models with their processors, built here from each family's config shape.

    path = build_vlm("llava", tmp_path / "llava")         # model + processor (tokenizer, image processor, template)
    write_images(tmp_path, 3)                               # img0.png ... small RGB pictures of different sizes

The tokenizer is the bundled tiny Llama's (byte-level BPE) with each family's image tokens added; the
chat templates are the families' own (tests/fixtures/chat_templates). Nothing touches the network.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from finetune.config.files import resolve_path

TEMPLATES = Path(__file__).parent / "fixtures" / "chat_templates"
TINY_TEXT = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
FAMILIES = ("llava", "gemma3", "idefics3")


def _tokenizer(special: list[str], named: dict[str, str] | None = None, eos: str | None = None):
    from transformers import AutoTokenizer

    # extra_special_tokens: named ones (boi_token, ...) get their attributes and ids, as Gemma 3's processor reads them.
    tok = AutoTokenizer.from_pretrained(resolve_path("asset:tiny-llama"), extra_special_tokens=named or {})
    tok.add_special_tokens({"additional_special_tokens": special})
    if eos is not None:  # Idefics3's ends turns with <end_of_utterance>, its eos
        tok.eos_token = eos
    return tok


def _ids(tok, tokens: list[str]) -> list[int]:
    return tok.convert_tokens_to_ids(tokens)


def _text(tok, **extra) -> dict:
    return dict(
        TINY_TEXT,
        vocab_size=len(tok),
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        max_position_embeddings=2048,
        **extra,
    )


def _qwen2_vl():
    from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration, Qwen2VLImageProcessorPil, Qwen2VLProcessor

    tok = _tokenizer(["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"])
    vs, ve, img, vid = _ids(tok, ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"])
    rope = {"rope_type": "default", "mrope_section": [2, 3, 3], "rope_theta": 10000.0}
    cfg = Qwen2VLConfig(
        text_config=_text(tok, rope_parameters=rope),
        vision_config=dict(
            depth=1,
            embed_dim=32,
            hidden_size=64,
            num_heads=2,
            mlp_ratio=2,
            patch_size=14,
            spatial_merge_size=2,
            temporal_patch_size=2,
            in_channels=3,
        ),
        vision_start_token_id=vs,
        vision_end_token_id=ve,
        image_token_id=img,
        video_token_id=vid,
    )
    images = Qwen2VLImageProcessorPil(min_pixels=28 * 28 * 2, max_pixels=28 * 28 * 8, patch_size=14, merge_size=2)
    processor = Qwen2VLProcessor(image_processor=images, tokenizer=tok, chat_template=(TEMPLATES / "qwen2-vl.jinja").read_text())
    return Qwen2VLForConditionalGeneration(cfg), processor


def _llava():
    from transformers import CLIPImageProcessor, LlavaConfig, LlavaForConditionalGeneration, LlavaProcessor

    tok = _tokenizer(["<image>"])
    cfg = LlavaConfig(
        vision_config=dict(
            model_type="clip_vision_model",
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=1,
            num_attention_heads=2,
            image_size=28,
            patch_size=14,
            projection_dim=32,
        ),
        text_config=dict(_text(tok), model_type="llama"),
        image_token_index=_ids(tok, ["<image>"])[0],
        vision_feature_layer=-1,
        vision_feature_select_strategy="default",
    )
    images = CLIPImageProcessor(size={"shortest_edge": 28}, crop_size={"height": 28, "width": 28})
    processor = LlavaProcessor(
        image_processor=images,
        tokenizer=tok,
        patch_size=14,
        vision_feature_select_strategy="default",
        num_additional_image_tokens=1,
        chat_template=(TEMPLATES / "llava-1.5.jinja").read_text(),
    )
    return LlavaForConditionalGeneration(cfg), processor


def _gemma3():
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration, Gemma3ImageProcessorPil, Gemma3Processor

    named = {"boi_token": "<start_of_image>", "eoi_token": "<end_of_image>", "image_token": "<image_soft_token>"}
    tok = _tokenizer(["<start_of_turn>", "<end_of_turn>"], named)
    boi, eoi, img = _ids(tok, list(named.values()))
    cfg = Gemma3Config(
        text_config=_text(tok, head_dim=16, sliding_window=64, query_pre_attn_scalar=16),
        vision_config=dict(
            hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=28, patch_size=14
        ),
        mm_tokens_per_image=4,
        boi_token_index=boi,
        eoi_token_index=eoi,
        image_token_index=img,
    )
    images = Gemma3ImageProcessorPil(size={"height": 28, "width": 28})
    processor = Gemma3Processor(
        image_processor=images, tokenizer=tok, image_seq_length=4, chat_template=(TEMPLATES / "gemma-3.jinja").read_text()
    )
    return Gemma3ForConditionalGeneration(cfg), processor


def _idefics3():
    from transformers import Idefics3Config, Idefics3ForConditionalGeneration, Idefics3ImageProcessorPil, Idefics3Processor

    tok = _tokenizer(["<fake_token_around_image>", "<image>", "<global-img>", "<end_of_utterance>"], eos="<end_of_utterance>")
    cfg = Idefics3Config(
        vision_config=dict(
            hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=28, patch_size=14
        ),
        text_config=dict(_text(tok), model_type="llama"),
        scale_factor=2,
        image_token_id=_ids(tok, ["<image>"])[0],
    )
    images = Idefics3ImageProcessorPil(size={"longest_edge": 56}, max_image_size={"longest_edge": 28})
    processor = Idefics3Processor(
        image_processor=images, tokenizer=tok, image_seq_len=1, chat_template=(TEMPLATES / "idefics3.jinja").read_text()
    )
    return Idefics3ForConditionalGeneration(cfg), processor


BUILDERS = {"llava": _llava, "gemma3": _gemma3, "idefics3": _idefics3}


def build_qwen2_vl(out: Path, monkeypatch, seed: int = 0) -> Path:
    """Qwen2-VL, whose processor transformers 5.24 builds only with torchvision installed (it checks the video
    processor's class, VideoProcessorMixin, exported only with torchvision, even when there is none), and
    torchvision has no CPU wheel for this torch. So the processor is built here, without a video processor
    (no video is ever processed), and AutoProcessor hands it out for this folder: the rest of the path
    (its image tokens, grids, 3-D rotary positions, training, peft) is the real one."""
    import transformers

    monkeypatch.setattr(transformers, "VideoProcessorMixin", type(None), raising=False)
    torch.manual_seed(seed)
    model, processor = _qwen2_vl()
    # Saved as the processor would be without its (absent) video processor: finetune saves it with an adapter.
    attributes = [a for a in processor.get_attributes() if a != "video_processor"]
    processor.get_attributes = lambda: attributes
    model.save_pretrained(out)
    processor.tokenizer.save_pretrained(out)
    real = transformers.AutoProcessor.from_pretrained

    def from_pretrained(source, *args, **kwargs):
        return processor if Path(source) == out else real(source, *args, **kwargs)

    monkeypatch.setattr(transformers.AutoProcessor, "from_pretrained", from_pretrained)
    return out


def build_vlm(family: str, out: Path, seed: int = 0) -> Path:
    """A tiny random-init model of `family` and its processor saved in `out` (as a hub folder would hold them)."""
    torch.manual_seed(seed)
    model, processor = BUILDERS[family]()
    model.save_pretrained(out)
    processor.tokenizer.save_pretrained(out)
    processor.image_processor.save_pretrained(out)
    # processor.save_pretrained would also save the (absent) video processor; the rest is what it writes.
    kwargs = {
        k: getattr(processor, k)
        for k in (
            "image_seq_length",
            "image_seq_len",
            "patch_size",
            "vision_feature_select_strategy",
            "num_additional_image_tokens",
        )
        if hasattr(processor, k)
    }
    (out / "processor_config.json").write_text(json.dumps({"processor_class": type(processor).__name__, **kwargs}))
    (out / "chat_template.jinja").write_text(processor.chat_template)
    return out


def write_images(folder: Path, n: int, sizes: tuple[tuple[int, int], ...] = ((40, 30), (28, 56), (64, 64))) -> list[Path]:
    """n small RGB pictures (different sizes, deterministic pixels) as PNG files in folder: img0.png, img1.png, ..."""
    from PIL import Image

    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for i in range(n):
        w, h = sizes[i % len(sizes)]
        g = torch.Generator().manual_seed(i)
        pixels = torch.randint(0, 256, (h, w, 3), generator=g, dtype=torch.uint8).numpy()
        paths.append(folder / f"img{i}.png")
        Image.fromarray(pixels).save(paths[-1])
    return paths
