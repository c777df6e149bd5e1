"""Where each assistant reply lies in a rendered conversation, in characters, for any chat template.

A reply's trained text is what the rendering of the whole conversation holds for it:
from the end of the generation prompt before it to where the next message's rendering
starts (or the end of the text), so its content, its end-of-turn marker and the
template's text up to the next turn. ChatML, [user "hi", assistant "yo"] ([[ ]] trained):
    <|im_start|>user\\nhi<|im_end|>\\n<|im_start|>assistant\\n[[yo<|im_end|>\\n]]

Prefix method, exact where the whole conversation's rendering starts with the rendering
of its first messages (ChatML, Llama 3, Qwen2.5, Gemma, ...): reply i spans
    [len(render(msgs[:i], add_generation_prompt)), len(render(msgs[:i+1]))).

Located method, for an end the prefix method cannot place because the template renders
a turn differently when more turns follow it:
    Qwen3        keeps a reply's reasoning only after the last user turn: render(msgs[:i+1]) has a
                 <think> block that reply i lacks in the whole
    Mistral v3   writes the system prompt into the last user turn only: render(msgs[:i]) has it, the whole not there
    Phi-3        writes eos after the last message: render(msgs[:i+1]) ends in eos where the whole goes on
    DeepSeek-R1  ends its generation prompt in "<think>\\n", which no rendered reply starts with
A probe character appended to one message's text (its content, or its last tool call's
name) marks where that text ends in a rendering: rendered again with the probe, which
must show up once, all else unchanged. For a reply's start the message probed is the
nearest earlier one that keeps it, and the reply's own text must lie after the start
found; for its end, the reply. The text after the probe in the prefix rendering is then
matched against the whole:
after message i-1's text it is that message's end and the generation prompt (the reply
starts where the match ends); after reply i's text it is the reply's end-of-turn text
(the reply ends where the match ends). A match that stops short of the text's end stops
at the last whole token of it: DeepSeek-R1's generation prompt matches through
"<｜Assistant｜>" (not into "<think>" when a reply starts with "<"), and Phi-3's
end-of-turn text through "<|end|>\\n" where the whole goes on with the next turn, not
its eos; nothing the template writes before its generation prompt may be missing.
A reply that cannot be placed this way is reported (mask check `boundary`), never guessed.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from finetune.errors import DataError

# Private-use characters: no chat template or tokenizer gives them a meaning. The first one
# the conversation does not hold is the probe.
_PROBES = "\ue000\ue001\ue002\ue003"


def render(tokenizer: Any, messages: list[dict], where: str, add_generation_prompt: bool = False) -> str:
    try:
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
    except Exception as exc:
        raise DataError(
            f"{where}: the chat template failed on this conversation: {type(exc).__name__}: {exc}",
            hint="check the roles and their order (many templates require user/assistant alternation)",
        ) from None


def _appends_eos(tokenizer: Any) -> bool:
    """Whether add_special_tokens=True also appends eos (some tokenizers do; a rendered prefix must not end in it)."""
    cached = getattr(tokenizer, "_finetune_appends_eos", None)
    if cached is None:
        eos = getattr(tokenizer, "eos_token_id", None)
        ids = tokenizer("a", add_special_tokens=True)["input_ids"]
        cached = eos is not None and len(ids) > 0 and ids[-1] == eos
        try:
            tokenizer._finetune_appends_eos = cached
        except AttributeError:  # a tokenizer that refuses attributes: ask again next time
            pass
    return cached


def encode_rendered(tokenizer: Any, text: str) -> list[int]:
    """Tokenize chat-template output as the template wrote it: no second BOS (templates like Llama 3's
    write one), and no eos appended by the tokenizer (the template decides where turns end)."""
    bos = getattr(tokenizer, "bos_token", None)
    has_bos = isinstance(bos, str) and bool(bos) and text.startswith(bos)
    ids = list(tokenizer(text, add_special_tokens=not has_bos, verbose=False)["input_ids"])
    if not has_bos and ids and _appends_eos(tokenizer) and not text.endswith(tokenizer.eos_token or "\0"):
        ids.pop()
    return ids


def common_prefix(a: Sequence, b: Sequence) -> int:
    """How many leading items (tokens, characters) a and b share."""
    n = min(len(a), len(b))
    return next((i for i in range(n) if a[i] != b[i]), n)


def _probed_messages(m: dict, probe: str) -> list[dict]:
    """m with `probe` after its text, in the places a template may render it: after the content (before
    its trailing whitespace, which templates that trim it drop, probe or not), then after the last tool
    call's name (a reply that only calls tools, or a template that renders a call without its content)."""
    out = []
    content = m.get("content") or ""
    if content.strip():
        body = content.rstrip()
        out.append({**m, "content": body + probe + content[len(body) :]})
    calls = m.get("tool_calls") or []
    last = calls[-1] if calls and isinstance(calls[-1], dict) else None
    inner = last is not None and isinstance(last.get("function"), dict)
    fn = last["function"] if last is not None and inner else last
    if last is not None and isinstance(fn, dict) and isinstance(fn.get("name"), str):
        named = {**fn, "name": fn["name"] + probe}
        out.append({**m, "tool_calls": [*calls[:-1], {**last, "function": named} if inner else named]})
    return out


class Conversation:
    """A conversation rendered once as a whole (its text and token ids), and the place of each of
    its replies in that text: start(i) and end(i) give a character offset, or why there is none."""

    def __init__(self, tokenizer: Any, messages: list[dict], where: str):
        self.tokenizer, self.messages, self.where = tokenizer, messages, where
        self.text = render(tokenizer, messages, where)
        self.ids = encode_rendered(tokenizer, self.text)
        self._ends: dict[int, tuple[int, int] | None] = {}  # message index -> (probe place, where its text ends)

    def token_at(self, at: int) -> tuple[int, bool]:
        """(how many tokens of the whole lie before character `at`, whether a token straddles `at`)."""
        head = encode_rendered(self.tokenizer, self.text[:at])
        k = common_prefix(self.ids, head)
        return k, k != len(head)

    def start(self, i: int) -> int | str:
        """Where reply i's trained text starts in the whole, or why that cannot be found."""
        prompt = render(self.tokenizer, self.messages[:i], self.where, add_generation_prompt=True)
        if self.text.startswith(prompt):
            return len(prompt)
        for k in range(i - 1, -1, -1):  # the nearest earlier message whose text a probe can mark
            if self.text_end(k) is None:
                continue
            start, reply = self._start_after(i, k, prompt), self.text_end(i)
            if isinstance(start, int) and reply is None:
                return self._unplaced(i, "its text does not keep its place when rendered with a probe character")
            if isinstance(start, int) and reply is not None and reply < start:
                return self._unplaced(i, f"its text ends (character {reply}) before its generation prompt does")
            return start
        return self._unplaced(i, "no message before it keeps its text when rendered with a probe character")

    def end(self, i: int) -> int | str:
        """Where reply i's trained text ends in the whole, or why that cannot be found."""
        upto = render(self.tokenizer, self.messages[: i + 1], self.where)
        return len(upto) if self.text.startswith(upto) else self._end_after(i, upto)

    def text_end(self, k: int) -> int | None:
        """Where message k's text ends in the whole rendering (None: a probe cannot mark it)."""
        if k not in self._ends:
            self._ends[k] = self._probe(self.messages, k, self.text, False)
        found = self._ends[k]
        return None if found is None else found[1]

    def _probe_as_whole(self, messages: list[dict], k: int, text: str, generation: bool) -> int | None:
        """Where message k's text ends in `text`, probed in the place it was in the whole (content or tool call)."""
        self.text_end(k)  # probes the whole first, so that its place is known
        place = self._ends[k]
        found = None if place is None else self._probe(messages, k, text, generation, place[0])
        return None if found is None else found[1]

    def _end_after(self, i: int, upto: str) -> int | str:
        """Reply i's end, from the end of its text: the text that follows it in render(msgs[:i+1]) (its
        end-of-turn text, and whatever the template writes after the last message), matched against the whole."""
        whole, alone = self.text_end(i), self._probe_as_whole(self.messages[: i + 1], i, upto, False)
        if whole is None or alone is None:
            return self._unplaced(i, "its text does not keep its place when rendered with a probe character")
        return whole + self._matched(upto, alone, whole)

    def _start_after(self, i: int, k: int, prompt: str) -> int | str:
        """Reply i's start, from the end of message k's text (text_end(k) is known): the text that follows
        message k in the generation prompt for reply i, matched against the whole."""
        whole = self.text_end(k)
        alone = self._probe_as_whole(self.messages[:i], k, prompt, True)
        if whole is None or alone is None:
            return self._unplaced(i, f"message {k} does not keep its place when rendered with a probe character")
        matched = self._matched(prompt, alone, whole)
        if alone + matched < len(prompt):
            # The whole lacks the generation prompt's tail (DeepSeek-R1's "<think>\n"): fine if all that the
            # prompt renders before its generation prompt is there; else the prompt itself was rewritten.
            bare = render(self.tokenizer, self.messages[:i], self.where)
            bare_end = self._probe_as_whole(self.messages[:i], k, bare, False)
            if bare_end is None or matched < common_prefix(prompt[alone:], bare[bare_end:]):
                have, want = prompt[alone + matched :][:24], self.text[whole + matched :][:24]
                return self._unplaced(
                    i, f"after message {k} the prompt has {have!r} before its generation prompt, the whole {want!r}"
                )
        return whole + matched

    def _matched(self, part: str, alone: int, whole: int) -> int:
        """How much of part[alone:] (text of a rendering of some first messages, after a message's text)
        the whole holds after character `whole`: all of it, or its whole tokens up to where the two part."""
        matched = common_prefix(part[alone:], self.text[whole:])
        if alone + matched == len(part):
            return matched
        ids = encode_rendered(self.tokenizer, part)
        while matched > 0:  # back to the last token boundary of `part` (at most a token's length)
            head = encode_rendered(self.tokenizer, part[: alone + matched])
            if common_prefix(ids, head) == len(head):
                break
            matched -= 1
        return matched

    def _probe(
        self, messages: list[dict], k: int, text: str, generation: bool, place: int | None = None
    ) -> tuple[int, int] | None:
        """(probe place, where message k's text ends in `text`), `text` being `messages` rendered, found by
        rendering them again with a probe after the text (the first place of _probed_messages that works,
        or `place`); None when the probe does not show up exactly once with all else unchanged."""
        probe = next((c for c in _PROBES if c not in text), None)
        if probe is None:
            return None
        for n, probed in enumerate(_probed_messages(messages[k], probe)):
            if place is not None and n != place:
                continue
            try:
                other = render(self.tokenizer, [*messages[:k], probed, *messages[k + 1 :]], self.where, generation)
            except DataError:
                continue
            at = other.find(probe)
            if at >= 0 and other[:at] + other[at + 1 :] == text:
                return n, at
        return None

    def _unplaced(self, i: int, why: str) -> str:
        return (
            f"the chat template renders the conversation up to message {i} differently from the start of the whole "
            f"conversation, and reply {i} cannot be placed in the whole: {why}"
        )
