"""alpaca: {"instruction": str, "input": str (optional), "output": str}; output + EOS trained."""

from __future__ import annotations

from finetune.data.formats.base import Format

ALPACA_PROMPT = (
    "Below is an instruction that describes a task, paired with an input that provides further context. "
    "Write a response that appropriately completes the request.\n\n"
    "### Instruction:\n{instruction}\n\n### Input:\n{input}\n\n### Response:\n"
)
ALPACA_PROMPT_NO_INPUT = (
    "Below is an instruction that describes a task. "
    "Write a response that appropriately completes the request.\n\n"
    "### Instruction:\n{instruction}\n\n### Response:\n"
)


def alpaca_prompt(rec: dict) -> str:
    inp = rec.get("input") or ""
    if inp.strip():
        return ALPACA_PROMPT.format(instruction=rec["instruction"], input=inp)
    return ALPACA_PROMPT_NO_INPUT.format(instruction=rec["instruction"])


FORMAT = Format(
    name="alpaca",
    columns=("instruction", "output"),
    optional=("input",),
    example='`{"instruction", "input" (optional), "output"}`',
    trained="output + EOS",
    chat=False,
    split=lambda rec: (alpaca_prompt(rec), rec["output"]),
    prompt_record=lambda text, context: {"instruction": text, "input": context, "output": ""},
    context="input",
    synonyms={
        "instruction": ("prompt", "question", "query", "task"),
        "output": ("answer", "response", "completion", "target", "solution", "label"),
    },
    prompt_template={"with_input": ALPACA_PROMPT, "without_input": ALPACA_PROMPT_NO_INPUT},
)
