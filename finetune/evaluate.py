"""Task evaluation by greedy generation: does the model answer held-out prompts exactly?

    from finetune.evaluate import exact_match
    result = exact_match(model, tokenizer, records, fmt="alpaca")
    result.accuracy  # 0.93

Prompts are built by data.prompt_and_answer, so they are token-for-token what
training saw before the response.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from finetune.data import prompt_and_answer
from finetune.data.templates import end_of_turn_ids


@dataclass
class ExactMatch:
    correct: int
    total: int
    samples: list[dict] = field(default_factory=list)  # a few (prompt, expected, got) for the log

    @property
    def accuracy(self) -> float:
        return self.correct / self.total if self.total else 0.0

    def summary(self) -> str:
        return f"exact match {self.correct}/{self.total} = {100 * self.accuracy:.1f}%"


@torch.no_grad()
def generate(model, tokenizer, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """Greedy continuations (token ids, stop tokens removed) of a batch of tokenized prompts."""
    device = next(model.parameters()).device
    width = max(len(p) for p in prompts)
    pad = tokenizer.pad_token_id
    # Left padding keeps every prompt's last token in the last column, where generation starts.
    input_ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts], device=device)
    attention = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=device)
    stops = end_of_turn_ids(tokenizer)  # eos, <|im_end|>, <|eot_id|>, ... as this tokenizer has them
    out = model.generate(
        input_ids=input_ids,
        attention_mask=attention,
        max_new_tokens=max_new_tokens,
        do_sample=False,
        eos_token_id=stops,
        pad_token_id=pad,
        use_cache=True,
    )
    results = []
    for row in out[:, width:].tolist():
        cut = next((i for i, t in enumerate(row) if t in stops), len(row))
        results.append(row[:cut])
    return results


def exact_match(
    model, tokenizer, records: list[dict], fmt: str, max_new_tokens: int = 32, batch_size: int = 32, keep_samples: int = 3
) -> ExactMatch:
    was_training = model.training
    model.eval()
    correct = 0
    samples = []
    try:
        for start in range(0, len(records), batch_size):
            chunk = records[start : start + batch_size]
            pairs = [prompt_and_answer(r, fmt, tokenizer) for r in chunk]
            outputs = generate(model, tokenizer, [p for p, _ in pairs], max_new_tokens)
            for (prompt, answer), out in zip(pairs, outputs):
                got = tokenizer.decode(out, skip_special_tokens=True).strip()
                ok = got == answer.strip()
                correct += ok
                if len(samples) < keep_samples:
                    samples.append({"expected": answer.strip(), "got": got, "correct": ok})
    finally:
        model.train(was_training)
    return ExactMatch(correct=correct, total=len(records), samples=samples)
