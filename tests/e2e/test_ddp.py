"""Two processes on the gloo backend (DDP through accelerate): the same global
batch gives the same losses, gradient norms and adapter as one process, also when the two
are two "nodes" (two launchers rendezvousing on 127.0.0.1), and a tiny eval set (fewer
eval batches than processes) does not hang.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from conftest import CLOSED_AT_EXIT, WRONG_SCALE_DRIVER, Job, assert_same_steps, free_port, step_rows, write_jsonl
from safetensors.torch import load_file


def recipe_file(recipe_dict, tmp_path, batch: int, name: str, **memory):
    ev = write_jsonl(tmp_path / "eval.jsonl", [{"instruction": "Add.", "input": "1 + 1", "output": "2"}])
    out = tmp_path / name
    data = json.loads(json.dumps(recipe_dict))
    data["output_dir"] = str(out)
    # Clipping off: with it, every step's update is normalised and a wrong gradient scale hides.
    data["train"].update({"max_steps": 4, "batch_size": batch, "grad_accum": 2, "max_grad_norm": None})
    data["data"]["eval_path"] = str(ev)  # 1 eval example: fewer eval batches than processes
    data["eval"] = {"every_steps": 2}
    data["checkpoint"] = {"every_steps": 2}
    data["memory"] = {**data["memory"], **memory}
    recipe = tmp_path / f"{name}.yaml"
    recipe.write_text(yaml.safe_dump(data))
    return recipe, out


def run(recipe_dict, tmp_path, nproc: int, batch: int, name: str, wrong_scale: bool = False):
    """The recipe trained by a torchrun driver on nproc processes of one node."""
    recipe, out = recipe_file(recipe_dict, tmp_path, batch, name)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", **({"WRONG_SCALE": "1"} if wrong_scale else {})}
    driver = tmp_path / "driver.py"
    driver.write_text(CLOSED_AT_EXIT + WRONG_SCALE_DRIVER)
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


def two_nodes(recipe_dict, tmp_path, batch: int, name: str, **memory) -> tuple[Path, str]:
    """The recipe trained by two launchers (`finetune run --nnodes 2 --node-rank R`, one process each) that
    rendezvous on one port and run one job; (its folder, node 0's output)."""
    recipe, out = recipe_file(recipe_dict, tmp_path, batch, name, **memory)
    port = free_port()  # both launchers meet there
    cmd = [sys.executable, "-m", "finetune", "run", str(recipe), "--no-progress", "--master-port", str(port)]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    node = ("--nproc", "1", "--nnodes", "2", "--node-rank")
    nodes = [Job([*cmd, *node, str(r)], tmp_path / f"node{r}.log", cwd=tmp_path, env=env) for r in (0, 1)]
    codes = [n.finish(420) for n in nodes]
    assert codes == [0, 0], nodes[0].tail() + nodes[1].tail()
    assert "parallel: ddp over 2 processes" in nodes[0].output()
    return out, nodes[0].output()


@pytest.mark.slow
def test_two_processes_match_one(recipe_dict, tmp_path):
    one = run(recipe_dict, tmp_path, 1, 4, "run1")
    # The two nodes also keep the frozen vocabulary tables in host RAM (memory.embeddings=cpu): DDP must neither
    # broadcast them nor refuse a module on two devices, and they train as the tables in place do.
    two, said = two_nodes(recipe_dict, tmp_path, 2, "run2", embeddings="cpu")
    assert "of frozen vocabulary tables live in host RAM" in said
    # Token-weighted over both processes and the window: losses and pre-clip gradient norms equal.
    assert_same_steps(one, two, rel=1e-5)
    a = load_file(str(one / "adapter" / "adapter_model.safetensors"))
    b = load_file(str(two / "adapter" / "adapter_model.safetensors"))
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(b[k], a[k], rtol=1e-4, atol=1e-6)
    assert (two / "checkpoints" / "step-2" / "manifest.json").is_file()

    # The comparison sees a gradient twice too large whose loss values are right (2 processes of one node: exactly
    # twice one process's norm, so that launch computes one process's gradient too).
    doubled = run(recipe_dict, tmp_path, 2, 2, "doubled", wrong_scale=True)
    with pytest.raises(AssertionError, match="differ"):
        assert_same_steps(one, doubled, rel=1e-5)
    (loss_one, norm_one), (loss_doubled, norm_doubled) = step_rows(one)[0], step_rows(doubled)[0]
    assert loss_doubled == pytest.approx(loss_one, rel=1e-5) and norm_doubled == pytest.approx(2 * norm_one, rel=1e-5)
