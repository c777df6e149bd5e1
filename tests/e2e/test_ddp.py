"""Two processes on the gloo backend (DDP through accelerate): the same global
batch gives the same losses and adapter as one process, and a tiny eval set
(fewer eval batches than processes) does not hang.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
import yaml
from safetensors.torch import load_file

from conftest import write_jsonl

DRIVER = """
import sys
from finetune.config import load_recipe
from finetune.trainer import Trainer
Trainer(load_recipe(sys.argv[1]), progress=False).train()
"""


def losses(out):
    return [json.loads(line)["loss"] for line in (out / "metrics.jsonl").read_text().splitlines() if '"loss"' in line]


@pytest.mark.slow
def test_two_processes_match_one(recipe_dict, tmp_path):
    ev = write_jsonl(tmp_path / "eval.jsonl", [{"instruction": "Add.", "input": "1 + 1", "output": "2"}])
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    driver = tmp_path / "driver.py"
    driver.write_text(DRIVER)
    outs = {}
    for nproc, batch in ((1, 4), (2, 2)):
        out = tmp_path / f"run{nproc}"
        data = json.loads(json.dumps(recipe_dict))
        data["output_dir"] = str(out)
        data["train"].update({"max_steps": 4, "batch_size": batch, "grad_accum": 2})
        data["data"]["eval_path"] = str(ev)  # 1 eval example: fewer eval batches than processes
        data["eval"] = {"every_steps": 2}
        data["checkpoint"] = {"every_steps": 2}
        recipe = tmp_path / f"r{nproc}.yaml"
        recipe.write_text(yaml.safe_dump(data))
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc), "--master_port", str(29500 + nproc), str(driver), str(recipe)]
        proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr[-3000:]
        outs[nproc] = out
    one, two = losses(outs[1]), losses(outs[2])
    assert len(one) == len(two) == 4
    assert two == pytest.approx(one, rel=1e-5)  # token-weighted over both processes and the window
    a = load_file(str(outs[1] / "adapter" / "adapter_model.safetensors"))
    b = load_file(str(outs[2] / "adapter" / "adapter_model.safetensors"))
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(b[k], a[k], rtol=1e-4, atol=1e-6)
    assert (outs[2] / "checkpoints" / "step-2" / "manifest.json").is_file()
