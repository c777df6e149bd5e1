"""train.compile: torch.compile of each decoder layer (finetune/model.compile_decoder_layers).

On this CPU inductor compiles the tiny model's layers in ~10 s; the numbers must be those of the
eager run within float rounding, dropout included (inductor's fallback_random keeps eager's random
ops), and a resumed compiled run bitwise the uninterrupted one. Whether compile is faster is a GPU
question (issue 20), not measured here.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from finetune.config.schema import build_recipe
from finetune.errors import ConfigError
from finetune.metrics import read_metrics
from finetune.trainer import Trainer


def run(recipe_dict, out: Path, steps: int = 4, compile: bool = True, **top):
    data = json.loads(json.dumps(recipe_dict))
    data.update(output_dir=str(out), report={"plot": False}, quant={"bits": 4}, checkpoint={"every_steps": 2}, **top)
    data["lora"]["dropout"] = 0.1  # the masks must be eager's, and a resumed run's those of an uninterrupted one
    data["train"].update(max_steps=steps, batch_size=2, scheduler="constant", compile=compile)
    data["memory"] = {"activation_checkpointing": "all", "tiled_mlp": 2, "embeddings": "cpu"}
    trainer = Trainer(build_recipe(data), progress=False)
    trainer.train()
    return trainer, [r["loss"] for r in read_metrics(out / "metrics.jsonl") if "loss" in r]


def test_compiled_layers_train_like_eager_ones_and_resume_exactly(recipe_dict, tmp_path, capsys):
    # With the levers that run inside a layer (checkpointing, a tiled MLP) and the host tables around it.
    eager_trainer, eager = run(recipe_dict, tmp_path / "eager", compile=False)
    assert all(layer._compiled_call_impl is None for layer in eager_trainer.model.get_base_model().model.layers)
    trainer, compiled = run(recipe_dict, tmp_path / "compiled")
    assert "compile: 2 decoder layers compile at their first step" in capsys.readouterr().out
    layers = trainer.model.get_base_model().model.layers
    assert all(layer._compiled_call_impl is not None for layer in layers)
    assert "base_model.model.model.layers.0.self_attn.q_proj.lora_A.default.weight" in dict(trainer.model.named_parameters())
    assert len(compiled) == 4 and compiled == pytest.approx(eager, rel=1e-5)
    # Its step-2 checkpoint resumed by a new Trainer (a new model, compiled anew): steps 3 and 4 bitwise the
    # uninterrupted run's (the resumed run's own output holds only those).
    capsys.readouterr()
    _, resumed = run(recipe_dict, tmp_path / "resumed", resume=str(tmp_path / "compiled" / "checkpoints" / "step-2"))
    assert "step-2 at step 2" in capsys.readouterr().out  # resumed, not started over
    assert resumed == compiled[2:]


@pytest.mark.parametrize(
    "memory, distributed, message",
    [
        ({"base_weights": "cpu"}, {}, "train.compile cannot trace memory.base_weights=cpu"),
        ({"activation_offload": True}, {}, "the offloaded checkpoint's saved-tensor hooks are not traced"),
        ({}, {"strategy": "fsdp"}, "distributed.strategy=fsdp with train.compile is not tested yet"),
        ({}, {"strategy": "deepspeed"}, "train.compile under distributed.strategy=deepspeed is not tested yet"),
    ],
)
def test_what_compile_cannot_run_with_is_refused(recipe_dict, tmp_path, memory, distributed, message):
    data = json.loads(json.dumps(recipe_dict))
    data.update(output_dir=str(tmp_path / "r"), quant={"bits": 4}, memory=memory, distributed=distributed)
    data["train"]["compile"] = True
    with pytest.raises(ConfigError) as err:
        build_recipe(data)
    assert message in str(err.value)
