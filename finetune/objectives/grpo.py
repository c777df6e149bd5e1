"""GRPO (train.objective=grpo): online RL from reward functions (Shao et al. 2024, DeepSeekMath).

Each step's micro-batch of prompts becomes a batch of sampled completions (prepare): the model itself
(4-bit base + the current adapter; no second copy of the weights) samples train.num_generations
completions of each prompt with a KV cache, each cut after its first end token; the rewards
(objectives/rewards.py) score them; each prompt's group of rewards becomes advantages

    grpo, dapo   A = (r - mean(group)) / (std(group) + 1e-4)
    dr_grpo      A = r - mean(group)                         (Liu et al. 2025: no std, no length bias)

and the loss of a completion token t is the clipped policy-gradient term, plus beta x KL to the base
(the adapter switched off, as DPO's reference; k3 estimator, Schulman 2020):

    ratio = exp(logp_t - logp_t_sampling)     against the policy that sampled the completion (importance_sampling=
                                              sequence, GSPO: exp of the completion's mean of them, one per completion)
    l_t = -min(ratio A, clip(ratio, 1 - epsilon, 1 + epsilon_high) A) + beta (exp(ref_t - logp_t) - (ref_t - logp_t) - 1)

    grpo     each completion's token mean, averaged over completions      (units: completions)
    dr_grpo  each completion's token sum / max_new_tokens, averaged        (units: completions)
    dapo     the mean over every completion token of the step             (units: completion tokens)

A sampling serves train.steps_per_generation (k) optimizer steps: at the first step of each cycle the
prompts of every step up to the cycle's end are sampled by the policy of that moment, and each step
trains on its own prompts' completions. With k = 1 the sampling policy is the one being trained (ratio
1, its gradient the policy gradient; no extra pass); with k > 1 the sampling policy's log-probabilities
are computed once, right after sampling, and later steps' ratios move away from 1 and are clipped.
train.num_iterations (mu, TRL's) trains each step's completions mu times: a cycle is k x mu steps, the k steps'
prompts in turn, mu times over (data_step), each against the policy that sampled it; mu = 1 is the above.

Only completion tokens up to and including the first end token are trained (labels), never the
prompt or the padding. Groups never span processes: each rank samples every completion of its own
prompts, so the group statistics are the same on any number of processes. Each micro-batch samples
from a generator seeded by (seed, step, micro-batch, rank), and the completions sampled ahead for
later steps go into every checkpoint (state_dict): a resumed run trains on what the uninterrupted one did.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from finetune.data import IGNORE_INDEX
from finetune.errors import ConfigError
from finetune.memory.linear_ce import chunked_token_logps, logits_transform, states_before_head
from finetune.model.load import compute_device, head_owner
from finetune.objectives.dapo import overlong_penalty, refill
from finetune.objectives.loss import Loss, chunking, head_reproduces_logits, model_inputs
from finetune.objectives.preference import adapter_off
from finetune.objectives.prompt_sharing import Sharing, holds_on, shared_rows, sharing_for
from finetune.objectives.rewards import Reward, score
from finetune.objectives.sampling import Completions, complete, end_ids, sampling_seed, trainable_rows
from finetune.parallel import context

DYNAMIC_SAMPLING_SHARDED = (
    "train.dynamic_sampling with sharded weights (FSDP): every rank would have to redraw together. "
    "Set train.dynamic_sampling=0, or use distributed.strategy=ddp."
)
SHARING_REFUSED = (
    "grpo: this model's forward did not give a shared prompt's rows their own log-probabilities on a probe "
    "(objectives/prompt_sharing.holds_on); each completion trains on its own row, as before (slower on long prompts)"
)
EPS_STD = 1e-4  # TRL's, so that a group whose rewards barely differ does not blow its advantages up
DAPO_EPSILON_HIGH = 0.28  # DAPO's clip-higher (Yu et al. 2025)


def advantages(rewards: torch.Tensor, group: int, scale: bool) -> torch.Tensor:
    """Each completion's reward against its group's mean (and std when `scale`), in sampling order."""
    grouped = rewards.view(-1, group)
    centred = grouped - grouped.mean(dim=1, keepdim=True)
    if scale:
        centred = centred / (grouped.std(dim=1, keepdim=True) + EPS_STD)
    return centred.reshape(-1)


def token_losses(
    logps: torch.Tensor,
    sampled_logps: torch.Tensor,
    adv: torch.Tensor,
    epsilon: float,
    epsilon_high: float,
    beta: float = 0.0,
    ref_logps: torch.Tensor | None = None,
    sequence_mask: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(loss of every completion token, whether its ratio was clipped, its KL to the reference). sequence_mask (the
    completion tokens, GSPO): every token of a completion takes the completion's one ratio, the exp of the mean of
    its tokens' log-ratios, clipped as one."""
    log_ratio = logps - sampled_logps
    if sequence_mask is not None:
        m = sequence_mask.to(log_ratio.dtype)
        log_ratio = ((log_ratio * m).sum(-1, keepdim=True) / m.sum(-1, keepdim=True).clamp(min=1)).expand_as(logps)
    ratio = torch.exp(log_ratio)
    a = adv.unsqueeze(-1)
    clipped_ratio = ratio.clamp(1 - epsilon, 1 + epsilon_high)
    loss = -torch.minimum(ratio * a, clipped_ratio * a)
    clipped = (ratio * a > clipped_ratio * a).detach()  # the clip chose the bound
    kl = torch.zeros_like(logps)
    if beta and ref_logps is not None:
        delta = ref_logps - logps
        kl = torch.exp(delta) - delta - 1
        loss = loss + beta * kl
    return loss, clipped, kl.detach()


def completion_logps(
    model,
    batch: dict[str, torch.Tensor],
    temperature: float,
    head_on_targets_only: bool = False,
    sharing: Sharing | None = None,
    chunk_rows: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(log-probability of each next token at the sampling temperature, 0 off the completions; whether it is a
    completion token), both (rows, seq - 1). head_on_targets_only: the LM head (and the fp32 softmax over the
    vocabulary) runs on completion positions only, through a boolean logits_to_keep, not on every prompt token.
    sharing: each group's prompt runs once, its completions behind it (prompt_sharing.py), where that pays.
    chunk_rows (memory.loss chunked): the head runs over that many completion tokens at a time, its logits recomputed
    in backward (memory/linear_ce.py): no (tokens x vocabulary) logits."""
    targets = batch["labels"][:, 1:]
    mask = targets != IGNORE_INDEX
    shared = shared_rows(batch, sharing) if sharing is not None else None
    if shared is not None:
        inputs, keep, order = shared.inputs, shared.keep, shared.picks
    else:  # whole rows and their mask, or a context-parallel rank's part and its positions
        inputs, keep, order = model_inputs(batch), torch.zeros_like(batch["labels"], dtype=torch.bool), None
        keep[:, :-1] = mask
    owner = head_owner(model) if chunk_rows else None
    given = {**inputs, **({"logits_to_keep": keep} if head_on_targets_only else {})}
    out: Any = None
    states, out = states_before_head(model, owner, given) if owner is not None else (model(**given).logits, None)
    states = states[keep] if states.dim() == 3 else states  # (kept, .) from every position's (rows, L, .)
    states = states[order] if order is not None else states  # a shared prompt's last position read per completion
    if owner is not None and chunk_rows:
        head: Any = owner.lm_head
        picked = chunked_token_logps(states, head, targets[mask], chunk_rows, logits_transform(owner.config), temperature)
        picked = picked + out.logits.sum() * 0.0  # the empty logits in the graph: FSDP's root backward runs
    else:
        picked = -F.cross_entropy(states.float() / temperature, targets[mask], reduction="none")
    return torch.zeros(mask.shape, dtype=picked.dtype, device=picked.device).masked_scatter(mask, picked), mask


class GRPOLoss(Loss):
    """(model, batch of sampled completions) -> (summed loss, units); prepare() samples them."""

    scores_held_out_loss = False
    flags_spikes = False

    def __init__(self, train: Any, rewards: list[Reward], seed: int = 0):
        self.train, self.rewards, self.seed = train, rewards, seed
        self.group = train.num_generations
        self.epsilon = train.epsilon
        high = train.epsilon_high
        self.epsilon_high = high if high is not None else (DAPO_EPSILON_HIGH if train.loss_type == "dapo" else train.epsilon)
        self.beta = float(train.beta or 0.0)
        self.tokenizer: Any = None  # use_tokenizer()
        self.sharing: Sharing | None = None  # fit(): whether the model can share a group's prompt in one row
        self.dropout = False  # fit(): the model has active dropout (its training forward then never shares)
        self.sharing_checked = False  # the model's forward was checked on a probe (prompt_sharing.holds_on)
        self.chunk_rows: int | None = None  # use_memory(): completion tokens per chunk of the head (None: whole)
        self.chunk_only_above = False  # memory.loss=auto: chunk only batches with more completion tokens than a chunk
        self.head_checked = False  # the chunked head was checked against the model's own logits
        self.ready: dict[int, list[dict[str, Any]]] = {}  # step -> its completions, sampled at its cycle's start
        self.served: set[int] = set()  # the steps of `ready` handed out already
        self.synced = False  # use_memory(): the weights are sharded
        self.replica = _rank()  # use_rows(): which rows this process samples for
        self.row_group: tuple[Any, int] | None = None  # use_rows(): a context-parallel group, whose first rank samples
        self.last_sums: dict[str, float] = {}
        self.metric_keys = ("_sequences", "reward", "reward_std", "frac_reward_zero_std", "completion_length")
        names = [r.name for r in rewards]
        penalty = next(n for n in ("overlong", *(f"overlong_{i}" for i in range(2, 99))) if n not in names)
        self.reward_names = names + ([penalty] if train.overlong_buffer else [])  # (a reward of yours named overlong)
        self.metric_keys += ("clip_ratio", "kl") + tuple(f"rewards/{name}" for name in self.reward_names)
        self.metric_keys += ("redraws",) if train.dynamic_sampling else ()

    def fit(self, model) -> None:
        super().fit(model)
        self.sharing = sharing_for(model, self.group)  # each group's prompt run once where the model allows
        # LoRA (or model) dropout: a shared prompt would draw one mask for the group's rows (prompt_sharing.py)
        text = getattr(head_owner(model), "config", None)
        attention_dropout = float(getattr(text, "attention_dropout", 0.0) or 0.0) if text is not None else 0.0
        self.dropout = attention_dropout > 0 or any(isinstance(m, torch.nn.Dropout) and m.p > 0 for m in model.modules())

    def use_tokenizer(self, tokenizer) -> None:
        self.tokenizer = tokenizer

    def use_memory(self, mode: str, chunk: int, device: torch.device, sharded: bool, head_partitioned: bool = False) -> None:
        """sharded (FSDP): generate steps every rank's decoder alike (each step gathers the weights). memory.loss as the
        causal-LM loss reads it (chunked, or auto for more completion tokens than a chunk; liger is refused with grpo:
        its fused kernel sums a loss, and GRPO needs each token's log-probability)."""
        if sharded and self.train.dynamic_sampling:  # a rank redrawing alone would wait in FSDP's gathers forever
            raise ConfigError([DYNAMIC_SAMPLING_SHARDED])
        self.synced = sharded
        self.chunk_rows, self.chunk_only_above = chunking(mode, chunk, sharded, head_partitioned)
        for reward in self.rewards:  # a reward model is loaded where the policy trains
            if hasattr(reward.fn, "use_device"):
                reward.fn.use_device(device)

    def logps(self, model, batch: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
        """completion_logps as this run computes them: the prompt shared where it can be (the model checked once, at
        the first call: every rank makes it at the same micro-batch, FSDP's gathers and all), the head chunked where
        memory.loss says (checked once against the model's own logits: a head it cannot reproduce runs whole)."""
        chunk = self.chunk_rows
        if chunk and self.chunk_only_above and int((batch["labels"] != IGNORE_INDEX).sum()) <= chunk:
            chunk = None
        owner = head_owner(model)  # through DDP's and peft's wrappers: the config context parallelism switches
        if chunk and not self.head_checked:
            if owner is None or not head_reproduces_logits(model, owner, batch["input_ids"].device):
                self.chunk_rows = chunk = None
            self.head_checked = True
        if self.sharing is not None and not self.sharing_checked:
            self.sharing_checked = True
            if owner is None or not holds_on(getattr(model, "module", model), self.sharing):
                warnings.warn(SHARING_REFUSED, stacklevel=2)
                self.sharing = None
        sharing = self.sharing
        attention = getattr(getattr(owner, "config", None), "_attn_implementation", None)
        if attention not in ("sdpa", "eager") or (model.training and self.dropout):  # (switched since fit: cp)
            sharing = None
        return completion_logps(model, batch, self.train.temperature, self.head_on_targets_only, sharing, chunk)

    def use_rows(self, replica: int, row_group: tuple[Any, int] | None) -> None:
        self.replica, self.row_group = replica, row_group
        if row_group is not None:  # context parallelism: each rank trains a part of every row, never a shared row
            self.sharing = None

    def _parts(self) -> int:
        """The ranks that train parts of the same rows (a context-parallel group's), 1 without one."""
        return torch.distributed.get_world_size(self.row_group[0]) if self.row_group is not None else 1

    # ------------------------------------------------------------------ sampling

    def prepare(self, model, step: int, batches_of: Callable[[int], list[dict[str, Any]]], steps: int) -> list[dict[str, Any]]:
        """The completions step `step` trains on: at a cycle's first step (or when none are ready: a resume on
        another number of processes) the prompts of every step to the cycle's end are sampled. A step asked for
        again (an out-of-memory retry, in smaller micro-batches) samples its prompts afresh."""
        again = step in self.served
        if again or step not in self.ready:
            k, mu = self.train.steps_per_generation, self.train.num_iterations
            end = step + 1 if again else min(steps, (step // (k * mu) + 1) * k * mu)
            sampled: dict[int, list[dict[str, Any]]] = {}  # data step -> its completions, sampled once for its mu steps
            for s in range(step, end):
                d = data_step(s, k, mu, steps)
                if d not in sampled:
                    sampled[d] = [self.sample(model, b, s, i) for i, b in enumerate(batches_of(d))]
            self.ready = {s: sampled[data_step(s, k, mu, steps)] for s in range(step, end)}
            self.served = set()
        self.served.add(step)
        device = compute_device(model)  # a resumed run's were read to the CPU (memory.embeddings=cpu: not there)
        return [{k: v.to(device) if torch.is_tensor(v) else v for k, v in b.items()} for b in self.ready[step]]

    def sample(self, model, prompts: dict[str, Any], step: int = 0, micro: int = 0) -> dict[str, Any]:
        """A micro-batch of prompts -> its completions as a trainable batch, with their advantages (and, when
        later steps train on them, the sampling policy's log-probabilities). Under context parallelism the group's
        first rank samples (whole rows, the whole model) and hands the batch to the others, which train their parts
        of the same rows."""
        if self.row_group is None:
            return self._sampled(model, prompts, step, micro)
        group, first = self.row_group
        mine = torch.distributed.get_rank() == first
        batch = self._sampled(model, prompts, step, micro) if mine else None
        held: list[Any] = [{k: v.cpu() if torch.is_tensor(v) else v for k, v in batch.items()} if batch else None]
        torch.distributed.broadcast_object_list(held, src=first, group=group)
        return held[0]

    @torch.no_grad()
    def _sampled(self, model, prompts: dict[str, Any], step: int, micro: int) -> dict[str, Any]:
        train, tok = self.train, self.tokenizer
        ends = end_ids(tok, model)

        def draw(groups: list[int], attempt: int) -> tuple[Completions, torch.Tensor, torch.Tensor]:
            """The completions of these prompts (their groups), drawn with this attempt's seed, and their rewards."""
            some = _prompts_of(prompts, groups)
            seed = sampling_seed(self.seed, step, micro, self.replica, attempt)  # a replica's own draws (ranks, not cp)
            done = complete(model, some, self.group, tok, ends, train, greedy=False, seed=seed, synced=self.synced)
            return (done, *self._scored(done, some))

        completions, per_reward, total = draw(list(range(len(prompts["prompts"]))), 0)
        completions, per_reward, total, redrawn = refill(draw, completions, per_reward, total, self.group, train.dynamic_sampling)
        batch: dict[str, Any] = dict(trainable_rows(prompts, completions, self.group, tok.pad_token_id))
        batch["advantages"] = advantages(total, self.group, scale=train.loss_type != "dr_grpo").to(batch["input_ids"].device)
        was_training = model.training
        model.eval()  # dropout off: the sampling policy's own log-probabilities; the reference deterministic
        try:
            if train.steps_per_generation * train.num_iterations > 1:
                batch["old_logps"] = self.logps(model, batch)[0]
            if self.beta:
                with adapter_off(model):
                    batch["ref_logps"] = self.logps(model, batch)[0]
        finally:
            model.train(was_training)
        grouped = total.view(-1, self.group)
        n = total.numel()
        sums = {
            "_sequences": float(n),
            "reward": float(total.sum()),
            "reward_std": float(grouped.std(dim=1).sum()) * self.group,
            "frac_reward_zero_std": float((grouped.std(dim=1) == 0).sum()) * self.group,
            "completion_length": float(completions.lengths.sum()),
        }
        sums.update({f"rewards/{name}": float(per_reward[:, j].sum()) for j, name in enumerate(self.reward_names)})
        if train.dynamic_sampling:
            sums["redraws"] = float(redrawn) * self.group  # (a mean over completions: a prompt's redraws)
        batch["sample_sums"] = sums
        return batch

    def _scored(self, done: Completions, prompts: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
        """(each reward of each completion, (n, k); their weighted total, (n,)) with DAPO's overlong penalty."""
        records = [r for r in prompts["records"] for _ in range(self.group)]
        texts = [p for p in prompts["prompts"] for _ in range(self.group)]
        each, total = score(self.rewards, done.texts, records, texts)
        if self.train.overlong_buffer:
            penalty = overlong_penalty(done.lengths, self.train.max_new_tokens, self.train.overlong_buffer)
            each, total = torch.cat([each, penalty[:, None]], dim=1), total + penalty
        return each, total

    # ------------------------------------------------------------------ the loss

    def count(self, batch: dict[str, Any]) -> int:
        """The batch's units: its completion tokens (dapo: a context-parallel part its own), else its rows (counted
        by a context-parallel group's first part only)."""
        if self.train.loss_type == "dapo":
            return int((batch["labels"][:, 1:] != IGNORE_INDEX).sum())
        return int(batch["input_ids"].shape[0]) if _first_part(batch) else 0

    def __call__(self, model, batch: dict[str, Any]) -> tuple[torch.Tensor, int]:
        logps, mask = self.logps(model, batch)
        # Sampled by this very policy (one step a sampling): ratio 1, its gradient the policy gradient.
        sampled = batch["old_logps"] if "old_logps" in batch else logps.detach()
        sequence = mask if self.train.importance_sampling == "sequence" else None
        loss, clipped, kl = token_losses(
            logps, sampled, batch["advantages"], self.epsilon, self.epsilon_high, self.beta, batch.get("ref_logps"), sequence
        )
        m = mask.float()
        part = batch.get(context.KEY)  # a context-parallel rank's part of every row: a row's tokens are the group's
        per_row_tokens = (context.whole_row_counts(part, m.sum(dim=1)) if part is not None else m.sum(dim=1)).clamp(min=1)
        kind = self.train.loss_type
        if kind == "grpo":
            summed = ((loss * m).sum(dim=1) / per_row_tokens).sum()
        elif kind == "dr_grpo":
            summed = ((loss * m).sum(dim=1) / self.train.max_new_tokens).sum()
        else:
            summed = (loss * m).sum()
        sums = {k: v * _first_part(batch) for k, v in batch["sample_sums"].items()}  # the group's, counted once
        sums["clip_ratio"] = float(((clipped.float() * m).sum(dim=1) / per_row_tokens).sum())
        sums["kl"] = float(((kl * m).sum(dim=1) / per_row_tokens).sum())
        self.last_sums = sums
        return summed, self.count(batch)

    def metric_sums(self) -> dict[str, float]:
        return self.last_sums

    def metric_means(self, sums: dict[str, float], units: float) -> dict[str, float]:
        """Every metric is a mean over the step's completions (whatever the loss's units)."""
        n = max(sums.pop("_sequences", 0.0), 1.0)
        return {k: v / n for k, v in sums.items() if math.isfinite(v)}

    # ------------------------------------------------------------------ what a checkpoint keeps

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The completions sampled ahead for steps not trained yet (`step.micro.key`), and the number of processes
        that sampled them (another number splits the prompts otherwise)."""
        out: dict[str, torch.Tensor] = {}
        for s, batches in self.ready.items():
            if s in self.served:
                continue
            for i, b in enumerate(batches):
                out |= {f"{s}.{i}.{k}": v.detach().cpu().contiguous() for k, v in b.items() if torch.is_tensor(v)}
                out |= {f"{s}.{i}.sums.{k}": torch.tensor(v, dtype=torch.float64) for k, v in b["sample_sums"].items()}
        return {"world": torch.tensor(_world()), "parts": torch.tensor(self._parts()), **out} if out else {}

    def load_state_dict(self, saved: dict[str, torch.Tensor]) -> str | None:
        """Take back the completions a checkpoint sampled ahead; a note when they cannot be used (sampled by
        another number of processes: those steps sample afresh)."""
        self.ready, self.served = {}, set()
        if not saved:
            return None
        # Another number of processes, or of context-parallel parts (the same world as other replicas), splits the
        # prompts otherwise: each rank's saved rows are not the rows it trains now.
        if int(saved.pop("world")) != _world() or int(saved.pop("parts", torch.tensor(1))) != self._parts():
            return "resume: the completions sampled ahead came from another number of processes or replicas; sampling afresh"
        for key, value in saved.items():
            s, i, name = key.split(".", 2)
            batches = self.ready.setdefault(int(s), [])
            while len(batches) <= int(i):
                batches.append({"sample_sums": {}})
            if name.startswith("sums."):
                batches[int(i)]["sample_sums"][name[5:]] = float(value)
            else:
                batches[int(i)][name] = value
        return None

    # ------------------------------------------------------------------ held out

    @torch.no_grad()
    def held_out(self, model, prompts: Any, collate, batch_size: int, device: torch.device) -> dict[str, float]:
        """The rewards' means over held-out prompts, one greedy completion each: what the demos print
        before and after training, and `finetune eval` for a grpo run."""
        tok, ends = self.tokenizer, end_ids(self.tokenizer, model)
        totals, per = [], []
        for start in range(0, len(prompts), batch_size):
            batch = collate([prompts[i] for i in range(start, min(start + batch_size, len(prompts)))])
            batch = {k: v.to(device) if torch.is_tensor(v) else v for k, v in batch.items()}
            done = complete(model, batch, 1, tok, ends, self.train, greedy=True, synced=self.synced)
            each, total = score(self.rewards, done.texts, batch["records"], batch["prompts"])
            totals.append(total)
            per.append(each)
        total, each = torch.cat(totals), torch.cat(per)
        return {"reward": float(total.mean()), **{r.name: float(each[:, j].mean()) for j, r in enumerate(self.rewards)}}


def _prompts_of(prompts: dict[str, Any], groups: list[int]) -> dict[str, Any]:
    """These prompts of a prompt batch (their rows of every tensor, their items of every list)."""
    if groups == list(range(len(prompts["prompts"]))):
        return prompts
    rows = torch.tensor(groups, device=prompts["input_ids"].device)
    return {k: v.index_select(0, rows) if torch.is_tensor(v) else [v[g] for g in groups] for k, v in prompts.items()}


def data_step(step: int, k: int, mu: int, steps: int | None = None) -> int:
    """The data order's step whose prompts optimizer step `step` trains on: a cycle of k x mu steps trains the prompts
    of k data steps mu times over, in turn (k = 2, mu = 2: 0 1 0 1, 2 3 2 3, ...); mu = 1: the step itself. A last
    cycle cut short by the run's `steps` takes as many data steps as its steps can train mu times (an epoch of 3 data
    steps with k = 2, mu = 2: 0 1 0 1, 2 2), so that an epoch trains each of its prompts mu times."""
    cycle, within = divmod(step, k * mu)
    width = k
    if steps is not None and steps - cycle * k * mu < k * mu:
        width = max(1, -(-(steps - cycle * k * mu) // mu))  # the data steps its remaining steps hold
    return cycle * k + within % width


def _first_part(batch: dict[str, Any]) -> bool:
    """Whether this batch is whole rows or a context-parallel group's first part of them."""
    part = batch.get(context.KEY)
    return part is None or part.split.index == 0


def _rank() -> int:
    return torch.distributed.get_rank() if torch.distributed.is_available() and torch.distributed.is_initialized() else 0


def _world() -> int:
    return torch.distributed.get_world_size() if torch.distributed.is_available() and torch.distributed.is_initialized() else 1
