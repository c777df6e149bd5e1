"""The training objective: summed next-token cross-entropy over target tokens, and their count.

A loss function takes (model, batch) and returns (summed loss, number of target tokens);
the trainer divides by the target tokens of the whole accumulation window on every
process, so pass your own `loss_fn` in the same form (see Trainer).

Mixture-of-experts models that compute a load-balancing loss (transformers' aux_loss, with
output_router_logits) get it added as transformers' own forward adds it to the mean
cross-entropy, `router_aux_loss_coef * aux`: in the summed form that is coef * aux * (the
micro-batch's target tokens), so after the trainer's division each micro-batch's aux weighs
what its share of the window's targets weighs (one micro-batch: exactly transformers' loss).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from finetune.data import IGNORE_INDEX
from finetune.data.images import IMAGE_INPUTS, TOKEN_TYPE_INPUTS
from finetune.declarations.splits import PIPELINE
from finetune.errors import ConfigError
from finetune.memory.linear_ce import (
    chunked_head_matches,
    chunked_linear_cross_entropy,
    fusable_head,
    liger_fused_loss,
    logits_transform,
    states_before_head,
)
from finetune.model.load import head_owner, takes_boolean_logits_to_keep
from finetune.runs.evaluate import loss_sum_and_count, shifted_targets


def count_targets(batch: dict[str, torch.Tensor]) -> int:
    return int((shifted_targets(batch["labels"]) != IGNORE_INDEX).sum())


def target_positions(labels: torch.Tensor) -> torch.Tensor:
    """(batch, seq) booleans: the positions whose next token is a target (where the head must run)."""
    keep = torch.zeros_like(labels, dtype=torch.bool)
    keep[:, :-1] = shifted_targets(labels) != IGNORE_INDEX
    return keep


def model_inputs(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """What the model is called with. Packed rows carry position_ids and no attention_mask: the
    model then keeps each packed example's attention to itself (finetune.data.dataset.Collator),
    but only without a KV cache (use_cache=False), which transformers would otherwise take as a
    sign of generation and ignore the packing. A vision-language batch carries its images' inputs
    (finetune/data/images.py). A context-parallel rank's part carries context_part, which
    the model hands to every attention call (finetune/parallel/context.py); a batch padded for sequence
    parallelism sequence_split, which the decoder layers' hooks take (finetune/parallel/sequence.py)."""
    keys = ("input_ids", "attention_mask", "position_ids", "context_part", "sequence_split", *IMAGE_INPUTS, *TOKEN_TYPE_INPUTS)
    return {k: batch[k] for k in keys if k in batch}


class Loss:
    """What the trainer asks of an objective, whatever it computes (every objective here is one):

    __call__(model, batch) -> (summed loss, units)   the trainer divides by the units of the whole window
    count(batch)       the units a batch holds: target tokens here, pairs for preference losses
    metric_sums()      sums of the last call that go into the step's metrics (rewards); none here
    ranks_pairs        held-out pairs are scored by how the model ranks them (preference objectives)
    fit(model)         adapt to the loaded model: the LM head on target positions only where it can
    use_memory(...)    memory.loss (chunked, liger) where the objective runs the head itself
    prepare(model, step, batches_of, steps)   the step's micro-batches made trainable (grpo samples them)
    metric_means(sums, units) the step's metrics from their sums over every micro-batch and process
    state_dict() / load_state_dict(saved)     what a checkpoint keeps of the objective on each process
    """

    ranks_pairs = False
    scores_held_out_loss = True  # an online objective's prompts have no targets to score a loss on
    flags_spikes = True  # a loss far above its recent mean is news (not a policy gradient's, ~0 of either sign)
    head_on_targets_only = False
    metric_keys: tuple[str, ...] = ()  # what metric_sums() returns, known before a call (a pipeline's stages all sum them)
    needs_reference = False  # dpo: the loss compares with the same rows' forward with the adapter off

    def __call__(self, model, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, int]:
        raise NotImplementedError

    def count(self, batch: dict[str, torch.Tensor]) -> int:
        return count_targets(batch)

    def metric_sums(self) -> dict[str, float]:
        return {}

    def metric_means(self, sums: dict[str, float], units: float) -> dict[str, float]:
        return {k: v / units for k, v in sums.items()}

    def prepare(self, model, step: int, batches_of: Callable[[int], list[dict[str, Any]]], steps: int) -> list[dict[str, Any]]:
        """The micro-batches optimizer step `step` (of `steps`) trains on; batches_of(s): step s's data."""
        return batches_of(step)

    def state_dict(self) -> dict[str, torch.Tensor]:
        """What a checkpoint keeps of this objective on each process (grpo: completions sampled ahead)."""
        return {}

    def load_state_dict(self, saved: dict[str, torch.Tensor]) -> str | None:
        """Take back state_dict()'s tensors; a note to print when they cannot be used."""
        return None

    def fit(self, model) -> None:
        self.head_on_targets_only = takes_boolean_logits_to_keep(model)

    def use_tokenizer(self, tokenizer) -> None:
        """The run's tokenizer, for an objective that writes text (grpo's completions)."""

    def use_rows(self, replica: int, row_group: tuple[Any, int] | None) -> None:
        """Where this process stands: its replica (which rows it trains) and, under context parallelism, the
        group whose ranks train parts of the same rows with its first rank (grpo: that rank samples for all)."""

    def use_memory(self, mode: str, chunk: int, device: torch.device, sharded: bool, head_partitioned: bool = False) -> None:
        """Only the causal-LM loss runs its head in chunks; other objectives train on their full logits.
        sharded: every rank runs each forward together (FSDP, ZeRO-3); head_partitioned: the head is a partition
        again once the forward has run (ZeRO-3)."""

    def head_loss(self, owner: Any, hidden: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, int]:
        """(summed loss, units) from the final hidden states (after the last norm): what a pipeline's last
        stage computes (finetune/parallel/pipeline.py). Only the causal-LM loss has one."""
        raise ConfigError(
            [
                f"{PIPELINE.key}: the last stage computes the loss from hidden states, which "
                f"{type(self).__name__} does not (only the causal-LM loss does). Set {PIPELINE.key}=1."
            ]
        )


class FunctionLoss(Loss):
    """A user's `loss_fn(model, batch) -> (summed loss, units)` as a Loss: its own `count(batch)` and
    `last_sums` when it has them (as attributes of the function object); the model left as it is."""

    def __init__(self, function) -> None:
        self.function = function

    def __call__(self, model, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, int]:
        return self.function(model, batch)

    def count(self, batch: dict[str, torch.Tensor]) -> int:
        count = getattr(self.function, "count", None)
        return count(batch) if count is not None else count_targets(batch)

    def metric_sums(self) -> dict[str, float]:
        return getattr(self.function, "last_sums", {})

    def fit(self, model) -> None:
        pass


def as_loss(loss_fn) -> Loss:
    """The trainer's objective: ours as they are, a user's function wrapped."""
    return loss_fn if isinstance(loss_fn, Loss) else FunctionLoss(loss_fn)


class CausalLMLoss(Loss):
    """Cross-entropy of the next token where a label is set.

    head_on_targets_only: run the LM head only where a target is predicted (a boolean
    logits_to_keep gives flat (n_targets, vocab) logits), so masked prompt positions cost
    no head matmul and no logits memory, which for a 150k vocabulary is most of the
    activation peak. Turned off for good by the first model that ignores or rejects it.

    chunk_rows (memory.loss=chunked|auto): the head and the loss run together over chunks
    of that many target positions (finetune.memory.linear_ce), so the logits of one chunk
    are all that ever exists; `auto` (chunk_only_above) takes that path only for batches
    with more targets than one chunk holds.
    """

    def __init__(self, head_on_targets_only: bool = True, chunk_rows: int | None = None, chunk_only_above: bool = False):
        self.head_on_targets_only = head_on_targets_only
        self.chunk_rows = chunk_rows
        self.chunk_only_above = chunk_only_above
        self.fused = None  # memory.loss=liger: (weight, hidden, targets, bias) -> summed loss, for a plain head
        self.checked = False  # the chunked head was checked against this model's own logits
        self.chunked_batches = 0  # batches that took the chunked path (for tests and the planner's check)
        self.aux_coef: float | None = None  # router_aux_loss_coef of an MoE model (0: none), read on the first batch

    def use_memory(self, mode: str, chunk: int, device: torch.device, sharded: bool, head_partitioned: bool = False) -> None:
        """memory.loss: full logits of the targets, chunked, or liger's fused kernel. auto chunks batches
        with more targets than one chunk, except under ZeRO-3 (whose head is a partition again once the forward
        has run: there the head runs on target positions only). Under FSDP every batch is chunked: the one
        check of the chunked head runs the model (FSDP's gathers), so every rank must take it at the same batch."""
        if mode == "full" or (mode == "auto" and head_partitioned):
            return
        if mode == "liger":
            if device.type != "cuda":
                raise ConfigError(
                    [
                        f"memory.loss=liger runs liger-kernel's CUDA kernel; this run is on {device}. "
                        "Use memory.loss=chunked (the same memory, any device)."
                    ]
                )
            self.fused = liger_fused_loss()
            if self.fused is None:
                raise ConfigError(
                    ["memory.loss=liger needs liger-kernel: pip install 'finetune[gpu]'; or use memory.loss=chunked."]
                )
        self.chunk_rows, self.chunk_only_above = chunking(mode, chunk, sharded, head_partitioned)

    def __call__(self, model, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, int]:
        inputs: dict = model_inputs(batch)
        if self.aux_coef is None:
            self.aux_coef = router_aux_coef(model)
        if self.aux_coef:
            inputs["output_router_logits"] = True
        loss, n, out = self._cross_entropy(model, inputs, batch["labels"])
        aux = getattr(out, "aux_loss", None)
        if self.aux_coef and isinstance(aux, torch.Tensor):
            loss = loss + self.aux_coef * n * aux.to(loss.dtype)
        return loss, n

    def _cross_entropy(self, model, inputs: dict, labels: torch.Tensor) -> tuple[torch.Tensor, int, object]:
        """(summed cross-entropy, target tokens, the model's output: aux_loss and all)."""
        keep = target_positions(labels)
        owner = head_owner(model) if isinstance(model, torch.nn.Module) else None  # a plain callable: a test's stand-in
        # A head split along the vocabulary (parallel/vocab.py) always chunks: no whole-vocabulary logits on any rank.
        split = owner is not None and hasattr(owner.lm_head, "vocab_split")
        if self.chunk_rows and (split or not (self.chunk_only_above and int(keep.sum()) <= self.chunk_rows)):
            if owner is not None and self._reproduces_logits(model, owner, inputs["input_ids"].device):
                self.chunked_batches += 1
                return self._chunked(model, owner, inputs, labels, keep)
        if self.head_on_targets_only:
            try:
                out = model(**inputs, use_cache=False, logits_to_keep=keep)
            except (TypeError, IndexError):
                # TypeError: no such argument. IndexError: a model (or a transformers release
                # before the boolean form, e.g. 5.17) that slices hidden_states[:, keep, :].
                # A real indexing bug raises again on the full path below.
                out = None
            if out is not None and out.logits.dim() == 2:
                n = int(keep.sum())
                if n == 0:
                    return out.logits.sum() * 0.0, 0, out
                return F.cross_entropy(out.logits.float(), labels[:, 1:][keep[:, :-1]], reduction="sum"), n, out
            self.head_on_targets_only = False  # this model ignores or rejects it: full logits from now on
            if out is not None:
                return (*loss_sum_and_count(out.logits, labels), out)
        out = model(**inputs, use_cache=False)
        return (*loss_sum_and_count(out.logits, labels), out)

    def _reproduces_logits(self, model, owner: torch.nn.Module, device: torch.device) -> bool:
        """Checked once, on the first batch that would be chunked: a model whose forward changes its
        logits in a way logits_transform does not know trains on the full logits instead."""
        if not self.checked:
            self.checked = True
            if not head_reproduces_logits(model, owner, device):
                self.chunk_rows = None
        return self.chunk_rows is not None

    def _chunked(
        self, model, owner: torch.nn.Module, inputs: dict, labels: torch.Tensor, keep: torch.Tensor
    ) -> tuple[torch.Tensor, int, object]:
        """The decoder runs with a stand-in head that keeps its input and makes no logits; the real
        head then runs chunk by chunk inside the loss."""
        hidden: torch.Tensor | None = None
        out: Any = None
        if self.head_on_targets_only:
            try:
                hidden, out = states_before_head(model, owner, {**inputs, "use_cache": False, "logits_to_keep": keep})
            except (TypeError, IndexError):  # no boolean logits_to_keep: the head sees every position
                self.head_on_targets_only = False  # from now on (as the unchunked path decides)
        if hidden is None:
            hidden, out = states_before_head(model, owner, {**inputs, "use_cache": False})
        loss, n = self._head_in_chunks(owner, hidden, labels, keep)
        return loss + out.logits.sum() * 0.0, n, out  # the empty logits in the loss: FSDP's root backward runs

    def _head_in_chunks(
        self, owner: torch.nn.Module, hidden: torch.Tensor, labels: torch.Tensor, keep: torch.Tensor
    ) -> tuple[torch.Tensor, int]:
        """liger's fused kernel where it fits, else the head and the loss over chunk_rows targets at a time."""
        head = owner.lm_head
        assert isinstance(head, torch.nn.Module)
        if hidden.dim() == 3:  # the whole (batch, seq, hidden): keep the positions that predict a target
            hidden = hidden[keep]
        targets = labels[:, 1:][keep[:, :-1]]
        transform = logits_transform(owner.config)
        if (
            self.fused is not None
            and transform is None
            and fusable_head(head)
            and not hasattr(head, "vocab_split")
            and targets.numel()
        ):
            return self.fused(head.weight, hidden, targets, head.bias), int(targets.numel())
        assert self.chunk_rows is not None
        return chunked_linear_cross_entropy(hidden, head, targets, self.chunk_rows, transform), int(targets.numel())

    def head_loss(self, owner: Any, hidden: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, int]:
        keep = target_positions(labels)
        if self.chunk_rows and not (self.chunk_only_above and int(keep.sum()) <= self.chunk_rows):
            return self._head_in_chunks(owner, hidden, labels, keep)
        logits = owner.lm_head(hidden[keep])  # the head on target positions only, as head_on_targets_only
        transform = logits_transform(owner.config)
        if transform is not None:
            logits = transform(logits)
        return F.cross_entropy(logits.float(), labels[:, 1:][keep[:, :-1]], reduction="sum"), int(keep.sum())


def chunking(mode: str, chunk: int, sharded: bool, head_partitioned: bool) -> tuple[int | None, bool]:
    """memory.loss -> (positions per chunk of the head, or None: full logits; whether only batches with more targets
    than one chunk take it). auto chunks such batches, except under ZeRO-3 (its head is a partition again once the
    forward has run); under FSDP every batch (the one check of the chunked head runs the model: every rank at once)."""
    if mode == "full" or (mode == "auto" and head_partitioned):
        return None, False
    return chunk, mode == "auto" and not sharded


def head_reproduces_logits(model, owner: torch.nn.Module, device: torch.device) -> bool:
    """Whether the head called by itself (+ logits_transform) gives the model's own logits; warns when not."""
    # The module inside DDP's wrapper: the probe must join no collective (ranks chunk independently).
    if chunked_head_matches(getattr(model, "module", model), owner, device):
        return True
    warnings.warn(
        f"memory.loss: {type(owner).__name__} post-processes its logits in a way the chunked loss does "
        "not reproduce; training on the full logits (set memory.loss=full to silence this)",
        stacklevel=3,
    )
    return False


def router_aux_coef(model) -> float:
    """The weight of the model's load-balancing loss (config.router_aux_loss_coef) when it computes one
    (transformers' MoE models: config.output_router_logits exists), else 0."""
    owner = head_owner(model) if isinstance(model, torch.nn.Module) else None  # a plain callable: a test's stand-in
    config = getattr(owner, "config", None)
    if config is None or not hasattr(config, "output_router_logits"):
        return 0.0
    return float(getattr(config, "router_aux_loss_coef", 0.0) or 0.0)
