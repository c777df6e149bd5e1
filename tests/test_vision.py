"""Vision-language models: masks that never train an image token, QLoRA of LLaVA / Gemma 3 / Idefics3, merges.

Tiny random-init models built here (tests/vlm_models.py) with each family's own chat template; records with
0, 1 and 2 images of different sizes. Qwen2-VL is not here: transformers cannot build its processor without
torchvision, which has no CPU wheel for this torch (tests/vlm_models.py).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from conftest import straight_and_resumed, training_kernel_only, write_jsonl
from vlm_models import build_vlm, write_images

from finetune.config.schema import build_recipe
from finetune.data import IGNORE_INDEX, Collator, build_datasets
from finetune.data.show import marked_text
from finetune.errors import DataError
from finetune.model.load import load_tokenizer


def conversation(i: int, images: int) -> dict:
    content = [{"type": "image", "path": f"img/img{(i + k) % 3}.png"} for k in range(images)]
    return {
        "messages": [
            {"role": "user", "content": [*content, {"type": "text", "text": f"What is in picture {i}?"}]},
            {"role": "assistant", "content": f"A pattern, number {i}."},
        ]
    }


@pytest.fixture(scope="module")
def vision_data(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("vision_data")
    write_images(folder / "img", 3)
    return write_jsonl(folder / "train.jsonl", [conversation(i, i % 3) for i in range(8)])


@pytest.fixture(scope="module")
def families(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("vlms")
    return {f: build_vlm(f, root / f) for f in ("llava", "gemma3", "idefics3")}


def recipe(model: Path, data_file: Path, out: Path, **over) -> dict:
    r = {
        "model": {"path": str(model)},
        "data": {"path": str(data_file), "format": "messages", "max_seq_len": 512, "cache": False},
        "output_dir": str(out),
        "seed": 0,
        "precision": "fp32",
        "quant": {"bits": 4},
        "lora": {"r": 4, "alpha": 8, "dropout": 0.0},
        "train": {"max_steps": 3, "batch_size": 4, "lr": 1e-2},
        "memory": {"activation_checkpointing": "none"},
        "report": {"plot": False},
    }
    for key, value in over.items():
        r[key] = {**r.get(key, {}), **value} if isinstance(value, dict) else value
    return r


def test_two_image_conversation_golden_mask(families, vision_data, tmp_path):
    """LLaVA renders 'USER: <image>\\n<image>\\nWhat ... ASSISTANT: A pattern ...</s>'; each <image> becomes the
    4 tokens of a 28x28 image's 2x2 patches. Only the reply and its eos are trained."""
    cfg = build_recipe(recipe(families["llava"], vision_data, tmp_path / "run"))
    tok = load_tokenizer(cfg)
    train = build_datasets(cfg, tok).train
    ex = train[2]  # two images
    image = tok.convert_tokens_to_ids("<image>")
    assert ex["input_ids"].count(image) == 8
    assert ex["images"] == [str(vision_data.parent / "img" / "img2.png"), str(vision_data.parent / "img" / "img0.png")]
    trained = [t for t, label in zip(ex["input_ids"], ex["labels"]) if label != IGNORE_INDEX]
    assert tok.decode(trained) == " A pattern, number 2.</s>"
    first = ex["labels"].index(next(label for label in ex["labels"] if label != IGNORE_INDEX))
    assert tok.decode(ex["input_ids"][:first]).endswith("What is in picture 2? ASSISTANT:")
    assert all(label == IGNORE_INDEX for t, label in zip(ex["input_ids"], ex["labels"]) if t == image)
    # `finetune data` shows it with each image's tokens folded (Qwen2-VL's are hundreds).
    shown = "<s>USER: <image>x4\n<image>x4\nWhat is in picture 2? ASSISTANT:[[ A pattern, number 2.</s>]]"
    assert marked_text(tok, ex["input_ids"], ex["labels"], color=False) == shown
    # The collated batch carries each row's pixels, in order: rows with 0, 1 and 2 images.
    batch = Collator.for_tokenizer(tok)([train[0], train[1], train[2]])
    assert batch["pixel_values"].shape == (3, 3, 28, 28)
    assert batch["input_ids"].eq(image).sum() == 12


def test_train_on_all_still_leaves_image_tokens_untrained(families, vision_data, tmp_path):
    cfg = build_recipe(recipe(families["gemma3"], vision_data, tmp_path / "run", data={"train_on": "all"}))
    tok = load_tokenizer(cfg)
    ex = build_datasets(cfg, tok).train[1]
    soft = tok.convert_tokens_to_ids("<image_soft_token>")
    assert ex["input_ids"].count(soft) == 4
    assert [label for t, label in zip(ex["input_ids"], ex["labels"]) if t == soft] == [IGNORE_INDEX] * 4
    assert sum(label != IGNORE_INDEX for label in ex["labels"]) == len(ex["labels"]) - 4 - 1  # all but images and BOS


def bad_data(tmp_path: Path, record: dict) -> Path:
    write_images(tmp_path / "img", 1)
    return write_jsonl(tmp_path / "bad.jsonl", [conversation(0, 1), record])


@pytest.mark.parametrize(
    ("record", "expected"),
    [
        (
            conversation(5, 0)
            | {
                "messages": [
                    {"role": "user", "content": [{"type": "image", "path": "img/gone.png"}]},
                    {"role": "assistant", "content": "x"},
                ]
            },
            "img/gone.png' cannot be read",
        ),
        (
            {
                "messages": [
                    {
                        "role": "user",
                        "content": [
                            {"type": "image", "path": "img/img0.png"},
                            {"type": "text", "text": "an <image> typed in the text"},
                        ],
                    },
                    {"role": "assistant", "content": "x"},
                ]
            },
            "has 1 image(s) but the chat template renders 2",
        ),
        (
            {
                "messages": [
                    {"role": "user", "content": "hi"},
                    {"role": "assistant", "content": [{"type": "image", "path": "img/img0.png"}]},
                ]
            },
            "assistant reply with an image",
        ),
        (
            {"messages": [{"role": "user", "content": [{"type": "image"}]}, {"role": "assistant", "content": "x"}]},
            "has no 'path'",
        ),
    ],
    ids=["missing-image", "more-placeholders-than-images", "image-in-a-reply", "image-without-path"],
)
def test_bad_image_records_name_the_record(families, tmp_path, record, expected):
    cfg = build_recipe(recipe(families["llava"], bad_data(tmp_path, record), tmp_path / "run"))
    with pytest.raises(DataError) as err:
        build_datasets(cfg, load_tokenizer(cfg))
    assert expected in str(err.value) and "line 2" in str(err.value)


def test_an_image_for_a_text_only_model_is_refused(tiny_model_dir, tmp_path):
    cfg = build_recipe(recipe(tiny_model_dir, bad_data(tmp_path, conversation(1, 1)), tmp_path / "run"))
    with pytest.raises(DataError, match="line 1: the record has 1 image.*text-only"):
        build_datasets(cfg, load_tokenizer(cfg))


def test_packing_is_refused_for_a_vision_language_model(families, vision_data, tmp_path):
    cfg = build_recipe(recipe(families["llava"], vision_data, tmp_path / "run", data={"packing": True}))
    with pytest.raises(DataError, match="data.packing=true with a vision-language model"):
        build_datasets(cfg, load_tokenizer(cfg))


def trained(model_dir: Path, data: Path, out: Path, **over):
    from finetune.trainer import Trainer

    trainer = Trainer(build_recipe(recipe(model_dir, data, out, **over)), progress=False)
    trainer.train()
    return trainer


@pytest.mark.parametrize("family", ["llava", "gemma3", "idefics3"])
def test_qlora_trains_the_language_model_only_and_loads_in_vanilla_peft(families, vision_data, tmp_path, family):
    from peft import PeftModel
    from transformers import AutoModelForImageTextToText

    trainer = trained(families[family], vision_data, tmp_path / "run")
    model = trainer.accelerator.unwrap_model(trainer.model).eval()
    quantized = {n for n, m in model.named_modules() if type(m).__name__ == "Linear4bit"}
    adapted = {n.split(".lora_A")[0] for n, _ in model.named_parameters() if ".lora_A." in n}
    assert quantized and all(".language_model." in n or ".text_model." in n for n in quantized)  # vision side: fp32
    assert adapted and all(".language_model." in n or ".text_model." in n for n in adapted)
    losses = [
        json.loads(line)["loss"]
        for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
        if '"loss"' in line and '"step"' in line
    ]
    assert len(losses) == 3 and losses[-1] < losses[0]
    # The adapter in plain peft on the 4-bit base gives our logits on a batch with images.
    batch = Collator.for_tokenizer(trainer.tokenizer)([trainer.data.train[i] for i in range(3)])
    inputs = {k: v for k, v in batch.items() if k != "labels"}
    with torch.no_grad():
        ours = model(**inputs).logits
    from transformers import BitsAndBytesConfig

    from finetune.model import vision

    skip = vision.not_quantized(model.config, "compute")
    bnb = BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type="nf4",
        bnb_4bit_use_double_quant=True,
        bnb_4bit_compute_dtype=torch.float32,
        llm_int8_skip_modules=skip,
    )
    base = AutoModelForImageTextToText.from_pretrained(families[family], dtype=torch.float32, quantization_config=bnb)
    training_kernel_only(base)  # bitsandbytes' eval-only bf16 repack on some CPUs (conftest says why)
    with torch.no_grad():
        plain = base.eval()(**inputs).logits
    theirs_model = PeftModel.from_pretrained(base, str(tmp_path / "run" / "adapter")).eval()
    with torch.no_grad():
        theirs = theirs_model(**inputs).logits
    assert (ours - theirs).abs().max() < 1e-5
    assert (ours - plain).abs().max() > 1e-3  # the adapter moved them: the check above can fail


def test_lora_on_a_projector_with_no_linear_layer_is_refused_not_ignored(families, vision_data, tmp_path):
    from finetune.errors import ModelError

    # Gemma 3's projector is a bare weight matrix and a norm: peft would adapt nothing there, silently.
    with pytest.raises(ModelError, match=r"lists \['projector'\], but Gemma3ForConditionalGeneration has no linear layer"):
        trained(families["gemma3"], vision_data, tmp_path / "run", lora={"target": ["q_proj", "projector"]})


@pytest.mark.parametrize(
    "distributed, message",
    [
        ({"strategy": "deepspeed", "zero_stage": 3}, "zero_stage=3 and a vision-language model: a rank whose micro-batch"),
        ({"tensor_parallel": 2}, "distributed.tensor_parallel=2: not supported for vision-language models yet"),
    ],
)
def test_what_a_vlm_cannot_launch_with_is_refused_before_any_process_starts(
    families, vision_data, tmp_path, monkeypatch, capsys, distributed, message
):
    import yaml

    from finetune.cli import commands as cli

    path = tmp_path / "r.yaml"
    path.write_text(yaml.safe_dump(recipe(families["gemma3"], vision_data, tmp_path / "run", distributed=distributed)))
    monkeypatch.setattr(cli, "run_launcher", lambda *a: pytest.fail("launched"))
    assert cli.main(["run", str(path), "--nproc", "2"]) == 2
    assert message in capsys.readouterr().err


def test_zero_bucket_sizes_come_from_a_vlms_text_config(families, tiny_model_dir):
    # accelerate fills ZeRO's "auto" sizes from model.config.hidden_size, which a VLM's config lacks: it stopped
    # there (ValueError) under ZeRO-2 and 3. Filled from the text config's, ZeRO-2 trained as one process did.
    from types import SimpleNamespace

    from transformers import AutoConfig

    from finetune.declarations import zero_config

    def filled(config) -> dict:
        zero = {"stage": 3, **dict.fromkeys(("reduce_bucket_size", "stage3_prefetch_bucket_size"), "auto")}
        zero["stage3_param_persistence_threshold"] = "auto"
        plugin = SimpleNamespace(hf_ds_config=SimpleNamespace(config={"zero_optimization": zero}))
        zero_config.fill_sizes(plugin, SimpleNamespace(config=config))
        return zero

    config = AutoConfig.from_pretrained(families["gemma3"])
    h = config.get_text_config().hidden_size
    assert getattr(config, "hidden_size", None) is None
    assert filled(config) == {
        "stage": 3,
        "reduce_bucket_size": h * h,
        "stage3_prefetch_bucket_size": int(0.9 * h * h),
        "stage3_param_persistence_threshold": 10 * h,
    }
    assert filled(AutoConfig.from_pretrained(tiny_model_dir))["reduce_bucket_size"] == "auto"  # accelerate's to fill


def test_merged_vlm_loads_as_its_class_with_its_processor(families, vision_data, tmp_path):
    from transformers import AutoModelForImageTextToText, AutoProcessor

    from finetune.export.run import export_run

    trained(families["llava"], vision_data, tmp_path / "run")  # its checkpoint keeps the older names
    result = export_run(tmp_path / "run", tmp_path / "merged", merge=True, say=lambda _t: None)
    assert result.metadata["verification"]["passed"]
    merged = AutoModelForImageTextToText.from_pretrained(tmp_path / "merged", dtype=torch.float32)
    assert type(merged).__name__ == "LlavaForConditionalGeneration"
    assert type(AutoProcessor.from_pretrained(tmp_path / "merged")).__name__ == "LlavaProcessor"
    # The adapter export carries the processor too (its image settings and template), as it carries the tokenizer.
    export_run(tmp_path / "run", tmp_path / "adapter", say=lambda _t: None)
    processor, base = (AutoProcessor.from_pretrained(d) for d in (tmp_path / "adapter", families["llava"]))
    assert type(processor).__name__ == "LlavaProcessor" and processor.chat_template == base.chat_template
    assert processor.image_processor.crop_size == base.image_processor.crop_size


def test_the_merge_check_sees_a_projector_adapter_through_its_picture_prompt(families, vision_data, tmp_path, monkeypatch):
    from finetune.errors import MergeCheckFailed
    from finetune.export import run as export

    # LoRA on the projector alone: no text prompt runs it, only the check's prompt with a picture.
    trained(families["llava"], vision_data, tmp_path / "run", lora={"target": ["projector"]})
    check = export.export_run(tmp_path / "run", tmp_path / "merged", merge=True, say=lambda _t: None).metadata["verification"]
    assert check["passed"] and check["prompts"] == 4 and check["prompts_with_images"] == 1
    assert check["distinguishes_unmerged"] and check["adapter_effect"] > 10 * check["tolerance"]
    # A merge that lost the projector's adapter fails the check and writes nothing.
    read = export.read_adapter
    monkeypatch.setattr(export, "read_adapter", lambda d: {k: v for k, v in read(d).items() if "projector" not in k})
    with pytest.raises(MergeCheckFailed):
        export.export_run(tmp_path / "run", tmp_path / "lost", merge=True, say=lambda _t: None)
    assert not (tmp_path / "lost").exists()


def test_resume_after_a_stop_signal_is_bitwise(families, vision_data, tmp_path):
    def cfg(out: Path, resume: str | None = None):
        train = {"max_steps": 5, "batch_size": 2}
        r = recipe(families["llava"], vision_data, out, train=train, checkpoint={"every_steps": 2})
        return build_recipe(r | ({"resume": resume} if resume else {}))

    straight, resumed = straight_and_resumed(cfg, tmp_path / "a", tmp_path / "b")
    assert len(straight) == 5 and straight == resumed


def test_generate_with_an_image_prompts_as_training_did_and_passes_its_pixels(families, vision_data, tmp_path):
    from finetune.runs.evaluate import exact_match, generate, prompt_ids

    trainer = trained(families["llava"], vision_data, tmp_path / "run")
    tok, model = trainer.tokenizer, trainer.accelerator.unwrap_model(trainer.model).eval()
    ex = trainer.data.train[1]  # record 1: img1.png, "What is in picture 1?"
    first_trained = next(k for k, label in enumerate(ex["labels"]) if label != IGNORE_INDEX)
    ids = prompt_ids("What is in picture 1?", "messages", tok, images=ex["images"])
    assert ids == ex["input_ids"][:first_trained]
    seen: list[dict] = []
    real = model.generate
    model.generate = lambda **kw: seen.append(kw) or real(**kw)  # type: ignore[method-assign]
    generate(model, tok, [ids], 3, images=[ex["images"]])
    assert seen[0]["pixel_values"].shape == (1, 3, 28, 28)
    records = [json.loads(line) for line in vision_data.read_text().splitlines()[:3]]
    from finetune.data.images import absolute_images

    scored = exact_match(model, tok, absolute_images(records, vision_data.parent, "test"), "messages", max_new_tokens=4)
    assert scored.total == 3 and [kw["pixel_values"].shape[0] for kw in seen[1:]] == [3]  # 0 + 1 + 2 images


def test_max_pixels_bounds_an_area_sized_processors_image_tokens_and_is_refused_elsewhere(families, vision_data, tmp_path):
    from types import SimpleNamespace

    from PIL import Image
    from transformers import Qwen2VLImageProcessorPil

    from finetune.errors import ModelError
    from finetune.model.vision import limit_pixels

    processor = SimpleNamespace(image_processor=Qwen2VLImageProcessorPil())
    image = Image.new("RGB", (1000, 800))
    assert processor.image_processor(images=[image])["image_grid_thw"].tolist() == [[1, 58, 72]]  # 1044 tokens
    limit_pixels(processor, 64 * 28 * 28)
    grid = processor.image_processor(images=[image])["image_grid_thw"]
    assert grid.tolist() == [[1, 14, 16]] and int(grid.prod()) // 4 <= 64  # 2x2 patches per image token
    cfg = build_recipe(recipe(families["llava"], vision_data, tmp_path / "run", data={"max_pixels": 50000}))
    with pytest.raises(ModelError, match="does not size images by area"):
        load_tokenizer(cfg)


def test_qwen2_vl_trains_with_its_grids_and_loads_in_vanilla_peft(vision_data, tmp_path, monkeypatch):
    """Qwen2-VL: images of different sizes become different numbers of <|image_pad|> tokens (one per 2x2
    patches of 14 px), batched as flat patches + image_grid_thw, positions from mm_token_type_ids."""
    from peft import PeftModel
    from transformers import AutoModelForImageTextToText, BitsAndBytesConfig
    from vlm_models import build_qwen2_vl

    model_dir = build_qwen2_vl(tmp_path / "qwen2-vl", monkeypatch)
    trainer = trained(model_dir, vision_data, tmp_path / "run")
    tok, model = trainer.tokenizer, trainer.accelerator.unwrap_model(trainer.model).eval()
    pad = tok.convert_tokens_to_ids("<|image_pad|>")
    quantized = [n for n, m in model.named_modules() if type(m).__name__ == "Linear4bit"]
    adapted = [n for n, _ in model.named_parameters() if ".lora_A." in n]
    assert all(".language_model." in n for n in quantized + adapted) and quantized and adapted  # model.visual: fp32
    ex = trainer.data.train[2]  # img2.png (64x64) and img0.png (40x30): both 56x56 (min_pixels), 4x4 patches
    assert ex["input_ids"].count(pad) == 4 + 4  # one token per 2x2 patches
    batch = Collator.for_tokenizer(tok)([trainer.data.train[i] for i in range(3)])  # 0, 1 (img1: 28x56), 2 images
    assert batch["image_grid_thw"].tolist() == [[1, 4, 2], [1, 4, 4], [1, 4, 4]]
    assert batch["pixel_values"].shape[0] == 8 + 16 + 16  # flat patches, one row each
    assert batch["mm_token_type_ids"].eq(1).sum() == batch["input_ids"].eq(pad).sum()
    inputs = {k: v for k, v in batch.items() if k != "labels"}
    with torch.no_grad():
        ours = model(**inputs).logits
    bnb = BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type="nf4",
        bnb_4bit_use_double_quant=True,
        bnb_4bit_compute_dtype=torch.float32,
        llm_int8_skip_modules=["lm_head", "model.visual"],
    )
    base = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32, quantization_config=bnb)
    training_kernel_only(base)
    with torch.no_grad():
        plain = base.eval()(**inputs).logits
    with torch.no_grad():
        theirs = PeftModel.from_pretrained(base, str(tmp_path / "run" / "adapter")).eval()(**inputs).logits
    assert (ours - theirs).abs().max() < 1e-5 and (ours - plain).abs().max() > 1e-3


def test_without_pillow_a_vision_language_model_says_how_to_install_it(families, vision_data, tmp_path, monkeypatch):
    from finetune.errors import ModelError

    monkeypatch.setitem(sys.modules, "PIL", None)  # what `import PIL` meets where Pillow is not installed
    cfg = build_recipe(recipe(families["llava"], vision_data, tmp_path / "run"))
    with pytest.raises(ModelError, match="needs Pillow") as err:
        load_tokenizer(cfg)
    assert err.value.hint == "pip install 'finetune[vision]'"


def test_a_built_in_template_is_refused_for_a_vision_language_model(families, vision_data, tmp_path):
    cfg = build_recipe(recipe(families["llava"], vision_data, tmp_path / "run", data={"template": "chatml"}))
    with pytest.raises(DataError, match="data.template=chatml with a vision-language model"):
        build_datasets(cfg, load_tokenizer(cfg))
