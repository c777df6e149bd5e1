"""completion: {"prompt": str, "completion": str}; the prompt as written, completion + EOS trained."""

from __future__ import annotations

from finetune.data.formats.base import Format

FORMAT = Format(
    name="completion",
    columns=("prompt", "completion"),
    example='`{"prompt", "completion"}`',
    trained="completion + EOS",
    chat=False,
    split=lambda rec: (rec["prompt"], rec["completion"]),
    prompt_record=lambda text, context: {"prompt": text, "completion": ""},
    synonyms={
        "prompt": ("question", "instruction", "query", "input", "source"),
        "completion": ("answer", "response", "output", "target", "solution"),
    },
    prompt_template="{prompt}",
)
