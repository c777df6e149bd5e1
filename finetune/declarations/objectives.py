"""Training objectives (train.objective), and what each needs: one table.

    sft     next-token cross-entropy on the response tokens (any data.format but preference)
    dpo     Direct Preference Optimization (Rafailov et al. 2023): the policy's log-probability
            margin of chosen over rejected, against a reference model (the base with the
            adapter switched off: no second copy of the weights)
    orpo    Odds Ratio Preference Optimization (Hong et al. 2024): SFT on the chosen response
            plus beta x an odds-ratio term; no reference model
    simpo   Simple Preference Optimization (Meng et al. 2024): the length-normalised margin
            with a target gap simpo_gamma; no reference model
    grpo    Group Relative Policy Optimization (Shao et al. 2024), online: completions sampled from
            the model itself, scored by train.rewards, each group's rewards normalised into
            advantages (objectives/grpo.py); a KL term to the base when train.beta > 0

config asks `problems(cfg)` for the recipe's cross-field rules; the trainer builds the loss
from finetune/objectives/preference.py; the planner reads `sequences_per_example`,
`head_in_chunks` and `reference_passes`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from finetune.declarations import splits, strategies
from finetune.errors import Rule, broken


@dataclass(frozen=True)
class Objective:
    name: str
    pairs: bool  # trains on preference pairs (data.format=preference)
    reference: bool  # needs the reference model's log-probabilities
    default_beta: float | None  # train.beta when the recipe leaves it null
    beta_means: str  # what beta is, for messages and the recipe comment
    per_token: bool = False  # its rewards use the mean log-probability of a response, not the sum
    online: bool = False  # trains on completions it samples itself from data.format=prompt (grpo)

    @property
    def sequences_per_example(self) -> int:
        """Sequences one example puts through the model in one forward: chosen and rejected together."""
        return 2 if self.pairs else 1

    @property
    def head_in_chunks(self) -> bool:
        """Its loss can run the LM head over one chunk of target positions at a time (memory.loss:
        objectives/loss.CausalLMLoss, grpo's completion tokens: objectives/grpo.completion_logps); the preference
        losses score every response token in one head call."""
        return not self.pairs

    @property
    def reference_passes(self) -> int:
        """Forward passes without gradients per step for the reference (0 with precomputed references)."""
        return 1 if self.reference else 0


OBJECTIVES: dict[str, Objective] = {
    o.name: o
    for o in (
        Objective("sft", pairs=False, reference=False, default_beta=None, beta_means="unused"),
        Objective("dpo", pairs=True, reference=True, default_beta=0.1, beta_means="the KL penalty to the reference"),
        Objective(
            "orpo", pairs=True, reference=False, default_beta=0.1, beta_means="the weight of the odds-ratio term", per_token=True
        ),
        Objective("simpo", pairs=True, reference=False, default_beta=2.0, beta_means="the reward scale", per_token=True),
        # Its reference pass (the adapter off) runs only when train.beta > 0: reference stays False.
        Objective("grpo", pairs=False, reference=False, default_beta=0.0, beta_means="the KL penalty to the base", online=True),
    )
}
PREFERENCE_FORMAT = "preference"  # the data.format of preference pairs
PROMPT_FORMAT = "prompt"  # the data.format of online objectives: prompts only, completions sampled


def get(name: str) -> Objective:
    return OBJECTIVES[name]


def beta(train: Any) -> float:
    """train.beta, or the objective's default when the recipe leaves it null."""
    objective = get(train.objective)
    value = train.beta if train.beta is not None else objective.default_beta
    return float(value) if value is not None else 0.0


def simpo_gamma(train: Any) -> float:
    """train.simpo_gamma, or half of beta when null (the SimPO paper's gamma/beta ratio of 0.5)."""
    return float(train.simpo_gamma) if train.simpo_gamma is not None else 0.5 * beta(train)


def _formats(cfg: Any) -> set[str]:
    return {cfg.data.format} | {m.format for m in cfg.data.mix or [] if m.format}


def _objective(cfg: Any) -> Objective:
    return get(cfg.train.objective)


RULES: tuple[Rule[Any], ...] = (
    Rule(
        lambda cfg: _objective(cfg).pairs and _formats(cfg) != {PREFERENCE_FORMAT},
        lambda cfg: (
            f"train.objective={_objective(cfg).name} trains on preference pairs, but data.format is "
            f"{'/'.join(sorted(_formats(cfg)))}. Set data.format=preference (records with prompt, chosen and "
            "rejected) or train.objective=sft."
        ),
    ),
    Rule(
        lambda cfg: _objective(cfg).online and _formats(cfg) != {PROMPT_FORMAT},
        lambda cfg: (
            f"train.objective={_objective(cfg).name} samples its own completions of prompts, but data.format is "
            f"{'/'.join(sorted(_formats(cfg)))}. Set data.format=prompt (records with a prompt, and the columns your "
            "rewards read) or train.objective=sft."
        ),
    ),
    Rule(
        lambda cfg: not _objective(cfg).online and PROMPT_FORMAT in _formats(cfg),
        "data.format=prompt holds prompts without answers to train on; set train.objective=grpo (online RL from "
        "train.rewards), or give SFT data (e.g. data.format=completion).",
    ),
    Rule(
        lambda cfg: _objective(cfg).online and cfg.data.packing,
        "data.packing with train.objective=grpo: each prompt's completions are sampled and scored as rows of their "
        "own. Set data.packing=false.",
    ),
    Rule(
        lambda cfg: _objective(cfg).online and cfg.train.beta and (cfg.lora is None or cfg.lora.method == "pissa"),
        "train.beta > 0 with train.objective=grpo compares with the base model (the adapter switched off); full "
        "fine-tuning (lora: null) and lora.method=pissa (which rewrites the base) have none. Set train.beta=0 or lora.",
    ),
    Rule(
        lambda cfg: (
            _objective(cfg).online
            and (strategies.of_recipe(cfg).deepspeed or any(s.asked(cfg) for s in splits.SPLITS if s is not splits.CONTEXT))
        ),
        "train.objective=grpo runs on one process, DDP, FSDP or context parallelism (each rank, or each context-parallel "
        "group's first, samples whole completions of its own prompts with model.generate); DeepSpeed's engine and "
        "pipeline or tensor parallelism split what generate runs whole. Use distributed.strategy=ddp, fsdp or auto.",
    ),
    Rule(
        lambda cfg: not _objective(cfg).pairs and PREFERENCE_FORMAT in _formats(cfg),
        "data.format=preference holds preference pairs, which train.objective=sft cannot train on. "
        "Set train.objective=dpo (or orpo, simpo), or use SFT data.",
    ),
    Rule(
        lambda cfg: _objective(cfg).pairs and cfg.data.packing,
        lambda cfg: (
            f"data.packing with train.objective={_objective(cfg).name}: a preference pair's two sequences are "
            "scored whole, side by side, not packed. Set data.packing=false."
        ),
    ),
    Rule(
        lambda cfg: _objective(cfg).reference and cfg.lora is None,
        lambda cfg: (
            f"train.objective={_objective(cfg).name} takes its reference from the base model with the adapter "
            "switched off; full fine-tuning (lora: null) has no such base. Set lora, or use orpo or simpo (no reference)."
        ),
    ),
    Rule(
        lambda cfg: _objective(cfg).reference and cfg.lora is not None and cfg.lora.method == "pissa",
        lambda cfg: (
            f"train.objective={_objective(cfg).name} takes its reference from the base with the adapter switched "
            "off, but lora.method=pissa rewrites the base weights (W minus the adapter's initial product): that is not the "
            "base model. Use lora.method=lora (or dora, rslora), or orpo or simpo (no reference)."
        ),
    ),
    Rule(
        lambda cfg: cfg.train.precompute_reference and not _objective(cfg).reference,
        lambda cfg: (
            f"train.precompute_reference is set, but train.objective={_objective(cfg).name} uses no reference "
            "model. Remove it (or use train.objective=dpo)."
        ),
    ),
    Rule(
        lambda cfg: _objective(cfg).pairs and cfg.memory.loss in ("chunked", "liger"),
        lambda cfg: (
            f"memory.loss={cfg.memory.loss} is the SFT loss's; train.objective={_objective(cfg).name} runs the "
            "LM head itself, over whole rows. Set memory.loss=auto."
        ),
    ),
    Rule(
        lambda cfg: _objective(cfg).online and (cfg.train.overlong_buffer or 0) > cfg.train.max_new_tokens,
        lambda cfg: (
            f"train.overlong_buffer={cfg.train.overlong_buffer} is longer than train.max_new_tokens="
            f"{cfg.train.max_new_tokens}: the penalty would start before a completion's first token. Set it to at most "
            "max_new_tokens (DAPO: a fifth of it)."
        ),
    ),
    Rule(
        lambda cfg: _objective(cfg).online and cfg.train.dynamic_sampling and strategies.of_recipe(cfg) is strategies.FSDP,
        "train.dynamic_sampling with distributed.strategy=fsdp: every rank would have to redraw together (each "
        "decode step gathers the weights). Set train.dynamic_sampling=0, or use distributed.strategy=ddp.",
    ),
    Rule(
        lambda cfg: _objective(cfg).online and cfg.memory.loss == "liger",
        "memory.loss=liger is liger-kernel's fused loss, a sum; train.objective=grpo needs each completion token's "
        "log-probability. Set memory.loss=chunked (the head over chunks of completion tokens: the same memory) or auto.",
    ),
    Rule(
        lambda cfg: cfg.train.beta is not None and not (_objective(cfg).pairs or _objective(cfg).online),
        "train.beta is a preference-tuning setting; train.objective=sft does not read it. Remove it.",
    ),
    Rule(
        lambda cfg: _objective(cfg).pairs and cfg.train.beta == 0,
        lambda cfg: f"train.beta=0 gives train.objective={_objective(cfg).name} no gradient; set it above 0 or null.",
    ),
    Rule(
        lambda cfg: cfg.train.simpo_gamma is not None and _objective(cfg).name != "simpo",
        lambda cfg: f"train.simpo_gamma is SimPO's target margin; train.objective={_objective(cfg).name} does not read it.",
    ),
)


ONLINE_KEYS: tuple[str, ...] = ("loss_type", "num_generations", "epsilon", "epsilon_high", "max_new_tokens")
ONLINE_KEYS += ("steps_per_generation", "num_iterations", "temperature", "top_p", "stop", "rewards", "importance_sampling")
ONLINE_KEYS += ("overlong_buffer", "dynamic_sampling")


def online_keys_set(train: Any) -> list[str]:
    """The grpo-only train.* keys a recipe moved off their defaults (what a forgotten train.objective=grpo leaves)."""
    fields = type(train).model_fields
    return [k for k in ONLINE_KEYS if getattr(train, k) != fields[k].get_default(call_default_factory=True)]


RULES += (
    Rule(
        lambda cfg: not _objective(cfg).online and bool(online_keys_set(cfg.train)),
        lambda cfg: (
            f"train.{', train.'.join(online_keys_set(cfg.train))}: grpo's, but train.objective={_objective(cfg).name} "
            "does not read them. Set train.objective=grpo, or remove them."
        ),
    ),
)


def problems(cfg: Any) -> list[str]:
    """What train.objective cannot run with. Each message names the keys and the fix."""
    return broken(RULES, cfg)
