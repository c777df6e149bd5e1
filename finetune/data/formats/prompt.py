"""prompt: {"prompt": text or messages, ...any other columns}; nothing trained from the record itself.

train.objective=grpo samples completions of each prompt and trains them by their rewards; the other
columns (an `answer`, test cases) reach the reward functions. A text prompt is used as written; a
list of messages is rendered with the chat template and the assistant's turn opened.
"""

from __future__ import annotations

from finetune.data.formats.base import Format, conversation_problem, turns_problem


def check(rec: dict) -> tuple[str, str] | None:
    prompt = rec["prompt"]
    if isinstance(prompt, str):
        return None if prompt else ("column 'prompt' is empty", "give every record a prompt")
    example = '{"role": "user", "content": "..."}'
    return turns_problem(prompt, "prompt", ("role", "content"), example) or conversation_problem(prompt)


def text_of(rec: dict) -> tuple[str, str]:
    prompt = rec["prompt"]
    return (prompt if isinstance(prompt, str) else "\n".join(m["content"] for m in prompt)), ""


FORMAT = Format(
    name="prompt",
    columns=("prompt",),
    example='`{"prompt": text or [messages], ...}` (train.objective=grpo; other columns reach the rewards)',
    trained="completions sampled from the model, by their rewards",
    chat=False,
    split=text_of,
    check=check,
    answers=False,
    prompt_record=lambda text, context: {"prompt": text},
    synonyms={"prompt": ("question", "instruction", "query", "problem")},
)
