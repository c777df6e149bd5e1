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
