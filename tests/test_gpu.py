"""GPU-only paths: mixed precision with GradScaler (fp16) and bf16 autocast on CUDA.

Skipped on CPU-only machines (marked gpu). The CPU suite covers the same loop in
fp32; what only a GPU can show is that 16-bit compute trains and saves an adapter.
"""

from __future__ import annotations

import math

import pytest

from finetune.config import build_recipe
from finetune.metrics import read_metrics
from finetune.trainer import Trainer


@pytest.mark.gpu
@pytest.mark.parametrize("precision", ["fp16", "bf16"])
def test_qlora_trains_in_16_bit_on_cuda(recipe_dict, precision):
    import torch

    if precision == "bf16" and not torch.cuda.is_bf16_supported(including_emulation=False):
        pytest.skip("GPU has no native bf16")
    cfg = build_recipe(
        {**recipe_dict, "precision": precision, "quant": {"bits": 4},
         "train": {**recipe_dict["train"], "max_steps": 30, "lr": 1e-2, "scheduler": "constant"}}
    )
    trainer = Trainer(cfg, progress=False)
    result = trainer.train()
    # fp16 must go through a GradScaler; bf16 must not.
    assert (trainer.accelerator.scaler is not None) == (precision == "fp16")
    losses = [r["loss"] for r in read_metrics(result.metrics_path) if "loss" in r]
    assert sum(losses[-5:]) / 5 < sum(losses[:5]) / 5
    assert math.isfinite(result.final_loss)
    assert (result.adapter_dir / "adapter_model.safetensors").is_file()
    assert result.peak_memory_bytes > 0


@pytest.mark.gpu
@pytest.mark.parametrize("cpu_offload", [False, True])
def test_fsdp_qlora_on_two_gpus_matches_one(recipe_dict, tmp_path, cpu_offload):
    # The CUDA side of tests/e2e/test_distributed.py: loads into CPU RAM, shards, moves shards and
    # bitsandbytes' quantization states to each GPU (or keeps shards in CPU RAM with cpu_offload).
    import json
    import os
    import subprocess
    import sys

    import torch
    import yaml
    from safetensors.torch import load_file

    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    outs = {}
    for nproc, batch in ((1, 4), (2, 2)):
        data = {**recipe_dict, "precision": "bf16", "quant": {"bits": 4}, "output_dir": str(tmp_path / f"r{nproc}"),
                "train": {**recipe_dict["train"], "max_steps": 4, "batch_size": batch}}
        if nproc == 2:
            data["distributed"] = {"strategy": "fsdp", "cpu_offload": cpu_offload}
        path = tmp_path / f"r{nproc}.yaml"
        path.write_text(yaml.safe_dump(data))
        cmd = [sys.executable, "-m", "finetune", "run", str(path), "--no-progress", "--nproc", str(nproc), "--master-port", str(29700 + nproc)]
        proc = subprocess.run(cmd, capture_output=True, text=True, env=os.environ, timeout=600)
        assert proc.returncode == 0, proc.stderr[-3000:]
        outs[nproc] = tmp_path / f"r{nproc}"
    losses = {n: [json.loads(x)["loss"] for x in (o / "metrics.jsonl").read_text().splitlines() if '"loss"' in x] for n, o in outs.items()}
    assert losses[2] == pytest.approx(losses[1], rel=2e-2)  # bf16: reduction order differs
    a, b = (load_file(str(o / "adapter" / "adapter_model.safetensors")) for o in (outs[1], outs[2]))
    assert a.keys() == b.keys() and all(a[k].shape == b[k].shape for k in a)
