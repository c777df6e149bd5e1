"""Checkpoints and the final adapter, written so that a half-written one is never taken for a good one.

Layout under output_dir:
    recipe.yaml                  resolved config of the run
    metrics.jsonl                one JSON object per logged step
    checkpoints/step-N/          periodic: adapter/, optimizer.safetensors, optimizer.json,
                                 rng.safetensors, trainer_state.json, manifest.json (written last);
                                 grad_compression/rankR.{safetensors,json}: each rank's PowerSGD state,
                                 objective/rankR.safetensors: each rank's grpo completions sampled ahead
    adapter/                     final adapter in PEFT format (+ tokenizer)

Every directory is written to a hidden temporary sibling and renamed into place
only when complete; a checkpoint counts only if its manifest lists files whose
sizes match. Tensors go to safetensors, everything else to JSON: nothing is
unpickled from disk.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from finetune.config.older_runs import current_spelling
from finetune.config.schema import RecipeConfig
from finetune.data.images import processor_of
from finetune.data.sources import file_digest
from finetune.declarations.splits import RESUME_HARMLESS as SPLITS_RESUME_HARMLESS
from finetune.declarations.techniques import RESUME_HARMLESS
from finetune.errors import CheckpointError, OutputDirError
from finetune.parallel.distribute import (
    held_indices,
    held_optimizer_state,
    is_sharded,
    load_full_trainable_state,
    shard_optimizer_state,
)
from finetune.parallel.rank_state import RankState, read_powersgd, restore_rng_states, save_rank_states
from finetune.parallel.zero import zero_load, zero_optimizer

RUN_MARKERS = ("recipe.yaml", "metrics.jsonl", "adapter", "checkpoints")
MANIFEST = "manifest.json"
FORMAT_VERSION = 1


# --------------------------------------------------------------------------- output dir


def output_dir_problem(cfg: RecipeConfig) -> str | None:
    """Why output_dir cannot be used as configured, or None."""
    out = Path(cfg.output_dir)
    if not out.exists():
        return None
    if not out.is_dir():
        return f"output_dir: '{out}' exists and is a file. Choose another output_dir."
    entries = [p.name for p in out.iterdir()]
    if not entries or cfg.resume is not None:
        return None
    is_run = any(m in entries for m in RUN_MARKERS)
    if cfg.overwrite:
        if is_run:
            return None
        return (
            f"output_dir: '{out}' is not empty and does not look like a finetune run ({', '.join(sorted(entries)[:5])}); "
            "overwrite=true only deletes finetune runs. Choose an empty or new output_dir."
        )
    if is_run:
        return (
            f"output_dir: '{out}' holds another run. Set resume=auto to continue it, overwrite=true to replace it, "
            "or choose a new output_dir."
        )
    return f"output_dir: '{out}' is not empty ({', '.join(sorted(entries)[:5])}). Choose an empty or new output_dir."


def prepare_output_dir(cfg: RecipeConfig) -> Path:
    """Create output_dir (deleting a previous run when overwrite=true). Raises OutputDirError."""
    problem = output_dir_problem(cfg)
    if problem:
        raise OutputDirError(problem)
    out = Path(cfg.output_dir)
    if cfg.overwrite and out.exists():
        for name in RUN_MARKERS + ("loss.png", "tensorboard", "wandb"):
            target = out / name
            if target.is_dir():
                shutil.rmtree(target)
            elif target.exists():
                target.unlink()
    out.mkdir(parents=True, exist_ok=True)
    return out


# --------------------------------------------------------------------------- atomic writes


@contextmanager
def atomic_dir(final: Path) -> Iterator[Path]:
    """Yield a temporary directory that becomes `final` only if the block completes."""
    final = Path(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = final.parent / f".tmp-{final.name}-{os.getpid()}"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    try:
        yield tmp
        _fsync_tree(tmp)
        if final.exists():
            # Keep the old copy until the new one is in place.
            old = final.parent / f".old-{final.name}-{os.getpid()}"
            final.rename(old)
            tmp.rename(final)
            shutil.rmtree(old)
        else:
            tmp.rename(final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _fsync_tree(root: Path) -> None:
    for p in root.rglob("*"):
        if p.is_file():
            with p.open("rb") as fh:
                os.fsync(fh.fileno())


def write_json(path: Path, obj: Any) -> None:
    path.write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n", encoding="utf-8")


def write_manifest(directory: Path, extra: dict[str, Any]) -> None:
    """Written last: every file with its size and sha256, so truncation and bit rot are caught."""
    files = {
        str(p.relative_to(directory)): {"bytes": p.stat().st_size, "sha256": file_digest(p)}
        for p in sorted(directory.rglob("*"))
        if p.is_file() and p.name != MANIFEST
    }
    write_json(directory / MANIFEST, {"format": FORMAT_VERSION, "files": files, **extra})


def verify_manifest(directory: Path, hash_files: bool = True) -> dict[str, Any]:
    """The manifest of a complete checkpoint; CheckpointError naming the bad file otherwise.

    hash_files=False checks presence and sizes only: enough to tell a finished
    save from an interrupted one, without reading every byte again.
    """
    mpath = directory / MANIFEST
    if not mpath.is_file():
        raise CheckpointError(f"checkpoint '{directory}' is incomplete: {MANIFEST} is missing (interrupted save?)")
    try:
        manifest = json.loads(mpath.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise CheckpointError(f"checkpoint '{directory}': {MANIFEST} is corrupt ({exc})") from None
    for name, meta in manifest.get("files", {}).items():
        f = directory / name
        if not f.is_file():
            raise CheckpointError(f"checkpoint '{directory}': file '{name}' listed in the manifest is missing")
        if f.stat().st_size != meta["bytes"]:
            raise CheckpointError(
                f"checkpoint '{directory}': file '{name}' has {f.stat().st_size} bytes, manifest says {meta['bytes']} (truncated)"
            )
        if hash_files and file_digest(f) != meta["sha256"]:
            raise CheckpointError(f"checkpoint '{directory}': file '{name}' is corrupt (sha256 differs from the manifest)")
    return manifest


# --------------------------------------------------------------------------- resume compatibility

# Keys whose change keeps a resumed run the same run (what is logged, evaluated,
# saved, or how long it goes). Everything else changes the numbers.
HARMLESS_CHANGES = (
    "description",
    "output_dir",
    "resume",
    "resume_ignore_changes",
    "overwrite",
    "train.max_steps",
    "train.epochs",
    "train.log_every_steps",
    "train.on_nonfinite",
    "train.loss_spike_factor",
    "eval.",
    "checkpoint.",
    "report.",
    "profile.",  # torch.profiler watches the steps; it changes no number of the run
    # How the same numbers are computed, not which: the objective is unchanged, only rounding
    # (attention kernels) differs. Runs from before these keys resume, said.
    "model.attn_implementation",
    "model.kernels",
    "train.compile",
    # The memory techniques that declare themselves harmless on resume (finetune/declarations/techniques.py).
    *RESUME_HARMLESS,
    # How the processes share the work, not what they compute (checkpoints hold whole tensors; the
    # reduction order differs in the last bits): a ZeRO run resumes under DDP, FSDP or on one process.
    "distributed.strategy",
    "distributed.zero_stage",
    "distributed.offload_optimizer",
    "distributed.offload_params",
    "distributed.nvme_dir",
    *SPLITS_RESUME_HARMLESS,  # pipeline, tensor and context parallelism's keys (finetune/declarations/splits.py)
    # How long a rank waits, what it warns about, whether a step is retried: not what a step computes.
    *("distributed.timeout_s", "distributed.straggler_ratio", "distributed.straggler_steps", "train.oom_backoff"),
)


def _flatten(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in tree.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict) and v:
            out.update(_flatten(v, key + "."))
        else:
            out[key] = v
    return out


def recipe_changes(old: dict[str, Any], new: dict[str, Any]) -> tuple[list[str], list[str]]:
    """(changes that break an exact resume, harmless changes), each 'key: old -> new'. Both recipes are
    compared as this version spells them (an older run's lora.dora is lora.method)."""
    a, b = _flatten(current_spelling(old)), _flatten(current_spelling(new))
    breaking: list[str] = []
    harmless: list[str] = []
    for key in sorted(set(a) | set(b)):
        if a.get(key) == b.get(key):
            continue
        text = f"{key}: {a.get(key)!r} -> {b.get(key)!r}"
        is_harmless = any(key == h or (h.endswith(".") and key.startswith(h)) for h in HARMLESS_CHANGES)
        (harmless if is_harmless else breaking).append(text)
    return breaking, harmless


# --------------------------------------------------------------------------- adapter


def save_adapter(model, dest: Path, tokenizer=None, state_dict: dict[str, torch.Tensor] | None = None) -> Path:
    """The trained adapter in vanilla PEFT format (adapter_config.json + adapter_model.safetensors).

    state_dict: the trained weights gathered whole, when the model holds only a shard (FSDP).
    """
    with atomic_dir(Path(dest)) as tmp:
        model.save_pretrained(tmp, safe_serialization=True, **({"state_dict": state_dict} if state_dict else {}))
        if tokenizer is not None:  # a VLM's processor: its tokenizer, image settings and template (loads from here)
            (processor_of(tokenizer) or tokenizer).save_pretrained(tmp)
    return Path(dest)


# --------------------------------------------------------------------------- periodic checkpoints


def _optimizer_to_tensors(sd: dict[str, Any]) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    tensors: dict[str, torch.Tensor] = {}
    scalars: dict[str, Any] = {}
    for idx, state in sd["state"].items():
        for name, value in state.items():
            if torch.is_tensor(value):
                tensors[f"{idx}.{name}"] = value.detach().cpu().contiguous()
            else:
                scalars[f"{idx}.{name}"] = value
    return tensors, {"param_groups": sd["param_groups"], "scalars": scalars}


def _optimizer_from_tensors(tensors: dict[str, torch.Tensor], meta: dict[str, Any]) -> dict[str, Any]:
    state: dict[int, dict[str, Any]] = {}
    for key, value in list(tensors.items()) + list(meta.get("scalars", {}).items()):
        idx, name = key.split(".", 1)
        state.setdefault(int(idx), {})[name] = value
    return {"state": state, "param_groups": meta["param_groups"]}


def checkpoint_dir(output_dir: Path, step: int) -> Path:
    return Path(output_dir) / "checkpoints" / f"step-{step}"


def save_checkpoint(
    output_dir: Path,
    step: int,
    model,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    trainer_state: dict[str, Any],
    keep_last: int | None = None,
    model_state: dict[str, torch.Tensor] | None = None,
    optimizer_state: dict[str, Any] | None = None,
    rank_states: list[RankState] | None = None,
    scheduler_state: dict[str, Any] | None = None,
) -> Path:
    """model_state / optimizer_state: full (gathered) states when the model and optimizer hold shards (FSDP), or
    snapshots (written in the background); scheduler_state: a snapshot of the scheduler's, likewise.

    rank_states: what every process holds alone (generators, PowerSGD), so that each continues
    its own dropout stream and error feedback on resume (with the same number of processes).
    """
    final = checkpoint_dir(output_dir, step)
    trainable = model_state or {n: p for n, p in model.named_parameters() if p.requires_grad}
    bad = [n for n, p in trainable.items() if not torch.isfinite(p.detach()).all()]
    if bad:
        # A checkpoint is a promise of a good state: never write NaN/inf weights into one.
        raise CheckpointError(f"refusing to write checkpoint step-{step}: non-finite values in {bad[0]} (+{len(bad) - 1} more)")
    with atomic_dir(final) as tmp:
        model.save_pretrained(tmp / "adapter", safe_serialization=True, **({"state_dict": model_state} if model_state else {}))
        tensors, meta = _optimizer_to_tensors(optimizer_state or optimizer.state_dict())
        save_file(tensors, str(tmp / "optimizer.safetensors"))
        write_json(tmp / "optimizer.json", meta)
        write_json(tmp / "scheduler.json", scheduler_state if scheduler_state is not None else scheduler.state_dict())
        save_rank_states(tmp, rank_states or [])
        write_json(tmp / "trainer_state.json", {"step": step, **trainer_state})
        write_manifest(tmp, {"step": step})
    prune_checkpoints(output_dir, keep_last)
    return final


def snapshot(
    model, optimizer, scheduler, model_state: dict[str, torch.Tensor] | None, optimizer_state: dict[str, Any] | None
) -> dict[str, Any]:
    """save_checkpoint's model_state, optimizer_state and scheduler_state as host-RAM copies taken now, gathered ones
    too (a whole tensor gathered on a CPU is the live one: `.cpu()` copies nothing there): what a background write
    needs while the next steps change the originals."""

    def copied(obj: Any) -> Any:
        if torch.is_tensor(obj):
            return obj.detach().to("cpu", copy=True)
        if isinstance(obj, dict):
            return {k: copied(v) for k, v in obj.items()}
        if isinstance(obj, list | tuple):
            return type(obj)(copied(v) for v in obj)
        return obj

    if model_state is None:
        model_state = {n: p for n, p in model.named_parameters() if p.requires_grad}
    return {
        "model_state": copied(model_state),
        "optimizer_state": copied(optimizer_state if optimizer_state is not None else optimizer.state_dict()),
        "scheduler_state": copied(scheduler.state_dict()),
    }


def list_checkpoints(output_dir: Path) -> list[Path]:
    """Checkpoint directories, oldest first (by step)."""
    root = Path(output_dir) / "checkpoints"
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if p.is_dir() and p.name.startswith("step-") and p.name[5:].isdigit()]
    return sorted(found, key=lambda p: int(p.name[5:]))


def prune_checkpoints(output_dir: Path, keep_last: int | None) -> None:
    """Delete complete checkpoints beyond the newest keep_last, and leftovers of interrupted saves."""
    complete = []
    for p in list_checkpoints(output_dir):
        try:
            verify_manifest(p, hash_files=False)
            complete.append(p)
        except CheckpointError:
            continue
    for p in complete[:-keep_last] if keep_last else []:
        shutil.rmtree(p, ignore_errors=True)
    # Leftovers of interrupted saves (this or an earlier process).
    root = Path(output_dir) / "checkpoints"
    for p in root.glob(".tmp-*"):
        if not p.name.endswith(f"-{os.getpid()}"):
            shutil.rmtree(p, ignore_errors=True)


def latest_checkpoint(output_dir: Path) -> tuple[Path | None, list[str]]:
    """(newest complete checkpoint or None, notes about incomplete ones skipped)."""
    notes: list[str] = []
    for p in reversed(list_checkpoints(output_dir)):
        try:
            verify_manifest(p)
            return p, notes
        except CheckpointError as exc:
            notes.append(f"skipping {exc.message}")
    return None, notes


def follow_schedule(scheduler: torch.optim.lr_scheduler.LRScheduler) -> None:
    """Set the lr of the restored step from the schedule as configured now, not as saved.

    The optimizer's saved lr is the old schedule's: a finished 3-step cosine run ends at
    lr 0, and extending it to 6 steps would train step 4 at 0 before the new schedule
    took over. A LambdaLR's value depends only on its step, so it can be recomputed;
    other schedulers keep what they saved.
    """
    if not isinstance(scheduler, torch.optim.lr_scheduler.LambdaLR):
        return
    step = scheduler.last_epoch
    lrs = [base * factor(step) for base, factor in zip(scheduler.base_lrs, scheduler.lr_lambdas)]
    for group, lr in zip(scheduler.optimizer.param_groups, lrs):
        group["lr"] = lr
    scheduler._last_lr = lrs


def _share_of_rank(model, optimizer, weights: dict[str, torch.Tensor], optimizer_state: dict[str, Any]) -> tuple[dict, dict]:
    """A checkpoint's whole tensors cut to this rank's share under tensor parallelism (the model's
    finetune_local_slice, parallel/tensor.py): adapter weights and their moments alike; else as they are."""
    local = getattr(model, "finetune_local_slice", None)
    if local is None:
        return weights, optimizer_state
    name_of = {id(p): n for n, p in model.named_parameters()}
    names = [name_of.get(id(p), "") for group in optimizer.param_groups for p in group["params"]]  # its numbering
    state = {
        i: {k: local(names[int(i)], v) if torch.is_tensor(v) and v.dim() else v for k, v in st.items()}
        for i, st in optimizer_state["state"].items()
    }
    return {k: local(k, v) for k, v in weights.items()}, {**optimizer_state, "state": state}


def load_checkpoint(
    path: Path,
    model,
    optimizer,
    scheduler,
    check: Callable[[Path, dict], None] | None = None,
    rank: int = 0,
    powersgd=None,
) -> dict[str, Any]:
    """Restore adapter weights, optimizer, scheduler and RNG from `path`; return trainer_state.

    `check(path, trainer_state)` runs after every file is read and before anything
    is assigned; it may raise to refuse the checkpoint. powersgd: this run's PowerSGD
    (parallel.ddp_hooks.PowerSGD), given its state back when the checkpoint holds one.
    """
    from peft import PeftModel, get_peft_model_state_dict, set_peft_model_state_dict

    path = Path(path)
    verify_manifest(path)
    is_peft = isinstance(model, PeftModel)
    try:
        if is_peft:
            weights = load_file(str(path / "adapter" / "adapter_model.safetensors"))
        else:  # full fine-tuning: the whole model, possibly in shards
            weights = {}
            for f in sorted((path / "adapter").glob("*.safetensors")):
                weights.update(load_file(str(f)))
        opt_tensors = load_file(str(path / "optimizer.safetensors"))
        rng = load_file(str(path / "rng.safetensors"))
        opt_meta = json.loads((path / "optimizer.json").read_text(encoding="utf-8"))
        sched = json.loads((path / "scheduler.json").read_text(encoding="utf-8"))
        state = json.loads((path / "trainer_state.json").read_text(encoding="utf-8"))
        compression = read_powersgd(path, rank) if powersgd is not None else None
    except Exception as exc:  # safetensors raises its own error types
        raise CheckpointError(f"checkpoint '{path}' cannot be read: {exc}") from None
    if check is not None:
        check(path, state)
    full_optimizer = _optimizer_from_tensors(opt_tensors, opt_meta)
    zero = zero_optimizer(optimizer)
    held = held_indices(model) if zero is None else None  # a pipeline stage: its own parameters' state only
    if held is not None:
        full_optimizer = held_optimizer_state(full_optimizer, held)  # numbered as this rank's optimizer, then sliced
    weights, full_optimizer = _share_of_rank(model, optimizer, weights, full_optimizer)
    if is_peft and zero is not None:
        # DeepSpeed ZeRO: the parameters of this rank may be empty (ZeRO-3); peft names them as the file does.
        view = get_peft_model_state_dict(model, state_dict=dict(model.named_parameters()))
        unexpected = sorted(set(weights) ^ set(view))
    elif is_peft and is_sharded(model):
        # FSDP: the file holds full tensors; each rank keeps its shard. peft's own state-dict
        # view names every adapter tensor as the file does and shares the parameters' storage.
        view = get_peft_model_state_dict(model)
        unexpected = sorted(set(weights) ^ set(view))
        if not unexpected:
            load_full_trainable_state(model, weights, view)
    elif is_peft:
        result = set_peft_model_state_dict(model, weights)
        unexpected = list(getattr(result, "unexpected_keys", None) or [])
    else:
        result = model.load_state_dict(weights, strict=False)
        unexpected = list(result.unexpected_keys)
        tied = {k for k in result.missing_keys if "lm_head" in k or "embed" in k}  # tied weights are saved once
        if set(result.missing_keys) - tied:
            unexpected += [f"missing {k}" for k in sorted(set(result.missing_keys) - tied)]
    if unexpected:
        raise CheckpointError(
            f"checkpoint '{path}': weights do not match this model ({len(unexpected)} differ, e.g. {unexpected[0]})",
            hint="the recipe's LoRA shape or base model changed since the checkpoint was written",
        )
    if zero is not None:  # each rank keeps its partitions of the whole tensors
        zero_load(zero, zero.finetune_param_groups, [(view[k], weights[k]) for k in sorted(weights)], full_optimizer)
    else:
        # Optimizer.load_state_dict moves state to each parameter's device itself; sharded
        # parameters get their state sharded the same way first.
        optimizer.load_state_dict(shard_optimizer_state(optimizer, full_optimizer))
    scheduler.load_state_dict(sched)
    follow_schedule(scheduler)
    restore_rng_states(rng, rank)
    if compression is not None:
        powersgd.load_state_dict(*compression[:2], own_rank=compression[2])
    return state
