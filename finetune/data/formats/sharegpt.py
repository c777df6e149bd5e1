"""sharegpt: {"conversations": [{"from": "human"/"gpt"/"system", "value": ...}, ...]}; trained as messages."""

from __future__ import annotations

from finetune.data.formats.base import Format, conversation_problem, turns_problem

# ShareGPT speaker names (several dialects) -> OpenAI roles.
SHAREGPT_ROLES = {
    "system": "system",
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "model": "assistant",
    "bing": "assistant",
    "chatgpt": "assistant",
    "function_call": "assistant",
    "tool": "tool",
    "observation": "tool",
    "function_response": "tool",
    "function": "tool",
}


def to_messages(rec: dict) -> list[dict]:
    return [{"role": SHAREGPT_ROLES[t["from"].lower()], "content": t["value"]} for t in rec["conversations"]]


def _speaker_problem(j: int, turn: dict) -> tuple[str, str] | None:
    if turn["from"].lower() in SHAREGPT_ROLES:
        return None
    return f"conversations[{j}] has speaker {turn['from']!r}", f"use one of {', '.join(sorted(SHAREGPT_ROLES))}"


def check(rec: dict) -> tuple[str, str] | None:
    openai = (("role", "content"), "these are OpenAI-style turns: set data.format=messages")
    example = '{"from": "human", "value": "..."}'
    turns = rec["conversations"]
    return turns_problem(turns, "conversations", ("from", "value"), example, openai, _speaker_problem) or conversation_problem(
        to_messages(rec)
    )


FORMAT = Format(
    name="sharegpt",
    columns=("conversations",),
    example='`{"conversations": [{"from": "human"/"gpt"/"system", "value"}, ...]}`',
    trained="as messages",
    chat=True,
    to_messages=to_messages,
    check=check,
    prompt_record=lambda text, context: {"conversations": [{"from": "human", "value": text}, {"from": "gpt", "value": ""}]},
    synonyms={"conversations": ("messages", "conversation", "chat", "dialog", "turns")},
)
