"""GRPO (train.objective=grpo): online RL from reward functions (Shao et al. 2024, DeepSeekMath).

Each step's micro-batch of prompts becomes a batch of sampled completions (prepare): the model itself
(4-bit base + the current adapter; no second copy of the weights) samples train.num_generations
completions of each prompt with a KV cache, each cut after its first end token; the rewards
(objectives/rewards.py) score them; each prompt's group of rewards becomes advantages

    grpo, dapo   A = (r - mean(group)) / (std(group) + 1e-4)
    dr_grpo      A = r - mean(group)                         (Liu et al. 2025: no std, no length bias)

and the loss of a completion token t is the clipped policy-gradient term, plus beta x KL to the base
(the adapter switched off, as DPO's reference; k3 estimator, Schulman 2020):

    ratio = exp(logp_t - logp_t_sampling)     1: one update per sampling (its gradient: the policy gradient)
    l_t = -min(ratio A, clip(ratio, 1 - epsilon, 1 + epsilon_high) A) + beta (exp(ref_t - logp_t) - (ref_t - logp_t) - 1)

    grpo     each completion's token mean, averaged over completions      (units: completions)
    dr_grpo  each completion's token sum / max_new_tokens, averaged        (units: completions)
    dapo     the mean over every completion token of the step             (units: completion tokens)

Only completion tokens up to and including the first end token are trained (labels), never the
prompt or the padding. Groups never span processes: each rank samples every completion of its own
prompts, so the group statistics are the same on any number of processes. Sampling draws from the
global generator, which every checkpoint saves: a resumed run samples what the uninterrupted one did.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from finetune.data import IGNORE_INDEX
from finetune.objectives.loss import Loss
from finetune.objectives.preference import adapter_off
from finetune.objectives.rewards import Reward, score
from finetune.objectives.sampling import complete, end_ids, trainable_rows

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
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(loss of every completion token, whether its ratio was clipped, its KL to the reference)."""
    ratio = torch.exp(logps - sampled_logps)
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


def completion_logps(model, batch: dict[str, torch.Tensor], temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(log-probability of each next token at the sampling temperature, whether it is a completion token),
    both (rows, seq - 1)."""
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits[:, :-1]
    targets = batch["labels"][:, 1:]
    mask = targets != IGNORE_INDEX
    logp = torch.log_softmax(logits.float() / temperature, dim=-1)
    return logp.gather(-1, targets.clamp(min=0).unsqueeze(-1)).squeeze(-1), mask


class GRPOLoss(Loss):
    """(model, batch of sampled completions) -> (summed loss, units); prepare() samples them."""

    scores_held_out_loss = False

    def __init__(self, train: Any, rewards: list[Reward]):
        self.train, self.rewards = train, rewards
        self.group = train.num_generations
        self.epsilon = train.epsilon
        high = train.epsilon_high
        self.epsilon_high = high if high is not None else (DAPO_EPSILON_HIGH if train.loss_type == "dapo" else train.epsilon)
        self.beta = float(train.beta or 0.0)
        self.tokenizer: Any = None  # use_tokenizer()
        self.last_sums: dict[str, float] = {}
        self.metric_keys = ("_sequences", "reward", "reward_std", "frac_reward_zero_std", "completion_length")
        self.metric_keys += ("clip_ratio", "kl") + tuple(f"rewards/{r.name}" for r in rewards)

    def use_tokenizer(self, tokenizer) -> None:
        self.tokenizer = tokenizer

    def fit(self, model) -> None:
        pass  # the loss reads every completion token's log-probability itself

    # ------------------------------------------------------------------ sampling

    def prepare(self, model, batches: list[dict[str, Any]]) -> list[dict[str, Any]]:
        return [self.sample(model, b) for b in batches]

    @torch.no_grad()
    def sample(self, model, prompts: dict[str, Any]) -> dict[str, Any]:
        """A micro-batch of prompts -> its completions as a trainable batch, with their advantages."""
        train, tok = self.train, self.tokenizer
        ends = end_ids(tok, model)
        completions = complete(model, prompts, self.group, tok, ends, train, greedy=False)
        records = [r for r in prompts["records"] for _ in range(self.group)]
        texts = [p for p in prompts["prompts"] for _ in range(self.group)]
        per_reward, total = score(self.rewards, completions.texts, records, texts)
        batch: dict[str, Any] = dict(trainable_rows(prompts, completions, self.group, tok.pad_token_id))
        batch["advantages"] = advantages(total, self.group, scale=train.loss_type != "dr_grpo").to(batch["input_ids"].device)
        if self.beta:
            was_training = model.training
            model.eval()  # the base's own dropout off too: the reference is the base model, deterministic
            try:
                with adapter_off(model):
                    batch["ref_logps"] = completion_logps(model, batch, train.temperature)[0]
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
        sums.update({f"rewards/{r.name}": float(per_reward[:, j].sum()) for j, r in enumerate(self.rewards)})
        batch["sample_sums"] = sums
        return batch

    # ------------------------------------------------------------------ the loss

    def count(self, batch: dict[str, Any]) -> int:
        if self.train.loss_type == "dapo":
            return int((batch["labels"][:, 1:] != IGNORE_INDEX).sum())
        return int(batch["input_ids"].shape[0])

    def __call__(self, model, batch: dict[str, Any]) -> tuple[torch.Tensor, int]:
        logps, mask = completion_logps(model, batch, self.train.temperature)
        # One update per sampling: the sampling policy is this one (ratio 1, its gradient the policy gradient).
        sampled = logps.detach()
        loss, clipped, kl = token_losses(
            logps, sampled, batch["advantages"], self.epsilon, self.epsilon_high, self.beta, batch.get("ref_logps")
        )
        m = mask.float()
        per_row_tokens = m.sum(dim=1).clamp(min=1)
        kind = self.train.loss_type
        if kind == "grpo":
            summed = ((loss * m).sum(dim=1) / per_row_tokens).sum()
        elif kind == "dr_grpo":
            summed = ((loss * m).sum(dim=1) / self.train.max_new_tokens).sum()
        else:
            summed = (loss * m).sum()
        sums = dict(batch["sample_sums"])
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
            done = complete(model, batch, 1, tok, ends, self.train, greedy=True)
            each, total = score(self.rewards, done.texts, batch["records"], batch["prompts"])
            totals.append(total)
            per.append(each)
        total, each = torch.cat(totals), torch.cat(per)
        return {"reward": float(total.mean()), **{r.name: float(each[:, j].mean()) for j, r in enumerate(self.rewards)}}
