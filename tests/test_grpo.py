"""GRPO (objectives/grpo.py, objectives/sampling.py, data/prompts.py): the loss of hand-worked groups for
each loss_type, its gradient, the rows it trains, and whole runs of the tiny model (resume bitwise)."""

from __future__ import annotations

import json
import math
from types import SimpleNamespace

import pytest
import torch
from conftest import straight_and_resumed, write_jsonl
from test_trainer import train_losses

from finetune.config.schema import build_recipe
from finetune.data import IGNORE_INDEX
from finetune.errors import ConfigError
from finetune.metrics import read_metrics
from finetune.objectives.grpo import GRPOLoss, advantages, completion_logps, data_step, token_losses
from finetune.objectives.rewards import Reward
from finetune.objectives.sampling import Completions, sampling_seed, trainable_rows
from finetune.trainer import Trainer

ROWS = [{"prompt": f"Add {a} and {b}:", "answer": str(a + b)} for a in range(1, 9) for b in range(1, 9)]


def grpo_recipe(recipe_dict, tmp_path, **train) -> dict:
    data = json.loads(json.dumps(recipe_dict))
    data["data"] = {"path": str(write_jsonl(tmp_path / "prompts.jsonl", ROWS)), "format": "prompt", "max_seq_len": 64}
    data["data"]["eval_fraction"] = 0.125  # 8 held-out prompts: the reward before and after
    data["train"] = {
        "objective": "grpo",
        "max_steps": 4,
        "batch_size": 2,
        "lr": 1e-2,
        "num_generations": 4,
        "max_new_tokens": 6,
        "rewards": [{"name": "contains", "column": "answer"}, {"name": "length", "target": 3, "weight": 0.5}],
        **train,
    }
    return data


# ---------------------------------------------------------------- hand-worked


def test_advantages_of_a_group():
    r = torch.tensor([1.0, 0.0, 0.0, 1.0, 2.0, 2.0, 2.0, 2.0])
    a = advantages(r, 4, scale=True)
    std = torch.tensor([1.0, 0.0, 0.0, 1.0]).std()  # unbiased, as TRL: 0.5774
    torch.testing.assert_close(a[:4], torch.tensor([0.5, -0.5, -0.5, 0.5]) / (std + 1e-4))
    assert a[4:].tolist() == [0.0, 0.0, 0.0, 0.0]  # equal rewards teach nothing
    assert advantages(r, 4, scale=False).tolist() == [0.5, -0.5, -0.5, 0.5, 0.0, 0.0, 0.0, 0.0]  # dr_grpo


def test_the_clipped_objective_per_token():
    logps = torch.log(torch.tensor([[0.3, 0.3]]))
    sampled = torch.log(torch.tensor([[0.2, 0.2]]))  # ratio 1.5 on both tokens
    up, clipped_up, _ = token_losses(logps, sampled, torch.tensor([1.0]), 0.2, 0.2)
    down, clipped_down, _ = token_losses(logps, sampled, torch.tensor([-1.0]), 0.2, 0.2)
    torch.testing.assert_close(up, torch.tensor([[-1.2, -1.2]]))  # min(1.5, 1.2) x 1: the clip holds it
    torch.testing.assert_close(down, torch.tensor([[1.5, 1.5]]))  # min(-1.5, -1.2): the unclipped, worse one
    assert clipped_up.all() and not clipped_down.any()
    # clip-higher (dapo): 1.5 within 1 + 0.6, so not clipped
    higher, clipped, _ = token_losses(logps, sampled, torch.tensor([1.0]), 0.2, 0.6)
    torch.testing.assert_close(higher, torch.tensor([[-1.5, -1.5]]))
    assert not clipped.any()
    # KL (k3) to a reference: exp(d) - d - 1 with d = ref - logp
    ref = torch.log(torch.tensor([[0.6, 0.3]]))
    with_kl, _, kl = token_losses(logps, logps, torch.tensor([0.0]), 0.2, 0.2, beta=0.5, ref_logps=ref)
    d = math.log(2.0)
    torch.testing.assert_close(kl, torch.tensor([[math.exp(d) - d - 1, 0.0]]))
    torch.testing.assert_close(with_kl, 0.5 * kl)


class _Logits(torch.nn.Module):
    """A model whose logits are a parameter: log-probabilities known by hand."""

    def __init__(self, rows: int, width: int, vocab: int):
        super().__init__()
        self.table = torch.nn.Parameter(torch.randn(rows, width, vocab, generator=torch.Generator().manual_seed(0)))

    def forward(self, input_ids, attention_mask):
        return SimpleNamespace(logits=self.table)


def _group_batch():
    # 2 completions of one prompt (token 1): 2 and 1 completion tokens
    ids = torch.tensor([[1, 2, 3], [1, 4, 0]])
    labels = torch.tensor([[IGNORE_INDEX, 2, 3], [IGNORE_INDEX, 4, IGNORE_INDEX]])
    return {"input_ids": ids, "labels": labels, "attention_mask": (labels != -7).long(), "sample_sums": {}}


@pytest.mark.parametrize("loss_type", ["grpo", "dr_grpo", "dapo", "grpo+sequence"])
def test_each_loss_type_reduces_a_group_as_its_paper_says(loss_type):
    # (grpo+sequence: GSPO's one ratio a completion; at the first update every ratio is 1, so grpo's numbers)
    loss_type, _, level = loss_type.partition("+")
    train = SimpleNamespace(loss_type=loss_type, num_generations=2, epsilon=0.2, epsilon_high=None, beta=0.0,
                            temperature=1.0, max_new_tokens=4, overlong_buffer=None, dynamic_sampling=0,
                            importance_sampling=level or "token")  # fmt: skip
    loss_fn = GRPOLoss(train, [Reward("one", 1.0, lambda c, r: 1.0)])
    model = _Logits(2, 3, 5)
    batch = {**_group_batch(), "advantages": torch.tensor([1.0, -1.0])}
    summed, units = loss_fn(model, batch)
    summed.backward()
    # At the first update the ratio is 1: the loss is -A per token; its gradient the policy gradient.
    expected_units, per_row = {"grpo": (2, [2, 1]), "dr_grpo": (2, [4, 4]), "dapo": (3, [1, 1])}[loss_type]
    assert units == expected_units
    table = model.table.detach().clone().requires_grad_(True)
    ref_logp = torch.log_softmax(table[:, :-1], dim=-1)
    picks = [[ref_logp[0, 0, 2], ref_logp[0, 1, 3]], [ref_logp[1, 0, 4]]]
    if loss_type == "dapo":
        target = -(picks[0][0] + picks[0][1]) + (picks[1][0])
    else:
        target = -(picks[0][0] + picks[0][1]) / per_row[0] + picks[1][0] / per_row[1]
    target.backward()
    torch.testing.assert_close(model.table.grad, table.grad)
    # The value: -A per token, reduced: (-1 - 1) / 2 + 1 / 1; (-1 - 1) / 4 + 1 / 4; -1 - 1 + 1
    expected = {"grpo": 0.0, "dr_grpo": -0.25, "dapo": -1.0}[loss_type]
    assert float(summed.detach()) == pytest.approx(expected, abs=1e-6)


def test_zero_advantage_gives_zero_gradient_and_a_first_update_has_ratio_1_and_kl_0():
    train = SimpleNamespace(loss_type="grpo", num_generations=2, epsilon=0.2, epsilon_high=None, beta=0.1,
                            temperature=1.0, max_new_tokens=4, overlong_buffer=None, dynamic_sampling=0,
                            importance_sampling="token")  # fmt: skip
    loss_fn = GRPOLoss(train, [Reward("one", 1.0, lambda c, r: 1.0)])
    model = _Logits(2, 3, 5)
    logp = torch.log_softmax(model.table.detach()[:, :-1], dim=-1)
    ref = logp.gather(-1, _group_batch()["labels"][:, 1:].clamp(min=0).unsqueeze(-1)).squeeze(-1)
    batch = {**_group_batch(), "advantages": torch.zeros(2), "ref_logps": ref}
    summed, _ = loss_fn(model, batch)
    summed.backward()
    assert float(summed.detach()) == 0.0 and torch.count_nonzero(model.table.grad) == 0
    assert loss_fn.last_sums["kl"] == 0.0 and loss_fn.last_sums["clip_ratio"] == 0.0


def test_only_completion_tokens_up_to_the_end_token_are_trained():
    prompts = {"input_ids": torch.tensor([[0, 0, 5, 6], [7, 8, 9, 10]]), "attention_mask": torch.tensor([[0, 0, 1, 1], [1] * 4])}
    done = Completions(tokens=[[11, 2], [12], [13, 14, 2], [15]], texts=["a", "b", "c", "d"])  # 2 = the end token
    rows = trainable_rows(prompts, done, 2, pad_id=0)
    assert rows["input_ids"].tolist() == [
        [5, 6, 11, 2, 0, 0, 0],
        [5, 6, 12, 0, 0, 0, 0],
        [7, 8, 9, 10, 13, 14, 2],
        [7, 8, 9, 10, 15, 0, 0],
    ]
    assert rows["labels"].tolist() == [
        [-100, -100, 11, 2, -100, -100, -100],
        [-100, -100, 12, -100, -100, -100, -100],
        [-100, -100, -100, -100, 13, 14, 2],
        [-100, -100, -100, -100, 15, -100, -100],
    ]
    assert rows["attention_mask"].sum(dim=1).tolist() == [4, 3, 7, 5]


# ---------------------------------------------------------------- the recipe


def test_a_recipe_names_built_in_rewards_never_code(recipe_dict, tmp_path):
    data = grpo_recipe(recipe_dict, tmp_path)
    data["train"]["rewards"] = [{"name": "my_rewards.py"}]
    with pytest.raises(ConfigError) as err:
        build_recipe(data)
    assert "names 'my_rewards.py', not a built-in reward (exact_match | contains" in str(err.value)
    assert "finetune run --rewards FILE.py" in str(err.value)
    sft = json.loads(json.dumps(recipe_dict))
    sft["data"]["format"] = "prompt"
    with pytest.raises(ConfigError, match="data.format=prompt holds prompts without answers"):
        build_recipe(sft)
    zero = grpo_recipe(recipe_dict, tmp_path)
    zero["distributed"] = {"strategy": "deepspeed", "zero_stage": 3}
    with pytest.raises(ConfigError, match="runs on one process, DDP, FSDP or context parallelism"):
        build_recipe(zero)
    zero["distributed"] = {"tensor_parallel": 2}
    with pytest.raises(ConfigError, match="pipeline or tensor parallelism split what generate runs whole"):
        build_recipe(zero)
    zero["distributed"] = {"strategy": "fsdp"}
    assert build_recipe(zero).distributed.strategy == "fsdp"
    zero["distributed"] = {"context_parallel": 2}
    assert build_recipe(zero).distributed.context_parallel == 2
    zero["train"]["importance_sampling"] = "sequence"  # GSPO's one ratio a row: the row split over ranks
    with pytest.raises(ConfigError, match="train.importance_sampling=sequence: a completion's one ratio"):
        build_recipe(zero)


# ---------------------------------------------------------------- whole runs


def test_a_grpo_run_trains_completions_by_their_rewards(recipe_dict, tmp_path):
    cfg = build_recipe(grpo_recipe(recipe_dict, tmp_path, max_steps=3) | {"output_dir": str(tmp_path / "run")})
    result = Trainer(cfg, progress=False).train()
    rows = [r for r in read_metrics(result.metrics_path) if "loss" in r]
    assert [r["step"] for r in rows] == [1, 2, 3]
    for r in rows:
        # 2 prompts x 4 completions a step; every metric a mean over them
        assert 1 <= r["completion_length"] <= 6
        assert r["reward"] == pytest.approx(r["rewards/contains"] + 0.5 * r["rewards/length"], abs=1e-6)
        assert r["kl"] == 0.0 and r["clip_ratio"] == 0.0  # beta 0; one update per sampling
        assert 0.0 <= r["frac_reward_zero_std"] <= 1.0
    assert result.reward_before is not None and result.reward_after is not None


@pytest.mark.parametrize("steps_per_generation, num_iterations", [(1, 1), (2, 1), (1, 2)], ids=["k1", "k2", "mu2"])
def test_grpo_resumes_bitwise_after_sigterm(recipe_dict, tmp_path, steps_per_generation, num_iterations):
    # With 2 of either, the stop falls inside a cycle: step 4 trains on completions sampled before step 3, kept by the
    # checkpoint (mu 2: step 3's own, a second time).
    def cfg(out, **extra):
        train = {"max_steps": 6, "scheduler": "constant", "steps_per_generation": steps_per_generation}
        train["num_iterations"] = num_iterations
        data = grpo_recipe(recipe_dict, tmp_path, **train) | {"output_dir": str(out), **extra}
        data["checkpoint"] = {"every_steps": 100}
        data["lora"]["dropout"] = 0.1
        return build_recipe(data)

    # stopped as step 2 asks for its prompts (mu 2: data step 1, trained at steps 2 and 3), else as step 3 asks
    a, b = straight_and_resumed(cfg, tmp_path / "a", tmp_path / "b", stop_at=1 if num_iterations == 2 else 3)
    if steps_per_generation * num_iterations == 2:
        assert (tmp_path / "b" / "checkpoints" / "step-3" / "objective" / "rank0.safetensors").is_file()
    assert a == b  # the same completions sampled, the same rewards and losses
    assert not [r for r in a if "spike" in r]  # a policy-gradient loss near 0 of either sign: no "spikes"
    assert train_losses(tmp_path / "a" / "metrics.jsonl") == train_losses(tmp_path / "b" / "metrics.jsonl")
    # the weights, not only the metrics: the final adapters' tensors bitwise
    from safetensors.torch import load_file

    straight, resumed = (load_file(tmp_path / d / "adapter" / "adapter_model.safetensors") for d in ("a", "b"))
    assert straight.keys() == resumed.keys() and all(torch.equal(straight[k], resumed[k]) for k in straight)


def test_a_grpo_run_exports_its_adapter_and_a_verified_merge_as_an_sft_run_does(recipe_dict, tmp_path):
    from finetune.export.run import export_run

    cfg = build_recipe(grpo_recipe(recipe_dict, tmp_path, max_steps=2) | {"output_dir": str(tmp_path / "run")})
    with Trainer(cfg, progress=False) as trainer:
        trainer.train()
    adapter = export_run(tmp_path / "run", tmp_path / "adapter", say=lambda s: None)
    assert (adapter.out / "adapter_model.safetensors").is_file()
    merged = export_run(tmp_path / "run", tmp_path / "merged", merge=True, dtype="fp32", say=lambda s: None)
    check = merged.metadata["verification"]
    assert check["passed"] and check["max_abs_diff"] < 1e-4  # the merged model's logits are the adapter's


def _tiny_grpo_trainer(recipe_dict, tmp_path, **train) -> Trainer:
    cfg = build_recipe(grpo_recipe(recipe_dict, tmp_path, **train) | {"output_dir": str(tmp_path / "run")})
    trainer = Trainer(cfg, progress=False)
    trainer.setup()
    return trainer


def _asking(trainer, asked: list[int]):
    """trainer.step_batches, noting each data step asked for in `asked`."""

    def batches_of(step):
        asked.append(step)
        return trainer.step_batches(step)

    return batches_of


def _moved(model) -> None:
    """The adapter's B moved as an update would (seeded): the policy is no longer the one that sampled."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.add_(0.5 * torch.randn(p.shape, generator=torch.Generator().manual_seed(1)))


def test_one_sampling_serves_steps_per_generation_steps_against_the_policy_that_sampled(recipe_dict, tmp_path):
    trainer = _tiny_grpo_trainer(recipe_dict, tmp_path, max_steps=5, steps_per_generation=2, epsilon=0.05)
    model, loss = trainer.parallel.unwrap(trainer.model), trainer.loss_fn
    asked: list[int] = []
    batches_of = _asking(trainer, asked)
    first = loss.prepare(model, 0, batches_of, 5)
    assert asked == [0, 1]  # the cycle's prompts, sampled together by this policy
    # The first step's ratio is exactly 1: the same loss and gradient as a step that sampled its own (no old_logps).
    model.train()
    summed, _ = loss(model, first[0])
    own, _ = loss(model, {k: v for k, v in first[0].items() if k != "old_logps"})
    assert torch.equal(summed, own) and loss.last_sums["clip_ratio"] == 0.0
    # An update later, step 2 trains on what the old policy sampled: its ratios against that policy, clipped.
    _moved(model)
    second = loss.prepare(model, 1, batches_of, 5)
    assert asked == [0, 1]  # not sampled again
    loss(model, second[0])
    assert loss.last_sums["clip_ratio"] > 0
    # What a checkpoint keeps: the completions of step 3, sampled at step 2, given back to a fresh loss.
    loss.prepare(model, 2, batches_of, 5)
    assert asked == [0, 1, 2, 3]
    saved = loss.state_dict()
    assert {k.split(".")[0] for k in saved} == {"world", "parts", "3"}
    again = GRPOLoss(trainer.cfg.train, loss.rewards, trainer.cfg.seed)
    assert again.load_state_dict(dict(saved)) is None
    kept = again.prepare(model, 3, batches_of, 5)
    assert asked == [0, 1, 2, 3]
    expected = loss.prepare(model, 3, batches_of, 5)
    assert all(torch.equal(kept[0][k], expected[0][k]) for k in ("input_ids", "labels", "advantages", "old_logps"))
    assert kept[0]["sample_sums"] == expected[0]["sample_sums"]
    # From another number of processes (another split of the prompts): said, and sampled afresh.
    other = GRPOLoss(trainer.cfg.train, loss.rewards, trainer.cfg.seed)
    other.use_tokenizer(trainer.tokenizer)
    assert "another number of processes" in other.load_state_dict({**saved, "world": torch.tensor(2)})
    other.prepare(model, 3, batches_of, 5)
    assert asked == [0, 1, 2, 3, 3]
    # ...or of context-parallel parts (the same number of processes as other replicas: cp2 on 2 vs DDP on 2)
    assert "or replicas; sampling afresh" in other.load_state_dict({**saved, "parts": torch.tensor(2)})
    other.prepare(model, 3, batches_of, 5)
    assert asked == [0, 1, 2, 3, 3, 3]
    # The last cycle ends with the run; an out-of-memory retry asks for its step again: sampled afresh.
    loss.prepare(model, 4, batches_of, 5)
    loss.prepare(model, 4, batches_of, 5)
    assert asked == [0, 1, 2, 3, 3, 3, 4, 4]
    trainer.close()


def test_num_iterations_trains_each_steps_prompts_that_many_times_in_turn():
    assert [data_step(s, 1, 1) for s in range(4)] == [0, 1, 2, 3]  # one step a sampling: the data order itself
    assert [data_step(s, 2, 1) for s in range(4)] == [0, 1, 2, 3]  # steps_per_generation alone: each step its own
    assert [data_step(s, 1, 3) for s in range(7)] == [0, 0, 0, 1, 1, 1, 2]
    assert [data_step(s, 2, 2) for s in range(9)] == [0, 1, 0, 1, 2, 3, 2, 3, 4]  # TRL's order: k slices, mu times
    # a last cycle cut short by the run (an epoch of 3 data steps: 6 steps) trains its one data step twice
    assert [data_step(s, 2, 2, steps=6) for s in range(6)] == [0, 1, 0, 1, 2, 2]
    assert [data_step(s, 2, 2, steps=7) for s in range(7)] == [0, 1, 0, 1, 2, 3, 2]  # max_steps: as far as it goes


def test_a_second_iteration_trains_the_same_completions_against_the_policy_that_sampled_them(recipe_dict, tmp_path):
    trainer = _tiny_grpo_trainer(recipe_dict, tmp_path, max_steps=4, num_iterations=2, epsilon=0.05)
    model, loss = trainer.parallel.unwrap(trainer.model), trainer.loss_fn
    asked: list[int] = []
    batches_of = _asking(trainer, asked)
    first = loss.prepare(model, 0, batches_of, 4)
    assert asked == [0] and "old_logps" in first[0]  # sampled once for its 2 steps, their sampling policy kept
    model.train()
    loss(model, first[0])
    assert loss.last_sums["clip_ratio"] == 0.0  # the first iteration: ratio 1
    assert {k.split(".")[0] for k in loss.state_dict()} == {"world", "parts", "1"}  # a checkpoint keeps step 1's
    _moved(model)  # an update later
    second = loss.prepare(model, 1, batches_of, 4)
    assert asked == [0]  # not sampled again: the same completions, rewards and advantages
    assert all(torch.equal(second[0][k], first[0][k]) for k in ("input_ids", "labels", "advantages", "old_logps"))
    loss(model, second[0])
    assert loss.last_sums["clip_ratio"] > 0  # against the policy that sampled them, clipped
    loss.prepare(model, 2, batches_of, 4)
    assert asked == [0, 1]  # the next cycle: the data order's next step
    trainer.close()
    # train.epochs counts each prompt once: an epoch is num_iterations times the steps
    epochs = {"max_steps": None, "epochs": 1}
    once, twice = (_tiny_grpo_trainer(recipe_dict, tmp_path, **epochs, num_iterations=n) for n in (1, 2))
    assert twice.state.total_steps == 2 * once.state.total_steps == 2 * 56 // 2
    once.close()
    twice.close()


def test_the_head_runs_on_completion_tokens_only_with_the_same_log_probabilities(recipe_dict, tmp_path):
    trainer = _tiny_grpo_trainer(recipe_dict, tmp_path, max_steps=2)
    model, loss = trainer.parallel.unwrap(trainer.model), trainer.loss_fn
    assert loss.head_on_targets_only  # this model takes a boolean logits_to_keep
    batch = loss.sample(model, trainer.step_batches(0)[0])
    seen: list[tuple[int, ...]] = []
    hook = model.get_output_embeddings().register_forward_hook(lambda m, i, o: seen.append(tuple(o.shape)))
    lean, mask = completion_logps(model, batch, 0.7, head_on_targets_only=True)
    full, _ = completion_logps(model, batch, 0.7, head_on_targets_only=False)
    hook.remove()
    assert seen[0][0] == int(mask.sum()) < batch["input_ids"].numel()  # completion tokens, not every position
    torch.testing.assert_close(lean, full, rtol=1e-5, atol=1e-6)
    assert bool((lean[~mask] == 0).all()) and bool((lean[mask] < 0).all())
    trainer.close()


def test_sharded_weights_sample_with_every_ranks_decoder_in_step(recipe_dict, tmp_path):
    # Under FSDP each decode step gathers the weights: a rank whose completions all ended must go on stepping
    # with the others (generate's synced_gpus), or they wait for it forever. (tests/e2e: FSDP samples as DDP.)
    trainer = _tiny_grpo_trainer(recipe_dict, tmp_path, max_steps=2)
    model, loss, prompts = trainer.parallel.unwrap(trainer.model), trainer.loss_fn, trainer.step_batches(0)[0]
    synced: list[bool] = []
    generate = model.generate
    model.generate = lambda *a, **k: synced.append(k["synced_gpus"]) or generate(*a, **{**k, "synced_gpus": False})
    loss.sample(model, prompts)
    loss.use_memory("auto", 0, torch.device("cpu"), sharded=True)
    loss.sample(model, prompts)
    loss.held_out(model, [trainer.data.eval[0]], trainer.collate, 1, torch.device("cpu"))
    assert synced == [False, True, True]
    trainer.close()


def test_sampling_draws_from_its_own_seeded_generator_per_step_and_rank(recipe_dict, tmp_path):
    trainer = _tiny_grpo_trainer(recipe_dict, tmp_path, max_steps=2)
    model, loss, prompts = trainer.parallel.unwrap(trainer.model), trainer.loss_fn, trainer.step_batches(0)[0]
    torch.manual_seed(1)
    a = loss.sample(model, prompts, step=0)
    torch.manual_seed(2)  # whatever else drew from the global generator (an eval, your callback)
    b = loss.sample(model, prompts, step=0)
    c = loss.sample(model, prompts, step=1)
    assert torch.equal(a["input_ids"], b["input_ids"]) and not torch.equal(a["input_ids"], c["input_ids"])
    # Each (seed, step, micro-batch, rank) draws its own stream...
    keys = [(seed, step, micro, rank) for seed in (0, 1) for step in (0, 3) for micro in (0, 1) for rank in (0, 1)]
    assert len({sampling_seed(*k) for k in keys}) == len(keys)
    # ...and the same one in every process and every resume (golden: a per-process hash() or a global draw fails).
    assert sampling_seed(0, 3, 0, 1) == 8512558575088286278 and sampling_seed(0, 3, 0, 0) == 8165442179359992593
    trainer.close()


def test_your_rewards_come_from_the_python_api_or_a_file_you_name(recipe_dict, tmp_path):
    from finetune.cli.commands import main

    seen: list[str] = []

    def reward_echo(completion: str, record: dict) -> float:
        seen.append(completion)
        return float(len(completion) % 2)

    cfg = build_recipe(grpo_recipe(recipe_dict, tmp_path, max_steps=1) | {"output_dir": str(tmp_path / "api")})
    Trainer(cfg, progress=False, reward_fns=[reward_echo]).train()
    assert len(seen) >= 8  # 2 prompts x 4 completions, and the held-out prompts
    rows = [r for r in read_metrics(tmp_path / "api" / "metrics.jsonl") if "loss" in r]
    assert "rewards/reward_echo" in rows[0]
    # The CLI: a file the user names on the command line.
    (tmp_path / "mine.py").write_text("def reward_short(completion, record):\n    return -len(completion) / 10\n")
    recipe = tmp_path / "grpo.yaml"
    import yaml

    recipe.write_text(yaml.safe_dump(grpo_recipe(recipe_dict, tmp_path, max_steps=1) | {"output_dir": str(tmp_path / "cli")}))
    assert main(["run", str(recipe), "--rewards", str(tmp_path / "mine.py"), "--no-progress"]) == 0
    rows = [r for r in read_metrics(tmp_path / "cli" / "metrics.jsonl") if "loss" in r]
    assert rows[0]["rewards/reward_short"] <= 0.0


def test_finetune_eval_scores_a_grpo_run_as_it_printed_after_training(recipe_dict, tmp_path, capsys):
    from finetune.cli.commands import main

    cfg = build_recipe(grpo_recipe(recipe_dict, tmp_path, max_steps=3, lr=5e-2) | {"output_dir": str(tmp_path / "run")})
    result = Trainer(cfg, progress=False, reward_fns=[lambda c, r: float("4" in c)]).train()
    capsys.readouterr()
    assert main(["eval", str(tmp_path / "run"), "--json", str(tmp_path / "eval.json")]) == 0
    out, err = capsys.readouterr()
    found = json.loads((tmp_path / "eval.json").read_text())
    # The same held-out prompts, greedy, the same weights: the numbers training printed before and after.
    assert found["records"] == 8 and result.reward_after != pytest.approx(result.reward_before, abs=1e-3)  # it moved
    assert found["base"]["reward"] == pytest.approx(result.reward_before, abs=1e-7)
    assert found["fine-tuned"]["reward"] == pytest.approx(result.reward_after, abs=1e-7)
    assert set(found["base"]) == {"reward", "contains", "length"}
    assert "total" in out and "contains" in out
    # Trained with a reward of your own, which the recipe cannot name: eval says so and scores it once given.
    assert "also trained on lambda" in err and "--rewards FILE.py" in err
    (tmp_path / "mine.py").write_text("def reward_four(completion, record):\n    return float('4' in completion)\n")
    assert (
        main(
            [
                "eval",
                str(tmp_path / "run"),
                "--rewards",
                str(tmp_path / "mine.py"),
                "--limit",
                "4",
                "--json",
                str(tmp_path / "e.json"),
            ]
        )
        == 0
    )
    assert set(json.loads((tmp_path / "e.json").read_text())["base"]) == {"reward", "contains", "length", "reward_four"}


@pytest.mark.slow
def test_the_grpo_demo_raises_held_out_accuracy_by_rewards_alone(tmp_path):
    # The README's promise for `finetune run grpo-demo-cpu`: held-out exact match 16% -> 92% (bf16; fp32 17% -> 93%),
    # QLoRA, rewards only (the loss never sees an answer). About 40 s on 2 cores.
    from finetune.config.schema import load_recipe

    # fp32 pinned: the same numbers on CPUs with and without native bf16 (the demo's auto picks either).
    cfg = load_recipe("grpo-demo-cpu", [f"output_dir={tmp_path / 'grpo'}", "precision=fp32"])
    assert cfg.train.objective == "grpo" and cfg.quant.bits == 4 and cfg.lora is not None
    with Trainer(cfg, progress=False) as trainer:
        result = trainer.train()
    assert 0.05 <= result.reward_before <= 0.30, result.reward_before  # RL needs some reward to start from (16-17%)
    assert result.reward_after >= 0.88, (result.reward_before, result.reward_after)  # the README's "88% or more" (93% in fp32)


def test_the_planner_counts_every_completion_and_says_what_it_leaves_out(recipe_dict, tmp_path):
    from finetune.plan.recipe import ONLINE_NOTE, plan_recipe, setup_of

    cfg = build_recipe(grpo_recipe(recipe_dict, tmp_path, num_generations=8, beta=0.1))
    setup = setup_of(cfg)
    assert (setup.sequences_per_example, setup.reference_passes) == (8, 1)  # 8 completions a prompt; the KL's pass
    assert setup_of(build_recipe(grpo_recipe(recipe_dict, tmp_path))).reference_passes == 0  # beta 0: none
    assert ONLINE_NOTE in plan_recipe(cfg, None).notes


class _CharTokenizer:
    """Decodes each id as one character: 1.. as a.., 27 as a newline (id 0 is the end token)."""

    def decode(self, ids, skip_special_tokens=True):
        return "".join("\n" if i == 27 else chr(96 + i) if i else "" for i in ids)


@pytest.mark.parametrize(
    "row, stops, trained, text",
    [
        ([1, 2, 0, 3], [], [1, 2, 0], "ab"),  # the end token: trained, not read
        ([1, 2, 3], [], [1, 2, 3], "abc"),  # max_new_tokens reached
        ([3, 1, 2, 3], ["a"], [3, 1], "c"),  # the stop string ends it; trained up to its token
        ([27, 1, 2, 27, 3], ["\n"], [27, 1, 2, 27], "\nab"),  # a leading newline does not end it (it has not begun)
        ([1, 2, 1, 0], ["a"], [1], ""),  # a stop string that is not whitespace ends it even first
        ([2, 1, 0], ["x"], [2, 1, 0], "ba"),  # no stop string: the end token
    ],
)
def test_a_completion_ends_at_its_end_token_or_its_first_stop_string_once_begun(row, stops, trained, text):
    from finetune.objectives.sampling import cut

    assert cut(row, [0], stops, _CharTokenizer()) == (trained, text)


def test_sampling_takes_no_setting_from_the_models_generation_config(tiny_model_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from finetune.data.dataset import collate_prompts
    from finetune.objectives.sampling import complete, end_ids

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    model.generation_config.do_sample, model.generation_config.temperature = True, 5.0  # a chat model's defaults
    model.generation_config.repetition_penalty = 3.0
    train = SimpleNamespace(max_new_tokens=6, temperature=1.0, top_p=1.0, stop=[])
    prompts = collate_prompts([{"input_ids": tok("Add 1 and 2:")["input_ids"], "prompt": "", "record": {}}] * 2, 0)
    ends = end_ids(tok, model)
    greedy = [complete(model, prompts, 1, tok, ends, train, greedy=True).tokens for _ in range(3)]
    assert greedy[0] == greedy[1] == greedy[2]  # greedy, whatever the model's config says
    logits = model(input_ids=prompts["input_ids"][:1]).logits[0, -1]
    assert greedy[0][0][0] == int(logits.argmax())  # the first token is the plain argmax (no penalty applied)


def test_a_preference_objective_refuses_beta_0(recipe_dict, tmp_path):
    data = json.loads(json.dumps(recipe_dict))
    data["data"] = {"path": str(write_jsonl(tmp_path / "p.jsonl", [{"prompt": "a", "chosen": "b", "rejected": "c"}] * 4))}
    data["data"]["format"] = "preference"
    data["train"] |= {"objective": "dpo", "beta": 0}
    with pytest.raises(ConfigError, match="train.beta=0 gives train.objective=dpo no gradient"):
        build_recipe(data)


def test_grpo_keys_under_another_objective_are_refused_not_ignored(recipe_dict):
    # A recipe that tunes sampling but forgot train.objective=grpo would train SFT and never sample.
    data = json.loads(json.dumps(recipe_dict))
    data["train"] |= {"num_generations": 8, "stop": ["\n"]}
    with pytest.raises(ConfigError, match=r"train.num_generations, train.stop: grpo's, but train.objective=sft"):
        build_recipe(data)
    data["train"] |= {"num_generations": 4, "stop": []}  # the defaults: a recipe written out whole is fine
    assert build_recipe(data).train.objective == "sft"


def test_finetune_data_shows_prompts_and_the_columns_the_rewards_read(recipe_dict, tmp_path, capsys):
    import yaml

    from finetune.cli.commands import main

    recipe = tmp_path / "grpo.yaml"
    recipe.write_text(yaml.safe_dump(grpo_recipe(recipe_dict, tmp_path)))
    assert main(["data", str(recipe), "--examples", "1"]) == 0
    out = capsys.readouterr().out
    assert "train: 56 prompts, " in out and "(completions sampled from them are trained)" in out
    assert "--- 0: " in out and "other columns {'answer': '" in out and "% trained" not in out


def _sampled_both_ways(tiny_model_dir, monkeypatch, greedy: bool):
    """complete()'s completions of 2 prompts (one left-padded) x 4, with each prompt prefilled once, then with every
    row prefilled (shared_prefill off); and the rows each way's first forward ran on."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from finetune.data.dataset import collate_prompts
    from finetune.objectives import sampling

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    texts = ["Repeat the words: ship snow car pen\nAnswer:", "Add 1 and 2:"]
    prompts = collate_prompts([{"input_ids": tok(t)["input_ids"], "prompt": t, "record": {}} for t in texts], tok.pad_token_id)
    train = SimpleNamespace(max_new_tokens=12, temperature=1.0, top_p=1.0, stop=[])
    ends = sampling.end_ids(tok, model)
    seen: list[tuple[int, int]] = []
    model.register_forward_pre_hook(lambda m, a, k: seen.append(tuple(k["input_ids"].shape)), with_kwargs=True)
    shared = sampling.complete(model, prompts, 4, tok, ends, train, greedy=greedy, seed=5).tokens
    first_shared, seen[:] = seen[:2], []  # the prefill's forward, then generate's first
    monkeypatch.setattr(sampling, "shared_prefill", lambda model, prompts, n, synced=False: None)
    every = sampling.complete(model, prompts, 4, tok, ends, train, greedy=greedy, seed=5).tokens
    return shared, every, (first_shared, seen[:1]), prompts["input_ids"].shape


@pytest.mark.parametrize("greedy", [True, False], ids=["greedy", "sampled"])
def test_each_prompt_prefilled_once_samples_what_every_row_prefilled_samples(tiny_model_dir, monkeypatch, greedy):
    shared, every, (first_shared, first_every), (prompts, width) = _sampled_both_ways(tiny_model_dir, monkeypatch, greedy)
    # one prefill per prompt, then generate feeds each row its last prompt token; unshared, every row whole
    assert first_shared == [(prompts, width - 1), (prompts * 4, 1)] and first_every == [(prompts * 4, width)]
    assert shared == every and len({tuple(c) for c in shared}) > (1 if greedy else 4)  # (the two prompts differ)


def test_a_prefill_repeated_in_the_wrong_order_samples_other_completions(tiny_model_dir, monkeypatch):
    from transformers import DynamicCache

    # the cache tiled (prompt 0, 1, 0, 1, ...) where generate's rows are each prompt's 4 completions together
    def tiled(cache, n: int) -> None:
        for layer in cache.layers:
            layer.keys, layer.values = layer.keys.repeat(n, 1, 1, 1), layer.values.repeat(n, 1, 1, 1)

    monkeypatch.setattr(DynamicCache, "batch_repeat_interleave", tiled)
    shared, every, _, _ = _sampled_both_ways(tiny_model_dir, monkeypatch, greedy=True)
    assert shared != every


def test_a_model_whose_cache_cannot_be_shared_prefills_every_row():
    # Linear-attention layers' states do not repeat (Qwen3-Next: its cache has no batch_repeat_interleave), a cache
    # class the generation config names makes generate refuse ours, multimodal rope adds the last call's deltas.
    import transformers

    from finetune.objectives.sampling import shareable, shared_prefill

    cfg = transformers.Qwen3NextConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                       num_attention_heads=2, num_key_value_heads=1, head_dim=16, linear_num_value_heads=2,
                                       linear_num_key_heads=1, linear_key_head_dim=16, linear_value_head_dim=16, num_experts=2,
                                       num_experts_per_tok=1, moe_intermediate_size=32, shared_expert_intermediate_size=32,
                                       layer_types=["linear_attention", "full_attention"])  # fmt: skip
    hybrid = transformers.Qwen3NextForCausalLM(cfg).eval()
    ids = torch.randint(1, 60, (2, 6))
    prompts = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    assert shareable(hybrid) and shared_prefill(hybrid, prompts, 3) is None  # refused by its cache's layers
    llama = transformers.LlamaForCausalLM(transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
                                                                   num_hidden_layers=1, num_attention_heads=2)).eval()  # fmt: skip
    assert shared_prefill(llama, prompts, 3) is not None and shared_prefill(llama, prompts, 1) is None
    llama.generation_config.cache_implementation = "dynamic"
    assert not shareable(llama)
    llama.generation_config.cache_implementation = None
    llama.model.rope_deltas = None  # (what Qwen2-VL's model holds)
    assert not shareable(llama)


def test_gspo_clips_each_completions_one_ratio_as_computed_by_hand():
    # Two completions of 3 tokens (the second's last is padding), off-policy: the ratio of each completion is the exp
    # of its tokens' mean log-ratio, the same for its every token; the first's is clipped at 1 + 0.2, the second's not.
    logps = torch.tensor([[-1.0, -2.0, -0.5], [-0.3, -0.6, -9.0]], requires_grad=True)
    old = torch.tensor([[-1.3, -2.4, -0.5], [-0.4, -0.5, -1.0]])
    adv = torch.tensor([1.0, -0.5])
    mask = torch.tensor([[True, True, True], [True, True, False]])
    loss, clipped, _ = token_losses(logps, old, adv, 0.2, 0.2, sequence_mask=mask)
    r0, r1 = math.exp((0.3 + 0.4 + 0.0) / 3), math.exp((0.1 - 0.1) / 2)  # 1.2629 (clipped to 1.2), 1.0
    assert r0 > 1.2
    torch.testing.assert_close(loss[0], torch.full((3,), -1.2 * 1.0))
    torch.testing.assert_close(loss[1, :2], torch.full((2,), -r1 * -0.5))
    assert clipped[0].all() and not clipped[1].any()
    ((loss * mask).sum(dim=1) / mask.sum(dim=1)).sum().backward()  # loss_type grpo: each completion's token mean
    # d/dlogp_j of -r A, r = exp(mean of the row's log-ratios): -A r / n on the row's tokens; the clipped row: 0
    torch.testing.assert_close(logps.grad, torch.tensor([[0.0, 0.0, 0.0], [0.25, 0.25, 0.0]]))


def test_gspo_on_policy_is_grpo_and_padding_left_in_changes_the_ratio():
    torch.manual_seed(0)
    logps = (-torch.rand(4, 5) * 3).requires_grad_(True)
    adv, mask = torch.tensor([1.0, -1.0, 0.5, -0.5]), torch.rand(4, 5) > 0.3
    grads = []
    for sequence in (None, mask):  # steps_per_generation 1: sampled by this very policy, every ratio 1
        logps.grad = None
        loss, _, _ = token_losses(logps, logps.detach(), adv, 0.2, 0.2, sequence_mask=sequence)
        ((loss * mask).sum(dim=1) / mask.sum(dim=1)).sum().backward()
        grads.append(logps.grad.clone())
    torch.testing.assert_close(grads[0], grads[1])
    old = logps.detach() - 0.1 * torch.arange(5.0)  # off-policy, and the padding's log-ratios differ from the tokens'
    kept, _, _ = token_losses(logps, old, adv, 0.5, 0.5, sequence_mask=mask)
    padded, _, _ = token_losses(logps, old, adv, 0.5, 0.5, sequence_mask=torch.ones_like(mask))
    assert not torch.allclose(kept[mask], padded[mask])  # the negative control: padding counted in the mean


def test_the_loss_runs_gspo_under_importance_sampling_sequence():
    # Off-policy (old_logps per token apart): the loss GRPOLoss returns is the one token_losses gives with each
    # completion's tokens as the sequence mask, and not the per-token one.
    batch = {**_group_batch(), "advantages": torch.tensor([1.0, -1.0])}
    logp = torch.log_softmax(_Logits(2, 3, 5).table.detach()[:, :-1], dim=-1)
    labels = batch["labels"][:, 1:]
    current = logp.gather(-1, labels.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    batch["old_logps"] = current - torch.tensor([[0.3, -0.1], [0.05, 0.0]])
    mask = labels != IGNORE_INDEX
    summed = {}
    for level in ("token", "sequence"):
        train = SimpleNamespace(loss_type="grpo", num_generations=2, epsilon=0.2, epsilon_high=None, beta=0.0,
                                temperature=1.0, max_new_tokens=4, overlong_buffer=None, dynamic_sampling=0,
                            importance_sampling=level)  # fmt: skip
        summed[level] = float(GRPOLoss(train, [Reward("one", 1.0, lambda c, r: 1.0)])(_Logits(2, 3, 5), batch)[0].detach())
    by_hand, _, _ = token_losses(current, batch["old_logps"], batch["advantages"], 0.2, 0.2, sequence_mask=mask)
    assert summed["sequence"] == pytest.approx(float(((by_hand * mask).sum(1) / mask.sum(1)).sum()), abs=1e-6)
    assert summed["sequence"] != pytest.approx(summed["token"], abs=1e-3)
