"""The planner's image terms for vision-language models (finetune/plan/images.py): tokens per image as each
family's processor and vision tower give them, and the pixel values and vision-tower forward of a step."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from vlm_models import build_qwen2_vl, build_vlm

from finetune.config.schema import load_recipe
from finetune.gpus import find_gpu
from finetune.plan import plan_recipe, read_model_shape

QWEN25_VL = Path(__file__).parent / "fixtures" / "configs" / "qwen2.5-vl-7b"
RECIPE = Path(__file__).parents[1] / "recipes" / "qlora-vlm-1x24gb.yaml"


def image_prompt(processor, image) -> dict:
    text = processor.apply_chat_template(
        [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "hi"}]}], add_generation_prompt=True
    )
    return processor(text=[text], images=[[image]], return_tensors="pt")


@pytest.mark.parametrize("family", ["llava", "gemma3", "idefics3"])
def test_a_fixed_size_towers_tokens_and_positions_are_the_processors_and_the_towers(family, tmp_path):
    from PIL import Image
    from transformers import AutoModelForImageTextToText, AutoProcessor

    folder = build_vlm(family, tmp_path / family)
    tower = read_model_shape(str(folder)).tower
    assert tower is not None and tower.fixed_tokens
    processor = AutoProcessor.from_pretrained(folder)
    batch = image_prompt(processor, Image.new("RGB", (64, 48), (200, 10, 10)))
    pixels = batch["pixel_values"].reshape(-1, 3, *batch["pixel_values"].shape[-2:])  # images or tiles
    model = AutoModelForImageTextToText.from_pretrained(folder)
    image_id = getattr(model.config, "image_token_id", None) or model.config.image_token_index
    assert int((batch["input_ids"] == image_id).sum()) == tower.tokens_per_image(None) * len(pixels)
    assert pixels[0].numel() == (tower.positions_per_image(None) - tower.extra_positions) * tower.values_per_patch
    encoder = getattr(model.model, "vision_tower", None) or model.model.vision_model
    with torch.no_grad():
        encoded = encoder(pixel_values=pixels).last_hidden_state
    assert encoded.shape[1] == tower.positions_per_image(None)  # what one block of the tower runs over, per image
    assert encoded.shape[2] == tower.hidden


def test_an_area_sized_towers_tokens_follow_max_pixels(tmp_path, monkeypatch):
    from PIL import Image

    folder = build_qwen2_vl(tmp_path / "qwen2-vl", monkeypatch)
    from transformers import AutoModelForImageTextToText, AutoProcessor

    tower = read_model_shape(str(folder)).tower
    processor = AutoProcessor.from_pretrained(folder)
    max_pixels = processor.image_processor.size["longest_edge"]  # 28 x 28 x 8: 8 tokens at most
    assert tower is not None and tower.tokens_per_image(max_pixels) == 8 and tower.positions_per_image(max_pixels) == 32
    batch = image_prompt(processor, Image.new("RGB", (112, 56), (0, 90, 200)))  # exactly max_pixels: 4 x 8 patches
    image_id = processor.tokenizer.convert_tokens_to_ids("<|image_pad|>")
    assert int((batch["input_ids"] == image_id).sum()) == 8
    assert tuple(batch["pixel_values"].shape) == (32, tower.values_per_patch)
    model = AutoModelForImageTextToText.from_pretrained(folder)
    with torch.no_grad():
        out = model.model.visual(batch["pixel_values"], grid_thw=batch["image_grid_thw"])
    merged = out.pooler_output if hasattr(out, "pooler_output") else out
    assert merged.shape[0] == 8


def vlm_plan(*overrides: str):
    cfg = load_recipe(str(RECIPE), [f"model.path={QWEN25_VL}", *overrides])
    return plan_recipe(cfg, find_gpu("rtx4090"), gpus=1)


def test_a_vlm_step_plans_its_pixels_and_the_vision_towers_forward():
    e = vlm_plan()  # batch 2 x seq 2048, max_pixels 802816: 1024 tokens, 4096 patches of 2 x 3 x 14 x 14 values an image
    images, patches = 2 * 2, 2 * 2 * 4096
    assert e.component("pixel_values") == patches * 1176 * 4  # fp32, held for the step
    # one block over every image (bf16): 8 hidden widths and the gated MLP's 3 intermediate ones; the pixels cast
    assert e.component("vision_forward") == patches * (8 * 1280 + 3 * 3420) * 2 + patches * 1176 * 2
    assert e.component("vision_activations") == 0  # frozen: nothing kept for backward
    note = f"up to 1024 tokens each at data.max_pixels 802816; planned as rows full of them ({images} a micro-batch"
    assert any(note in n for n in e.notes)
    assert e.peak_phase == "backward" and "pixel_values" in e.to_dict()["in_peak"]
    longer = vlm_plan("data.max_seq_len=4096")
    assert longer.component("pixel_values") == 2 * e.component("pixel_values")


def test_lora_in_the_vision_tower_keeps_its_activations():
    e = vlm_plan("lora.target=[q_proj,v_proj,vision_tower]")
    assert e.component("vision_activations") == 32 * 16384 * 1280 * 2  # each checkpointed block's input
    unchecked = vlm_plan("lora.target=[q_proj,v_proj,vision_tower]", "memory.activation_checkpointing=none")
    assert unchecked.component("vision_activations") == 32 * 16384 * (8 * 1280 + 4 * 3420) * 2


def test_an_image_longer_than_a_row_is_said_to_drop_its_examples():
    e = vlm_plan("data.max_pixels=null")  # the processor's own: 16384 tokens an image, over 2048
    assert e.component("pixel_values") == 0 and e.component("vision_forward") == 0
    assert any("one image is up to 16384 tokens at its processor's size, more than data.max_seq_len 2048" in n for n in e.notes)


def test_a_text_only_model_has_no_image_terms(tiny_model_dir):
    assert read_model_shape(str(tiny_model_dir)).tower is None


TEXT = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 2}
QWEN_TEXT = {
    **TEXT,
    "vocab_size": 300,
    "rope_parameters": {"rope_type": "default", "mrope_section": [2, 3, 3], "rope_theta": 1e4},
}
AREA = {"patch_size": 14, "spatial_merge_size": 2, "temporal_patch_size": 2, "in_channels": 3}
FIXED = {"hidden_size": 128, "intermediate_size": 512, "num_hidden_layers": 2, "num_attention_heads": 4, "image_size": 224}
TOWERS = {  # 4 images of 16 x 16 patches, width 128, MLP 512, 2 blocks
    "qwen2_vl": ("Qwen2VL", {"depth": 2, "embed_dim": 128, "hidden_size": 64, "num_heads": 4, "mlp_ratio": 4, **AREA}, {}),
    "qwen2_5_vl": (
        "Qwen2_5_VL",
        {"depth": 2, "hidden_size": 128, "intermediate_size": 512, "num_heads": 4, "out_hidden_size": 64, **AREA},
        {},
    ),
    "llava": (
        "Llava",
        {"model_type": "clip_vision_model", "patch_size": 14, "projection_dim": 64, **FIXED},
        {"vision_feature_layer": -2},
    ),
    "gemma3": ("Gemma3", {"patch_size": 14, **FIXED}, {"mm_tokens_per_image": 64}),
}


@pytest.mark.parametrize("family", sorted(TOWERS))
def test_the_planned_vision_forward_bounds_the_measured_one(family):
    """The tower's forward over a micro-batch's images, measured as in tests/test_plan_measured.py (every op's
    output storage while alive), in fp32: at most the plan, and not far under it."""
    import transformers
    from test_plan_measured import LiveBytes

    from finetune.plan.images import image_terms, vision_shape

    prefix, vision, own = TOWERS[family]
    text = QWEN_TEXT if family.startswith("qwen") else {**TEXT, "vocab_size": 300, "head_dim": 16}
    config = getattr(transformers, f"{prefix}Config")(
        text_config={**text, "model_type": "llama"} if family == "llava" else text, vision_config=vision, **own
    )
    torch.manual_seed(0)
    model = getattr(transformers, f"{prefix}ForConditionalGeneration")(config).eval()
    gated = any(n.endswith("gate_proj") for n, _ in model.model.named_modules() if "visual" in n)
    tower = vision_shape(config, gated=gated)
    assert tower is not None and tower.gated == (family == "qwen2_5_vl")
    if family.startswith("qwen"):
        pixels, grid = torch.randn(4 * 256, tower.values_per_patch), torch.tensor([[1, 16, 16]] * 4)
        max_pixels = 256 * 14 * 14

        def run():
            return model.model.visual(pixels, grid_thw=grid)
    else:
        pixels, max_pixels = torch.randn(4, 3, 224, 224), None

        def run():
            return model.model.get_image_features(pixel_values=pixels)

    planned = image_terms(tower, max_pixels, 1, 4 * tower.tokens_per_image(max_pixels), 4, adapted=False, checkpointed=True)
    assert planned.images == 4 and planned.positions == 4 * tower.positions_per_image(max_pixels)
    with torch.no_grad():
        live = LiveBytes(existing=[*model.parameters(), *model.buffers(), pixels])
        with live:
            run()
    assert 0.7 * planned.forward <= live.peak <= planned.forward, (live.peak, planned.forward)
