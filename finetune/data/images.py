"""Images in conversations, for vision-language models: the parts of a record, their tokens, their pixels.

A turn's content may be a list of parts (paths relative to the data file, local files only):
    {"role": "user", "content": [{"type": "image", "path": "img/cat.png"}, {"type": "text", "text": "What is it?"}]}

tokenize: the chat template renders one placeholder per image (the processor's image_token, e.g. LLaVA's
<image>); each is expanded into the text the processor gives that image (how many image tokens depends
on its size), so the replies are found, and the masks computed, in exactly the text the model reads.
Image tokens are never trained: an image inside a trained reply stops the run naming the record.
collate: the images of a micro-batch through the processor's image side (pixels, grids, masks); the
token types the model needs besides (Gemma 3's token_type_ids) from the ids themselves.
"""

from __future__ import annotations

import os
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from finetune.errors import DataError

# What a processor's image side may give the model; anything else it returns is refused, not guessed at.
IMAGE_INPUTS = ("pixel_values", "image_grid_thw", "pixel_attention_mask", "image_sizes")
# Token-type inputs computed from the ids (create_mm_token_type_ids), named as each processor names them.
TOKEN_TYPE_INPUTS = ("token_type_ids", "mm_token_type_ids")
_TEXT_KEYS = ("input_ids", "attention_mask", *TOKEN_TYPE_INPUTS)


def image_paths(messages: Sequence[dict]) -> list[str]:
    """The image parts' paths of a conversation, in the order the template renders them."""
    out: list[str] = []
    for m in messages:
        if isinstance(m, dict) and isinstance(m.get("content"), list):
            out += [_path(p) for p in m["content"] if isinstance(p, dict) and p.get("type") == "image"]
    return out


def _path(part: dict) -> str:
    return str(part.get("path", part.get("image")))  # checked a string by the record check


def resolve_images(messages: list[dict], folder: Path | None, where: str) -> list[dict]:
    """The conversation with each image path made absolute (relative to the data file's folder)."""
    out = []
    for m in messages:
        if isinstance(m, dict) and isinstance(m.get("content"), list):
            parts = []
            for p in m["content"]:
                if isinstance(p, dict) and p.get("type") == "image":
                    path = Path(os.path.expanduser(_path(p)))
                    if not path.is_absolute():
                        if folder is None:
                            raise DataError(
                                f"{where}: image path '{path}' is relative, but the data does not come from a local file",
                                hint="give absolute image paths, or load the data from a local JSON/JSONL file",
                            )
                        path = folder / path
                    p = {"type": "image", "path": str(path)}
                parts.append(p)
            m = {**m, "content": parts}
        out.append(m)
    return out


def absolute_images(records: list[dict], folder: Path | None, where: str) -> list[dict]:
    """messages records with their image paths made absolute (eval records, read away from their data file)."""
    out = []
    for rec in records:
        msgs = rec.get("messages")
        if isinstance(msgs, list) and image_paths(msgs):
            rec = {**rec, "messages": resolve_images(msgs, folder, where)}
        out.append(rec)
    return out


def processor_of(tokenizer: Any) -> Any | None:
    """The processor a vision-language model's tokenizer was loaded with (model/vision.py), else None."""
    return getattr(tokenizer, "finetune_processor", None)


def open_images(paths: Sequence[str], where: str) -> list[Any]:
    """The images as RGB PIL images, or DataError naming the record and the file."""
    from PIL import Image, UnidentifiedImageError

    images = []
    for path in paths:
        try:
            with Image.open(path) as im:
                images.append(im.convert("RGB"))
        except (OSError, UnidentifiedImageError) as exc:
            raise DataError(
                f"{where}: image '{path}' cannot be read: {type(exc).__name__}: {exc}",
                hint="fix the path (relative to the data file) or the file (PNG/JPEG/WebP ...), or drop the record",
            ) from None
    return images


def replacements(processor: Any, paths: Sequence[str], where: str) -> list[str]:
    """The text the processor puts in place of each image's placeholder (its size decides the token count)."""
    if not paths:
        return []
    out = processor(
        text=[processor.image_token * len(paths)], images=open_images(paths, where), return_text_replacement_offsets=True
    )
    return [r["replacement"] for r in out["text_replacement_offsets"][0]]


class ImageText:
    """A tokenizer that renders one conversation's images as the processor expands them.

    Everything but apply_chat_template is the tokenizer's. Rendering normalizes string contents into
    text parts (VLM templates iterate content parts) and expands the k-th placeholder with the k-th
    image's text, so a prefix of the conversation renders as a prefix of the whole (replies.py)."""

    def __init__(self, tokenizer: Any, processor: Any, expanded: list[str]):
        self.__dict__.update(_tokenizer=tokenizer, _placeholder=re.compile(re.escape(processor.image_token)))
        self.__dict__.update(_processor=processor, _expanded=expanded)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._tokenizer, name)

    def __setattr__(self, name: str, value: Any) -> None:
        setattr(self._tokenizer, name, value)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._tokenizer(*args, **kwargs)

    def placeholders(self, messages: list[dict]) -> int:
        """How many image placeholders the template renders for this conversation."""
        text = self._processor.apply_chat_template(_parts_of(messages), tokenize=False)
        return len(self._placeholder.findall(text))

    def apply_chat_template(self, messages: list[dict], tokenize: bool = False, add_generation_prompt: bool = False) -> str:
        text = self._processor.apply_chat_template(
            _parts_of(messages), tokenize=False, add_generation_prompt=add_generation_prompt
        )
        texts = iter(self._expanded)
        return self._placeholder.sub(lambda _m: next(texts, _m.group()), text)


def _parts_of(messages: list[dict]) -> list[dict]:
    """Every content as a list of parts, as VLM templates read them (an image part without its path)."""
    out = []
    for m in messages:
        content = m.get("content")
        if isinstance(content, list):
            parts = [{"type": "image"} if p.get("type") == "image" else p for p in content]
        else:
            parts = [{"type": "text", "text": content or ""}]
        out.append({**m, "content": parts})
    return out


def image_token_ids(processor: Any) -> set[int]:
    """The ids that stand for image features (never trained)."""
    return {i for i in processor.image_token_ids if i is not None}


def image_inputs(processor: Any, ids: Any, images: Sequence[Sequence[str]]) -> dict[str, Any]:
    """The model's image inputs for a padded (batch, seq) id tensor whose row i holds images[i]."""
    import torch

    out: dict[str, Any] = {}
    if any(images):
        batch = processor(
            text=[processor.image_token * len(paths) for paths in images],
            images=[open_images(paths, "batch") for paths in images],
            padding=True,  # the placeholder text is thrown away; only its lengths differ
            return_tensors="pt",
        )
        unknown = sorted(set(batch) - set(IMAGE_INPUTS) - set(_TEXT_KEYS))
        if unknown:
            raise DataError(
                f"the processor {type(processor).__name__} gives the model {unknown}, which finetune does not batch",
                hint="this vision-language family is not supported yet; README's vision section lists those that are",
            )
        out = {k: batch[k] for k in IMAGE_INPUTS if k in batch}
    if getattr(processor, "return_mm_token_type_ids", False):
        # From our ids, not the processor's text: they must mark the tokens the model reads. Gemma 3's
        # processor names them token_type_ids; Qwen2-VL's, mm_token_type_ids.
        name = "mm_token_type_ids" if "mm_token_type_ids" in processor.model_input_names else "token_type_ids"
        out[name] = torch.tensor(processor.create_mm_token_type_ids(ids.tolist()), dtype=torch.long)
    return out
