"""Real process deaths: SIGKILL mid-run and mid-save, SIGTERM from a scheduler.
Each ends with the same adapter as an uninterrupted run (bitwise, CPU fp32).
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from conftest import Job, logged_steps
from safetensors.torch import load_file

ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
# Picks the SIGKILL step: fixed, so a failure repeats; FINETUNE_TEST_SEED=N tries another step.
KILL_SEED = int(os.environ.get("FINETUNE_TEST_SEED", "25"))

# Runs a recipe in a fresh process and SIGKILLs itself: at optimizer step KILL_STEP,
# or inside the KILL_SAVE-th checkpoint save, after its files but before its manifest.
DRIVER = """
import os, signal, sys
import finetune.runs.checkpoint as ck
from finetune.config.schema import load_recipe
from finetune.trainer import Trainer

recipe, kill_step, kill_save = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
saves = [0]
real_manifest = ck.write_manifest
def dying_manifest(directory, extra):
    saves[0] += 1
    if saves[0] == kill_save:
        os.kill(os.getpid(), signal.SIGKILL)
    real_manifest(directory, extra)
ck.write_manifest = dying_manifest

class Dying(Trainer):
    def step_batches(self, step):
        if step == kill_step:
            os.kill(os.getpid(), signal.SIGKILL)
        return super().step_batches(step)

Dying(load_recipe(recipe), progress=False).train()
"""


def write_recipe(recipe_dict, tmp_path, out, every_steps=3, **train):
    data = json.loads(json.dumps(recipe_dict))
    data["output_dir"] = str(out)
    data["train"].update({"max_steps": 12, "batch_size": 4, "grad_accum": 2, **train})
    data["lora"]["dropout"] = 0.1
    data["checkpoint"] = {"every_steps": every_steps, "keep_last": 2}
    path = tmp_path / f"{out.name}.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def run_cli(*args, cwd):
    return subprocess.run(
        [sys.executable, "-m", "finetune", *args], cwd=cwd, env=ENV, capture_output=True, text=True, timeout=600
    )


def run_driver(tmp_path, recipe, kill_step=-1, kill_save=-1):
    driver = tmp_path / "driver.py"
    driver.write_text(DRIVER)
    return subprocess.run(
        [sys.executable, str(driver), str(recipe), str(kill_step), str(kill_save)],
        cwd=tmp_path,
        env=ENV,
        capture_output=True,
        text=True,
        timeout=600,
    )


def adapter(out: Path) -> dict[str, torch.Tensor]:
    return load_file(str(out / "adapter" / "adapter_model.safetensors"))


def assert_same_adapter(a: Path, b: Path):
    ta, tb = adapter(a), adapter(b)
    assert ta.keys() == tb.keys() and all(torch.equal(ta[k], tb[k]) for k in ta)


@pytest.fixture
def straight(recipe_dict, tmp_path):
    out = tmp_path / "straight"
    proc = run_cli("run", str(write_recipe(recipe_dict, tmp_path, out)), "--no-progress", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    return out


def test_sigkill_at_a_random_step_then_resume_auto(recipe_dict, tmp_path, straight):
    kill_step = random.Random(KILL_SEED).randrange(4, 11)
    print(f"SIGKILL at step {kill_step} (FINETUNE_TEST_SEED={KILL_SEED})")  # pytest shows it on a failure
    out = tmp_path / "killed"
    recipe = write_recipe(recipe_dict, tmp_path, out)
    proc = run_driver(tmp_path, recipe, kill_step=kill_step)
    assert proc.returncode == -signal.SIGKILL, (kill_step, proc.stderr[-2000:])
    done = [r["step"] for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines())]
    assert done[-1] == kill_step, kill_step
    proc = run_cli("run", str(recipe), "resume=auto", "--no-progress", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    last_ckpt = kill_step // 3 * 3
    assert f"step-{last_ckpt}" in proc.stdout, (kill_step, proc.stdout)  # lost only the steps since it
    assert_same_adapter(out, straight)


def test_sigkill_during_a_save_never_yields_a_checkpoint(recipe_dict, tmp_path, straight):
    out = tmp_path / "killed_in_save"
    recipe = write_recipe(recipe_dict, tmp_path, out)
    proc = run_driver(tmp_path, recipe, kill_save=2)  # dies writing step-6
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-2000:]
    names = sorted(p.name for p in (out / "checkpoints").iterdir())
    assert len(names) == 2 and names[0].startswith(".tmp-step-6-") and names[1] == "step-3", names
    proc = run_cli("run", str(recipe), "resume=auto", "--no-progress", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "resumed from" in proc.stdout and "step-3 at step 3" in proc.stdout
    assert not any(p.name.startswith(".tmp-") for p in (out / "checkpoints").iterdir())  # leftovers cleaned
    assert_same_adapter(out, straight)


def test_sigterm_checkpoints_and_exits_75(recipe_dict, tmp_path):
    out = tmp_path / "preempted"
    # No periodic checkpoint (it could fall on the step the run stops at): the one found is the signal's.
    recipe = write_recipe(recipe_dict, tmp_path, out, every_steps=100_000, max_steps=100_000)
    cmd = [sys.executable, "-m", "finetune", "run", str(recipe), "--no-progress"]
    job = Job(cmd, tmp_path / "preempted.log", cwd=tmp_path, env=ENV)
    # Training is under way (its signal handlers set) once step 2 is logged; 100_000 steps: it cannot end first.
    job.wait_until(lambda: len(logged_steps(out)) >= 2, f"2 steps in {out / 'metrics.jsonl'}")
    job.proc.send_signal(signal.SIGTERM)
    assert job.finish(300) == 75, job.tail()
    err = job.output()
    assert "preempted: SIGTERM received" in err and "resume=auto" in err
    metrics = out / "metrics.jsonl"
    stopped = [json.loads(line)["step"] for line in metrics.read_text().splitlines()][-1]
    assert [p.name for p in out.glob("checkpoints/*")] == [f"step-{stopped}"], job.tail()
    assert (out / "checkpoints" / f"step-{stopped}" / "manifest.json").is_file()
    # Continue (a shorter max_steps is a harmless change) from exactly that step.
    proc = run_cli("run", str(recipe), "resume=auto", f"train.max_steps={stopped + 2}", "--no-progress", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert f"at step {stopped}" in proc.stdout and "allowed change train.max_steps" in proc.stdout
    steps = [json.loads(line)["step"] for line in metrics.read_text().splitlines()]
    assert steps == list(range(1, stopped + 3))


def test_custom_model_code_needs_trust_remote_code(tiny_model_dir, tmp_path, recipe_dict):
    import shutil

    model = tmp_path / "custom"
    shutil.copytree(tiny_model_dir, model)
    marker = tmp_path / "custom_code_ran"
    (model / "custom_llama.py").write_text(
        f"open({str(marker)!r}, 'w').close()\n"
        "from transformers import LlamaConfig, LlamaForCausalLM\n"
        "class CustomConfig(LlamaConfig):\n    model_type = 'custom_llama'\n"
        "class CustomForCausalLM(LlamaForCausalLM):\n    config_class = CustomConfig\n"
    )
    cfg = json.loads((model / "config.json").read_text())
    cfg.update(
        {
            "model_type": "custom_llama",
            "auto_map": {"AutoConfig": "custom_llama.CustomConfig", "AutoModelForCausalLM": "custom_llama.CustomForCausalLM"},
        }
    )
    (model / "config.json").write_text(json.dumps(cfg))
    recipe = tmp_path / "r.yaml"
    recipe.write_text(yaml.safe_dump({**recipe_dict, "model": {"path": str(model)}}))
    proc = run_cli("run", str(recipe), "--no-progress", cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr
    assert "trust_remote_code" in proc.stderr
    assert not marker.exists()
