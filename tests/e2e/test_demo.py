"""The README's demo, as shipped: the bundled tiny pretrained model learns the
bundled task with QLoRA on the CPU. Held-out exact match must go from under
10% to over 80% (the demo's promise), and the adapter must be real PEFT.

About 1.5 minutes on 2 idle cores (see benchmarks/README.md for timings).
"""

from __future__ import annotations

import json

import pytest

from finetune.config import load_recipe
from finetune.trainer import Trainer


@pytest.mark.slow
def test_demo_recipe_learns_the_task(tmp_path):
    cfg = load_recipe("demo-cpu", [f"output_dir={tmp_path / 'demo'}"])
    assert cfg.quant.bits == 4 and cfg.lora is not None  # the demo is QLoRA, not a shortcut
    result = Trainer(cfg, progress=False).train()
    before, after = result.exact_match_before, result.exact_match_after
    assert before.total == after.total == 150
    assert before.accuracy < 0.10, before.summary()
    assert after.accuracy > 0.80, after.summary()
    config = json.loads((result.adapter_dir / "adapter_config.json").read_text())
    assert config["peft_type"] == "LORA" and config["r"] == cfg.lora.r
