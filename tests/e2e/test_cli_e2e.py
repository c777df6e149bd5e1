"""The CLI as a user runs it: a fresh process, real exit codes, real files."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import yaml

from finetune.runs.report import plot_available

REPO = Path(__file__).resolve().parents[2]


def finetune(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    return subprocess.run(
        [sys.executable, "-m", "finetune", *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=600
    )


def test_qlora_run_from_a_clean_process(recipe_dict, tmp_path):
    recipe = tmp_path / "recipe.yaml"
    data = {
        **recipe_dict,
        "quant": {"bits": 4},
        "checkpoint": {"every_steps": 2},
        "train": {**recipe_dict["train"], "max_steps": 3},
    }
    del data["report"]  # the default report section, as a user's recipe leaves it out
    recipe.write_text(yaml.safe_dump(data))
    proc = finetune("run", str(recipe), "--no-progress", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "Traceback" not in proc.stderr
    out = Path(data["output_dir"])
    plot = ["loss.png"] if plot_available() else []  # report.plot defaults on; matplotlib is optional
    assert sorted(p.name for p in out.iterdir()) == ["adapter", "checkpoints"] + plot + ["metrics.jsonl", "recipe.yaml"]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert "done." in proc.stdout and str(out / "adapter") in proc.stdout
    assert "precision fp32" in proc.stdout
    # deepspeed (installed by the test extra) is imported only for distributed.strategy=deepspeed: no warning line
    said = proc.stdout + proc.stderr
    assert not [m for m in ("real_accelerator", "Setting accelerator to CPU", "deepspeed") if m in said], said

    # The same command again must refuse, exit 2, and say how to fix it, without a traceback.
    again = finetune("run", str(recipe), cwd=tmp_path)
    assert again.returncode == 2
    assert "holds another run" in again.stderr and "Traceback" not in again.stderr

    # resume=auto on the finished run finds the final checkpoint and trains nothing more.
    resumed = finetune("run", str(recipe), "resume=auto", "--no-progress", cwd=tmp_path)
    assert resumed.returncode == 0, resumed.stderr
    assert "resumed from" in resumed.stdout and "step-3" in resumed.stdout
    assert "already complete (3 of 3 steps)" in resumed.stdout
    rows2 = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert rows2 == rows
    assert f"final loss   {rows[2]['loss']:.4f}" in resumed.stdout

    # ...and extends it when asked for more steps: step-3's state, steps 4-5 trained.
    extended = finetune(
        "run", str(recipe), "resume=auto", "train.max_steps=5", "resume_ignore_changes=true", "--no-progress", cwd=tmp_path
    )
    assert extended.returncode == 0, extended.stderr
    rows3 = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows3] == [1, 2, 3, 4, 5] and rows3[:3] == rows


def test_bad_input_exit_codes(tmp_path):
    proc = finetune("validate", str(tmp_path / "missing.yaml"), cwd=tmp_path)
    assert proc.returncode == 2 and "not found" in proc.stderr and "Traceback" not in proc.stderr
    proc = finetune("frobnicate", cwd=tmp_path)
    assert proc.returncode == 2  # argparse usage error


def test_shipped_recipes_from_any_directory(tmp_path):
    proc = finetune("ls", cwd=tmp_path)
    assert proc.returncode == 0 and "demo-cpu" in proc.stdout
    proc = finetune("validate", "demo-cpu", f"output_dir={tmp_path / 'demo'}", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "valid" in proc.stdout
