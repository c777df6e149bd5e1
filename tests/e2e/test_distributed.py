"""Multi-process training on CPU (gloo): FSDP2 with a 4-bit base, resume across world sizes,
two "nodes" on one machine, and an elastic restart after a rank is killed.

Every run goes through the real launcher (`finetune run --nproc N`, i.e. torchrun).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file

pytestmark = pytest.mark.slow

ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}


def losses(out: Path) -> list[float]:
    return [r["loss"] for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if "loss" in r]


def adapter(out: Path) -> dict[str, torch.Tensor]:
    return load_file(str(out / "adapter" / "adapter_model.safetensors"))


def write(tmp_path: Path, recipe_dict: dict, name: str, **changes) -> tuple[Path, Path]:
    data = json.loads(json.dumps(recipe_dict))
    for key, value in changes.items():
        section, _, field = key.partition("__")
        if field:
            data.setdefault(section, {})[field] = value
        else:
            data[section] = value
    out = tmp_path / name
    data["output_dir"] = str(out)
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(data))
    return path, out


def finetune(*args: str, cwd: Path, port: int, timeout: int = 420, wait: bool = True):
    cmd = [sys.executable, "-m", "finetune", "run", *args, "--no-progress", "--master-port", str(port)]
    if not wait:
        return subprocess.Popen(cmd, cwd=cwd, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    proc = subprocess.run(cmd, cwd=cwd, env=ENV, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    return proc


def assert_adapters_close(a: dict, b: dict, atol: float = 1e-5) -> None:
    assert a.keys() == b.keys() and len(a) > 0
    for k in a:
        assert a[k].shape == b[k].shape, k
        torch.testing.assert_close(b[k], a[k], rtol=1e-4, atol=atol)


def test_fsdp_qlora_two_processes_match_one(recipe_dict, tmp_path):
    # 4-bit base (stored in fp32 so FSDP can shard it), LoRA sharded per decoder layer.
    common = {"quant": {"bits": 4}, "train__max_steps": 4, "train__grad_accum": 2, "checkpoint": {"every_steps": 2}}
    one_recipe, one = write(tmp_path, recipe_dict, "one", train__batch_size=4, **common)
    two_recipe, two = write(tmp_path, recipe_dict, "two", train__batch_size=2, distributed={"strategy": "fsdp"}, **common)
    finetune(str(one_recipe), cwd=tmp_path, port=29611)
    proc = finetune(str(two_recipe), "--nproc", "2", cwd=tmp_path, port=29612)
    assert "parallel: fsdp over 2 processes" in proc.stdout
    l1, l2 = losses(one), losses(two)
    assert len(l1) == len(l2) == 4 and all(0 < x < 20 for x in l2)
    assert l2 == pytest.approx(l1, rel=1e-5)
    assert l2[-1] < l2[0]
    # The saved adapter is whole (every rank's shard gathered) and equals the single-process one.
    assert_adapters_close(adapter(one), adapter(two))
    # ...and so is the periodic checkpoint's, which vanilla peft reads on one process.
    ck = load_file(str(two / "checkpoints" / "step-2" / "adapter" / "adapter_model.safetensors"))
    assert {k: v.shape for k, v in ck.items()} == {k: v.shape for k, v in adapter(one).items()}
