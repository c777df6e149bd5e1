"""Preference pairs: each side tokenized and masked as its own format trains it, stored side by side.

    pairs = PreferencePairs(sides)     # sides: TokenizedData, chosen at 2i, rejected at 2i + 1
    pairs[0] -> {"chosen": {"input_ids", "labels"}, "rejected": {"input_ids", "labels"}}

The Collator stacks a batch of pairs as [chosen rows; rejected rows], so one forward scores
both (finetune/objectives/preference.py splits it in half again).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from finetune.data.dataset import TokenizedData
from finetune.data.formats import get_format
from finetune.data.tokenize import Encoded, encode_records

# The mask of each side, as its format trains: a conversation's final reply only; a string
# response after its prompt.
SIDE_TRAIN_ON = {"messages": "last", "completion": "assistant"}


@dataclass(frozen=True)
class EncodedPair:
    chosen: Encoded
    rejected: Encoded
    chat: bool  # the sides are rendered conversations (for the mask checker)

    @property
    def sides(self) -> tuple[Encoded, Encoded]:
        return self.chosen, self.rejected

    @property
    def train_on(self) -> str:
        return SIDE_TRAIN_ON["messages" if self.chat else "completion"]


def encode_pairs(
    records: list[dict], fmt: str, tokenizer: Any, wheres: list[str], max_len: int | None = None
) -> list[EncodedPair | None]:
    """Pair records -> both sides encoded; None when either side has nothing to train (an empty
    response, or a reply that starts beyond max_len)."""
    split = get_format(fmt).pairs
    assert split is not None, f"data.format={fmt} is not a pair format"
    sides = [split(r) for r in records]
    out: list[EncodedPair | None] = [None] * len(records)
    for side_fmt, train_on in SIDE_TRAIN_ON.items():
        idx = [i for i, (f, _, _) in enumerate(sides) if f == side_fmt]
        if not idx:
            continue
        recs = [sides[i][1] for i in idx] + [sides[i][2] for i in idx]
        where = [f"{wheres[i]} (chosen)" for i in idx] + [f"{wheres[i]} (rejected)" for i in idx]
        encoded = encode_records(recs, side_fmt, tokenizer, train_on, where, max_len)
        for k, i in enumerate(idx):
            chosen, rejected = encoded[k], encoded[len(idx) + k]
            if chosen is not None and rejected is not None:
                out[i] = EncodedPair(chosen, rejected, chat=side_fmt == "messages")
    return out


class PreferencePairs(Sequence):
    """Pairs stored as one TokenizedData of interleaved sides; indexes like a list of pair dicts."""

    packed = False
    unit = "pairs"  # what one item is (the trainer's step descriptions)

    def __init__(self, sides: TokenizedData):
        if len(sides) % 2:
            raise ValueError(f"preference pairs need an even number of sides, got {len(sides)}")
        self.sides = sides

    def __len__(self) -> int:
        return len(self.sides) // 2

    def __getitem__(self, i):
        i = range(len(self))[i]  # negative indices, slices and IndexError as a list has them
        if isinstance(i, range):
            return [self[j] for j in i]
        return {"chosen": self.sides[2 * i], "rejected": self.sides[2 * i + 1]}

    def lengths(self) -> np.ndarray:
        """The longer side of each pair: what its row costs once the batch is padded."""
        both = self.sides.lengths()
        return np.maximum(both[0::2], both[1::2])

    def example_lengths(self) -> np.ndarray:
        return self.lengths()

    def fingerprint(self) -> str:
        return self.sides.fingerprint()

    def __repr__(self) -> str:
        return f"PreferencePairs({len(self)} pairs, {len(self.sides.input_ids):,} tokens)"
