"""Held-out scores before and after training: exact match on eval.exact_match_path's records (greedy
generation) and, for preference objectives, the share of held-out pairs the model ranks right.
Printed, given to Callback.on_eval, and kept in the TrainResult. A finished grpo run's held-out rewards,
the base against the fine-tuned (run_rewards): `finetune eval`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from finetune.data.dataset import collate_prompts
from finetune.data.prompts import encode_prompts
from finetune.errors import DataError
from finetune.metrics import read_metrics
from finetune.objectives.grpo import GRPOLoss
from finetune.objectives.preference import preference_accuracy
from finetune.objectives.rewards import build_rewards
from finetune.runs.evaluate import ExactMatch, exact_match
from finetune.runs.open import Run, load_base, load_trained


@dataclass
class HeldOutScores:
    """What a before/after evaluation found (None: not scored)."""

    exact_match: ExactMatch | None = None
    preference_accuracy: float | None = None
    rewards: dict[str, float] | None = None  # grpo: the rewards' means over held-out prompts, greedy

    @property
    def reward(self) -> float | None:
        return None if self.rewards is None else self.rewards["reward"]

    @property
    def pref_text(self) -> str:
        return "-" if self.preference_accuracy is None else f"{100 * self.preference_accuracy:.1f}%"

    @property
    def scores(self) -> dict[str, float]:
        out: dict[str, float] = {}
        if self.exact_match is not None:
            out.update(exact_match=self.exact_match.accuracy, contains_match=self.exact_match.contains_accuracy)
        if self.preference_accuracy is not None:
            out["preference_accuracy"] = self.preference_accuracy
        if self.rewards is not None:
            out.update({f"held_out_{k}" if k == "reward" else f"held_out_rewards/{k}": v for k, v in self.rewards.items()})
        return out


def score(trainer: Any, em_records: list[dict] | None, when: str) -> HeldOutScores:
    """Score the trainer's model ("before training" / "after training"), say it, and tell the callbacks."""
    model, found, cfg = trainer.parallel.unwrap(trainer.model), HeldOutScores(), trainer.cfg
    if em_records:
        found.exact_match = exact_match(
            model, trainer.tokenizer, em_records, cfg.data.format, max_new_tokens=cfg.eval.max_new_tokens
        )
        trainer.say(f"eval ({when}): {found.exact_match.summary()}")
        for s in found.exact_match.samples:
            trainer.say(f"    expected {s['expected']!r:<30} got {s['got']!r}")
    eval_data = trainer.data.eval
    if trainer.loss_fn.ranks_pairs and eval_data and trainer.parallel.holds_whole_model:  # (Pipeline.fit_objective)
        head_only = trainer.loss_fn.head_on_targets_only
        found.preference_accuracy = preference_accuracy(model, eval_data, cfg, trainer.collate, trainer.parallel, head_only)
        trainer.say(f"eval ({when}): preference accuracy {found.pref_text} on {len(eval_data)} held-out pairs")
    if hasattr(trainer.loss_fn, "held_out") and eval_data:  # grpo: the rewards of greedy completions
        bs = cfg.eval.batch_size or cfg.train.batch_size
        found.rewards = trainer.loss_fn.held_out(model, eval_data, trainer.collate, bs, trainer.parallel.device)
        each = ", ".join(f"{k} {v:.3f}" for k, v in found.rewards.items() if k != "reward")
        trainer.say(f"eval ({when}): reward {found.reward:.3f} ({each}) on {len(eval_data)} held-out prompts, greedy")
    if found.scores:
        trainer.callbacks("on_eval", trainer.state, {"step": trainer.state.step, "when": when, **found.scores})
    return found


def run_rewards(
    run: Run,
    records: list[dict],
    source: str,
    reward_fns: Sequence[Callable[[str, dict], float]] = (),
    limit: int | None = None,
    max_new_tokens: int | None = None,
    batch_size: int = 8,
    device: torch.device | None = None,
) -> dict[str, dict[str, float]]:
    """A grpo run's rewards (the recipe's, then `reward_fns`) of one greedy completion per prompt, as the run
    printed them after training: {"base": ..., "fine-tuned": ...}, each {"reward": total, name: mean}."""
    records = records[:limit] if limit else records
    train = run.cfg.train if max_new_tokens is None else run.cfg.train.model_copy(update={"max_new_tokens": max_new_tokens})
    model, tokenizer = load_trained(run, device=device)
    prompts, stats = encode_prompts(records, run.cfg.model_copy(update={"train": train}), tokenizer)
    if not len(prompts):
        raise DataError(
            f"{source}: none of its {len(records)} prompts leaves room for {train.max_new_tokens} new tokens within "
            f"data.max_seq_len={run.cfg.data.max_seq_len} ({stats.too_long} too long)",
            hint="pass --max-new-tokens N (fewer), or --data FILE with shorter prompts",
        )
    loss = GRPOLoss(train, build_rewards(train.rewards, reward_fns), run.cfg.seed)
    loss.use_tokenizer(tokenizer)

    def scored(m) -> dict[str, float]:
        on = m.get_input_embeddings().weight.device
        for reward in loss.rewards:  # a reward model runs where the policy does
            if hasattr(reward.fn, "use_device"):
                reward.fn.use_device(on)
        return loss.held_out(m, prompts, lambda xs: collate_prompts(xs, tokenizer.pad_token_id), batch_size, on)

    tuned = scored(model)
    if run.is_adapter:
        with model.disable_adapter():  # the same weights in memory minus the adapter: the base as trained
            base = scored(model)
    else:
        del model
        base = scored(load_base(run, device=device))
    return {"base": base, "fine-tuned": tuned}


def reward_table(columns: dict[str, dict[str, float]]) -> str:
    """Rewards side by side, one column per model (the total first, then each reward's mean)."""
    names = list(next(iter(columns.values())))
    width = max(12, *(len(c) for c in columns))
    lines = [f"{'reward':<16}" + "".join(f"{c:>{width}}" for c in columns)]
    lines += [
        f"{('total' if n == 'reward' else n):<16}" + "".join(f"{col[n]:>{width}.3f}" for col in columns.values()) for n in names
    ]
    return "\n".join(lines)


def trained_rewards_missing(run_dir: Path, scored: dict[str, float]) -> list[str]:
    """The rewards a run's metrics.jsonl logged that `scored` lacks: your own, which its recipe cannot name."""
    path = Path(run_dir) / "metrics.jsonl"
    logged = {
        k[len("rewards/") :] for row in (read_metrics(path) if path.is_file() else []) for k in row if k.startswith("rewards/")
    }
    return sorted(logged - set(scored))
