"""Profiling and MFU (finetune/trainer/profiling.py): tflops and mfu in every step's row from the
planner's FLOP formula, torch.profiler over profile.steps, and neither changing a number of the run."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from conftest import step_rows

from finetune import Trainer
from finetune.config.schema import build_recipe
from finetune.errors import ConfigError
from finetune.gpus import GiB
from finetune.metrics import Progress, read_metrics
from finetune.plan import RecipeFacts, model_shape_of, setup_of, trainable_params
from finetune.plan.speed import token_flops
from finetune.runs.checkpoint import recipe_changes
from finetune.trainer import profiling
from finetune.trainer.profiling import StepProfiler, comm_and_compute_us, device_peak, measured_matmul_tflops


def cfg_for(recipe_dict, out, **sections):
    data = json.loads(json.dumps(recipe_dict))
    data["output_dir"] = str(out)
    data["report"] = {"plot": False}
    for key, value in sections.items():
        data[key] = {**data.get(key, {}), **value}
    return build_recipe(data)


def test_tflops_and_mfu_follow_the_planners_formula_and_profiling_changes_no_number(recipe_dict, tmp_path, capsys):
    train, lora = {"max_steps": 3, "log_every_steps": 1}, {"dropout": 0.1}  # dropout: a random draw would show
    plain_cfg = cfg_for(recipe_dict, tmp_path / "plain", train=train, lora=lora)
    Trainer(plain_cfg, progress=False).train()
    capsys.readouterr()
    profiled_cfg = cfg_for(recipe_dict, tmp_path / "profiled", train=train, lora=lora, profile={"steps": "2-2"})
    Trainer(profiled_cfg, progress=False).train()
    log = capsys.readouterr().out

    # Profiling watches: the losses and gradient norms are bitwise those of the run without it.
    assert step_rows(tmp_path / "profiled") == step_rows(tmp_path / "plain")

    # The tiny Llama by hand: 2 layers of q,o 64x64, k,v 64x32, gate,up,down 64x128; head 64 x 106;
    # LoRA r=4 on the 14 linears: 8,192 parameters. Per token: forward 2 x (73,728 + 6,784) + 2 x 8,192,
    # twice (forward and the input gradients), + LoRA's weight gradients 2 x 8,192, + attention
    # 2 x T x 4 heads x 16 x 2 layers, three times (forward and its ~2x backward).
    shape, recipe = model_shape_of(plain_cfg), RecipeFacts.from_config(plain_cfg, "fp32", on_gpu=False)
    setup, trainable = setup_of(plain_cfg), trainable_params(shape, recipe)
    assert trainable == 8_192
    for T in (10.0, 37.5):
        assert token_flops(shape, recipe, setup, trainable, seq_len=T).model == 2 * 177_408 + 16_384 + 3 * 256 * T

    # tflops: FLOPs per token averaged over the tokens so far x tokens_per_s; mfu: over the measured CPU peak.
    peak = measured_matmul_tflops(torch.device("cpu"), torch.float32)  # the run's own measurement (once per process)
    assert f"over 1 x {peak:.4g} TFLOP/s (CPU, fp32 matmul measured)" in log
    rows = [r for r in read_metrics(tmp_path / "plain" / "metrics.jsonl") if "loss" in r]
    flops = tokens = 0.0
    for r in rows:
        mean_row = r["tokens"] / 4  # batch 4, one sequence per example
        flops += r["tokens"] * token_flops(shape, recipe, setup, trainable, seq_len=mean_row).model
        tokens += r["tokens"]
        assert r["tflops"] == pytest.approx(flops / tokens * r["tokens_per_s"] / 1e12, rel=1e-12)
        assert r["mfu"] == pytest.approx(r["tflops"] / peak, rel=1e-12)
        assert 0 < r["mfu"] < 1
    assert len(rows) == 3

    # The profiled step: a trace that parses, holds its ops under the step's range; the op table in the log.
    trace = tmp_path / "profiled" / "profile" / "rank0-steps2-2.pt.trace.json"
    assert sorted(p.name for p in trace.parent.iterdir()) == [trace.name]  # no memory snapshot on a CPU
    names = [e.get("name", "") for e in json.loads(trace.read_text())["traceEvents"]]
    assert "train step 2" in names and "train step 1" not in names and "train step 3" not in names
    assert names.count("aten::mm") + names.count("aten::addmm") >= 14  # a LoRA matmul pair per linear, at least
    assert "profile: steps 2-2, top 15 ops by self CPU time (this process)" in log
    assert "Self CPU time total" in log and f"profile: wrote {trace}" in log
    assert "collectives" not in log  # one process: nothing to split


def fake_trainer(out: Path, world: int = 1) -> SimpleNamespace:
    return SimpleNamespace(
        cfg=SimpleNamespace(output_dir=str(out), profile=SimpleNamespace(memory_timeline=True)),
        accelerator=SimpleNamespace(device=torch.device("cpu")),
        parallel=SimpleNamespace(rank=0, world=world, is_main=True),
    )


def drive(profiler: StepProfiler, start: int, total: int) -> None:
    """The hooks a run calls, around a matmul per step."""
    state = SimpleNamespace(step=start)
    profiler.on_train_begin(state, {"start_step": start, "total_steps": total})
    for step in range(start + 1, total + 1):
        profiler.on_step_begin(state, {"step": step})
        torch.ones(8, 8) @ torch.ones(8, 8)
        state.step = step
        profiler.on_step_end(state, {"step": step})
    profiler.on_train_end(state, {})


def test_the_range_is_cut_at_the_runs_end_and_a_resume_inside_it_records_the_rest(tmp_path, capsys):
    drive(StepProfiler(fake_trainer(tmp_path / "a"), "2-9"), start=0, total=3)
    assert [p.name for p in (tmp_path / "a" / "profile").iterdir()] == ["rank0-steps2-3.pt.trace.json"]
    drive(StepProfiler(fake_trainer(tmp_path / "b"), "2-3"), start=2, total=5)  # resumed after step 2
    assert [p.name for p in (tmp_path / "b" / "profile").iterdir()] == ["rank0-steps3-3.pt.trace.json"]
    capsys.readouterr()
    drive(StepProfiler(fake_trainer(tmp_path / "c"), "5-6"), start=0, total=3)
    assert "profile: steps 5-6 lie past the run's 3 steps: nothing is recorded" in capsys.readouterr().out
    drive(StepProfiler(fake_trainer(tmp_path / "d"), "1-2"), start=4, total=6)
    assert "profile: steps 1-2 ran before step 4, where this launch resumed" in capsys.readouterr().out
    assert not (tmp_path / "c" / "profile").exists() and not (tmp_path / "d" / "profile").exists()


def event(key: str, self_cpu: float, cpu_total: float | None = None, self_device: float = 0.0) -> SimpleNamespace:
    return SimpleNamespace(
        key=key, self_cpu_time_total=self_cpu, cpu_time_total=cpu_total or self_cpu, self_device_time_total=self_device
    )


def test_collectives_are_told_from_compute():
    cpu = [
        event("aten::mm", 700.0),
        event("c10d::allreduce_", 10.0),  # the call on the training thread
        event("gloo:all_reduce", 0.0, cpu_total=290.0),  # the collective itself, async on gloo's thread
        event("train step 3", 5000.0),  # our range: not an op
        event("aten::add_", 300.0),
    ]
    assert comm_and_compute_us(cpu, cuda=False) == (300.0, 1000.0)
    gpu = [
        event("ncclDevKernel_AllReduce_Sum_f32_RING_LL(ncclDevKernelArgsStorage<4096ul>)", 0.0, self_device=250.0),
        event("c10d::allreduce_", 40.0),  # CPU time: no GPU time of its own
        event("ampere_bf16_s16816gemm_bf16_128x128", 0.0, self_device=750.0),
    ]
    assert comm_and_compute_us(gpu, cuda=True) == (250.0, 750.0)


def test_the_peak_is_measured_once_without_touching_the_runs_random_streams(monkeypatch):
    monkeypatch.setattr(profiling, "_MEASURED", {})
    before = torch.get_rng_state()
    first = measured_matmul_tflops(torch.device("cpu"), torch.float64, seconds=0.05)
    assert torch.equal(torch.get_rng_state(), before)  # dropout and the data order draw as they would have
    assert 0 < first < 100 and measured_matmul_tflops(torch.device("cpu"), torch.float64) == first  # cached


def test_a_known_gpu_uses_its_spec_sheet_peak(monkeypatch):
    monkeypatch.setattr(
        torch.cuda, "get_device_properties", lambda d: SimpleNamespace(name="NVIDIA H100 80GB HBM3", total_memory=80 * GiB)
    )
    assert device_peak(torch.device("cuda"), "bf16") == (989.0, "NVIDIA H100 SXM 80GB, spec-sheet dense bf16")


@pytest.mark.parametrize("bad", ["0", "7-5", "5-", "-3", "a-b", "1-2-3", "5..7", True])
def test_a_bad_step_range_says_what_to_write(recipe_dict, tmp_path, bad):
    with pytest.raises(ConfigError) as err:
        cfg_for(recipe_dict, tmp_path / "run", profile={"steps": bad})
    assert "profile.steps: not a range of optimizer steps: write FIRST-LAST, 1 <= FIRST <= LAST (e.g. 5-7)" in str(err.value)


def test_step_ranges_are_written_plainly_and_profiling_is_a_harmless_change_on_resume(recipe_dict, tmp_path):
    for given, kept in [("5-7", "5-7"), (" 5 - 7 ", "5-7"), (5, "5"), ("12", "12"), (None, None)]:
        assert cfg_for(recipe_dict, tmp_path / "run", profile={"steps": given}).profile.steps == kept
    new = cfg_for(recipe_dict, tmp_path / "run", profile={"steps": "2-3"}).to_dict()
    older = {k: v for k, v in new.items() if k != "profile"}  # a run from before the profile section
    assert recipe_changes(older, new) == ([], ["profile.steps: None -> '2-3'"])
    assert recipe_changes(older, {**new, "profile": {"steps": None, "memory_timeline": True}}) == ([], [])


def test_run_profile_is_the_profile_steps_override(monkeypatch):
    from finetune.cli import commands as cli

    seen = {}

    def check_all(args, training=True):
        seen["overrides"] = list(args.overrides)
        return None, None  # stop before training

    monkeypatch.setattr(cli, "check_all", check_all)
    assert cli.main(["run", "demo-cpu", "train.lr=1e-3", "--profile", "5-7"]) == 2
    assert seen["overrides"] == ["train.lr=1e-3", "profile.steps=5-7"]


def test_the_progress_bar_shows_tflops_and_mfu():
    bar = Progress(total=3)
    bar.update(1.5, 1234.0, 1e-3, {"loss": 1.5, "tflops": 0.00612, "mfu": 0.0187, "rewards/accuracy": 0.75})
    assert bar._bar is not None
    assert bar._bar.postfix == "loss=1.5000 acc=0.750 lr=1.00e-03 tok/s=1,234 TFLOP/s=0.00612 MFU=1.9%"
    bar.close()


def test_an_error_inside_the_range_leaves_no_profiler_running(recipe_dict, tmp_path):
    # A run that dies inside the profiled steps must release the profiler: the next run in the same
    # process (a notebook) profiles again instead of failing on "profiler already enabled".
    class DiesAtStep2(Trainer):
        def step_batches(self, step):
            if step == 1:  # optimizer step 2, inside the range 2-3
                raise RuntimeError("boom")
            return super().step_batches(step)

    first = cfg_for(recipe_dict, tmp_path / "dies", train={"max_steps": 4}, profile={"steps": "2-3"})
    with pytest.raises(RuntimeError, match="boom"):
        DiesAtStep2(first, progress=False).train()
    assert not torch.autograd.profiler._is_profiler_enabled
    again = cfg_for(recipe_dict, tmp_path / "again", train={"max_steps": 3}, profile={"steps": "2-2"})
    Trainer(again, progress=False).train()
    assert len(list((tmp_path / "again" / "profile").glob("rank0-steps2-2.pt.trace.json"))) == 1
