"""The memory check `finetune run` makes before any weight is loaded (`preflight_memory`)."""

from __future__ import annotations

import os

from finetune.config.schema import RecipeConfig
from finetune.declarations.splits import PIPELINE, SPLITS
from finetune.errors import FinetuneError
from finetune.gpus import GiB
from finetune.plan.fitting import search
from finetune.plan.inputs import RecipeFacts
from finetune.plan.memory import gib
from finetune.plan.recipe import model_shape_of, plan_precision, plan_recipe
from finetune.plan.rewrite import _yaml_value, changes_of

REFUSE_FACTOR = 1.10  # `finetune run` refuses when the predicted peak exceeds 1.1 x device memory


def preflight_memory(cfg: RecipeConfig, refuse: bool = True) -> tuple[list[str], list[str]]:
    """(problems, notes) of the memory estimate before weights are loaded.

    On CUDA a predicted peak above REFUSE_FACTOR x the device's memory is a
    problem (with the fitting setup the search finds), unless `refuse` is off.
    On a CPU the estimate is only a note.
    """
    try:
        return _preflight_memory(cfg, refuse)
    except FinetuneError as exc:  # a stand-in config of an invalid recipe, an unreadable model: reported elsewhere
        return [], [f"memory estimate skipped: {exc.message}"]


def physical_ram() -> int | None:
    """This machine's RAM in bytes (None where the OS does not say)."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):  # not a POSIX system
        return None


def _preflight_memory(cfg: RecipeConfig, refuse: bool) -> tuple[list[str], list[str]]:
    from finetune.gpus import gpu_for_device
    from finetune.hardware import detect_device

    model_shape_of(cfg)
    if detect_device().kind != "cuda":
        e = plan_recipe(cfg, None)
        return [], [
            f"memory estimate: peak {gib(e.peak_allocated_bytes)} for tensors ({e.peak_phase} phase); checked only on CUDA"
        ]
    import torch

    gpu = gpu_for_device(torch.cuda.get_device_name(0), torch.cuda.get_device_properties(0).total_memory)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    e = plan_recipe(cfg, gpu, gpus=world)
    line = f"memory estimate: peak {gib(e.peak_bytes)} per GPU of {gib(gpu.memory_bytes)} ({gpu.name}, {world} process{'es' if world > 1 else ''})"
    asked = [split for split in SPLITS if split.asked(cfg)]
    if PIPELINE.asked(cfg):
        line += f", the fullest of {PIPELINE.size(cfg)} pipeline stages"
    if e.peak_bytes <= REFUSE_FACTOR * gpu.memory_bytes:
        return [], [line + ("" if e.fits else "; tight: it may run out of memory")]
    if asked:  # the search tries one-replica setups, not pipeline, tensor or context layouts
        fix = f"lower train.batch_size or data.max_seq_len, or raise {asked[0].key} (see `finetune plan RECIPE --gpus N`)"
        problem = f"{line}: more than {REFUSE_FACTOR:g} x the device memory. {fix}. Pass --skip-memory-check to try anyway."
        return ([problem], []) if refuse else ([], [problem])
    shape = model_shape_of(cfg)
    recipe = RecipeFacts.from_config(cfg, plan_precision(cfg, gpu), varlen_ok=shape.varlen_ok)
    best, _ = search(shape, recipe, e.setup, gpu, max_gpus=world, host_ram=physical_ram())
    if best is not None and best.setup.gpus == world:
        fix = "fits as: " + " ".join(f"{k}={_yaml_value(v)}" for k, v in changes_of(best, e.setup).items())
    else:
        fix = f"no batch/checkpointing/offload setup fits; see `finetune plan RECIPE --gpu-mem {gpu.memory_bytes // GiB}GB --fit`"
    problem = f"{line}: more than {REFUSE_FACTOR:g} x the device memory. {fix}. Pass --skip-memory-check to try anyway."
    return ([problem], []) if refuse else ([], [problem])
