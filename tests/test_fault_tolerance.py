"""Surviving faults without losing a step (trainer/faults.py, trainer/order.py's Window, runs/choices.py):
the run's window cut for another number of processes or a smaller micro-batch, out of memory retried in
place, what auto chose kept on resume, and the host watchdog."""

from __future__ import annotations

import json
import threading
from collections import Counter

import pytest
import torch
from test_trainer import make_cfg, train_losses

from finetune.config.schema import RecipeConfig
from finetune.errors import ConfigError, ResumeMismatch, TrainingError
from finetune.hardware import Device
from finetune.metrics import read_metrics
from finetune.runs import choices
from finetune.trainer import Trainer, faults
from finetune.trainer.order import DataOrder, Window

CPU_NO_BF16 = Device("cpu", "cpu", supports_bf16=False, supports_fp16=False)
CPU_BF16 = Device("cpu", "cpu", supports_bf16=True, supports_fp16=False)


def cfg_of(recipe_dict, **train) -> RecipeConfig:
    return make_cfg(recipe_dict, train={"max_steps": None, **train})


# ---------------------------------------------------------------- the window


def test_a_resume_on_other_processes_recomputes_grad_accum(recipe_dict):
    cfg = cfg_of(recipe_dict, batch_size=2, grad_accum=1)
    saved = {"window": 8, "micro_batch": 2, "length_group": 128, "replicas": 4}
    assert Window.resumed(saved, cfg, 4) == Window(2, 1, 4, 128)
    assert Window.resumed(saved, cfg, 2) == Window(2, 2, 2, 128)
    assert Window.resumed(saved, cfg, 1) == Window(2, 4, 1, 128)
    # The line a resume says names the new cut and the recipe's.
    note = Window.resumed(saved, cfg, 1).resume_note(saved, cfg)
    assert note == (
        "resume: the run's 8 examples per step as 2 x 4 accum x 1 replica (it had 4): grad_accum 4, micro-batch 2 "
        "(the recipe says 2 x 1); the epoch continues where it stopped"
    )
    assert Window.resumed(saved, cfg, 4).resume_note(saved, cfg) is None
    # A checkpoint from before windows were kept: the recipe's cut.
    assert Window.resumed({"step": 3}, cfg, 2) == Window(2, 1, 2, 128)


def test_a_window_no_integer_grad_accum_cuts_is_refused_naming_the_choices(recipe_dict):
    cfg = cfg_of(recipe_dict, batch_size=2)
    saved = {"window": 8, "micro_batch": 2, "length_group": 128}
    with pytest.raises(ConfigError) as err:
        Window.resumed(saved, cfg, 3)
    assert "8 examples per step; 3 replicas x train.batch_size 2 cannot cut it" in str(err.value)
    assert "1 or 2 or 4 replicas at batch_size 2" in str(err.value)
    with pytest.raises(ConfigError) as err:
        Window.resumed({"window": 12, "micro_batch": 4, "length_group": 256}, cfg_of(recipe_dict, batch_size=4), 2)
    assert "or here with train.batch_size one of 1, 2, 3, 6" in str(err.value)


def test_a_pipeline_takes_another_cut_of_the_window_where_its_schedule_can_run_it(recipe_dict):
    cfg = make_cfg(recipe_dict, train={"batch_size": 2, "grad_accum": 2}, distributed={"pipeline_parallel": 2})
    saved = {"window": 8, "micro_batch": 2, "length_group": 128}
    assert Window.resumed(saved, cfg, 1) == Window(2, 4, 1, 128)  # 4 micro-batches a step: 1f1b runs them
    assert Window.resumed({**saved, "oom_micro_batch": 1}, cfg, 1) == Window(1, 8, 1, 128)  # after a backoff
    with pytest.raises(ConfigError) as err:  # 1 micro-batch a step on each of 4 replicas: fewer than the stages
        Window.resumed(saved, cfg, 4)
    assert (
        "resume: this run's 8 examples per step on 4 replicas come to 1 micro-batch(es) of 2 a step; "
        "distributed.pipeline_schedule=1f1b needs at least as many micro-batches as stages (train.grad_accum=1 < 2)"
    ) in str(err.value)


def test_an_out_of_memory_a_pipeline_stage_re_raised_is_found_and_any_other_error_raised_again(recipe_dict):
    cfg, window = cfg_of(recipe_dict, batch_size=4), Window(4, 1, 1, 256)
    try:  # what torch's PipelineStage does with an error of the forward it runs
        raise RuntimeError("\n  [Stage 1] failed to run forward:") from torch.OutOfMemoryError("CUDA out of memory.")
    except RuntimeError as wrapped:
        assert faults.back_off(wrapped, window, cfg, 3) == Window(2, 2, 1, 256)
    with pytest.raises(ValueError, match="a bug"):
        faults.back_off(ValueError("a bug"), window, cfg, 3)


def test_deepspeed_is_told_the_keys_to_set(recipe_dict):
    cfg = make_cfg(recipe_dict, train={"batch_size": 2, "grad_accum": 2}, distributed={"strategy": "deepspeed"})
    with pytest.raises(ConfigError) as err:
        Window.resumed({"window": 8, "micro_batch": 2, "length_group": 128}, cfg, 4)
    assert "need train.batch_size=2 train.grad_accum=1; DeepSpeed takes its micro-batches from the recipe" in str(err.value)


def test_an_out_of_memory_backoff_halves_the_micro_batch_and_keeps_the_window():
    assert Window(8, 1, 1, 512).halved() == Window(4, 2, 1, 512)
    assert Window(6, 2, 2, 384).halved() == Window(3, 4, 2, 384)
    assert Window(3, 1, 1, 192).halved() == Window(1, 3, 1, 192)  # 3 examples: micro-batches of 1
    assert Window(1, 4, 1, 64).halved() is None
    # A resume after a backoff keeps the smaller micro-batch, not the recipe's.
    cfg_saved = {"window": 8, "micro_batch": 4, "length_group": 512}
    assert Window.resumed(cfg_saved, _Recipe(8, 1), 1) == Window(4, 2, 1, 512)


class _Recipe:
    """What Window.resumed reads of a recipe."""

    def __init__(self, batch: int, accum: int):
        self.train = type("T", (), {"batch_size": batch, "grad_accum": accum})()
        self.distributed = type("D", (), {"pipeline_parallel": 1, "strategy": "auto", "zero_stage": 2})()


class _Ids:
    """A collator that hands back which examples it got."""

    def __call__(self, examples):
        return {"ids": torch.tensor([e["id"] for e in examples])}


def _trained(cfg, window: Window, steps: range, n: int = 40) -> list[Counter]:
    """Per step, the multiset of example ids every replica trains."""
    train = [{"id": i, "input_ids": [0] * (1 + i % 7)} for i in range(n)]
    orders = [DataOrder(train, cfg, _Ids(), r, window, torch.device("cpu")) for r in range(window.replicas)]
    return [Counter(i for o in orders for b in o.step_batches(s) for i in b["ids"].tolist()) for s in steps]


@pytest.mark.parametrize("group_by_length", [False, True])
def test_every_cut_of_a_window_trains_the_same_examples_at_every_step(recipe_dict, group_by_length):
    cfg = make_cfg(recipe_dict, data={"group_by_length": group_by_length})
    two = _trained(cfg, Window(2, 1, 2, 128), range(0, 20))
    one = _trained(cfg, Window(2, 2, 1, 128), range(0, 20))
    halved = _trained(cfg, Window(1, 4, 1, 128), range(0, 20))
    both = _trained(cfg, Window(1, 2, 2, 128), range(0, 20))
    assert one == two == halved == both
    assert all(sum(c.values()) == 4 for c in one)
    # Each epoch (10 steps of 4) trains every example once.
    assert sum(one[:10], Counter()) == Counter(range(40))
    # Negative control: another window size trains other examples at the same steps.
    assert _trained(cfg, Window(2, 2, 2, 128), range(0, 5)) != one[:5]


# ---------------------------------------------------------------- out of memory


def test_out_of_memory_backs_off_until_one_example(recipe_dict):
    err = torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
    cfg = cfg_of(recipe_dict, batch_size=8)
    assert faults.back_off(err, Window(8, 1, 1, 512), cfg, 5) == Window(4, 2, 1, 512)
    with pytest.raises(TrainingError) as one:
        faults.back_off(err, Window(1, 8, 1, 64), cfg, 5)
    assert "out of memory in step 5 at micro-batch 1 (the micro-batch is one example already)" in str(one.value)
    off = cfg_of(recipe_dict, batch_size=8, oom_backoff=False)
    with pytest.raises(TrainingError) as err_off:
        faults.back_off(err, Window(8, 1, 1, 512), off, 5)
    assert "(train.oom_backoff is off)" in str(err_off.value)
    assert "train.batch_size=4 train.grad_accum=2" in err_off.value.hint


def test_a_restart_after_out_of_memory_takes_the_noted_micro_batch(recipe_dict, tmp_path):
    from finetune.runs.resume import OOM_BACKOFF, saved_state

    cfg = make_cfg(recipe_dict, output_dir=str(tmp_path), resume="auto", train={"batch_size": 4})
    (tmp_path / OOM_BACKOFF).write_text(json.dumps({"micro_batch": 2, "step": 5, "rank": 1}))
    saved = saved_state(cfg, tmp_path)  # no checkpoint yet: the recipe's window, the smaller micro-batch
    assert saved == {"oom_micro_batch": 2}
    assert Window.resumed(saved, cfg, 2) == Window(2, 2, 2, 256)
    # With a checkpoint: its window, the smallest micro-batch of the two.
    saved = {"window": 8, "micro_batch": 4, "length_group": 256, "oom_micro_batch": 2}
    assert Window.resumed(saved, cfg, 1) == Window(2, 4, 1, 256)
    # Without resume (a new run): nothing is read.
    assert saved_state(make_cfg(recipe_dict, output_dir=str(tmp_path)), tmp_path) == {}


# ---------------------------------------------------------------- what auto chose


def test_precision_auto_keeps_the_runs_choice_or_refuses_naming_both(recipe_dict):
    cfg = make_cfg(recipe_dict, precision="auto")
    assert choices.keep_precision(cfg, {}, CPU_BF16) == ("bf16", None)
    # Started on a machine without native bf16 (fp32), resumed on one with it: fp32 kept, and said.
    assert choices.keep_precision(cfg, {"precision": "fp32"}, CPU_BF16) == (
        "fp32",
        "resume: precision fp32 kept (precision=auto chose it for this run; on this machine it would choose bf16)",
    )
    # Started in bf16, resumed where bf16 cannot run: stopped, naming both.
    with pytest.raises(ResumeMismatch) as err:
        choices.keep_precision(cfg, {"precision": "bf16"}, CPU_NO_BF16)
    assert "this run trains in bf16 (precision=auto chose it on its first machine); auto chooses fp32" in str(err.value)
    assert "precision=fp32 resume_ignore_changes=true" in err.value.hint
    # An explicit precision is the user's: nothing is kept.
    assert choices.keep_precision(make_cfg(recipe_dict, precision="fp32"), {"precision": "bf16"}, CPU_BF16)[0] == "fp32"


def test_the_loaders_are_told_the_runs_earlier_choices(recipe_dict):
    cfg = make_cfg(recipe_dict, model={"attn_implementation": "auto"}, distributed={"strategy": "auto"})
    kept = choices.keep(cfg, {"model.attn_implementation": "eager", "distributed.strategy": "fsdp"}, 2)
    assert kept.model.attn_implementation == "eager" and kept.distributed.strategy == "fsdp"
    assert cfg.model.attn_implementation == "auto"  # the user's recipe (what checkpoints compare) is untouched
    # One process now: no strategy to keep; a value auto cannot be told (a registered function) is not kept.
    one = choices.keep(cfg, {"distributed.strategy": "ddp", "model.attn_implementation": "context_parallel"}, 1)
    assert one is cfg
    assert choices.changes({"memory.loss": "chunked"}, {"memory.loss": "full"}) == (
        "resume: auto chose otherwise on this launch: memory.loss chunked -> full"
    )
    assert choices.comment({"precision": "fp32"}) == "# auto chose, on this run's latest launch:\n#   precision: fp32\n"


# ---------------------------------------------------------------- the watchdog


def test_the_watchdog_leaves_restartable_when_no_step_ends(monkeypatch, tmp_path):
    exited = threading.Event()
    codes: list[int] = []
    dogs: list[faults.Watchdog] = []

    def fake_exit(code):
        codes.append(code)
        exited.set()
        dogs[0]._stop.set()  # ends the watchdog's thread, as os._exit would the process

    monkeypatch.setattr(faults.os, "_exit", fake_exit)
    monkeypatch.setattr(faults, "GRACE_S", 0)
    monkeypatch.setenv("FINETUNE_EXIT_DIR", str(tmp_path))
    monkeypatch.setenv("RANK", "3")
    with faults.Watchdog(0.4, world=2) as dog:
        dogs.append(dog)
        with dog.paused():  # an eval or a save: not a step
            assert not exited.wait(1.0)
        assert exited.wait(10), "the watchdog did not fire"
    assert codes == [75]
    assert (tmp_path / "round0.rank3").read_text() == "75"
    # One process waits for nobody: no watch.
    with faults.Watchdog(0.1, world=1) as dog:
        assert not dog._thread.is_alive()


def test_a_failed_collective_is_told_from_other_errors():
    gloo = RuntimeError("[../third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting 5000ms for recv")
    assert faults.lost_peer(gloo, 2)
    assert not faults.lost_peer(gloo, 1)
    assert not faults.lost_peer(RuntimeError("mat1 and mat2 shapes cannot be multiplied"), 2)
    # A pipeline stage re-raises its forward's error as its own RuntimeError, the collective's behind it
    stage = RuntimeError("[Stage 1] failed to run forward:")
    stage.__cause__ = gloo
    assert faults.lost_peer(stage, 2)
    stage.__cause__ = RuntimeError("mat1 and mat2 shapes cannot be multiplied")
    assert not faults.lost_peer(stage, 2)
    stage.__cause__ = stage  # raise e from e: a cycle, walked once
    assert not faults.lost_peer(stage, 2) and faults.out_of_memory(stage) is None


# ---------------------------------------------------------------- whole runs, in this process

OOM_TEXT = "CUDA out of memory. Tried to allocate 20.00 GiB (the test's own allocation failure)"


class OutOfMemoryInStep5(Trainer):
    """Runs out of memory in step 5's backward while a micro-batch holds 8 examples: after the last layer's
    LoRA gradients were accumulated, so a retry that kept them would train them twice."""

    def setup(self):
        super().setup()
        layers = self.parallel.unwrap(self.model).base_model.model.model.layers
        layers[0].register_forward_hook(self._fail_in_backward)

    def _fail_in_backward(self, module, args, output):
        hidden = output[0] if isinstance(output, tuple) else output
        if self.state.step == 4 and hidden.shape[0] == 8 and hidden.requires_grad:
            hidden.register_hook(self._out_of_memory)

    @staticmethod
    def _out_of_memory(grad):
        raise torch.OutOfMemoryError(OOM_TEXT)


def test_out_of_memory_in_a_step_retries_it_in_half_the_micro_batch(recipe_dict, tmp_path, capsys):
    common = {"train": {"max_steps": 8, "scheduler": "constant", "max_grad_norm": None}, "checkpoint": {"every_steps": 4}}
    ref = Trainer(make_cfg(recipe_dict, output_dir=str(tmp_path / "ref"), **_with(common, batch_size=4, grad_accum=2)))
    ref_losses = train_losses(ref.train().metrics_path)
    run = OutOfMemoryInStep5(make_cfg(recipe_dict, output_dir=str(tmp_path / "oom"), **_with(common, batch_size=8)))
    rows = [r for r in read_metrics(run.train().metrics_path) if "loss" in r]
    assert [r["loss"] for r in rows] == pytest.approx(ref_losses, rel=1e-6)
    assert [(r["step"], r.get("oom_retries"), r.get("micro_batch")) for r in rows if "oom_retries" in r] == [(5, 1, 4)]
    out = capsys.readouterr().out
    assert "step 5: out of memory at micro-batch 8; retrying it as 4 x 2 accum x 1 replica (the same 8 examples per step" in out
    # A resume keeps the smaller micro-batch (the recipe still says 8), and so stays out of memory's way.
    more = make_cfg(recipe_dict, output_dir=str(tmp_path / "oom"), resume="auto", **_with(common, batch_size=8, max_steps=10))
    resumed = OutOfMemoryInStep5(more)
    resumed.train()
    assert resumed.order.split == Window(4, 2, 1, 512)
    assert "grad_accum 2, micro-batch 4 (the recipe says 8 x 1)" in capsys.readouterr().out


def test_negative_control_a_retry_that_keeps_the_failed_gradients_differs(recipe_dict, tmp_path, monkeypatch):
    common = {"train": {"max_steps": 6, "scheduler": "constant", "max_grad_norm": None}}
    ref = Trainer(make_cfg(recipe_dict, output_dir=str(tmp_path / "ref"), **_with(common, batch_size=4, grad_accum=2)))
    ref_losses = train_losses(ref.train().metrics_path)
    monkeypatch.setattr(faults, "free_memory", lambda: None)
    keeping = OutOfMemoryInStep5(make_cfg(recipe_dict, output_dir=str(tmp_path / "keep"), **_with(common, batch_size=8)))
    monkeypatch.setattr(OutOfMemoryInStep5, "setup", _setup_without_zero_grad)
    losses = train_losses(keeping.train().metrics_path)
    assert losses[:5] == pytest.approx(ref_losses[:5], rel=1e-6)
    assert losses[5] != pytest.approx(ref_losses[5], rel=1e-6)


def _setup_without_zero_grad(self):
    OutOfMemoryInStep5.__mro__[1].setup(self)
    layers = self.parallel.unwrap(self.model).base_model.model.model.layers
    layers[0].register_forward_hook(self._fail_in_backward)
    real = self.optimizer.zero_grad
    self.optimizer.zero_grad = lambda set_to_none=True: real(set_to_none) if self.state.step != 4 else None


def _with(common: dict, **train) -> dict:
    return {**common, "train": {**common["train"], **train}}


def test_precision_auto_is_kept_by_a_resume_on_another_machine(recipe_dict, tmp_path, monkeypatch):
    import finetune.trainer.loop as loop

    common = {"precision": "auto", "train": {"max_steps": 4, "scheduler": "constant"}, "checkpoint": {"every_steps": 2}}
    monkeypatch.setattr(loop, "detect_device", lambda: CPU_NO_BF16)
    straight = Trainer(make_cfg(recipe_dict, output_dir=str(tmp_path / "straight"), **common), progress=False)
    expected = train_losses(straight.train().metrics_path)
    first = make_cfg(recipe_dict, output_dir=str(tmp_path / "moved"), **_with(common, max_steps=2))
    Trainer(first, progress=False).train()
    assert "#   precision: fp32\n" in (tmp_path / "moved" / "recipe.yaml").read_text()
    state = json.loads((tmp_path / "moved" / "checkpoints" / "step-2" / "trainer_state.json").read_text())
    assert state["choices"]["precision"] == "fp32" and state["window"] == 4 and state["micro_batch"] == 4
    # Requeued on a machine where auto would choose bf16: the run goes on in fp32, the same numbers.
    monkeypatch.setattr(loop, "detect_device", lambda: CPU_BF16)
    resumed = Trainer(make_cfg(recipe_dict, output_dir=str(tmp_path / "moved"), resume="auto", **common), progress=False)
    resumed.train()
    assert resumed.precision == "fp32"
    assert train_losses(tmp_path / "moved" / "metrics.jsonl") == expected


def test_a_bf16_run_is_not_continued_where_bf16_cannot_run(recipe_dict, tmp_path, monkeypatch):
    import finetune.trainer.loop as loop

    common = {"precision": "auto", "train": {"max_steps": 2}, "checkpoint": {"every_steps": 2}}
    monkeypatch.setattr(loop, "detect_device", lambda: CPU_BF16)
    Trainer(make_cfg(recipe_dict, output_dir=str(tmp_path / "run"), **common), progress=False).train()
    monkeypatch.setattr(loop, "detect_device", lambda: CPU_NO_BF16)
    more = make_cfg(recipe_dict, output_dir=str(tmp_path / "run"), resume="auto", **_with(common, max_steps=4))
    with pytest.raises(ResumeMismatch, match="this run trains in bf16"):
        Trainer(more, progress=False).train()
    assert (tmp_path / "run" / "checkpoints" / "step-2" / "manifest.json").is_file()  # nothing lost


def test_the_plan_says_when_a_step_would_outlast_the_watchdog():
    from pathlib import Path

    from finetune.config.schema import load_recipe
    from finetune.gpus import find_gpu
    from finetune.plan import plan_recipe

    model = str(Path(__file__).parent / "fixtures" / "configs" / "llama-3.1-8b")
    rtx4090 = find_gpu("rtx4090")

    def notes(*overrides: str) -> list[str]:
        recipe = Path(__file__).parent.parent / "recipes" / "qlora-longctx-2x24gb.yaml"
        cfg = load_recipe(recipe, [f"model.path={model}", *overrides])
        return [n for n in plan_recipe(cfg, rtx4090, gpus=2).notes if "timeout_s" in n]

    assert notes() == []  # the recipe's 3600 s is above its ~2352 s step
    assert notes("distributed.timeout_s=600") == [
        "a step (~2352 s) outlasts distributed.timeout_s (600): the host watchdog ends the job after timeout_s + 20 s; "
        "set distributed.timeout_s=3530"
    ]


def test_the_launcher_says_75_only_when_every_worker_of_the_last_round_left_restartable(tmp_path):
    from finetune.parallel.launch import job_exit

    def said(**codes: int) -> int | None:
        folder = tmp_path / str(len(list(tmp_path.iterdir())))
        folder.mkdir()
        for name, code in codes.items():
            (folder / name.replace("_", ".")).write_text(str(code))
        return job_exit(folder)

    assert said(round0_rank0=75) == 75  # a frozen rank 1 said nothing: it was stopped
    assert said(round0_rank0=75, round0_rank1=1) is None  # rank 1 failed on an error: no restart fixes it
    assert said(round0_rank0=75, round0_rank1=2) is None
    assert said(round0_rank1=1, round1_rank0=75, round1_rank1=75) == 75  # the last round is what ended the job
    assert said(round0_rank0=75, round1_rank1=1) is None
    assert said() is None


def test_a_leaving_rank_stops_only_its_own_launchers_workers(monkeypatch):
    import subprocess
    import sys

    from finetune.parallel.health import RankInfo

    monkeypatch.setattr(faults, "PEERS_GRACE_S", 0.5)
    monkeypatch.setattr(faults, "mark_exit", lambda code: None)
    # A process of this host that is not a sibling (its parent is this test, not this test's parent).
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        here = faults.socket.gethostname()
        faults.leave([RankInfo(rank=1, host=here, pid=child.pid)], "a test")
        with pytest.raises(subprocess.TimeoutExpired):  # still running a second later: not ours to stop
            child.wait(timeout=1)
        # Negative control: seen as a sibling (the same parent), it is stopped after the grace.
        monkeypatch.setattr(faults.os, "getppid", lambda: faults.os.getpid())
        faults.leave([RankInfo(rank=1, host=here, pid=child.pid)], "a test")
        assert child.wait(10) == -9
    finally:
        child.kill()


def test_an_explicit_batch_size_change_is_the_users(recipe_dict):
    cfg = cfg_of(recipe_dict, batch_size=4)
    saved = {"window": 8, "micro_batch": 2, "length_group": 128, "recipe": {"train": {"batch_size": 2}}}
    assert Window.resumed(saved, cfg, 1) == Window(4, 2, 1, 128)  # asked for 4 (it was 2): 4 x 2
    kept = {**saved, "recipe": {"train": {"batch_size": 4}}}  # the recipe says 4 as before, 2 after a backoff: 2
    assert Window.resumed(kept, cfg, 1) == Window(2, 4, 1, 128)


def test_a_killed_extension_builds_lock_is_named_before_a_launch_waits_on_it(tmp_path):
    # Seen in CI: a run killed while DeepSpeed compiled its shm op left the lock; every later launch hung in
    # deepspeed.initialize (torch's FileBaton.wait), before the watchdog's first step.
    import os

    from finetune.parallel.launch import STALE_LOCK_S, stale_build_locks

    fresh = tmp_path / "py311_cpu" / "fused_adam" / "lock"
    old = tmp_path / "py311_cpu" / "deepspeed_shm_comm" / "lock"
    for lock in (fresh, old):
        lock.parent.mkdir(parents=True)
        lock.touch()
    now = old.stat().st_mtime + STALE_LOCK_S + 120
    os.utime(fresh, (now - 30, now - 30))  # a build under way holds it: not named
    (warning,) = stale_build_locks(tmp_path, now=now)
    assert str(old) in warning and "12 min old" in warning and "delete it" in warning
    assert stale_build_locks(tmp_path / "nothing", now=now) == []
