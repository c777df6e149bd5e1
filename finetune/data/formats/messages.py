"""messages: OpenAI-style {"messages": [{"role": ..., "content": ...}, ...]}; every assistant reply trained.

A content may be a list of text and image parts (vision-language models; finetune/data/images.py).
Roles: system, developer, user, assistant, tool, function. Tool-calling keys
(tool_calls, name, tool_call_id, reasoning_content) pass through to the template; an
assistant turn that only calls tools may have content null.
"""

from __future__ import annotations

from finetune.data.formats.base import PASSED_KEYS, Format, content_text, conversation_problem, turns_problem


def to_messages(rec: dict) -> list[dict]:
    out = []
    for m in rec["messages"]:
        content = m["content"] if m.get("content") is not None else ""
        if m["role"] == "assistant" and isinstance(content, list):  # text parts only (checked): a reply is text
            content = content_text(content)
        msg = {"role": m["role"], "content": content}
        msg.update({k: m[k] for k in PASSED_KEYS if m.get(k) is not None})
        out.append(msg)
    return out


def check(rec: dict) -> tuple[str, str] | None:
    sharegpt = (("from", "value"), "these are ShareGPT turns: set data.format=sharegpt")
    example = '{"role": "user", "content": "..."}'
    return turns_problem(rec["messages"], "messages", ("role", "content"), example, sharegpt, parts=True) or conversation_problem(
        to_messages(rec)
    )


FORMAT = Format(
    name="messages",
    columns=("messages",),
    example='`{"messages": [{"role", "content"}, ...]}` (system, user, assistant, tool)',
    trained="every assistant reply + its end-of-turn token",
    chat=True,
    to_messages=to_messages,
    check=check,
    prompt_record=lambda text, context: {"messages": [{"role": "user", "content": text}, {"role": "assistant", "content": ""}]},
    synonyms={"messages": ("conversations", "conversation", "chat", "dialog", "turns")},
)
