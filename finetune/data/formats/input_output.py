"""input_output: OpenAI-style pairs {"input": str, "output": str, "system": str (optional)}.

Rendered with the chat template as a conversation (system, if any; user = input;
assistant = output), so the output is trained as a reply: its tokens and its
end-of-turn token, exactly as data.format=messages would train that conversation.
"""

from __future__ import annotations

from finetune.data.formats.base import Format


def to_messages(rec: dict) -> list[dict]:
    system = rec.get("system") or ""
    head = [{"role": "system", "content": system}] if system.strip() else []
    return head + [{"role": "user", "content": rec["input"]}, {"role": "assistant", "content": rec["output"]}]


FORMAT = Format(
    name="input_output",
    columns=("input", "output"),
    optional=("system",),
    example='`{"input", "output", "system" (optional)}` (one user turn and its reply)',
    trained="output + its end-of-turn token",
    chat=True,
    to_messages=to_messages,
    prompt_record=lambda text, context: {"input": text, "output": ""},
    synonyms={
        "input": ("prompt", "question", "instruction", "query", "source"),
        "output": ("answer", "response", "completion", "target", "solution", "label"),
    },
)
