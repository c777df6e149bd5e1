"""Reporting: TensorBoard events and W&B rows equal metrics.jsonl, loss.png is a real PNG, missing extras say how to install.

The test extra installs tensorboard, matplotlib and wandb, so these run (never skip) wherever the README's install ran."""

from __future__ import annotations

import struct
import sys
import types

import pytest
from conftest import train_tiny_run

from finetune.cli.commands import main
from finetune.config.schema import build_recipe
from finetune.errors import ReportError
from finetune.metrics import read_metrics
from finetune.runs.report import plot_curves, scalars
from finetune.trainer import Trainer

WITH_EVAL = {"data": {"eval_fraction": 0.1}, "eval": {"every_steps": 2}, "train": {"max_steps": 4}}


def logged(run_path):
    rows = read_metrics(run_path / "metrics.jsonl")
    train = [(r["step"], r["loss"]) for r in rows if "loss" in r]
    evals = [(r["step"], r["eval_loss"]) for r in rows if "eval_loss" in r]
    return train, evals


def test_scalar_names():
    row = {"step": 3, "loss": 1.5, "lr": 1e-4, "spike": True, "eval_loss": 2.0, "grad_norm": None}
    assert scalars(row) == {"train/loss": 1.5, "train/lr": 1e-4, "eval/loss": 2.0}


def test_tensorboard_event_file_holds_the_logged_scalars(tiny_model_dir, runs_data, tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run = train_tiny_run(tmp_path / "run", tiny_model_dir, runs_data, report={"tensorboard": True}, **WITH_EVAL)
    events = EventAccumulator(str(run.path / "tensorboard"))
    events.Reload()
    assert {"train/loss", "train/lr", "train/grad_norm", "train/tokens_per_s", "eval/loss"} <= set(events.Tags()["scalars"])
    train, evals = logged(run.path)
    assert [e.step for e in events.Scalars("train/loss")] == [1, 2, 3, 4]
    # Event files store float32: equal to the JSON values up to that rounding.
    assert [e.value for e in events.Scalars("train/loss")] == pytest.approx([v for _, v in train], rel=1e-6)
    assert [(e.step, e.value) for e in events.Scalars("eval/loss")] == [(s, pytest.approx(v, rel=1e-6)) for s, v in evals]
    assert len(evals) == 2


def png_size(data: bytes) -> tuple[int, int]:
    assert data[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG signature"
    length, kind = struct.unpack(">I4s", data[8:16])
    assert kind == b"IHDR" and length == 13
    return struct.unpack(">II", data[16:24])


def test_loss_png_is_written_at_the_end_of_a_run(tiny_model_dir, runs_data, tmp_path, capsys):
    run = train_tiny_run(tmp_path / "run", tiny_model_dir, runs_data, report={"plot": True}, **WITH_EVAL)
    png = run.path / "loss.png"
    data = png.read_bytes()
    assert png_size(data) == (800, 450)  # figsize 8 x 4.5 in at 100 dpi
    assert len(data) > 10_000  # axes, two curves and labels; an empty figure is ~3 KB
    assert data[-12:] == b"\x00\x00\x00\x00IEND\xaeB`\x82"  # the closing chunk: the file is whole
    assert f"loss curve   {png}" in capsys.readouterr().out
    assert not list(run.path.glob(".tmp-*"))


def test_plot_is_skipped_with_a_notice_without_matplotlib(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr("finetune.runs.report.plot_available", lambda: False)
    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "loss": 2.0}\n')
    assert plot_curves(tmp_path / "metrics.jsonl", tmp_path / "loss.png") is None
    assert capsys.readouterr().out == "note: loss.png skipped: matplotlib is not installed (pip install 'finetune[plot]')\n"
    assert not (tmp_path / "loss.png").exists()


def test_missing_extra_fails_before_training_with_the_install_hint(recipe_dict, tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "wandb", None)  # import wandb -> ImportError, find_spec -> None
    import yaml

    path = tmp_path / "r.yaml"
    path.write_text(yaml.safe_dump({**recipe_dict, "report": {"wandb": True}}))
    assert main(["validate", str(path)]) == 2
    assert "report.wandb=true needs the 'wandb' package" in capsys.readouterr().err
    trainer = Trainer(build_recipe({**recipe_dict, "report": {"wandb": True}}), progress=False)
    with pytest.raises(ReportError) as err:
        trainer.train()
    assert "pip install 'finetune[wandb]'" in str(err.value)
    assert trainer.model is None and not (tmp_path / "run").exists()  # refused before loading or writing anything


class FakeWandb(types.ModuleType):
    """Stands in for the wandb package: records init() arguments and logged rows."""

    def __init__(self):
        super().__init__("wandb")
        self.inits, self.logs, self.finished = [], [], 0

    def init(self, **kwargs):
        self.inits.append(kwargs)
        fake = self

        class Run:
            def log(self, values, step):
                fake.logs.append((step, values))

            def finish(self):
                fake.finished += 1

        return Run()


def test_wandb_sink_gets_every_row_in_the_chosen_mode(tiny_model_dir, runs_data, tmp_path, monkeypatch):
    fake = FakeWandb()
    monkeypatch.setitem(sys.modules, "wandb", fake)
    report = {"wandb": True, "wandb_project": "proj", "wandb_mode": "offline"}
    run = train_tiny_run(tmp_path / "run", tiny_model_dir, runs_data, report=report, **WITH_EVAL)
    (init,) = fake.inits
    assert init["project"] == "proj" and init["mode"] == "offline" and init["dir"] == str(run.path)
    assert init["config"]["report"]["wandb_project"] == "proj"
    train, evals = logged(run.path)
    assert [(s, v["train/loss"]) for s, v in fake.logs if "train/loss" in v] == train
    assert [(s, v["eval/loss"]) for s, v in fake.logs if "eval/loss" in v] == evals
    assert fake.finished == 1


def test_wandb_offline_run_is_written_locally(tiny_model_dir, runs_data, tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_SILENT", "true")
    report = {"wandb": True, "wandb_mode": "offline"}
    run = train_tiny_run(tmp_path / "run", tiny_model_dir, runs_data, report=report)
    (offline,) = (run.path / "wandb").glob("offline-run-*")
    assert list(offline.glob("run-*.wandb"))
