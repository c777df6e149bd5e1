"""GPU-only paths: mixed precision with GradScaler (fp16) and bf16 autocast on CUDA.

Skipped on CPU-only machines (marked gpu). The CPU suite covers the same loop in
fp32; what only a GPU can show is that 16-bit compute trains and saves an adapter.
"""

from __future__ import annotations

import math

import pytest

from finetune.config import build_recipe
from finetune.trainer import Trainer


@pytest.mark.gpu
@pytest.mark.parametrize("precision", ["fp16", "bf16"])
def test_qlora_trains_in_16_bit_on_cuda(recipe_dict, precision):
    import torch

    if precision == "bf16" and not torch.cuda.is_bf16_supported():
        pytest.skip("GPU has no bf16")
    cfg = build_recipe({**recipe_dict, "precision": precision, "quant": {"bits": 4}})
    result = Trainer(cfg, progress=False).train()
    assert math.isfinite(result.final_loss)
    assert (result.adapter_dir / "adapter_model.safetensors").is_file()
    assert result.peak_memory_bytes > 0
