"""Evaluation by loss and by generation: does the model answer held-out prompts?

During a run, held_out_loss splits the eval set over the processes (FSDP in step) and
exact_match_records reads eval.exact_match_path; after it, `finetune eval` scores a run.

    from finetune.runs.evaluate import exact_match, score, comparison_table
    result = exact_match(model, tokenizer, records, fmt="alpaca")
    result.accuracy, result.contains_accuracy  # 0.93, 0.95

Prompts are built by data.prompt_and_answer, so they are token-for-token what
training saw before the response; prompt_ids does the same for free text
(`finetune generate`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from finetune.config.schema import RecipeConfig, resolve_path
from finetune.data import IGNORE_INDEX, Collator, generation_prompt, load_records, prompt_and_answer
from finetune.data.images import absolute_images, image_inputs, processor_of
from finetune.data.templates import end_of_turn_ids
from finetune.data.tokenize import prompt_images
from finetune.model.load import compute_device
from finetune.parallel import context
from finetune.parallel.distribute import is_sharded
from finetune.parallel.runtime import Parallel
from finetune.parallel.sequence import SPLIT_KEY


@dataclass
class ExactMatch:
    correct: int
    total: int
    samples: list[dict] = field(default_factory=list)  # a few (prompt, expected, got) for the log
    contained: int = 0  # answers found anywhere in the output: credits a right answer wrapped in extra words

    @property
    def accuracy(self) -> float:
        return self.correct / self.total if self.total else 0.0

    @property
    def contains_accuracy(self) -> float:
        return self.contained / self.total if self.total else 0.0

    def summary(self) -> str:
        return f"exact match {self.correct}/{self.total} = {100 * self.accuracy:.1f}%"


# --------------------------------------------------------------------------- loss


def shifted_targets(labels: torch.Tensor) -> torch.Tensor:
    """Labels aligned with logits: position t predicts token t+1."""
    return labels[:, 1:]


def loss_sum_and_count(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, int]:
    """Summed cross-entropy over target tokens, and their number.

    Only rows with a label are gathered before the fp32 upcast, so masked
    prompt positions never cost an fp32 copy of the vocabulary row.
    """
    targets = shifted_targets(labels)
    mask = targets != IGNORE_INDEX
    picked = logits[:, :-1][mask]
    n = int(mask.sum())
    if n == 0:
        return logits.sum() * 0.0, 0
    return F.cross_entropy(picked.float(), targets[mask], reduction="sum"), n


@torch.no_grad()
def mean_loss(model, examples: Sequence[dict], tokenizer, batch_size: int = 8) -> tuple[float | None, int]:
    """(mean cross-entropy per target token, number of target tokens) over tokenized examples."""
    device = compute_device(model)
    collate = Collator.for_tokenizer(tokenizer)
    total, count = 0.0, 0
    for start in range(0, len(examples), batch_size):
        batch = {k: v.to(device) for k, v in collate(list(examples[start : start + batch_size])).items()}
        inputs = {k: v for k, v in batch.items() if k != "labels"}  # ids, mask, and a VLM batch's image inputs
        logits = model(**inputs, use_cache=False).logits
        loss, n = loss_sum_and_count(logits, batch["labels"])
        total += float(loss)
        count += n
    return (total / count if count else None), count


def row_logps(model, batch: dict[str, torch.Tensor], head_on_targets_only: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(summed log-probability of each row's target tokens, their number), both shape (rows,).

    head_on_targets_only: the LM head runs only where a target is predicted (a boolean
    logits_to_keep), so a pair's prompt costs no logits."""
    inputs = {k: batch[k] for k in ("input_ids", "attention_mask", "position_ids", context.KEY, SPLIT_KEY) if k in batch}
    labels = batch["labels"]
    targets = shifted_targets(labels)
    mask = targets != IGNORE_INDEX
    rows = labels.shape[0]
    if head_on_targets_only:
        keep = torch.zeros_like(labels, dtype=torch.bool)
        keep[:, :-1] = mask
        logits = model(**inputs, use_cache=False, logits_to_keep=keep).logits  # (n_targets, vocab), row-major
    else:
        logits = model(**inputs, use_cache=False).logits[:, :-1][mask]
    token_logps = -F.cross_entropy(logits.float(), targets[mask], reduction="none")
    row_of_token = mask.nonzero()[:, 0]
    sums = torch.zeros(rows, dtype=token_logps.dtype, device=token_logps.device).index_add(0, row_of_token, token_logps)
    part: Any = batch.get(context.KEY)  # a context-parallel rank's part of each row: the group's parts added
    return context.whole_row_sums(part, sums, mask.sum(dim=1)) if part is not None else (sums, mask.sum(dim=1))


def chosen_wins(
    model, batch: dict[str, torch.Tensor], length_normalised: bool, head_on_targets_only: bool = False
) -> tuple[torch.Tensor, int]:
    """(pairs whose chosen side the model scores higher, pairs) for a batch of preference pairs (the
    chosen rows, then the rejected ones): by summed log-probability, or per token (length_normalised)."""
    logps, counts = row_logps(model, batch, head_on_targets_only)
    if length_normalised:
        logps = logps / counts.clamp(min=1)
    pairs = logps.shape[0] // 2
    return (logps[:pairs] > logps[pairs:]).sum().double(), pairs


def pair_ranking(model, pairs: Sequence[dict], pad_token_id: int, length_normalised: bool, batch_size: int = 8) -> float | None:
    """The fraction of preference pairs whose chosen response the model scores higher; None without pairs."""
    device = compute_device(model)
    collate = Collator(pad_token_id=pad_token_id)
    wins = total = 0.0
    with torch.no_grad():
        for start in range(0, len(pairs), batch_size):
            batch = {k: v.to(device) for k, v in collate(list(pairs[start : start + batch_size])).items()}
            won, n = chosen_wins(model, batch, length_normalised)
            wins, total = wins + float(won), total + n
    return wins / total if total else None


# --------------------------------------------------------------------------- generation


def prompt_ids(text: str, fmt: str, tokenizer, context: str = "", images: Sequence[str] = ()) -> list[int]:
    """The tokens training put before a response, for a user's free text.

    Each format builds a record from the text (its Format.prompt_record): alpaca: the
    alpaca prompt with `text` as the instruction (and `context` as its input, the only
    format that has one); chat formats: one user turn rendered by the chat template
    with the assistant header appended; completion: `text` as the prompt; text: `text`
    itself, to be continued. The same code path as evaluation (prompt_and_answer),
    with an empty answer.
    """
    return generation_prompt(text, fmt, tokenizer, context, images)


@torch.no_grad()
def generate(
    model,
    tokenizer,
    prompts: list[list[int]],
    max_new_tokens: int,
    temperature: float = 0.0,
    top_p: float = 1.0,
    seed: int | None = None,
    images: list[list[str]] | None = None,
) -> list[list[int]]:
    """Continuations (token ids, stop tokens removed) of a batch of tokenized prompts.

    temperature 0 is greedy decoding; above 0 samples (nucleus top_p), seeded by `seed`;
    images: each prompt's image files (a vision-language model; its prompt ids expanded for them).
    """
    device = compute_device(model)
    width = max(len(p) for p in prompts)
    pad = tokenizer.pad_token_id
    # Left padding keeps every prompt's last token in the last column, where generation starts.
    input_ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts], device=device)
    attention = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=device)
    stops = end_of_turn_ids(tokenizer)  # eos, <|im_end|>, <|eot_id|>, ... as this tokenizer has them
    sampling: dict[str, Any] = {"do_sample": False}
    if temperature > 0:
        sampling = {"do_sample": True, "temperature": temperature, "top_p": top_p, "top_k": 0}
        if seed is not None:
            torch.manual_seed(seed)  # generate draws from the global generator
    processor = processor_of(tokenizer)
    if processor is not None:  # the images' pixels (and token types), as training batched them
        pixels = image_inputs(processor, input_ids.cpu(), images or [[] for _ in prompts])
        sampling.update({k: v.to(device) for k, v in pixels.items()})
    out = model.generate(
        input_ids=input_ids,
        # Sharded (FSDP): every forward gathers weights from all ranks, so a rank whose answers
        # end early keeps stepping until all have ended.
        synced_gpus=is_sharded(model),
        attention_mask=attention,
        max_new_tokens=max_new_tokens,
        eos_token_id=stops,
        pad_token_id=pad,
        use_cache=True,
        **sampling,
    )
    results = []
    for row in out[:, width:].tolist():
        cut = next((i for i, t in enumerate(row) if t in stops), len(row))
        results.append(row[:cut])
    return results


def exact_match(
    model, tokenizer, records: list[dict], fmt: str, max_new_tokens: int = 32, batch_size: int = 32, keep_samples: int = 3
) -> ExactMatch:
    """Greedy answers scored two ways: equal to the expected answer, and containing it (both stripped)."""
    was_training = model.training
    model.eval()
    correct = contained = 0
    samples: list[dict[str, Any]] = []
    try:
        for start in range(0, len(records), batch_size):
            chunk = records[start : start + batch_size]
            pairs = [prompt_and_answer(r, fmt, tokenizer) for r in chunk]
            images = [prompt_images(r, fmt) for r in chunk]
            outputs = generate(model, tokenizer, [p for p, _ in pairs], max_new_tokens, images=images)
            for (_prompt, answer), out in zip(pairs, outputs):
                got = tokenizer.decode(out, skip_special_tokens=True).strip()
                expected = answer.strip()
                ok = got == expected
                correct += ok
                contained += bool(expected) and expected in got
                if len(samples) < keep_samples:
                    samples.append({"expected": expected, "got": got, "correct": ok})
    finally:
        model.train(was_training)
    return ExactMatch(correct=correct, total=len(records), samples=samples, contained=contained)


# --------------------------------------------------------------------------- side by side


@dataclass
class Scores:
    loss: float | None  # mean cross-entropy per trained token
    tokens: int  # trained tokens the loss averages over
    match: ExactMatch | None  # None for data.format=text (no answers to match)
    preference: float | None = None  # preference pairs: the fraction whose chosen response scores higher

    @property
    def perplexity(self) -> float | None:
        if self.loss is None:
            return None
        return math.exp(self.loss) if self.loss < 700 else math.inf  # exp overflows a float past ~709


def score(
    model,
    tokenizer,
    records: list[dict],
    examples: Sequence[dict],
    fmt: str,
    max_new_tokens: int = 32,
    batch_size: int = 8,
    length_normalised: bool = False,
) -> Scores:
    """Loss/perplexity over tokenized `examples` and exact/contains match over `records`. Preference
    pairs: the loss of the chosen responses, and how many pairs the model ranks right (per token
    with length_normalised, as orpo and simpo score)."""
    was_training = model.training
    model.eval()
    pairs = bool(examples) and "chosen" in examples[0]
    sequences = [ex["chosen"] for ex in examples] if pairs else examples
    try:
        loss, tokens = mean_loss(model, sequences, tokenizer, batch_size) if examples else (None, 0)
        ranking = pair_ranking(model, examples, tokenizer.pad_token_id, length_normalised, batch_size) if pairs else None
    finally:
        model.train(was_training)
    match = exact_match(model, tokenizer, records, fmt, max_new_tokens=max_new_tokens) if records and fmt != "text" else None
    return Scores(loss=loss, tokens=tokens, match=match, preference=ranking)


def comparison_table(columns: dict[str, Scores]) -> str:
    """Scores side by side, one column per model:

    metric              base  fine-tuned
    loss              2.3026      0.1054
    perplexity         10.00        1.11
    exact match         0.0%       98.7%
    contains match      2.0%       99.3%
    """

    def num(v: float | None, fmt: str) -> str:
        return "-" if v is None else format(v, fmt)

    def pct(m: ExactMatch | None, attr: str) -> str:
        return "-" if m is None else f"{100 * getattr(m, attr):.1f}%"

    rows = [
        ("loss", [num(s.loss, ".4f") for s in columns.values()]),
        ("perplexity", [num(s.perplexity, ".2f") for s in columns.values()]),
        ("exact match", [pct(s.match, "accuracy") for s in columns.values()]),
        ("contains match", [pct(s.match, "contains_accuracy") for s in columns.values()]),
    ]
    if any(s.preference is not None for s in columns.values()):
        rows.append(
            ("preference acc", [num(None if s.preference is None else 100 * s.preference, ".1f") + "%" for s in columns.values()])
        )
    width = max(12, *(len(name) for name in columns))
    lines = [f"{'metric':<16}" + "".join(f"{name:>{width}}" for name in columns)]
    lines += [f"{label:<16}" + "".join(f"{v:>{width}}" for v in values) for label, values in rows]
    return "\n".join(lines)


@torch.no_grad()
def held_out_loss(
    model,
    examples: Sequence[dict] | None,
    cfg: RecipeConfig,
    collate: Collator,
    parallel: Parallel,
    compute_loss: Callable,
) -> float | None:
    """Mean loss per target token over `examples`, split over the processes; None without examples.

    `model` is the unwrapped model: a DDP forward joins collectives (buffer broadcast), and a
    process with fewer eval batches than the others would leave them waiting.
    """
    if not examples:
        return None
    bs = cfg.eval.batch_size or cfg.train.batch_size
    batches = [examples[i : i + bs] for i in range(0, len(examples), bs)]
    if cfg.eval.max_batches:
        batches = batches[: cfg.eval.max_batches]
    model.eval()
    if not parallel.holds_whole_model:  # the batches pass through the stages
        moved = [{k: v.to(parallel.device) for k, v in collate(list(rows)).items()} for rows in batches]
        total, count = parallel.staged_held_out_sums(moved, bs)
        model.train()
        total, count = parallel.global_sum(total), parallel.global_sum(count)
        return total / count if count else None
    total = count = 0.0
    layout = parallel.layout  # a replica's ranks (tensor parallel) run its batches together; one counts them
    mine = batches[layout.replica :: layout.replicas]
    for r in range(parallel.eval_rounds(len(batches), len(mine))):
        rows = mine[r] if r < len(mine) else batches[0]
        batch = parallel.local_part(
            {k: v.to(parallel.device) for k, v in collate(list(rows)).items()}
        )  # a context-parallel rank's part
        loss, n = compute_loss(model, batch)
        if r < len(mine) and parallel.counts_window:
            total += float(loss)
            count += n
    model.train()
    total, count = parallel.global_sum(total), parallel.global_sum(count)
    return total / count if count else None


def exact_match_records(cfg: RecipeConfig) -> list[dict] | None:
    """eval.exact_match_path's records (the first eval.exact_match_limit), or None."""
    path = cfg.eval.exact_match_path
    if not path:
        return None
    records = load_records(resolve_path(path), cfg.data, key="eval.exact_match_path")
    records = records[: cfg.eval.exact_match_limit] if cfg.eval.exact_match_limit else records
    folder = Path(resolve_path(path)).parent if Path(resolve_path(path)).is_file() else None
    return absolute_images(records, folder, "eval.exact_match_path")
