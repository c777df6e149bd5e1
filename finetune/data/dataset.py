"""Tokenized data in memory and on disk: flat int32 arrays, the statistics, and the collator.

A list of Python lists costs ~36 bytes per token (object + pointer); the flat arrays
here cost 8 (ids + labels as int32), load from the cache without parsing, and still
index like a list: data[i] is {"input_ids": [...], "labels": [...]} (plus
"position_ids" for packed rows).

Packed rows hold several examples back to back; `starts` marks where each example
begins, and position ids restart there. Two examples of 3 and 2 tokens in one row:
    input_ids    = [<s>, a, b, <s>, c]
    labels       = [-100, a, b, -100, c]
    position_ids = [0, 1, 2, 0, 1]
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from finetune.data.tokenize import IGNORE_INDEX


@dataclass
class DataStats:
    examples: int  # kept examples
    dropped: int  # empty response, or nothing left to train after truncation
    truncated: int  # kept examples cut to max_seq_len
    tokens: int  # total tokens of kept examples
    trained_tokens: int  # tokens with a label != IGNORE_INDEX
    skipped: int = 0  # malformed rows skipped (data.skip_bad_rows)
    too_long: int = 0  # dropped for exceeding max_seq_len (data.truncation=drop)
    mask_dropped: int = 0  # left out by the mask check (data.mask_check=drop)
    rows: int = 0  # packed rows (0 when not packing)
    row_capacity: int = 0  # tokens a packed row holds (data.max_seq_len)
    warnings: list[str] = field(default_factory=list)
    unit: str = "examples"  # "prompts": an online objective's, nothing of them trained

    @property
    def packing_waste(self) -> float:
        """Fraction of packed-row capacity left empty (padding)."""
        return 1.0 - self.tokens / (self.rows * self.row_capacity) if self.rows else 0.0

    def summary(self) -> str:
        if self.unit == "prompts":  # the trained tokens are the completions sampled from them, later
            text = f"{self.examples} prompts, {self.tokens:,} tokens (completions sampled from them are trained)"
            return text + (f", {self.too_long} too long for train.max_new_tokens (dropped)" if self.too_long else "")
        pct = 100.0 * self.trained_tokens / self.tokens if self.tokens else 0.0
        text = (
            f"{self.examples} example{'s' if self.examples != 1 else ''}, {self.tokens:,} tokens "
            f"({pct:.1f}% trained), {self.truncated} truncated, {self.dropped} dropped"
        )
        if self.too_long:
            text += f", {self.too_long} too long (dropped)"
        if self.mask_dropped:
            text += f", {self.mask_dropped} failed the mask check (left out)"
        if self.skipped:
            text += f", {self.skipped} malformed (skipped)"
        if self.rows:
            text += f"; packed into {self.rows} rows of {self.row_capacity} ({100 * self.packing_waste:.1f}% padding)"
        return text

    def to_dict(self) -> dict[str, Any]:
        return {k: v for k, v in self.__dict__.items()}


class TokenizedData(Sequence):
    """Examples (or packed rows) stored as flat arrays; indexes like a list of dicts."""

    def __init__(
        self,
        input_ids: np.ndarray,
        labels: np.ndarray,
        offsets: np.ndarray,
        starts: np.ndarray | None = None,
        images: list[list[str]] | None = None,
    ):
        self.images = images  # each example's image files (vision-language data; never packed), or None
        self.input_ids = np.asarray(input_ids, dtype=np.int32)
        self.labels = np.asarray(labels, dtype=np.int32)
        self.offsets = np.asarray(offsets, dtype=np.int64)  # row i is [offsets[i], offsets[i+1])
        self.starts = None if starts is None else np.asarray(starts, dtype=np.int64)  # packed: example starts

    @classmethod
    def from_examples(
        cls,
        examples: Sequence[tuple[list[int], list[int]]],
        rows: list[list[int]] | None = None,
        images: list[list[str]] | None = None,
    ):
        """From (ids, labels) pairs; `rows` (lists of example indices) packs them, in that order; images: each
        example's image files (when any example has one)."""
        order = [i for row in rows for i in row] if rows is not None else range(len(examples))
        lengths = np.array([len(examples[i][0]) for i in order], dtype=np.int64)
        ends = np.cumsum(lengths)
        ids = np.fromiter((t for i in order for t in examples[i][0]), dtype=np.int32, count=int(ends[-1]) if len(ends) else 0)
        labels = np.fromiter((t for i in order for t in examples[i][1]), dtype=np.int32, count=len(ids))
        example_starts = np.concatenate([[0], ends[:-1]]) if len(ends) else np.zeros(0, np.int64)
        if rows is None:
            return cls(ids, labels, np.concatenate([[0], ends]), images=images if images and any(images) else None)
        assert not (images and any(images)), "examples with images are never packed"
        row_ends = np.cumsum([sum(len(examples[i][0]) for i in row) for row in rows])
        return cls(ids, labels, np.concatenate([[0], row_ends]), example_starts)

    @property
    def packed(self) -> bool:
        return self.starts is not None

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def lengths(self) -> np.ndarray:
        return np.diff(self.offsets)

    def example_lengths(self) -> np.ndarray:
        """Lengths of the examples themselves (packed rows split at their starts)."""
        if self.starts is None:
            return self.lengths()
        return np.diff(np.append(self.starts, self.offsets[-1]))

    def __getitem__(self, i):
        i = range(len(self))[i]  # negative indices, slices and IndexError as a list has them
        if isinstance(i, range):
            return [self[j] for j in i]
        a, b = int(self.offsets[i]), int(self.offsets[i + 1])
        row = {"input_ids": self.input_ids[a:b].tolist(), "labels": self.labels[a:b].tolist()}
        if self.images is not None:
            row["images"] = self.images[i]
        if self.starts is not None:
            lo, hi = np.searchsorted(self.starts, [a, b])
            pos = np.arange(a, b, dtype=np.int64)
            # Each token's position = its offset from the start of its example.
            begins = self.starts[lo:hi]
            pos -= begins[np.searchsorted(begins, pos, side="right") - 1]
            row["position_ids"] = pos.tolist()
        return row

    def __eq__(self, other: object) -> bool:  # comparable with a list of example dicts, as tests write them
        if isinstance(other, (TokenizedData, list, tuple)):
            return len(self) == len(other) and all(a == b for a, b in zip(self, other))
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]  # mutable arrays

    def __repr__(self) -> str:
        kind = "packed rows" if self.packed else "examples"
        return f"TokenizedData({len(self)} {kind}, {len(self.input_ids):,} tokens)"

    def fingerprint(self) -> str:
        h = hashlib.sha256()
        for arr in (self.input_ids, self.labels, self.offsets) + (() if self.starts is None else (self.starts,)):
            h.update(np.ascontiguousarray(arr).tobytes())
        if self.images is not None:
            h.update(json.dumps(self.images).encode())
        return h.hexdigest()[:16]

    def arrays(self) -> dict[str, np.ndarray]:
        out: dict[str, np.ndarray] = {"input_ids": self.input_ids, "labels": self.labels, "offsets": self.offsets}
        return out if self.starts is None else {**out, "starts": self.starts}


@dataclass
class DataBundle:
    train: Sequence[dict]
    eval: Sequence[dict] | None
    train_stats: DataStats
    eval_stats: DataStats | None
    from_cache: bool = False


@dataclass
class Collator:
    """Right-pad a list of examples to the longest (rounded up to pad_to_multiple_of).

    [{"input_ids": [1, 7, 8], "labels": [-100, 7, 8]}, {"input_ids": [1, 9], "labels": [-100, 9]}], pad 0 ->
        input_ids      = [[1, 7, 8], [1, 9, 0]]
        labels         = [[-100, 7, 8], [-100, 9, -100]]
        attention_mask = [[1, 1, 1], [1, 1, 0]]
    Packed rows (with position_ids) get no attention_mask: the model finds the
    examples from where position_ids restart and never attends across them
    (transformers' packed-sequence masks; flash-attention's varlen path on GPU).
    Padding then gets positions 0, 1, ... of its own, a segment nothing else sees.
    Labels are padded with IGNORE_INDEX by position, never by comparing ids with
    the pad id, so a tokenizer whose pad == eos still trains its eos.
    B preference pairs ({"chosen", "rejected"}) become 2B rows: the chosen sides, then the
    rejected ones in the same order, padded to one width so one forward scores both.
    """

    pad_token_id: int
    pad_to_multiple_of: int | None = None
    processor: Any = None  # a vision-language model's: examples with images get its pixel inputs (data/images.py)

    @classmethod
    def for_tokenizer(cls, tokenizer: Any, pad_to_multiple_of: int | None = None) -> Collator:
        """The collator of a run's tokenizer (and of the processor a vision-language model's carries)."""
        from finetune.data.images import processor_of

        return cls(tokenizer.pad_token_id, pad_to_multiple_of, processor_of(tokenizer))

    def __call__(self, examples: list[dict]) -> dict[str, Any]:
        import torch  # lazily: `finetune validate` imports this module without needing torch

        if not examples:
            raise ValueError("Collator got an empty batch")
        if "record" in examples[0]:  # prompts of an online objective (data/prompts.py): left-padded
            return collate_prompts(examples, self.pad_token_id)
        if "chosen" in examples[0]:  # preference pairs: B chosen rows, then their B rejected rows
            batch = self([ex["chosen"] for ex in examples] + [ex["rejected"] for ex in examples])
            if "reference_logps" in examples[0]:  # precomputed: (chosen, rejected) of each pair
                refs = [ex["reference_logps"][0] for ex in examples] + [ex["reference_logps"][1] for ex in examples]
                batch["reference_logps"] = torch.tensor(refs, dtype=torch.float32)
            return batch
        width = max(len(ex["input_ids"]) for ex in examples)
        if self.pad_to_multiple_of:
            width = math.ceil(width / self.pad_to_multiple_of) * self.pad_to_multiple_of
        ids = torch.full((len(examples), width), self.pad_token_id, dtype=torch.long)
        labels = torch.full_like(ids, IGNORE_INDEX)
        packed = "position_ids" in examples[0]
        mask = torch.zeros_like(ids)
        positions = torch.zeros_like(ids) if packed else None
        for row, ex in enumerate(examples):
            n = len(ex["input_ids"])
            ids[row, :n] = torch.tensor(ex["input_ids"], dtype=torch.long)
            labels[row, :n] = torch.tensor(ex.get("labels", ex["input_ids"]), dtype=torch.long)
            mask[row, :n] = 1
            if positions is not None:
                positions[row, :n] = torch.tensor(ex["position_ids"], dtype=torch.long)
                positions[row, n:] = torch.arange(width - n)
        if positions is None:
            batch = {"input_ids": ids, "labels": labels, "attention_mask": mask}
            if self.processor is not None:
                from finetune.data.images import image_inputs

                batch.update(image_inputs(self.processor, ids, [ex.get("images", []) for ex in examples]))
            return batch
        return {"input_ids": ids, "labels": labels, "position_ids": positions, "num_tokens": mask.sum()}


def count_tokens(batch: dict[str, Any]) -> int:
    """Non-padding tokens of a collated batch."""
    return int(batch["num_tokens"]) if "num_tokens" in batch else int(batch["attention_mask"].sum())


def collate_prompts(examples: list[dict], pad_token_id: int) -> dict[str, Any]:
    """Prompts left-padded (generation continues every row from its last token), with their texts and records."""
    import torch

    width = max(len(x["input_ids"]) for x in examples)
    ids = torch.full((len(examples), width), pad_token_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, x in enumerate(examples):
        n = len(x["input_ids"])
        ids[row, width - n :] = torch.tensor(x["input_ids"])
        mask[row, width - n :] = 1
    return {
        "input_ids": ids,
        "attention_mask": mask,
        "prompts": [x["prompt"] for x in examples],
        "records": [x["record"] for x in examples],
    }
