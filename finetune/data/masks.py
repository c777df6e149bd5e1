"""The mask checker: label masks that would silently train the wrong tokens are refused before training.

Every tokenized example is checked (the checks run at C speed on lists, so a
whole dataset costs little next to tokenizing it). A finding names its kind, how
many examples have it, and the first one, with the file and record:

    all_masked      a non-empty reply, yet not one label is trained
    none_masked     a conversation where every token is trained (the prompt mask did not apply)
    end_untrained   a reply whose trained tokens hold no eos / end-of-turn token: the model never learns to stop
    double_bos      the example starts with two BOS tokens (template writes one, tokenizer adds another)
    boundary        prompt and response tokenize differently apart than together (see tokenize.py), or a
                    chat reply cannot be placed exactly in the rendered conversation (see replies.py): such
                    a reply is never trained, so a conversation with no reply placed is not also all_masked

data.mask_check=error (default) raises on any finding, warn prints them, drop leaves the
flagged examples out (counted), off skips the check.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from finetune.data.tokenize import IGNORE_INDEX, Encoded
from finetune.errors import DataError

FIXES = {
    "all_masked": "the reply's tokens were not found in the rendered example; check data.template and the "
    "tokenizer's chat template",
    "none_masked": "the prompt was not masked; check data.template, or set data.train_on=all if training on "
    "prompts is what you want",
    "end_untrained": "the template ends replies without eos or an end-of-turn token this tokenizer has as one "
    "token; choose data.template=chatml/llama3/mistral/alpaca or a tokenizer with that token",
    "double_bos": "the chat template writes bos_token and the tokenizer adds another; use a template without "
    "{{ bos_token }} or a tokenizer that does not add BOS",
    "boundary": "for prompt/response data, end the prompt at a token boundary (e.g. prompt 'Answer:' + "
    "completion ' 4', not 'Answer: ' + '4'); for chat data, data.train_on=last where the finding says the final "
    "reply is placed exactly, or a template whose replies render alike wherever they stand "
    "(data.template=chatml/llama3/mistral)",
}


@dataclass
class Finding:
    kind: str
    count: int
    first: str  # where the first example with this finding is, and what it looks like

    def describe(self) -> str:
        n = f"{self.count} example{'s' if self.count != 1 else ''}"
        return f"{self.kind}: {n}, first {self.first}"


def example_findings(enc: Encoded, chat: bool, train_on: str, bos: int | None, ends: set[int]) -> list[str]:
    """Kinds of problem this one example has (see the module docstring)."""
    found = []
    labels, ids = enc.labels, enc.input_ids
    n_masked = labels.count(IGNORE_INDEX)
    if n_masked == len(labels) and not enc.boundary:
        found.append("all_masked")
    elif chat and train_on != "all" and n_masked <= 1:
        found.append("none_masked")  # a conversation always has a user turn to mask
    if any(b > a and ends.isdisjoint(labels[a:b]) for a, b in enc.spans):
        found.append("end_untrained")
    if bos is not None and len(ids) > 1 and ids[0] == ids[1] == bos:
        found.append("double_bos")
    if enc.boundary:
        found.append("boundary")
    return found


def merge_findings(into: dict[str, Finding], kinds: list[str], tokenizer: Any, enc: Encoded, where: str) -> None:
    for kind in kinds:
        if kind in into:
            into[kind].count += 1
        else:
            into[kind] = Finding(kind, 1, f"{where}: {_detail(kind, tokenizer, enc)}")


def enforce(findings: dict[str, Finding], policy: str, key: str = "data") -> list[str]:
    """Apply data.mask_check: raise (error), or return warning lines (warn, drop), or nothing (off)."""
    if not findings or policy == "off":
        return []
    lines = [f.describe() for f in findings.values()]
    if policy == "error":
        fixes = "; ".join(f"{k}: {FIXES[k]}" for k in findings)  # one fix per kind found
        raise DataError(
            f"{key}: the label-mask check failed, so training would learn the wrong tokens:\n    " + "\n    ".join(lines),
            hint=f"{fixes}. `finetune data RECIPE` shows the examples with trained tokens marked; "
            "data.mask_check=drop leaves the flagged examples out, warn trains them anyway"
            + (" (but never a chat reply that cannot be placed)" if "boundary" in findings else ""),
        )
    verb = "left out" if policy == "drop" else "kept"
    return [f"mask check ({verb}): {line}" for line in lines]


def _detail(kind: str, tokenizer: Any, enc: Encoded) -> str:
    """What the first example with this finding looks like, in tokens."""
    tokens = tokenizer.convert_ids_to_tokens
    if kind == "boundary":
        return enc.boundary or ""
    if kind == "end_untrained":
        a, b = next((a, b) for a, b in enc.spans if b > a)
        return f"reply ends in tokens {tokens(enc.input_ids[max(a, b - 6) : b])}, none of them eos or an end-of-turn token"
    head = tokens(enc.input_ids[:16])
    return f"tokens {head}{' ...' if len(enc.input_ids) > 16 else ''}"
