"""Training loop on the tiny model: learning, grad-accum equivalence, output layout, peft round trip, resume."""

from __future__ import annotations

import json
import math

import pytest
import torch
import transformers
from conftest import training_kernel_only
from packaging.version import Version

from finetune.config.schema import build_recipe
from finetune.metrics import read_metrics
from finetune.model.load import takes_boolean_logits_to_keep
from finetune.runs.report import plot_available
from finetune.trainer import Trainer, lr_factor


def make_cfg(recipe_dict, **sections):
    data = json.loads(json.dumps(recipe_dict))
    for key, value in sections.items():
        if isinstance(value, dict):
            data.setdefault(key, {}).update(value)
        else:
            data[key] = value
    return build_recipe(data)


def train_losses(path):
    return [r["loss"] for r in read_metrics(path) if "loss" in r]


def lora_state(model):
    return {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}


def test_lr_schedule_values():
    # warmup 2 over 10 steps: 1/3, 2/3, then cosine from 1 down to 0 at step 10.
    got = [lr_factor(s, 2, 10, "cosine") for s in range(10)]
    assert got[0] == pytest.approx(1 / 3) and got[1] == pytest.approx(2 / 3)
    assert got[2] == pytest.approx(1.0)
    assert got[6] == pytest.approx(0.5)  # halfway through the decay
    assert lr_factor(10, 2, 10, "cosine") == pytest.approx(0.0)
    assert [lr_factor(s, 0, 4, "linear") for s in range(4)] == pytest.approx([1, 0.75, 0.5, 0.25])
    assert lr_factor(3, 0, 4, "constant") == 1.0


def test_loss_decreases(recipe_dict, tmp_path):
    from conftest import write_jsonl

    rows = [{"text": f"{i} little cats sat on {i} mats."} for i in range(64)]
    path = write_jsonl(tmp_path / "text.jsonl", rows)
    cfg = make_cfg(
        recipe_dict,
        data={"path": str(path), "format": "text"},
        train={"max_steps": 40, "lr": 3e-2, "batch_size": 8, "scheduler": "constant"},
    )
    result = Trainer(cfg, progress=False).train()
    losses = train_losses(result.metrics_path)
    assert len(losses) == 40
    first, last = sum(losses[:5]) / 5, sum(losses[-5:]) / 5
    assert last < 0.6 * first, (first, last)
    assert result.final_loss == losses[-1]
    assert result.steps == 40 and result.trained_tokens > 0


def window_grads(recipe_dict, batch_size, grad_accum, **sections):
    train = {"max_steps": 1, "batch_size": batch_size, "grad_accum": grad_accum, **sections.pop("train", {})}
    cfg = make_cfg(
        recipe_dict,
        **sections,
        train=train,
        lora={"r": 4, "alpha": 8, "dropout": 0.0},
    )
    trainer = Trainer(cfg, progress=False)
    trainer.setup()
    totals = trainer.accumulate_gradients(0)
    grads = {n: p.grad.detach().clone() for n, p in trainer.model.named_parameters() if p.requires_grad}
    return grads, totals.loss_sum / totals.units, trainer


def test_grad_accum_equals_full_batch_on_variable_length_data(recipe_dict, tmp_path):
    recipe_dict = {**recipe_dict, "output_dir": str(tmp_path / "a")}
    full, loss_full, t_full = window_grads(recipe_dict, 8, 1)
    recipe_dict = {**recipe_dict, "output_dir": str(tmp_path / "b")}
    accum, loss_accum, t_accum = window_grads(recipe_dict, 2, 4)
    assert loss_full == pytest.approx(loss_accum, rel=1e-6)
    assert full.keys() == accum.keys() and len(full) > 0
    for name in full:
        torch.testing.assert_close(accum[name], full[name], rtol=1e-5, atol=1e-7)
    # The data really is variable-length: per-micro-batch averaging (the 2024 bug) would differ.
    counts = [int((b["labels"][:, 1:] != -100).sum()) for b in t_accum.step_batches(0)]
    assert len(set(counts)) > 1, counts


def test_activation_checkpointing_policies_give_the_same_gradients(recipe_dict, tmp_path):
    from finetune.model.load import checkpointed_layers

    grads, layers = {}, {}
    for policy in ("none", "all", 2):
        d = {**recipe_dict, "output_dir": str(tmp_path / f"gc{policy}")}
        grads[policy], _, trainer = window_grads(d, 4, 1, quant={"bits": 4}, memory={"activation_checkpointing": policy})
        layers[policy] = checkpointed_layers(trainer.accelerator.unwrap_model(trainer.model))
    n = len(layers["all"])
    assert n >= 2 and layers == {"none": [], "all": list(range(n)), 2: list(range(0, n, 2))}
    for policy in ("all", 2):
        for name in grads["none"]:
            torch.testing.assert_close(grads[policy][name], grads["none"][name], rtol=1e-5, atol=1e-7)


def test_qlora_run_writes_exact_layout_and_peft_reloads_it(recipe_dict, tiny_model_dir):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    cfg = make_cfg(
        {k: v for k, v in recipe_dict.items() if k != "report"},  # the default report section
        quant={"bits": 4},
        train={"max_steps": 4, "batch_size": 4},
        checkpoint={"every_steps": 2, "keep_last": 2},
        data={"eval_fraction": 0.1},
        eval={"every_steps": 2},
    )
    trainer = Trainer(cfg, progress=False)
    result = trainer.train()
    out = result.output_dir
    # loss.png: report.plot is on by default and written when the optional matplotlib is installed.
    plot = ["loss.png"] if plot_available() else []
    assert sorted(p.name for p in out.iterdir()) == ["adapter", "checkpoints"] + plot + ["metrics.jsonl", "recipe.yaml"]
    assert (out / "adapter" / "adapter_config.json").is_file()
    assert (out / "adapter" / "adapter_model.safetensors").is_file()
    # Every 2 steps, and the last one (so the run can be extended with resume=auto).
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step-2", "step-4"]
    ckpt = out / "checkpoints" / "step-2"
    assert sorted(p.name for p in ckpt.iterdir()) == [
        "adapter",
        "manifest.json",
        "optimizer.json",
        "optimizer.safetensors",
        "rng.safetensors",
        "scheduler.json",
        "trainer_state.json",
    ]
    rows = read_metrics(out / "metrics.jsonl")
    train_rows = [r for r in rows if "loss" in r]
    assert [r["step"] for r in train_rows] == [1, 2, 3, 4]
    assert set(train_rows[0]) == {
        "step_s",
        "step",
        "loss",
        "lr",
        "grad_norm",
        "tokens",
        "trained_tokens",
        "tokens_per_s",
        "elapsed_s",
        "tflops",
        "mfu",
    }
    assert [r["step"] for r in rows if "eval_loss" in r] == [2, 4]
    assert build_recipe(__import__("yaml").safe_load((out / "recipe.yaml").read_text())) == cfg

    # Vanilla transformers + peft load the adapter and reproduce our logits exactly.
    ids = torch.tensor([trainer.data.train[0]["input_ids"]])
    ours = trainer.accelerator.unwrap_model(trainer.model)
    ours.eval()
    with torch.no_grad():
        expected = ours(input_ids=ids).logits
    q = BitsAndBytesConfig(
        load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True, bnb_4bit_compute_dtype=torch.float32
    )
    base = training_kernel_only(
        AutoModelForCausalLM.from_pretrained(tiny_model_dir, quantization_config=q, dtype=torch.float32, device_map={"": "cpu"})
    )
    with torch.no_grad():
        base_logits = base(input_ids=ids).logits
    vanilla = PeftModel.from_pretrained(base, out / "adapter").eval()
    with torch.no_grad():
        got = vanilla(input_ids=ids).logits
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-5)
    assert (got - base_logits).abs().max() > 1e-3  # the adapter is not a no-op


def test_same_seed_same_run(recipe_dict, tmp_path):
    a = Trainer(make_cfg(recipe_dict, output_dir=str(tmp_path / "a"), lora={"dropout": 0.1}), progress=False).train()
    b = Trainer(make_cfg(recipe_dict, output_dir=str(tmp_path / "b"), lora={"dropout": 0.1}), progress=False).train()
    assert train_losses(a.metrics_path) == train_losses(b.metrics_path)


def test_resume_from_checkpoint_continues_the_same_run(recipe_dict, tmp_path):
    common = {"train": {"max_steps": 6, "batch_size": 4}, "lora": {"dropout": 0.1}, "checkpoint": {"every_steps": 3}}
    straight = Trainer(make_cfg(recipe_dict, output_dir=str(tmp_path / "a"), **common), progress=False)
    ra = straight.train()
    resumed = Trainer(
        make_cfg(recipe_dict, output_dir=str(tmp_path / "b"), resume=str(tmp_path / "a" / "checkpoints" / "step-3"), **common),
        progress=False,
    )
    rb = resumed.train()
    assert train_losses(rb.metrics_path) == train_losses(ra.metrics_path)[3:]
    a_w = lora_state(straight.accelerator.unwrap_model(straight.model))
    b_w = lora_state(resumed.accelerator.unwrap_model(resumed.model))
    for name in a_w:
        assert torch.equal(a_w[name], b_w[name]), name


def test_output_dir_of_another_run_is_refused(recipe_dict):
    from finetune.errors import OutputDirError

    cfg = make_cfg(recipe_dict, train={"max_steps": 1})
    Trainer(cfg, progress=False).train()
    with pytest.raises(OutputDirError) as err:
        Trainer(cfg, progress=False).train()
    assert "holds another run" in str(err.value) and "resume=auto" in str(err.value)
    again = make_cfg(recipe_dict, train={"max_steps": 1}, overwrite=True)
    assert math.isfinite(Trainer(again, progress=False).train().final_loss)


class NaNAtStep(Trainer):
    """Returns a NaN loss for the micro-batches of one optimizer step."""

    bad_step = 2

    def accumulate_gradients(self, step):
        self._current = step
        return super().accumulate_gradients(step)

    def compute_loss(self, model, batch):
        loss, n = super().compute_loss(model, batch)
        return (loss * float("nan"), n) if self._current == self.bad_step else (loss, n)


def test_nonfinite_loss_stops_without_touching_weights(recipe_dict):
    from finetune.errors import TrainingError

    cfg = make_cfg(recipe_dict, train={"max_steps": 4, "batch_size": 4})
    trainer = NaNAtStep(cfg, progress=False)
    trainer.setup()
    snapshots = []
    original_step = trainer.optimizer.step

    def recording_step(*a, **k):
        out = original_step(*a, **k)
        snapshots.append(lora_state(trainer.accelerator.unwrap_model(trainer.model)))
        return out

    trainer.optimizer.step = recording_step
    with pytest.raises(TrainingError) as err:
        trainer.train()
    assert "non-finite step 3" in str(err.value) and "step-2" in str(err.value)
    assert len(snapshots) == 2  # steps 1 and 2 updated; step 3 (0-based 2) did not
    now = lora_state(trainer.accelerator.unwrap_model(trainer.model))
    assert all(torch.equal(now[k], snapshots[-1][k]) for k in now)
    ckpt = trainer.out / "checkpoints" / "step-2"
    from safetensors.torch import load_file

    saved = load_file(str(ckpt / "adapter" / "adapter_model.safetensors"))
    assert saved and all(torch.isfinite(t).all() for t in saved.values())
    rows = read_metrics(trainer.out / "metrics.jsonl")
    assert rows[-1]["step"] == 3 and rows[-1]["skipped"] is True and rows[-1]["loss"] is None


def test_nonfinite_loss_skip_policy_continues(recipe_dict):
    cfg = make_cfg(recipe_dict, train={"max_steps": 4, "batch_size": 4, "on_nonfinite": "skip"})
    result = NaNAtStep(cfg, progress=False).train()
    rows = read_metrics(result.metrics_path)
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert [r.get("skipped", False) for r in rows] == [False, False, True, False]
    assert math.isfinite(result.final_loss)


class SpikeAtStep(NaNAtStep):
    def compute_loss(self, model, batch):
        loss, n = Trainer.compute_loss(self, model, batch)
        return (loss * 50.0, n) if self._current == self.bad_step else (loss, n)


def test_loss_spike_is_logged(recipe_dict, capsys):
    cfg = make_cfg(recipe_dict, train={"max_steps": 4, "batch_size": 4, "loss_spike_factor": 3.0})
    result = SpikeAtStep(cfg, progress=False).train()
    rows = read_metrics(result.metrics_path)
    assert [r.get("spike", False) for r in rows] == [False, False, True, False]
    assert "step 3: loss spike" in capsys.readouterr().out  # said even without a progress bar


@pytest.mark.parametrize("data", [{"packing": True, "max_seq_len": 512}, {"group_by_length": True}])
def test_packing_and_length_grouping_train(recipe_dict, tmp_path, data):
    cfg = make_cfg(recipe_dict, data=data, train={"max_steps": 12, "lr": 3e-2, "batch_size": 2, "scheduler": "constant"})
    trainer = Trainer(cfg, progress=False)
    result = trainer.train()
    losses = train_losses(result.metrics_path)
    assert len(losses) == 12 and all(math.isfinite(x) for x in losses)
    assert sum(losses[-3:]) / 3 < 0.8 * sum(losses[:3]) / 3, losses
    longest = max(len(ex["input_ids"]) for ex in trainer.data.train)
    steps = [r for r in read_metrics(result.metrics_path) if "loss" in r]
    if data.get("packing"):
        # Rows of 512 hold 2-3 of these ~170-token examples: a step (2 rows) sees more than 2 examples' tokens.
        stats = trainer.data.train_stats
        assert trainer.unit == "packed rows" and stats.rows == len(trainer.data.train) < stats.examples
        assert min(r["tokens"] for r in steps) > 2 * stats.tokens / stats.examples
        assert longest <= 512


def set_up_with_first_batch(recipe_dict):
    """A set-up trainer without dropout (so two forwards agree) and its first micro-batch."""
    trainer = Trainer(make_cfg(recipe_dict, lora={"dropout": 0.0}), progress=False)
    trainer.setup()
    return trainer, trainer.step_batches(0)[0]


def test_models_that_cannot_take_a_boolean_logits_to_keep_get_full_logits(recipe_dict, tmp_path):
    # transformers before the boolean form (5.17 and older) slices hidden_states[:, keep, :]
    # and raises IndexError; the trainer must fall back to full logits with the same loss.
    from finetune.trainer import loss_sum_and_count

    trainer, batch = set_up_with_first_batch(recipe_dict)
    model = trainer.model
    calls = []

    def old_transformers(**kw):
        keep = kw.pop("logits_to_keep", 0)
        calls.append(torch.is_tensor(keep))
        out = model(**kw)
        if torch.is_tensor(keep):
            out.logits[:, keep, :]  # what the old slicing does with a 2D mask
        return out

    trainer.loss_fn.head_on_targets_only = True  # as if setup() had found slice_logits_to_keep
    loss, n = trainer.compute_loss(old_transformers, batch)
    assert trainer.loss_fn.head_on_targets_only is False and calls == [True, False]
    full = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], use_cache=False)
    expected, n_expected = loss_sum_and_count(full.logits, batch["labels"])
    assert n == n_expected > 0
    torch.testing.assert_close(loss, expected, rtol=1e-6, atol=1e-5)


def test_head_on_targets_only_equals_full_logits_loss_and_gradients(recipe_dict, tmp_path):
    # compute_loss asks the model for logits at target positions only; loss and LoRA
    # gradients must equal those from the full logits.
    from finetune.trainer import loss_sum_and_count

    trainer, batch = set_up_with_first_batch(recipe_dict)
    model = trainer.model

    def grads_of(loss):
        model.zero_grad()
        loss.backward()
        return {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}

    if not takes_boolean_logits_to_keep(model):
        # Never a silent skip on a transformers that has it (a wrong check once skipped this here).
        assert Version(transformers.__version__) < Version("5.23"), "5.23's Llama slices with slice_logits_to_keep"
        pytest.skip(f"transformers {transformers.__version__} has no boolean logits_to_keep (5.17 had none; 5.23 has it)")
    fast, n_fast = trainer.compute_loss(model, batch)
    assert trainer.loss_fn.head_on_targets_only is True  # the fast path was taken, not the fallback
    g_fast = grads_of(fast)
    out = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], use_cache=False)
    full, n_full = loss_sum_and_count(out.logits, batch["labels"])
    g_full = grads_of(full)
    assert n_fast == n_full > 0
    torch.testing.assert_close(fast, full, rtol=1e-6, atol=1e-5)
    # Fewer head rows change fp32 summation order; CI's CPU once gave one element of 128 a
    # 5e-7 (4e-5 relative) difference. A wrong mask moves gradients by far more than 1e-4.
    for name in g_full:
        torch.testing.assert_close(g_fast[name], g_full[name], rtol=1e-4, atol=1e-6)


def test_the_training_line_says_what_an_epoch_leaves_out(recipe_dict):
    # An epoch trains whole optimizer steps (len // window of them): the tail of its order waits.
    import torch

    from finetune.trainer.order import DataOrder, Window

    cfg = make_cfg(recipe_dict, train={"batch_size": 2, "grad_accum": 2, "max_steps": None})
    window = Window.of_recipe(cfg, 1)
    order = DataOrder([{}] * 10, cfg, None, 0, window, torch.device("cpu"))
    assert order.steps_per_epoch == 2
    assert order.untrained_per_epoch == "; the last 2 examples of each epoch's order do not fill a step and are not trained"
    assert DataOrder([{}] * 8, cfg, None, 0, window, torch.device("cpu")).untrained_per_epoch == ""
