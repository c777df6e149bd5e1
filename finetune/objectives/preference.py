"""Preference objectives (train.objective=dpo | orpo | simpo): the loss of a batch of pairs.

A batch of B pairs is 2B rows, the chosen sides then the rejected ones (finetune.data.Collator),
scored in one forward. Each row's score is the summed log-probability of its response tokens
(labels != IGNORE_INDEX), or their mean where the method normalises by length. Per pair:

    dpo    -log sigmoid(beta * ((pi_c - ref_c) - (pi_r - ref_r)))          Rafailov et al. 2023, eq. 7
    orpo   -mean_c + beta * -log sigmoid(log odds_c - log odds_r),          Hong et al. 2024, eq. 6
           odds = p / (1 - p), log p = the mean log-probability
    simpo  -log sigmoid(beta * mean_c - beta * mean_r - gamma)              Meng et al. 2024, eq. 6

The reference of DPO is the same model with its adapter switched off (no second copy of the
weights), or log-probabilities computed once before training (train.precompute_reference),
carried in the batch as "reference_logps". With LoRA B initialised to zero, policy and
reference agree exactly, so the first DPO loss is ln 2.

Like every loss here, a call returns (summed loss, units): the units are pairs, and the
trainer divides by the pairs of the whole step (all micro-batches, all processes). The
rewards of the last call are in `last_sums` (sums over its pairs), which metric_sums() hands the metrics.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import time
from collections.abc import Sequence
from contextlib import contextmanager
from functools import partial
from typing import Any

import torch
import torch.nn.functional as F

from finetune.declarations import objectives
from finetune.errors import TrainingError
from finetune.memory.linear_ce import logits_transform
from finetune.objectives.loss import Loss, target_positions
from finetune.runs.evaluate import chosen_wins, held_out_loss, row_logps
from finetune.runs.resume import data_fingerprint

REWARD_METRICS = ("rewards/chosen", "rewards/rejected", "rewards/margin", "rewards/accuracy")


@contextmanager
def adapter_off(model):
    """The base model: the PEFT adapter switched off for the forwards inside."""
    peft_model = getattr(model, "module", model)  # DDP's wrapper holds the PeftModel
    if not hasattr(peft_model, "disable_adapter"):
        raise TrainingError(
            f"train.objective=dpo scores against the base model with the adapter switched off, but "
            f"{type(peft_model).__name__} has no PEFT adapter to switch off",
            hint="train with lora set (the default), or use train.objective=orpo or simpo, which need no reference",
        )
    with peft_model.disable_adapter():
        yield


def log1mexp(x: torch.Tensor) -> torch.Tensor:
    """log(1 - exp(x)) for x < 0, accurate at both ends (Maechler 2012). torch.where differentiates
    both branches, so each gets an input where it is finite (0 x inf would be NaN); and x stays
    below -1e-6: a mean log-probability of exactly 0 (a certain answer) has no finite odds."""
    ln2 = math.log(2.0)
    x = x.clamp(max=-1e-6)
    near, far = torch.log(-torch.expm1(x.clamp(min=-ln2))), torch.log1p(-torch.exp(x.clamp(max=-ln2)))
    return torch.where(x > -ln2, near, far)


def pair_losses(
    objective: str,
    beta: float,
    chosen: torch.Tensor,
    rejected: torch.Tensor,
    n_chosen: torch.Tensor,
    n_rejected: torch.Tensor,
    ref_chosen: torch.Tensor | None = None,
    ref_rejected: torch.Tensor | None = None,
    gamma: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(loss of each pair, reward of chosen, reward of rejected) from summed log-probabilities."""
    if objective == "dpo":
        assert ref_chosen is not None and ref_rejected is not None, "dpo needs the reference log-probabilities"
        reward_c, reward_r = beta * (chosen - ref_chosen), beta * (rejected - ref_rejected)
        return -F.logsigmoid(reward_c - reward_r), reward_c, reward_r
    mean_c, mean_r = chosen / n_chosen.clamp(min=1), rejected / n_rejected.clamp(min=1)
    reward_c, reward_r = beta * mean_c, beta * mean_r
    if objective == "orpo":
        log_odds = (mean_c - log1mexp(mean_c)) - (mean_r - log1mexp(mean_r))
        return -mean_c - beta * F.logsigmoid(log_odds), reward_c, reward_r
    if objective == "simpo":
        return -F.logsigmoid(reward_c - reward_r - gamma), reward_c, reward_r
    raise ValueError(f"unknown preference objective {objective!r}")


class PreferenceLoss(Loss):
    """(model, batch of pairs) -> (summed loss over the pairs, number of pairs)."""

    ranks_pairs = True
    metric_keys = REWARD_METRICS

    def __init__(self, objective: str, beta: float, gamma: float = 0.0):
        self.objective, self.beta, self.gamma = objective, beta, gamma
        self.needs_reference = objective == "dpo"
        self.last_sums: dict[str, float] = {}

    def count(self, batch: dict[str, torch.Tensor]) -> int:
        return batch["input_ids"].shape[0] // 2

    def metric_sums(self) -> dict[str, float]:
        return self.last_sums

    def reference_logps(self, model, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """Each row's summed log-probability under the base model (precomputed ones when the batch has them)."""
        if "reference_logps" in batch:
            return batch["reference_logps"]
        with torch.no_grad(), adapter_off(model):
            return row_logps(model, batch, self.head_on_targets_only)[0]

    def __call__(self, model, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, int]:
        ref = self.reference_logps(model, batch) if self.objective == "dpo" else None
        return self._pairs_loss(*row_logps(model, batch, self.head_on_targets_only), ref)

    def reference_rows(self, owner: Any, hidden: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """A pipeline's last stage, in the pass with the adapter off: each row's summed log-probability."""
        return hidden_row_logps(owner, hidden, labels)[0]

    def head_loss(
        self,
        owner: Any,
        hidden: torch.Tensor,
        labels: torch.Tensor,
        reference: torch.Tensor | None = None,
        real: int | None = None,
    ) -> tuple[torch.Tensor, int]:
        """A pipeline's last stage: the pairs' loss from the final hidden states (parallel/pipeline.py).
        reference (dpo): the rows' log-probabilities with the adapter off, from the stages' pass before;
        real: the pairs that count (the first of each half: a short eval batch is filled with pairs)."""
        logps, counts = hidden_row_logps(owner, hidden, labels)
        if real is not None:
            half = logps.shape[0] // 2
            rows = torch.cat([torch.arange(real), half + torch.arange(real)]).to(logps.device)
            logps, counts = logps[rows], counts[rows]
            reference = None if reference is None else reference[rows]
        return self._pairs_loss(logps, counts, reference)

    def _pairs_loss(self, logps: torch.Tensor, counts: torch.Tensor, ref: torch.Tensor | None) -> tuple[torch.Tensor, int]:
        """(summed loss, pairs) of rows scored as chosen sides then rejected ones; the rewards into last_sums."""
        pairs = logps.shape[0] // 2
        losses, reward_c, reward_r = pair_losses(
            self.objective,
            self.beta,
            logps[:pairs],
            logps[pairs:],
            counts[:pairs],
            counts[pairs:],
            None if ref is None else ref[:pairs],
            None if ref is None else ref[pairs:],
            self.gamma,
        )
        reward_c, reward_r = reward_c.detach().float(), reward_r.detach().float()
        sums = torch.stack([reward_c.sum(), reward_r.sum(), (reward_c - reward_r).sum(), (reward_c > reward_r).sum()])
        self.last_sums = dict(zip(REWARD_METRICS, sums.tolist()))  # one device sync, not four
        return losses.sum(), pairs


def hidden_row_logps(owner: Any, hidden: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """runs/evaluate.row_logps from a decoder's final hidden states (a pipeline's last stage): the head on
    the target positions only."""
    keep = target_positions(labels)
    logits = owner.lm_head(hidden[keep])
    transform = logits_transform(owner.config)
    if transform is not None:
        logits = transform(logits)
    token_logps = -F.cross_entropy(logits.float(), labels[:, 1:][keep[:, :-1]], reduction="none")
    sums = torch.zeros(labels.shape[0], dtype=token_logps.dtype, device=token_logps.device)
    return sums.index_add(0, keep.nonzero()[:, 0], token_logps), keep.sum(dim=1)


def preference_accuracy(model, examples, cfg, collate, parallel, head_on_targets_only: bool = False) -> float | None:
    """The fraction of held-out pairs whose chosen response the model itself scores higher than
    the rejected one: summed log-probability (dpo), or per token (orpo, simpo: their rewards are
    length-normalised). Unlike the training metric rewards/accuracy (relative to the reference
    for dpo), it means the same before training as after."""
    per_token = objectives.get(cfg.train.objective).per_token
    score = partial(chosen_wins, length_normalised=per_token, head_on_targets_only=head_on_targets_only)
    return held_out_loss(model, examples, cfg, collate, parallel, score)


# ----------------------------------------------------------------------------- precomputed reference


class WithReference(Sequence):
    """Pairs carrying the base model's summed log-probabilities of their sides (train.precompute_reference)."""

    unit = "pairs"

    def __init__(self, pairs: Sequence[dict], table: torch.Tensor):
        self.pairs, self.table = pairs, table  # table: (pairs, 2) float32, chosen and rejected

    def __len__(self) -> int:
        return len(self.pairs)

    def __getitem__(self, i):
        i = range(len(self))[i]
        if isinstance(i, range):
            return [self[j] for j in i]
        return {**self.pairs[i], "reference_logps": self.table[i].tolist()}

    def lengths(self):
        return self.pairs.lengths()

    def fingerprint(self) -> str:
        """The pairs' (the reference values follow from them and the model, which resume checks apart)."""
        return data_fingerprint(self.pairs)


def reference_table(
    model, pairs: Sequence[dict], collate, device: torch.device, batch_size: int, head_only: bool
) -> torch.Tensor:
    """(pairs, 2): each side's summed log-probability with the adapter switched off. Every process
    runs the same batches (an FSDP forward is a collective)."""
    table = torch.zeros(len(pairs), 2, dtype=torch.float32)
    was_training = model.training
    model.eval()
    with torch.no_grad(), adapter_off(model):
        for start in range(0, len(pairs), batch_size):
            rows = [pairs[i] for i in range(start, min(start + batch_size, len(pairs)))]
            batch = {k: v.to(device) for k, v in collate(rows).items()}
            logps = row_logps(model, batch, head_only)[0].float().cpu()
            table[start : start + len(rows), 0], table[start : start + len(rows), 1] = logps[: len(rows)], logps[len(rows) :]
    model.train(was_training)
    return table


def reference_key(cfg, pairs: Sequence[dict], precision: str) -> str:
    """What the reference log-probabilities depend on: the model (its recipe keys, and for a local
    folder its weight files' sizes and times), quantization, precision, and the tokenized pairs."""
    from finetune.config.schema import resolve_path

    material: dict = {"model": cfg.model.model_dump(), "quant": cfg.quant.model_dump(), "precision": precision}
    material["lora"] = cfg.lora.model_dump() if cfg.lora is not None else None  # the adapter-off model can depend on it
    path = resolve_path(cfg.model.path)
    if os.path.isdir(path):
        material["files"] = sorted(
            (f.name, f.stat().st_size, f.stat().st_mtime_ns)
            for f in os.scandir(path)
            if f.name.endswith((".safetensors", ".bin"))
        )
    material["pairs"] = getattr(pairs, "fingerprint", lambda: str(len(pairs)))()
    return hashlib.sha256(json.dumps(material, sort_keys=True, default=str).encode()).hexdigest()[:24]


def precomputed_reference(
    model, pairs: Sequence[dict], cfg, collate, parallel, precision: str, head_only: bool, say
) -> WithReference:
    """The pairs with their reference log-probabilities: read from the cache, or computed once and
    written there (safetensors, atomically) by the main process."""
    from safetensors.torch import load_file, save_file

    from finetune.data.cache import cache_root

    path = cache_root(cfg).parent / "reference" / f"{reference_key(cfg, pairs, precision)}.safetensors"
    table = load_file(str(path))["reference_logps"] if path.exists() else None
    readable = table is not None and tuple(table.shape) == (len(pairs), 2)
    # All ranks read, or all compute: a cache on one node only must not split an FSDP forward.
    if parallel.global_sum(0.0 if readable else 1.0) == 0 and table is not None:
        say(f"reference: log-probabilities of {len(pairs)} pairs read from {path}")
        return WithReference(pairs, table)
    started = time.perf_counter()
    bs = cfg.eval.batch_size or cfg.train.batch_size
    table = reference_table(model, pairs, collate, parallel.device, bs, head_only)
    if parallel.is_main:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".tmp-{os.getpid()}")
        save_file({"reference_logps": table}, str(tmp))
        os.replace(tmp, path)
    say(f"reference: log-probabilities of {len(pairs)} pairs computed in {time.perf_counter() - started:.1f}s, cached at {path}")
    return WithReference(pairs, table)


def attach_reference(trainer, model):
    """The trainer's DataBundle with every pair (train and eval) carrying its reference log-probabilities."""
    import dataclasses

    loss, data = trainer.loss_fn, trainer.data
    assert isinstance(loss, PreferenceLoss), "train.precompute_reference is a preference objective's setting"

    def attach(pairs):
        parts = (trainer.cfg, trainer.collate, trainer.parallel, trainer.precision, loss.head_on_targets_only, trainer.say)
        return pairs and precomputed_reference(model, pairs, *parts)

    return dataclasses.replace(data, train=attach(data.train), eval=attach(data.eval))
