"""What a data format is (Format), and the record checks several formats share.

A format module (alpaca.py, messages.py, ...) defines one Format and nothing the
rest of the package has to know about: the registry (formats/__init__.py) lists it,
and records, tokenize, evaluate, generate and the README table read it from there.
"""

from __future__ import annotations

import reprlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

Problem = tuple[str, str]  # (what is wrong with the record, how to fix it)

ROLES = ("system", "developer", "user", "assistant", "tool", "function")
TOOL_ROLES = ("tool", "function")
# Message keys besides role/content that chat templates read (tool calling); passed through to them.
PASSED_KEYS = ("tool_calls", "name", "tool_call_id", "reasoning_content")


@dataclass(frozen=True, kw_only=True)
class Format:
    """One data.format: the columns a record holds and how it becomes a training example.

    Chat formats (chat=True) give to_messages: the conversation is rendered with the chat
    template and every assistant reply is trained with its end-of-turn token.
    Prompt/response formats give split: (prompt text, response text); the response and
    EOS are trained. Pair formats (preference) give pairs: each side is a record of one of
    those formats. check runs after every column in `columns` was found in the record;
    without one, every column (and each optional one present) must be a string.
    """

    name: str
    columns: tuple[str, ...]  # required, after data.columns is applied
    example: str  # README "a record" cell (markdown)
    trained: str  # README "trained by default" cell
    chat: bool
    prompt_record: Callable[[str, str], dict]  # (free text, --input context) -> a record with an empty answer
    to_messages: Callable[[dict], list[dict]] | None = None  # chat formats
    split: Callable[[dict], tuple[str, str]] | None = None  # prompt/response formats
    optional: tuple[str, ...] = ()  # read when present; missing or null = none
    check: Callable[[dict], Problem | None] | None = None  # None: string columns (string_columns_problem)
    answers: bool = True  # a prompt/answer split exists (exact-match eval); text has none
    context: str | None = None  # the record field `finetune generate --input` fills, if the format has one
    synonyms: dict[str, tuple[str, ...]] = field(default_factory=dict)  # dataset column names for ours: hints only
    prompt_template: Any = None  # prompt/response formats: how the prompt is built, for export metadata
    # Preference pairs: record -> (the format both sides are encoded as, chosen record, rejected record).
    pairs: Callable[[dict], tuple[str, dict, dict]] | None = None

    def __post_init__(self) -> None:
        if self.pairs is not None:
            if self.chat or self.split is not None:
                raise TypeError(f"format {self.name!r}: a pair format encodes its sides as other formats do; no chat/split")
        elif self.chat != (self.to_messages is not None) or self.chat == (self.split is not None):
            raise TypeError(f"format {self.name!r}: a chat format gives to_messages, a prompt/response format gives split")

    def problem(self, rec: dict) -> Problem | None:
        """(what is wrong, how to fix) for a record with every required column, else None."""
        if self.check is not None:
            return self.check(rec)
        return string_columns_problem(rec, self.columns, self.optional)

    @property
    def reads(self) -> tuple[str, ...]:
        return self.columns + self.optional

    def messages(self, rec: dict) -> list[dict]:
        """A chat format's record as [{"role", "content", ...}, ...]."""
        if self.to_messages is None:
            raise TypeError(f"data.format={self.name} is not a chat format")
        return self.to_messages(rec)

    def texts(self, rec: dict) -> tuple[str, str]:
        """A prompt/response format's record as (prompt text, response text)."""
        if self.split is None:
            raise TypeError(f"data.format={self.name} is a chat format")
        return self.split(rec)


def string_columns_problem(rec: dict, columns: tuple[str, ...], optional: tuple[str, ...] = ()) -> Problem | None:
    """Prompt/response formats: every column a string (an optional one may also be missing or null)."""
    for col in columns + optional:
        value = rec.get(col)
        if not isinstance(value, str) and not (col in optional and value is None):
            what = f"column '{col}' is {type(value).__name__} {reprlib.repr(value)}, expected a string"
            return what, "convert the column to strings"
    return None


def turns_problem(
    turns: object,
    col: str,
    keys: tuple[str, str],
    example: str,
    foreign: tuple[tuple[str, str], str] | None = None,
    turn_check: Callable[[int, dict], Problem | None] | None = None,
    parts: bool = False,
) -> Problem | None:
    """Chat formats: `turns` is a non-empty list of {role_key: str, text_key: str} dicts.

    parts: a text may also be a list of text and image parts (data/images.py), images outside assistant turns.
    foreign: (keys of another format's turns, the hint given when a turn has them);
    turn_check: a format's own check of each well-formed turn.
    """
    role_key, text_key = keys
    if not isinstance(turns, list) or not turns:
        what = f"column '{col}' is {type(turns).__name__} {reprlib.repr(turns)}, expected a non-empty list"
        return what, f"store each conversation as a list such as [{example}, ...]"
    for j, m in enumerate(turns):
        # An assistant turn that only calls tools has content null (OpenAI's format).
        calls_only = isinstance(m, dict) and m.get(text_key) is None and bool(m.get("tool_calls"))
        listed = parts and isinstance(m, dict) and isinstance(m.get(text_key), list)
        if listed:
            problem = _parts_problem(m, j, col, role_key, text_key)
            if problem:
                return problem
        elif not (isinstance(m, dict) and isinstance(m.get(role_key), str) and (isinstance(m.get(text_key), str) or calls_only)):
            what = f"{col}[{j}] is {reprlib.repr(m)}, expected {{{role_key!r}: str, {text_key!r}: str}}"
            if foreign and isinstance(m, dict) and all(k in m for k in foreign[0]):
                return what, foreign[1]
            if isinstance(m, dict) and isinstance(m.get(text_key), list):
                return what, "content given as a list of parts (multimodal) is not supported: join the text parts"
            return what, f"give every turn a string {role_key!r} and a string {text_key!r}"
        problem = turn_check(j, m) if turn_check else None
        if problem:
            return problem
    return None


PART_EXAMPLE = '[{"type": "image", "path": "img/cat.png"}, {"type": "text", "text": "What is it?"}]'


def part_problem(part: object) -> str | None:
    """Why one content part is not {"type": "text", "text": str} or {"type": "image", "path": str}, or None."""
    if isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str):
        return None
    if isinstance(part, dict) and part.get("type") == "image":
        path = part.get("path", part.get("image"))
        if isinstance(path, str) and path:
            return None
        return f"image part {part!r} has no 'path' (a local image file, relative to the data file)"
    return f"content part {part!r} is not a text or image part"


def content_text(content: object) -> str:
    """A turn's text: the content itself, or its text parts joined."""
    if isinstance(content, list):
        return "".join(p["text"] for p in content if isinstance(p, dict) and p.get("type") == "text")
    return content if isinstance(content, str) else ""


def _parts_problem(m: dict, j: int, col: str, role_key: str, text_key: str) -> Problem | None:
    """A turn whose content is a list of parts: every part well formed, and no image in an assistant reply."""
    if not isinstance(m.get(role_key), str):
        return f"{col}[{j}] has no string {role_key!r}", f"give every turn a string {role_key!r}"
    for part in m[text_key]:
        why = part_problem(part)
        if why:
            return f"{col}[{j}]: {why}", f"write the content as a list of parts such as {PART_EXAMPLE}"
    if m[role_key] == "assistant" and any(p["type"] == "image" for p in m[text_key]):
        return f"{col}[{j}] is an assistant reply with an image", "put images in user turns: an assistant reply is text"
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
        if role in TOOL_ROLES and prev not in ("assistant", *TOOL_ROLES):
            return f"messages[{j}] is a tool result that follows {prev or 'nothing'}, not an assistant turn"
        prev = role
    return None


def conversation_problem(messages: list[dict]) -> Problem | None:
    """role_order_problem with its fix, for a record whose turns are well formed."""
    order = role_order_problem(messages)
    return (order, "fix the conversation, or set data.skip_bad_rows=true to skip such rows") if order else None
