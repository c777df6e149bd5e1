"""What a record of each data.format must hold, ShareGPT -> messages, and the checks `validate` runs.

    alpaca      {"instruction": str, "input": str (optional), "output": str}
    completion  {"prompt": str, "completion": str}
    messages    {"messages": [{"role": "system"|"user"|"assistant"|"tool", "content": str}, ...]}
    sharegpt    {"conversations": [{"from": "system"|"human"|"gpt", "value": str}, ...]}
    text        {"text": str}
"""

from __future__ import annotations

import difflib
import os
import reprlib

from finetune.config import RecipeConfig, resolve_path
from finetune.data.sources import Source, Spec, _load, eval_spec, looks_like_hub_name, source_specs
from finetune.errors import DataError

# Columns each format reads (after data.columns is applied). alpaca's "input" is optional.
REQUIRED_COLUMNS: dict[str, tuple[str, ...]] = {
    "alpaca": ("instruction", "output"),
    "completion": ("prompt", "completion"),
    "messages": ("messages",),
    "sharegpt": ("conversations",),
    "text": ("text",),
}

# Column names datasets commonly use for ours; used only to suggest a data.columns fix.
_SYNONYMS: dict[str, tuple[str, ...]] = {
    "instruction": ("prompt", "question", "query", "task"),
    "output": ("answer", "response", "completion", "target", "solution", "label"),
    "prompt": ("question", "instruction", "query", "input", "source"),
    "completion": ("answer", "response", "output", "target", "solution"),
    "text": ("content", "document", "body", "sentence"),
    "messages": ("conversations", "conversation", "chat", "dialog", "turns"),
    "conversations": ("messages", "conversation", "chat", "dialog", "turns"),
}

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
ROLES = ("system", "developer", "user", "assistant", "tool", "function")
_TOOL_ROLES = ("tool", "function")
# Message keys besides role/content that chat templates read (tool calling); passed through to them.
PASSED_KEYS = ("tool_calls", "name", "tool_call_id", "reasoning_content")


def _column_hint(missing: str, found: list[str], fmt: str, columns: dict[str, str]) -> str:
    fixes: list[str] = []
    fits = [f for f in ("messages", "sharegpt", "completion", "alpaca", "text") if set(REQUIRED_COLUMNS[f]) <= set(found)]
    fixes += [f"data.format={fits[0]}"] if fits and fits[0] != fmt else []
    free = [c for c in found if c not in REQUIRED_COLUMNS[fmt] and c != "input"]
    cand = next((s for s in _SYNONYMS.get(missing, ()) if s in free), None)
    cand = cand or next(iter(difflib.get_close_matches(missing, free, n=1, cutoff=0.6)), None)
    if cand or not fixes:
        fixes.append(f"data.columns.{missing}={cand or 'YOUR_COLUMN'}")
    mapped = f" (data.columns maps it from '{columns[missing]}', which is not there)" if missing in columns else ""
    return "set " + " or ".join(fixes) + mapped


def _turn_problem(turns: object, col: str, fmt: str) -> tuple[str, str] | None:
    if not isinstance(turns, list) or not turns:
        what = f"column '{col}' is {type(turns).__name__} {reprlib.repr(turns)}, expected a non-empty list"
        example = '{"role": "user", "content": "..."}' if fmt == "messages" else '{"from": "human", "value": "..."}'
        return what, f"store each conversation as a list such as [{example}, ...]"
    role_key, text_key = ("role", "content") if fmt == "messages" else ("from", "value")
    for j, m in enumerate(turns):
        # An assistant turn that only calls tools has content null (OpenAI's format).
        calls_only = isinstance(m, dict) and m.get(text_key) is None and bool(m.get("tool_calls"))
        if not (isinstance(m, dict) and isinstance(m.get(role_key), str) and (isinstance(m.get(text_key), str) or calls_only)):
            what = f"{col}[{j}] is {reprlib.repr(m)}, expected {{{role_key!r}: str, {text_key!r}: str}}"
            if fmt == "messages" and isinstance(m, dict) and "from" in m and "value" in m:
                return what, "these are ShareGPT turns: set data.format=sharegpt"
            if fmt == "sharegpt" and isinstance(m, dict) and "role" in m and "content" in m:
                return what, "these are OpenAI-style turns: set data.format=messages"
            if isinstance(m, dict) and isinstance(m.get(text_key), list):
                return what, "content given as a list of parts (multimodal) is not supported: join the text parts"
            return what, f"give every turn a string {role_key!r} and a string {text_key!r}"
        if fmt == "sharegpt" and m[role_key].lower() not in SHAREGPT_ROLES:
            what = f"{col}[{j}] has speaker {m[role_key]!r}"
            return what, f"use one of {', '.join(sorted(SHAREGPT_ROLES))}"
    return None


def role_order_problem(messages: list[dict]) -> str | None:
    """Why this conversation cannot be a training example, or None.

    Only what no template can make sense of: an unknown role, or a tool result that
    answers nothing (no assistant turn before it). Anything else a template dislikes
    (a second user turn in a row, a late system message) is the template's to refuse,
    and its error is reported with the record.
    """
    prev = None
    for j, m in enumerate(messages):
        role = m["role"]
        if role not in ROLES:
            return f"messages[{j}] has role {role!r}; expected one of {', '.join(ROLES)}"
        if role in _TOOL_ROLES and prev not in ("assistant", *_TOOL_ROLES):
            return f"messages[{j}] is a tool result that follows {prev or 'nothing'}, not an assistant turn"
        prev = role
    return None


def record_problem(rec: dict, fmt: str, columns: dict[str, str]) -> tuple[str, str] | None:
    """(what is wrong, how to fix) for a record that `fmt` cannot use, else None."""
    missing = next((c for c in REQUIRED_COLUMNS[fmt] if c not in rec), None)
    if missing:
        found = ", ".join(rec) or "none"
        what = f"has no column '{missing}' needed by data.format={fmt} (found columns: {found})"
        return what, _column_hint(missing, list(rec), fmt, columns)
    if fmt in ("messages", "sharegpt"):
        col = REQUIRED_COLUMNS[fmt][0]
        problem = _turn_problem(rec[col], col, fmt)
        if problem:
            return problem
        order = role_order_problem(to_messages(rec, fmt))
        return (order, "fix the conversation, or set data.skip_bad_rows=true to skip such rows") if order else None
    for col in REQUIRED_COLUMNS[fmt] + (("input",) if fmt == "alpaca" else ()):
        value = rec.get(col)
        if not isinstance(value, str) and not (col == "input" and value is None):  # input: missing/null = none
            what = f"column '{col}' is {type(value).__name__} {reprlib.repr(value)}, expected a string"
            return what, "convert the column to strings"
    return None


def to_messages(rec: dict, fmt: str) -> list[dict]:
    """The conversation of a messages or sharegpt record as [{"role", "content", ...}, ...].

    Tool-calling keys (tool_calls, name, tool_call_id) pass through to the template.
    """
    if fmt == "sharegpt":
        return [{"role": SHAREGPT_ROLES[t["from"].lower()], "content": t["value"]} for t in rec["conversations"]]
    out = []
    for m in rec["messages"]:
        msg = {"role": m["role"], "content": m["content"] if m.get("content") is not None else ""}
        msg.update({k: m[k] for k in PASSED_KEYS if m.get(k) is not None})
        out.append(msg)
    return out


def has_reply(message: dict) -> bool:
    """An assistant turn with something to learn: text, or tool calls."""
    return message["role"] == "assistant" and (bool(message["content"].strip()) or bool(message.get("tool_calls")))


def usable_records(source: Source, columns: dict[str, str], skip_bad: bool) -> tuple[list[int], list[str]]:
    """Indices of records the format can use, and descriptions of those skipped (only when skip_bad).

    Without skip_bad, the first bad record raises a DataError naming file and record.
    """
    keep, skipped = [], []
    for i, rec in enumerate(source.records):
        problem = record_problem(rec, source.format, columns)
        if problem is None:
            keep.append(i)
        elif skip_bad:
            skipped.append(f"{source.where(i)} {problem[0]}")
        else:
            raise DataError(f"{source.where(i)} {problem[0]}", hint=problem[1])
    return keep, skipped


def check_data_source(cfg: RecipeConfig) -> list[str]:
    """Problems `finetune validate` can find without a tokenizer; [] when the data looks usable.

    Checks data.path, every data.mix path, data.eval_path and eval.exact_match_path:
    they exist (or look like a hub id, which is not fetched here), are readable and
    non-empty, and their first ~100 records have the columns and types the format needs.
    """
    problems = []
    d = cfg.data
    specs = source_specs(cfg) + [s for s in [eval_spec(cfg)] if s is not None]
    if cfg.eval.exact_match_path:
        specs.append(Spec("eval.exact_match_path", cfg.eval.exact_match_path, d.format, d.columns, d.split, d.subset))
    for spec in specs:
        resolved = resolve_path(spec.path)
        if not os.path.exists(resolved) and looks_like_hub_name(resolved):
            continue  # a hub id: checking it needs the network, which validate must not need
        try:
            # 100 records catch a wrong column or type and stay cheap on a multi-GB file.
            records, origins = _load(spec, limit=100, skipped=[] if d.skip_bad_rows else None)
        except DataError as exc:
            problems.append(f"{exc.message}. {exc.hint}" if exc.hint else exc.message)
            continue
        source = Source(spec.key, records, origins, spec.format)
        for i, rec in enumerate(records):
            problem = record_problem(rec, spec.format, spec.columns)
            if problem and not d.skip_bad_rows:
                # One problem per source: the same mistake usually repeats in every record.
                problems.append(f"{source.where(i)} {problem[0]}; {problem[1]}")
                break
    return problems
