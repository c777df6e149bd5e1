"""A resumed run is the same run: bitwise-equal losses, learning rates, data order,
LoRA weights and optimizer state on CPU fp32, across preemptions, epoch boundaries,
corrupt checkpoints and changed recipes.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal

import pytest
import torch
from conftest import write_jsonl

from finetune.config.schema import build_recipe
from finetune.errors import CheckpointError, Preempted
from finetune.metrics import read_metrics
from finetune.trainer import Trainer


def cfg_for(recipe_dict, out, **changes):
    data = json.loads(json.dumps(recipe_dict))
    data["output_dir"] = str(out)
    # 64 examples, window 4 x 2 = 8 -> 8 steps per epoch; 20 steps cross two epoch boundaries.
    data["train"].update({"max_steps": 20, "batch_size": 4, "grad_accum": 2, "warmup_steps": 3})
    data["lora"]["dropout"] = 0.1  # resume must restore the dropout RNG too
    data["checkpoint"] = {"every_steps": 5, "keep_last": 3}
    for key, value in changes.items():
        node = data
        *parents, leaf = key.split(".")
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = value
    return build_recipe(data)


class Recording(Trainer):
    """Records each step's data (hash of the token ids) and can send itself a stop signal at one step."""

    signal_at: int | None = None

    def step_batches(self, step):
        batches = super().step_batches(step)
        digest = hashlib.sha256(b"".join(b["input_ids"].numpy().tobytes() for b in batches)).hexdigest()[:12]
        self.seen = getattr(self, "seen", []) + [(step, digest)]
        if step == self.signal_at:
            os.kill(os.getpid(), signal.SIGUSR1)
        return batches


def preempt(cfg, at_step: int) -> Recording:
    """Run cfg until a SIGUSR1 sent during step `at_step` stops it (Preempted)."""
    run = Recording(cfg, progress=False)
    run.signal_at = at_step
    with pytest.raises(Preempted):
        run.train()
    return run


def lora(trainer):
    m = trainer.accelerator.unwrap_model(trainer.model)
    return {n: p.detach().clone() for n, p in m.named_parameters() if p.requires_grad}


def optimizer_tensors(trainer):
    sd = trainer.optimizer.state_dict()["state"]
    return {(i, k): v.clone() for i, st in sd.items() for k, v in st.items() if torch.is_tensor(v)}


def rows(out):
    return [(r["step"], r["loss"], r["lr"], r["grad_norm"]) for r in read_metrics(out / "metrics.jsonl") if "loss" in r]


def test_preempted_three_times_then_resumed_equals_straight_run(recipe_dict, tmp_path):
    straight = Recording(cfg_for(recipe_dict, tmp_path / "a"), progress=False)
    straight.train()

    out = tmp_path / "b"
    # Stop after step 3 (epoch 0), 10 (epoch 1, right after the periodic step-10 checkpoint),
    # and 12 (epoch 1 again: a second resume within the same epoch); then finish.
    segments = []
    for i, signal_at in enumerate([2, 9, 11, None]):
        run = Recording(cfg_for(recipe_dict, out, resume="auto" if i else None), progress=False)
        run.signal_at = signal_at
        if signal_at is None:
            run.train()
        else:
            with pytest.raises(Preempted) as err:
                run.train()
            assert "SIGUSR1 received" in str(err.value) and f"step-{signal_at + 1}" in str(err.value)
        segments.append(run)

    assert [[s for s, _ in r.seen] for r in segments] == [
        list(range(0, 3)),
        list(range(3, 10)),
        list(range(10, 12)),
        list(range(12, 20)),
    ]  # each resume restored the position: nothing replayed, nothing skipped
    assert sum((r.seen for r in segments), []) == straight.seen  # same examples, same order
    assert rows(out) == rows(tmp_path / "a")  # losses, lrs and grad norms bitwise equal
    a, b = lora(straight), lora(segments[-1])
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    oa, ob = optimizer_tensors(straight), optimizer_tensors(segments[-1])
    assert oa.keys() == ob.keys() and all(torch.equal(oa[k], ob[k]) for k in oa)


def test_changed_recipe_is_refused_with_every_difference(recipe_dict, tmp_path):
    out = tmp_path / "run"
    preempt(cfg_for(recipe_dict, out), 6)
    changed = cfg_for(recipe_dict, out, resume="auto", seed=7, **{"lora.r": 8, "train.batch_size": 2})
    with pytest.raises(CheckpointError) as err:
        Trainer(changed, progress=False).train()
    text = str(err.value)
    assert "lora.r: 4 -> 8" in text and "seed: 0 -> 7" in text and "train.batch_size: 4 -> 2" in text
    assert "resume_ignore_changes=true" in text

    # Harmless changes are allowed, and said.
    harmless = cfg_for(recipe_dict, out, resume="auto", **{"eval.max_new_tokens": 8, "train.log_every_steps": 2})
    trainer = Trainer(harmless, progress=False)
    result = trainer.train()
    assert result.steps == 20


def test_changed_data_is_refused(recipe_dict, tmp_path):
    out = tmp_path / "run"
    preempt(cfg_for(recipe_dict, out), 2)
    path = recipe_dict["data"]["path"]
    rows_ = [json.loads(line) for line in open(path)]
    rows_[0]["output"] = "999"
    write_jsonl(tmp_path / "train.jsonl", rows_)
    with pytest.raises(CheckpointError) as err:
        Trainer(cfg_for(recipe_dict, out, resume="auto"), progress=False).train()
    assert "tokenized training data differs" in str(err.value)


def test_corrupt_newest_checkpoint_falls_back_under_auto(recipe_dict, tmp_path, capsys):
    out = tmp_path / "run"
    preempt(cfg_for(recipe_dict, out), 11)  # checkpoints step-5, step-10, then step-12 on the signal
    newest = out / "checkpoints" / "step-12"
    f = newest / "optimizer.safetensors"
    data = bytearray(f.read_bytes())
    data[-1] ^= 0xFF  # same size, flipped bits
    f.write_bytes(bytes(data))

    with pytest.raises(CheckpointError) as err:
        Trainer(cfg_for(recipe_dict, out, resume=str(newest)), progress=False).train()
    assert "optimizer.safetensors' is corrupt" in str(err.value)

    capsys.readouterr()
    resumed = Recording(cfg_for(recipe_dict, out, resume="auto"), progress=False)
    resumed.train()
    said = capsys.readouterr().out
    assert "skipping step-12" in said and "optimizer.safetensors' is corrupt" in said
    assert "resumed from" in said and "step-10" in said
    assert resumed.seen[0][0] == 10


def test_malicious_pickle_in_a_checkpoint_never_executes(recipe_dict, tmp_path):
    import pickle

    from finetune.runs.checkpoint import write_manifest

    out = tmp_path / "run"
    preempt(cfg_for(recipe_dict, out), 6)
    ckpt = out / "checkpoints" / "step-7"
    marker = tmp_path / "pwned"

    class Evil:
        def __reduce__(self):
            return (open, (str(marker), "w"))

    for name in ("optimizer.safetensors", "rng.safetensors"):
        (ckpt / name).write_bytes(pickle.dumps(Evil()))
    (ckpt / "optimizer.pt").write_bytes(pickle.dumps(Evil()))
    write_manifest(ckpt, {"step": 7})  # a forged, self-consistent manifest
    with pytest.raises(CheckpointError) as err:
        Trainer(cfg_for(recipe_dict, out, resume=str(ckpt)), progress=False).train()
    assert "cannot be read" in str(err.value)
    assert not marker.exists()


def test_full_finetune_resumes_exactly(recipe_dict, tmp_path):
    full = {"lora": None, "quant.bits": None, "train.max_steps": 8}
    straight = Recording(cfg_for({**recipe_dict, "lora": {"r": 4}}, tmp_path / "a", **full), progress=False)
    straight.train()
    out = tmp_path / "b"
    preempt(cfg_for({**recipe_dict, "lora": {"r": 4}}, out, **full), 3)
    second = Recording(cfg_for({**recipe_dict, "lora": {"r": 4}}, out, resume="auto", **full), progress=False)
    result = second.train()
    assert result.adapter_dir.name == "model" and (result.adapter_dir / "model.safetensors").is_file()
    assert rows(out) == rows(tmp_path / "a")
    a, b = lora(straight), lora(second)  # every parameter is trainable here
    assert len(a) > 10 and all(torch.equal(a[k], b[k]) for k in a)


def test_resume_auto_without_checkpoint_starts_clean(recipe_dict, tmp_path, capsys):
    out = tmp_path / "run"
    Trainer(cfg_for(recipe_dict, out, **{"train.max_steps": 3, "checkpoint.every_steps": None}), progress=False).train()
    again = cfg_for(recipe_dict, out, resume="auto", **{"train.max_steps": 3, "checkpoint.every_steps": None})
    Trainer(again, progress=False).train()
    assert "no checkpoint" in capsys.readouterr().out
    assert [r[0] for r in rows(out)] == [1, 2, 3]  # not 1 2 3 1 2 3


def test_a_finished_run_is_extended_not_restarted(recipe_dict, tmp_path, capsys):
    # Train 3 steps, then ask for 6 with resume=auto: steps 4-6 continue from step 3's state,
    # exactly as an uninterrupted 6-step run (the final step is checkpointed for this).
    from finetune.config.schema import build_recipe
    from finetune.metrics import read_metrics
    from finetune.trainer import Trainer

    def cfg(out, steps, **extra):
        data = {
            **recipe_dict,
            "output_dir": str(tmp_path / out),
            "checkpoint": {"every_steps": 100},
            "train": {**recipe_dict["train"], "max_steps": steps, "scheduler": "constant"},
            **extra,
        }
        return build_recipe(data)

    full = Trainer(cfg("full", 6), progress=False).train()
    Trainer(cfg("ext", 3), progress=False).train()
    capsys.readouterr()
    ext = Trainer(cfg("ext", 6, resume="auto", resume_ignore_changes=True), progress=False).train()
    assert f"resumed from {tmp_path / 'ext' / 'checkpoints' / 'step-3'} at step 3" in capsys.readouterr().out
    assert sorted(p.name for p in (tmp_path / "ext" / "checkpoints").iterdir()) == ["step-3", "step-6"]
    losses = lambda r: [row["loss"] for row in read_metrics(r.metrics_path) if "loss" in row]  # noqa: E731
    assert losses(ext) == losses(full)


def test_every_step_after_resume_follows_the_new_schedule(recipe_dict, tmp_path):
    # A 3-step cosine run ends at lr 0; extended to 6 steps, step 4 must train at the
    # 6-step schedule's lr (as a straight 6-step run does), not at the restored 0.
    def cfg(out, steps, **extra):
        data = {
            **recipe_dict,
            "output_dir": str(tmp_path / out),
            "checkpoint": {"every_steps": 100},
            "train": {**recipe_dict["train"], "max_steps": steps, "scheduler": "cosine", "warmup_steps": 1},
            **extra,
        }
        return build_recipe(data)

    lrs = lambda out: {r["step"]: r["lr"] for r in read_metrics(tmp_path / out / "metrics.jsonl") if "loss" in r}  # noqa: E731
    Trainer(cfg("full", 6), progress=False).train()
    Trainer(cfg("ext", 3), progress=False).train()
    assert lrs("ext")[3] != lrs("full")[3]  # the two schedules differ: the test can tell them apart
    Trainer(cfg("ext", 6, resume="auto"), progress=False).train()
    assert [lrs("ext")[s] for s in (4, 5, 6)] == [lrs("full")[s] for s in (4, 5, 6)]
    assert lrs("ext")[4] > 0

    # A preempted run resumed with a longer schedule: the same, from its first resumed step.
    preempt(cfg("pre", 4), 1)  # stopped after step 2
    Trainer(cfg("pre", 6, resume="auto"), progress=False).train()
    assert [lrs("pre")[s] for s in (3, 4, 5, 6)] == [lrs("full")[s] for s in (3, 4, 5, 6)]


def test_a_run_from_before_the_long_context_keys_resumes_with_the_changes_said():
    # recipe.yaml of a run written before memory.loss / loss_chunk / tiled_mlp existed, with the
    # attention the recipes then named: resuming it with today's defaults is allowed and said.
    from finetune.runs.checkpoint import recipe_changes

    old = {"model": {"path": "m", "attn_implementation": "sdpa"}, "memory": {"activation_checkpointing": "all"}, "seed": 0}
    new = {
        "model": {"path": "m", "attn_implementation": "auto"},
        "memory": {"activation_checkpointing": "all", "loss": "auto", "loss_chunk": 256, "tiled_mlp": "auto"},
        "seed": 0,
    }
    breaking, harmless = recipe_changes(old, new)
    assert breaking == []
    assert harmless == [
        "memory.loss: 'full' -> 'auto'",
        "memory.tiled_mlp: 'off' -> 'auto'",
        "model.attn_implementation: 'sdpa' -> 'auto'",
    ]
    assert recipe_changes(old, {**new, "seed": 1})[0] == ["seed: 0 -> 1"]  # real changes are still refused


class Clocked(Trainer):
    """Each step takes 40 s of a fake clock (trainer/saving.py's), and each background write 0.3 s of real time, so
    the next steps change the weights while it writes."""

    def step_batches(self, step):
        CLOCK[0] += 40.0
        return super().step_batches(step)


CLOCK = [0.0]


def test_checkpoints_by_the_minute_are_written_off_the_training_thread_and_resume_exactly(recipe_dict, tmp_path, monkeypatch):
    import threading
    import time
    from types import SimpleNamespace

    from finetune.runs import resume
    from finetune.runs.background import BackgroundWriter
    from finetune.trainer import saving

    monkeypatch.setattr(saving, "time", SimpleNamespace(monotonic=lambda: CLOCK[0]))
    written, save = {}, resume.save_checkpoint

    def slow_save(out, step, *args, **kwargs):
        if threading.current_thread() is not threading.main_thread():
            time.sleep(0.3)
        written[step] = threading.current_thread().name
        return save(out, step, *args, **kwargs)

    monkeypatch.setattr(resume, "save_checkpoint", slow_save)
    # As a split room gathers them on a CPU: the whole tensors are the live ones (`.cpu()` copies nothing there).
    from finetune.parallel.room import Room

    def gathered(self, model, optimizer):
        return {n: p.detach().cpu() for n, p in model.named_parameters() if p.requires_grad}, optimizer.state_dict()

    monkeypatch.setattr(Room, "full_states", gathered)
    timed = {"train.max_steps": 7, "checkpoint.every_steps": None, "checkpoint.every_minutes": 1.0, "checkpoint.keep_last": 9}
    run = Clocked(cfg_for(recipe_dict, tmp_path / "timed", **timed), progress=False)
    run.train()
    # 40 s a step: 80 s have passed at steps 2, 4 and 6 (each a minute or more after the last); 7 is the last step.
    assert written == {2: "checkpoint-step-2", 4: "checkpoint-step-4", 6: "checkpoint-step-6", 7: "MainThread"}
    # Each written in the background holds its own step's state (weights, optimizer, schedule, generators), byte for
    # byte as a checkpoint written on the spot, and the run resumed from one ends as the uninterrupted run.
    monkeypatch.setattr(BackgroundWriter, "submit", lambda self, step, write: (write(), self._done.append(step)))
    every = {"train.max_steps": 7, "checkpoint.every_steps": 2, "checkpoint.keep_last": 9}
    Trainer(cfg_for(recipe_dict, tmp_path / "steps", **every), progress=False).train()
    assert written == {2: "MainThread", 4: "MainThread", 6: "MainThread", 7: "MainThread"}
    for step in (2, 4, 6):
        for name in ("adapter/adapter_model.safetensors", "optimizer.safetensors", "scheduler.json", "rng.safetensors"):
            a, b = (tmp_path / d / "checkpoints" / f"step-{step}" / name for d in ("timed", "steps"))
            assert a.read_bytes() == b.read_bytes(), (step, name)
    resumed = Trainer(
        cfg_for(recipe_dict, tmp_path / "timed", **timed, resume=str(tmp_path / "timed/checkpoints/step-4")), progress=False
    )
    resumed.train()
    assert rows(tmp_path / "timed") == rows(tmp_path / "steps")


def test_a_background_write_that_fails_stops_the_run_and_leaves_no_checkpoint(recipe_dict, tmp_path, monkeypatch):
    from finetune.runs import checkpoint

    def full_disk(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(checkpoint, "write_manifest", full_disk)  # the last file of a checkpoint
    out = tmp_path / "full"
    with pytest.raises(OSError, match="No space left on device"):
        Trainer(cfg_for(recipe_dict, out, **{"train.max_steps": 8, "checkpoint.every_steps": 2}), progress=False).train()
    assert not list((out / "checkpoints").glob("step-*")) and not list((out / "checkpoints").glob(".tmp-*"))
