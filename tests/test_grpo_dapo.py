"""DAPO's sampling-side techniques (objectives/dapo.py): overlong shaping by hand, groups refilled until their
rewards differ (by hand with a stand-in sampler, then through GRPOLoss.sample on the tiny model), and the recipe's
checks of both; memory.loss for grpo (chunked allowed, liger refused)."""

from __future__ import annotations

import pytest
import torch
from test_grpo import grpo_recipe

from finetune.config.schema import build_recipe
from finetune.errors import ConfigError
from finetune.objectives import grpo as grpo_module
from finetune.objectives.dapo import flat_groups, overlong_penalty, refill
from finetune.objectives.sampling import Completions
from finetune.trainer import Trainer


def test_overlong_shaping_is_zero_then_linear_to_minus_one_at_the_longest_completion():
    # max_new_tokens 20, buffer 5: no penalty up to 15 tokens, -(L - 15) / 5 after, -1 at 20
    lengths = torch.tensor([1.0, 15.0, 16.0, 18.0, 20.0])
    assert overlong_penalty(lengths, 20, 5).tolist() == pytest.approx([0.0, 0.0, -0.2, -0.6, -1.0])


def test_a_flat_group_is_drawn_again_until_its_rewards_differ_or_the_tries_run_out():
    done = Completions([[1], [2], [3], [4], [5], [6]], ["a", "b", "c", "d", "e", "f"])
    total = torch.tensor([1.0, 1.0, 0.0, 1.0, 0.5, 0.5])  # groups of 2: 0 and 2 flat, 1 not
    each = total[:, None].clone()
    assert flat_groups(total, 2) == [0, 2]
    calls: list[tuple[list[int], int]] = []

    def draw(groups, attempt):
        calls.append((list(groups), attempt))
        rewards = {1: [0.0, 0.0, 0.7, 0.2], 2: [1.0, 0.0]}[attempt]  # attempt 1: group 0 flat again, 2 differs
        n = len(rewards)
        got = Completions([[10 * attempt + i] for i in range(n)], [f"{attempt}{i}" for i in range(n)])
        return got, torch.tensor(rewards)[:, None], torch.tensor(rewards)

    kept, kept_each, kept_total, redrawn = refill(draw, done, each, total, 2, tries=3)
    assert calls == [([0, 2], 1), ([0], 2)]  # then only the group still flat; none after
    assert kept.tokens == [[20], [21], [3], [4], [12], [13]] and kept.texts == ["20", "21", "c", "d", "12", "13"]
    assert kept_total.tolist() == [1.0, 0.0, 0.0, 1.0, pytest.approx(0.7), pytest.approx(0.2)]
    assert torch.equal(kept_each[:, 0], kept_total) and redrawn == 3
    assert total.tolist() == [1.0, 1.0, 0.0, 1.0, 0.5, 0.5]  # the caller's tensors untouched
    # one try: group 0 stays flat, kept as drawn then
    calls.clear()
    _, _, once, redrawn = refill(draw, done, each, total, 2, tries=1)
    assert calls == [([0, 2], 1)] and once.tolist()[:2] == [0.0, 0.0] and redrawn == 2


def _trainer(recipe_dict, tmp_path, reward, **train) -> Trainer:
    cfg = build_recipe(grpo_recipe(recipe_dict, tmp_path, **train) | {"output_dir": str(tmp_path / "run")})
    trainer = Trainer(cfg, progress=False, reward_fns=[reward])
    trainer.setup()
    return trainer


def test_grpo_redraws_only_its_flat_groups_with_their_own_seeds_and_shapes_long_ones(recipe_dict, tmp_path, monkeypatch):
    # flat groups by construction: prompts whose answer is even score 0 whatever they draw; the others by the parity
    # of the completion's length (which varies in a group: checked below)
    scored: list[float] = []

    def parity(completion, record):
        scored.append(float(int(record["answer"]) % 2 and len(completion) % 2))
        return scored[-1]

    common = {"rewards": [], "max_new_tokens": 6, "batch_size": 4}
    plain = _trainer(recipe_dict, tmp_path, parity, **common)
    model, prompts = plain.parallel.unwrap(plain.model), plain.step_batches(0)[0]
    first = plain.loss_fn.sample(model, prompts, step=0)
    flat = flat_groups(torch.tensor(scored), 4)
    even = [g for g, record in enumerate(prompts["records"]) if int(record["answer"]) % 2 == 0]
    assert flat == even and 0 < len(flat) < 4  # (the data order's first prompts: some even answers, not all)
    plain.close()
    redrawing = _trainer(recipe_dict, tmp_path, parity, dynamic_sampling=1, overlong_buffer=2, **common)
    seeds: list[int] = []
    complete = grpo_module.complete
    monkeypatch.setattr(grpo_module, "complete", lambda *a, **k: seeds.append(k["seed"]) or complete(*a, **k))
    second = redrawing.loss_fn.sample(redrawing.parallel.unwrap(redrawing.model), prompts, step=0)
    assert len(seeds) == 2 and len(set(seeds)) == 2  # the first draw's seed, then the redraw's own
    rows = [g * 4 + j for g in range(4) for j in range(4)]
    redrawn = {r // 4 for r in rows if not torch.equal(first["input_ids"][r], second["input_ids"][r])}
    assert redrawn == set(flat)  # the flat groups drawn again (flat again: even answers), the others kept
    assert second["sample_sums"]["redraws"] == len(flat) * 4
    # overlong shaping: completions past 6 - 2 tokens lose reward, in the total and as rewards/overlong
    lengths = (second["labels"] != -100).sum(1).float()
    penalty = overlong_penalty(lengths, 6, 2)
    assert second["sample_sums"]["rewards/overlong"] == pytest.approx(float(penalty.sum()))
    assert float(penalty.sum()) < 0
    sums = second["sample_sums"]
    assert sums["reward"] == pytest.approx(sums["rewards/parity"] + sums["rewards/overlong"])  # in the total
    redrawing.close()


def test_a_reward_of_yours_named_overlong_keeps_its_name_beside_the_penalty(recipe_dict, tmp_path):
    def overlong(completion, record):
        return 1.0

    trainer = _trainer(recipe_dict, tmp_path, overlong, rewards=[], overlong_buffer=2, max_new_tokens=6)
    assert trainer.loss_fn.reward_names == ["overlong", "overlong_2"]
    trainer.close()


def test_the_recipe_checks_dapos_settings_and_grpos_memory_loss(recipe_dict, tmp_path):
    build_recipe(grpo_recipe(recipe_dict, tmp_path, overlong_buffer=6, max_new_tokens=6))  # up to the whole length
    with pytest.raises(ConfigError, match="overlong_buffer=7 is longer than train.max_new_tokens=6"):
        build_recipe(grpo_recipe(recipe_dict, tmp_path, overlong_buffer=7, max_new_tokens=6))
    chunked = grpo_recipe(recipe_dict, tmp_path) | {"memory": {"loss": "chunked"}}
    assert build_recipe(chunked).memory.loss == "chunked"  # grpo's head over chunks of completion tokens
    with pytest.raises(ConfigError, match="memory.loss=liger is liger-kernel's fused loss, a sum"):
        build_recipe(chunked | {"memory": {"loss": "liger"}})
    with pytest.raises(ConfigError, match="train.dynamic_sampling with distributed.strategy=fsdp"):
        build_recipe(grpo_recipe(recipe_dict, tmp_path, dynamic_sampling=2) | {"distributed": {"strategy": "fsdp"}})
    with pytest.raises(ConfigError, match="train.dynamic_sampling"):  # an SFT recipe naming a grpo key
        build_recipe(recipe_dict | {"train": {**recipe_dict["train"], "dynamic_sampling": 2}})
