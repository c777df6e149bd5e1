"""Exact resume under every memory.* mode: a run stopped by SIGTERM, or killed by SIGKILL,
then continued with resume=auto, equals the uninterrupted run bit for bit (CPU fp32).

The modes change where bytes wait (host RAM, a file, recomputation), and each keeps
state of its own that a resume must not lose: the host optimizer's fp32 copies of the
weights, the streamed layer store, the checkpointed layers' recomputed dropout.
"""

from __future__ import annotations

import copy
import json
import os
import signal
import subprocess
import sys
from contextlib import contextmanager
from functools import partial

import pytest
import torch
import yaml
from safetensors.torch import load_file

from finetune.config.schema import build_recipe
from finetune.errors import Preempted
from finetune.memory import apply
from finetune.memory.activation_offload import ActivationOffload
from finetune.memory.optimizer_offload import HostAdamW
from finetune.metrics import read_metrics
from finetune.trainer import Trainer

pytestmark = pytest.mark.slow

MODES = {
    "optimizer_offload": ({"activation_checkpointing": "none", "optimizer_offload": True}, None),
    "base_weights_cpu": ({"activation_checkpointing": "all", "base_weights": "cpu"}, 4),
    "base_weights_disk": ({"activation_checkpointing": "all", "base_weights": "disk"}, 4),
    "activation_offload": ({"activation_checkpointing": 2, "activation_offload": True}, None),
    "offloaded_checkpoints": ({"activation_checkpointing": "all", "activation_offload": True}, None),
    "checkpointing_k": ({"activation_checkpointing": 2}, None),
}

# On a CPU device an ActivationOffload only counts what it would move; in these modes it copies anyway
# (force_copy, every size): the GPU run's host buffers, copies and prefetch order, made at once and
# unpinned. What only a GPU exercises (pinned memory, the side stream, its events) is in tests/test_gpu.py.
FORCE_COPY = {"activation_offload", "offloaded_checkpoints"}


@contextmanager
def copies_like_a_gpu(mode: str):
    with pytest.MonkeyPatch.context() as patch:
        if mode in FORCE_COPY:
            patch.setattr(apply, "ActivationOffload", partial(ActivationOffload, min_bytes=0, force_copy=True))
        yield


# Runs a recipe in a fresh process and SIGKILLs itself when optimizer step KILL_STEP begins
# (argv: recipe, step, and "force_copy" for the modes of FORCE_COPY).
KILL_DRIVER = """
import functools, os, signal, sys
from finetune.config.schema import load_recipe
from finetune.memory import apply
from finetune.memory.activation_offload import ActivationOffload
from finetune.trainer import Trainer

if sys.argv[3] == "force_copy":
    apply.ActivationOffload = functools.partial(ActivationOffload, min_bytes=0, force_copy=True)

class Dying(Trainer):
    def step_batches(self, step):
        if step == int(sys.argv[2]):
            os.kill(os.getpid(), signal.SIGKILL)
        return super().step_batches(step)

Dying(load_recipe(sys.argv[1]), progress=False).train()
"""

STEPS, EVERY = 8, 3


def recipe_data(recipe_dict, out, mode: str, **top) -> dict:
    memory, bits = MODES[mode]
    data = json.loads(json.dumps(recipe_dict))
    data.update(output_dir=str(out), quant={"bits": bits}, **top)
    data["memory"] = dict(memory)
    if memory.get("base_weights") == "disk":
        data["memory"]["offload_dir"] = str(out.parent / f"{out.name}-offload")
    data["lora"]["dropout"] = 0.1  # resume must restore the dropout stream, recomputation must replay it
    data["train"].update(max_steps=STEPS, batch_size=2, grad_accum=2, warmup_steps=2, lr=5e-3)
    data["checkpoint"] = {"every_steps": EVERY}
    data["report"] = {"plot": False}
    return data


class SignalsItself(Trainer):
    """Sends itself SIGTERM while optimizer step `at` runs: the run checkpoints after it and stops."""

    at: int | None = None

    def step_batches(self, step):
        if step == self.at:
            os.kill(os.getpid(), signal.SIGTERM)
        return super().step_batches(step)


def rows(out):
    return [(r["step"], r["loss"], r["lr"], r["grad_norm"]) for r in read_metrics(out / "metrics.jsonl") if "loss" in r]


def adapter(out):
    return load_file(str(out / "adapter" / "adapter_model.safetensors"))


def assert_same_run(out, reference):
    assert rows(out) == rows(reference)  # every step's loss, lr and grad norm, bitwise
    a, b = adapter(out), adapter(reference)
    assert a.keys() == b.keys() and len(a) > 0
    assert all(torch.equal(a[k], b[k]) for k in a)


@pytest.fixture(scope="module")
def straight(tiny_model_dir, runs_data, tmp_path_factory, request):
    """The uninterrupted run of a mode (shared by the SIGTERM and SIGKILL tests of that mode)."""
    out = tmp_path_factory.mktemp(f"straight-{request.param}") / "run"
    recipe_dict = {
        "model": {"path": str(tiny_model_dir)},
        "data": {"path": str(runs_data), "format": "alpaca", "max_seq_len": 256},
        "seed": 0,
        "precision": "fp32",
        "lora": {"r": 4, "alpha": 8},
        "train": {},
    }
    with copies_like_a_gpu(request.param):
        Trainer(build_recipe(recipe_data(recipe_dict, out, request.param)), progress=False).train()
    return request.param, out, recipe_dict


@pytest.mark.parametrize("straight", list(MODES), indirect=True)
def test_sigterm_then_resume_equals_the_uninterrupted_run(tmp_path, straight):
    mode, reference, recipe_dict = straight
    out = tmp_path / "stopped"
    stopped = SignalsItself(build_recipe(recipe_data(recipe_dict, out, mode)), progress=False)
    stopped.at = 4  # during step 5: not a periodic checkpoint (every 3), one written for the signal
    with copies_like_a_gpu(mode), pytest.raises(Preempted):
        stopped.train()
    stopped.close()
    assert (out / "checkpoints" / "step-5" / "manifest.json").is_file()
    with copies_like_a_gpu(mode):
        Trainer(build_recipe(recipe_data(recipe_dict, out, mode, resume="auto")), progress=False).train()
    assert [r[0] for r in rows(out)] == list(range(1, STEPS + 1))
    assert_same_run(out, reference)


@pytest.mark.parametrize("straight", list(MODES), indirect=True)
def test_sigkill_then_resume_equals_the_uninterrupted_run(tmp_path, straight):
    mode, reference, recipe_dict = straight
    out = tmp_path / "killed"
    recipe = tmp_path / "killed.yaml"
    recipe.write_text(yaml.safe_dump(recipe_data(recipe_dict, out, mode)))
    driver = tmp_path / "driver.py"
    driver.write_text(KILL_DRIVER)
    # The same thread count as this process, which trains the reference and the resumed part:
    # reductions split over another number of threads round differently.
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": str(torch.get_num_threads())}
    proc = subprocess.run(
        [sys.executable, str(driver), str(recipe), "5", "force_copy" if mode in FORCE_COPY else "-"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-3000:]
    assert [r[0] for r in rows(out)] == [1, 2, 3, 4, 5]  # died as step 6 began; step-3 is the last checkpoint
    with copies_like_a_gpu(mode):
        Trainer(build_recipe(recipe_data(recipe_dict, out, mode, resume="auto")), progress=False).train()
    assert [r[0] for r in rows(out)] == list(range(1, STEPS + 1))  # steps 4-5 trained again, logged once
    assert_same_run(out, reference)


def test_host_adamw_starts_from_weights_loaded_after_it_was_built():
    # What a resume does: the optimizer exists, then the checkpoint's weights and state are loaded.
    torch.manual_seed(0)
    loaded = torch.randn(4, 3)
    plain_p = torch.nn.Parameter(loaded.clone())
    host_p = torch.nn.Parameter(torch.zeros(4, 3))  # the initial weights, before the checkpoint
    plain = torch.optim.AdamW([plain_p], lr=1e-2, weight_decay=0.1)
    host = HostAdamW([host_p], lr=1e-2, weight_decay=0.1)
    with torch.no_grad():
        host_p.copy_(loaded)  # the adapter from the checkpoint (no optimizer state loaded)
    for _ in range(3):
        g = torch.randn(4, 3)
        plain_p.grad, host_p.grad = g.clone(), g.clone()
        plain.step()
        host.step()
        torch.testing.assert_close(host_p, plain_p, rtol=0, atol=0)

    # load_state_dict takes the device weights as they are now, whatever their version says.
    other = torch.nn.Parameter(loaded.clone())
    host2 = HostAdamW([other], lr=1e-2, weight_decay=0.1)
    with torch.no_grad():
        other.copy_(plain_p)
    host2.load_state_dict(copy.deepcopy(plain.state_dict()))  # as read from a file: no shared tensors
    g = torch.randn(4, 3)
    plain_p.grad, other.grad = g.clone(), g.clone()
    plain.step()
    host2.step()
    torch.testing.assert_close(other, plain_p, rtol=0, atol=0)
