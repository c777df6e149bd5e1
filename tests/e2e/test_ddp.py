"""Two processes on the gloo backend (DDP through accelerate): the same global
batch gives the same losses, gradient norms and adapter as one process, and a tiny
eval set (fewer eval batches than processes) does not hang.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
import yaml
from conftest import CLOSED_AT_EXIT, WRONG_SCALE_DRIVER, assert_same_steps, free_port, step_rows, write_jsonl
from safetensors.torch import load_file


def run(recipe_dict, tmp_path, nproc: int, batch: int, name: str, wrong_scale: bool = False):
    ev = write_jsonl(tmp_path / "eval.jsonl", [{"instruction": "Add.", "input": "1 + 1", "output": "2"}])
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", **({"WRONG_SCALE": "1"} if wrong_scale else {})}
    driver = tmp_path / "driver.py"
    driver.write_text(CLOSED_AT_EXIT + WRONG_SCALE_DRIVER)
    out = tmp_path / name
    data = json.loads(json.dumps(recipe_dict))
    data["output_dir"] = str(out)
    # Clipping off: with it, every step's update is normalised and a wrong gradient scale hides.
    data["train"].update({"max_steps": 4, "batch_size": batch, "grad_accum": 2, "max_grad_norm": None})
    data["data"]["eval_path"] = str(ev)  # 1 eval example: fewer eval batches than processes
    data["eval"] = {"every_steps": 2}
    data["checkpoint"] = {"every_steps": 2}
    recipe = tmp_path / f"{name}.yaml"
    recipe.write_text(yaml.safe_dump(data))
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node",
        str(nproc),
        "--master_port",
        str(free_port()),
        str(driver),
        str(recipe),
    ]
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out


@pytest.mark.slow
def test_two_processes_match_one(recipe_dict, tmp_path):
    one = run(recipe_dict, tmp_path, 1, 4, "run1")
    two = run(recipe_dict, tmp_path, 2, 2, "run2")
    # Token-weighted over both processes and the window: losses and pre-clip gradient norms equal.
    assert_same_steps(one, two, rel=1e-5)
    a = load_file(str(one / "adapter" / "adapter_model.safetensors"))
    b = load_file(str(two / "adapter" / "adapter_model.safetensors"))
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(b[k], a[k], rtol=1e-4, atol=1e-6)
    assert (two / "checkpoints" / "step-2" / "manifest.json").is_file()

    # The comparison sees a gradient twice too large whose loss values are right.
    doubled = run(recipe_dict, tmp_path, 2, 2, "doubled", wrong_scale=True)
    with pytest.raises(AssertionError, match="differ"):
        assert_same_steps(one, doubled, rel=1e-5)
    (loss_one, norm_one), (loss_doubled, norm_doubled) = step_rows(one)[0], step_rows(doubled)[0]
    assert loss_doubled == pytest.approx(loss_one, rel=1e-5) and norm_doubled == pytest.approx(2 * norm_one, rel=1e-5)
