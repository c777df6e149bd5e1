"""A vision-language model under DDP and FSDP (2 gloo processes): the same global batch of records with 0, 1
and 2 images gives one process's losses, pre-clip gradient norms and adapter; a doubled gradient is caught."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
import yaml
from conftest import CLOSED_AT_EXIT, WRONG_SCALE_DRIVER, assert_same_steps, free_port, write_jsonl
from safetensors.torch import load_file
from vlm_models import build_vlm, write_images

pytestmark = pytest.mark.slow


def conversation(i: int) -> dict:
    images = [{"type": "image", "path": f"img/img{(i + k) % 3}.png"} for k in range(i % 3)]
    return {
        "messages": [
            {"role": "user", "content": [*images, {"type": "text", "text": f"Picture {i}?"}]},
            {"role": "assistant", "content": f"Pattern {i}."},
        ]
    }


def run(tmp_path, model, data, nproc: int, batch: int, name: str, wrong_scale: bool = False, **over):
    out = tmp_path / name
    recipe = {
        "model": {"path": str(model)},
        "data": {"path": str(data), "format": "messages", "max_seq_len": 512, "cache": False},
        "output_dir": str(out),
        "seed": 0,
        "precision": "fp32",
        "quant": {"bits": 4},
        "lora": {"r": 4, "alpha": 8, "dropout": 0.0},
        # Clipping off: with it, every step's update is normalised and a wrong gradient scale hides.
        "train": {"max_steps": 3, "batch_size": batch, "grad_accum": 2, "lr": 1e-2, "max_grad_norm": None},
        "memory": {"activation_checkpointing": "all"},
        "report": {"plot": False},
    }
    for key, value in over.items():  # distributed=..., lora=...
        recipe[key] = {**recipe.get(key, {}), **value}
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(recipe))
    (tmp_path / "driver.py").write_text(CLOSED_AT_EXIT + WRONG_SCALE_DRIVER)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", **({"WRONG_SCALE": "1"} if wrong_scale else {})}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc), "--master_port", str(free_port())]
    proc = subprocess.run(
        [*cmd, str(tmp_path / "driver.py"), str(path)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out


@pytest.fixture(scope="module")
def gemma3(tmp_path_factory):
    """(folder, model, data, the one-process reference run): the tiny Gemma 3 and 12 conversations with 0-2 pictures,
    trained once on one process (batch 4) for every comparison of the module."""
    root = tmp_path_factory.mktemp("vision_ddp")
    model = build_vlm("gemma3", root / "gemma3")
    write_images(root / "img", 3)
    data = write_jsonl(root / "train.jsonl", [conversation(i) for i in range(12)])
    return root, model, data, run(root, model, data, 1, 4, "one")


def test_two_processes_train_a_vlm_as_one(gemma3, tmp_path):
    root, model, data, one = gemma3
    two = run(root, model, data, 2, 2, "two")
    assert_same_steps(one, two, rel=1e-5)
    a, b = (load_file(str(o / "adapter" / "adapter_model.safetensors")) for o in (one, two))
    assert a.keys() == b.keys() and all(torch.allclose(a[k], b[k], rtol=1e-4, atol=1e-6) for k in a)
    doubled = run(root, model, data, 2, 2, "doubled", wrong_scale=True)
    with pytest.raises(AssertionError, match="differ"):
        assert_same_steps(one, doubled, rel=1e-5)


def test_fsdp_trains_a_vlm_as_one_process_with_images_on_some_ranks_only(gemma3, tmp_path):
    # FSDP shards the language model's layers only: the vision blocks stay in the root group, gathered on every
    # rank. Sharded apart (as _no_split_modules lists them), a rank whose micro-batch had no image skipped their
    # all-gathers while the other ran them: gloo "Received data size doesn't match", SIGABRT (seen, Gemma 3).
    root, model, data, one = gemma3
    assert_same_steps(one, run(root, model, data, 2, 2, "fsdp", distributed={"strategy": "fsdp"}), rel=1e-5)
    # LoRA on LLaVA's projector too: trained only by rows with images, summed over ranks that may have none.
    llava = build_vlm("llava", tmp_path / "llava")
    target = {"target": ["q_proj", "v_proj", "projector"]}
    one = run(root, llava, data, 1, 4, "llava-one", lora=target)
    fsdp = run(root, llava, data, 2, 2, "llava-fsdp", lora=target, distributed={"strategy": "fsdp"})
    assert_same_steps(one, fsdp, rel=1e-5)
    a, b = (load_file(str(o / "adapter" / "adapter_model.safetensors")) for o in (one, fsdp))
    assert any("multi_modal_projector" in k for k in a) and a.keys() == b.keys()
    assert all(torch.allclose(a[k], b[k], rtol=1e-4, atol=1e-6) for k in a)
