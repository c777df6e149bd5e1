"""text: {"text": str}; every token trained (continued pretraining). No prompt, so no exact-match eval."""

from __future__ import annotations

from finetune.data.formats.base import Format

FORMAT = Format(
    name="text",
    columns=("text",),
    example='`{"text"}`',
    trained="everything (continued pretraining)",
    chat=False,
    split=lambda rec: ("", rec["text"]),  # an empty prompt: BOS only, the text all trained
    prompt_record=lambda text, context: {"text": text},  # generation continues the text
    answers=False,
    synonyms={"text": ("content", "document", "body", "sentence")},
)
