"""The Trainer's seams for people who import it: callbacks, their own optimizer, scheduler
and loss, a run from parts in memory (no recipe paths), and cleanup as a context manager.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import ALPACA_ROWS
from safetensors.torch import load_file

from finetune import Callback, Trainer, TrainState
from finetune.config.schema import build_recipe
from finetune.metrics import read_metrics
from finetune.trainer import CausalLMLoss


def cfg_for(recipe_dict, out, **sections):
    data = json.loads(json.dumps(recipe_dict))
    data["output_dir"] = str(out)
    data["report"] = {"plot": False}
    for key, value in sections.items():
        data[key] = {**data.get(key, {}), **value} if isinstance(value, dict) else value
    return build_recipe(data)


def losses(out: Path) -> list[float]:
    return [r["loss"] for r in read_metrics(out / "metrics.jsonl") if "loss" in r]


def adapter(out: Path) -> dict[str, torch.Tensor]:
    return load_file(str(out / "adapter" / "adapter_model.safetensors"))


class Recorder(Callback):
    def __init__(self):
        self.calls: list[tuple[str, dict]] = []

    def on_train_begin(self, state, metrics):
        self.calls.append(("begin", metrics))

    def on_step_end(self, state, metrics):
        assert isinstance(state, TrainState) and state.step == metrics["step"]
        self.calls.append(("step", metrics))

    def on_eval(self, state, metrics):
        self.calls.append(("eval", metrics))

    def on_save(self, state, metrics):
        self.calls.append(("save", metrics))

    def on_train_end(self, state, metrics):
        self.calls.append(("end", metrics))


def test_a_callback_sees_every_step_eval_save_and_the_end(recipe_dict, tmp_path):
    rec = Recorder()
    cfg = cfg_for(
        recipe_dict,
        tmp_path / "run",
        train={"max_steps": 6, "log_every_steps": 3},
        eval={"every_steps": 3},
        data={"eval_fraction": 0.1},
        checkpoint={"every_steps": 2, "keep_last": None},
    )
    result = Trainer(cfg, progress=False, callbacks=[rec]).train()
    kinds = [k for k, _ in rec.calls]
    assert kinds[0] == "begin" and kinds[-1] == "end"
    steps = [m for k, m in rec.calls if k == "step"]
    assert [m["step"] for m in steps] == [1, 2, 3, 4, 5, 6]  # every step, though only 3 and 6 are logged
    logged = {r["step"]: r["loss"] for r in read_metrics(result.metrics_path) if "loss" in r}
    assert sorted(logged) == [3, 6] and all(logged[s] == steps[s - 1]["loss"] for s in logged)
    assert [m["eval_loss"] for k, m in rec.calls if k == "eval"] == [
        r["eval_loss"] for r in read_metrics(result.metrics_path) if "eval_loss" in r
    ]
    saves = [(m["kind"], m["step"]) for k, m in rec.calls if k == "save"]
    assert saves == [("checkpoint", 2), ("checkpoint", 4), ("checkpoint", 6), ("adapter", 6)]
    assert all(Path(m["path"]).is_dir() for k, m in rec.calls if k == "save")
    end = rec.calls[-1][1]
    assert end["final_loss"] == result.final_loss and end["steps"] == 6 and end["adapter_dir"] == str(result.adapter_dir)
    # Each hook got a copy: what a callback does to metrics never reaches metrics.jsonl.
    steps[2]["loss"] = 123.0
    assert logged[3] != 123.0


def test_a_callback_can_end_the_run_early_and_it_finishes_normally(recipe_dict, tmp_path):
    class StopAtThree(Callback):
        def on_step_end(self, state, metrics):
            if metrics["step"] == 3:
                state.should_stop = True

    cfg = cfg_for(recipe_dict, tmp_path / "run", train={"max_steps": 10}, checkpoint={"every_steps": 100})
    result = Trainer(cfg, progress=False, callbacks=[StopAtThree()]).train()
    assert result.steps == 3
    assert [r["step"] for r in read_metrics(result.metrics_path) if "loss" in r][-1] == 3  # the last step is logged
    assert (result.adapter_dir / "adapter_model.safetensors").is_file()
    assert (tmp_path / "run" / "checkpoints" / "step-3" / "manifest.json").is_file()  # extendable with resume=auto


def test_an_object_without_hooks_is_refused_as_a_callback(recipe_dict, tmp_path):
    with pytest.raises(TypeError, match="is not a callback"):
        Trainer(cfg_for(recipe_dict, tmp_path / "run"), callbacks=[object()])


def test_own_optimizer_and_scheduler_are_the_ones_that_train(recipe_dict, tmp_path):
    # SGD at lr 0 leaves LoRA's B at its zero init; AdamW (the default) moves it.
    frozen = Trainer(
        cfg_for(recipe_dict, tmp_path / "sgd0"), progress=False, optimizer=lambda params: torch.optim.SGD(params, lr=0.0)
    )
    frozen.train()
    assert isinstance(frozen.optimizer.optimizer, torch.optim.SGD)
    b = {k: v for k, v in adapter(tmp_path / "sgd0").items() if "lora_B" in k}
    assert b and all(torch.count_nonzero(v) == 0 for v in b.values())
    Trainer(cfg_for(recipe_dict, tmp_path / "adamw"), progress=False).train()
    assert any(torch.count_nonzero(v) > 0 for k, v in adapter(tmp_path / "adamw").items() if "lora_B" in k)

    # A scheduler function of the optimizer: its lr is the one each step logs.
    halving = Trainer(
        cfg_for(recipe_dict, tmp_path / "halving", train={"max_steps": 3}),
        progress=False,
        optimizer=lambda params: torch.optim.SGD(params, lr=0.1),
        scheduler=lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.5**s),
    )
    halving.train()
    assert [r["lr"] for r in read_metrics(tmp_path / "halving" / "metrics.jsonl") if "loss" in r] == [0.1, 0.05, 0.025]


def test_own_loss_function_is_the_objective(recipe_dict, tmp_path):
    base = CausalLMLoss()
    calls = []

    def doubled(model, batch):
        calls.append(batch["input_ids"].shape[0])
        loss, n = base(model, batch)
        return 2 * loss, n

    Trainer(cfg_for(recipe_dict, tmp_path / "plain", train={"max_steps": 1}), progress=False).train()
    Trainer(cfg_for(recipe_dict, tmp_path / "twice", train={"max_steps": 1}), progress=False, loss_fn=doubled).train()
    assert losses(tmp_path / "twice")[0] == pytest.approx(2 * losses(tmp_path / "plain")[0], rel=1e-6)
    assert calls == [recipe_dict["train"]["batch_size"]]  # one micro-batch, one call


def test_a_loss_says_its_units_and_metrics_to_the_loop(recipe_dict, tmp_path):
    # One protocol for every objective (finetune.Loss): the window's loss is divided by count()'s units, and
    # metric_sums() reaches the step's row divided by them. A plain function may carry the same as attributes.
    from finetune import Loss

    class PerExample(Loss):  # the cross-entropy summed per example, averaged over examples
        def __init__(self):
            self.inner = CausalLMLoss()

        def __call__(self, model, batch):
            loss, _ = self.inner(model, batch)
            return loss, self.count(batch)

        def count(self, batch):
            return batch["input_ids"].shape[0]

        def metric_sums(self):
            return {"examples": 4.0}

    def summed(model, batch):
        return PerExample()(model, batch)

    summed.count = lambda batch: batch["input_ids"].shape[0]
    summed.last_sums = {"examples": 4.0}
    plain = cfg_for(recipe_dict, tmp_path / "plain", train={"max_steps": 1})
    Trainer(plain, progress=False).train()
    rows = {}
    for name, loss in (("protocol", PerExample()), ("function", summed)):
        Trainer(cfg_for(recipe_dict, tmp_path / name, train={"max_steps": 1}), progress=False, loss_fn=loss).train()
        rows[name] = [r for r in read_metrics(tmp_path / name / "metrics.jsonl") if "loss" in r][0]
    (per_token,) = [r for r in read_metrics(tmp_path / "plain" / "metrics.jsonl") if "loss" in r]
    examples = recipe_dict["train"]["batch_size"]  # one micro-batch
    for row in rows.values():
        assert row["examples"] == pytest.approx(4.0 / examples, rel=1e-12)  # summed 4, over the window's examples
        # the same summed cross-entropy as the default objective's, divided by examples instead of target tokens
        assert row["loss"] == pytest.approx(per_token["loss"] * per_token["trained_tokens"] / examples, rel=1e-5)


def test_from_parts_needs_no_paths_and_trains_like_the_recipe(recipe_dict, tiny_model_dir, tmp_path, monkeypatch):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from finetune.memory import apply

    kernels = []  # model.kernels=auto patches what finetune loads, never a model handed over
    monkeypatch.setattr(apply, "apply_kernels", lambda model, setting, device: kernels.append(setting) or "none")

    # Dropout on: its masks come from the generator as the LoRA init leaves it, as in a recipe's run.
    settings = {
        "seed": 0,
        "precision": "fp32",
        "lora": {"r": 4, "alpha": 8, "dropout": 0.3},
        "train": {"max_steps": 3, "batch_size": 4, "lr": 1e-3},
        "memory": {"activation_checkpointing": "none"},
        "report": {"plot": False},
    }
    Trainer(cfg_for(recipe_dict, tmp_path / "recipe", **settings), progress=False).train()

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    with Trainer.from_parts(model, tokenizer, ALPACA_ROWS, output_dir=tmp_path / "parts", progress=False, **settings) as trainer:
        result = trainer.train()
    assert losses(tmp_path / "parts") == losses(tmp_path / "recipe")
    a, b = adapter(tmp_path / "parts"), adapter(tmp_path / "recipe")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert result.adapter_dir == tmp_path / "parts" / "adapter"
    written = (tmp_path / "parts" / "recipe.yaml").read_text()
    assert f"path: {tiny_model_dir}" in written and "path: in-memory" in written

    # Already-tokenized examples are used as they are.
    examples = list(trainer.data.train)
    fresh = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    again = Trainer.from_parts(fresh, tokenizer, examples, output_dir=tmp_path / "tokenized", progress=False, **settings)
    again.train()
    assert len(again.data.train) == len(examples) and again.data.train_stats.examples == len(examples)
    assert kernels == ["auto", "none", "none"]


def test_the_context_manager_deletes_the_streamed_weights_file(recipe_dict, tmp_path):
    cfg = cfg_for(
        recipe_dict,
        tmp_path / "run",
        quant={"bits": 4},
        train={"max_steps": 1},
        memory={"activation_checkpointing": "all", "base_weights": "disk", "offload_dir": str(tmp_path / "nvme")},
    )
    with Trainer(cfg, progress=False) as trainer:
        trainer.train()
        store = trainer.memory.stream.store
        assert store.is_file()
    assert not store.exists()


@pytest.mark.slow
def test_the_extending_example_runs(tmp_path):
    example = Path(__file__).resolve().parents[1] / "examples" / "extend_trainer.py"
    proc = subprocess.run([sys.executable, str(example), str(tmp_path / "out")], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "stopped early at step" in proc.stdout and "lr halves" in proc.stdout
