"""preference: pairs for DPO / ORPO / SimPO, in TRL's standard and conversational forms.

    {"prompt": "2+2=", "chosen": "4", "rejected": "5"}                          standard (strings)
    {"prompt": [{"role": "user", "content": "2+2?"}],
     "chosen": [{"role": "assistant", "content": "4"}],
     "rejected": [{"role": "assistant", "content": "5"}]}                        conversational
    {"chosen": [user, assistant "4"], "rejected": [user, assistant "5"]}         whole conversations

A pair becomes two records of an existing format, each tokenized and masked as that format
trains: strings as `completion` (the prompt as written; the response + EOS trained),
conversations as `messages` rendered with the chat template, where only the final assistant
reply (and its end-of-turn token) is trained. Whole conversations must share every message
but their final assistant reply, which is the response.
"""

from __future__ import annotations

import reprlib

from finetune.data.formats.base import Format, Problem, conversation_problem, turns_problem

STRINGS, CONVERSATIONS = "completion", "messages"  # the formats a pair's two sides are encoded as
_TURN = '{"role": "assistant", "content": "..."}'


def _is_turns(value: object) -> bool:
    return isinstance(value, list)


def _shared_prefix(chosen: list[dict], rejected: list[dict]) -> int:
    n = 0
    while n < min(len(chosen), len(rejected)) and chosen[n] == rejected[n]:
        n += 1
    return n


def split_pair(rec: dict) -> tuple[str, dict, dict]:
    """(the format both sides are encoded as, the chosen record, the rejected record)."""
    prompt, chosen, rejected = rec.get("prompt"), rec["chosen"], rec["rejected"]
    if not _is_turns(chosen):
        return STRINGS, {"prompt": prompt, "completion": chosen}, {"prompt": prompt, "completion": rejected}
    head = list(prompt or [])
    return CONVERSATIONS, {"messages": head + chosen}, {"messages": head + rejected}


def _turns_problem(value: object, col: str) -> Problem | None:
    return turns_problem(value, col, ("role", "content"), _TURN)


def check(rec: dict) -> Problem | None:
    prompt, chosen, rejected = rec.get("prompt"), rec["chosen"], rec["rejected"]
    if isinstance(chosen, str) and isinstance(rejected, str):
        if not isinstance(prompt, str):
            what = f"column 'prompt' is {type(prompt).__name__} {reprlib.repr(prompt)}, expected a string"
            return what, "give string pairs a string prompt (or give prompt, chosen and rejected as message lists)"
        return None
    if not (_is_turns(chosen) and _is_turns(rejected)):
        what = f"chosen is {type(chosen).__name__} and rejected is {type(rejected).__name__}"
        return what, "give both as strings, or both as lists of messages"
    for col, value in (("prompt", prompt), ("chosen", chosen), ("rejected", rejected)):
        if value is not None and (col != "prompt" or value):
            problem = _turns_problem(value, col)
            if problem:
                return problem
    return _conversation_problem(list(prompt or []), chosen, rejected)


def _conversation_problem(prompt: list[dict], chosen: list[dict], rejected: list[dict]) -> Problem | None:
    """Both sides: one conversation each, the same up to a final assistant reply."""
    full_c, full_r = prompt + chosen, prompt + rejected
    shared = _shared_prefix(full_c, full_r)
    for col, full in (("chosen", full_c), ("rejected", full_r)):
        tail = full[shared:]
        if len(tail) != 1 or tail[0].get("role") != "assistant":
            what = (
                f"{col} differs from the other side in {len(tail)} message(s) ending with role "
                f"{tail[-1].get('role') if tail else None!r}; a pair must differ only in its final assistant reply"
            )
            return (
                what,
                "put the shared conversation in prompt (or in both sides) and one assistant reply in each of chosen and rejected",
            )
        if not any(m.get("role") == "user" for m in full[:shared]):
            return f"{col}: the reply answers no user message", "start the conversation with a user message"
    return conversation_problem(full_c) or conversation_problem(full_r)


FORMAT = Format(
    name="preference",
    columns=("chosen", "rejected"),
    optional=("prompt",),
    example='`{"prompt", "chosen", "rejected"}` (strings or message lists)',
    trained="chosen and rejected responses (+ EOS / end-of-turn), scored by train.objective",
    chat=False,
    pairs=split_pair,
    check=check,
    prompt_record=lambda text, context: {"prompt": text, "chosen": "", "rejected": ""},
    synonyms={
        "prompt": ("question", "instruction", "query", "input"),
        "chosen": ("preferred", "winner", "good", "accepted", "response_chosen"),
        "rejected": ("dispreferred", "loser", "bad", "response_rejected"),
    },
)
