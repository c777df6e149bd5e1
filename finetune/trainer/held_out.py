"""Held-out scores before and after training: exact match on eval.exact_match_path's records (greedy
generation) and, for preference objectives, the share of held-out pairs the model ranks right.
Printed, given to Callback.on_eval, and kept in the TrainResult.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from finetune.objectives.preference import preference_accuracy
from finetune.runs.evaluate import ExactMatch, exact_match


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
    if trainer.loss_fn.ranks_pairs and eval_data and trainer.parallel.pipeline is None:  # (build.fit_pipeline: why)
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
