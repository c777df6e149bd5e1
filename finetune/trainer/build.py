"""The builder: accelerator, data, model (and its weight store), optimizer and schedule from a recipe.

Each function builds one part and says what it built; Trainer.setup calls them in order.
Parts a user passed in (model, tokenizer, data, optimizer, scheduler) are used as given.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from finetune.config.schema import RecipeConfig, build_recipe
from finetune.data import IGNORE_INDEX, DataBundle, DataStats, build_datasets, build_examples
from finetune.declarations import objectives
from finetune.declarations.splits import TENSOR
from finetune.errors import ConfigError
from finetune.memory.apply import Applied, apply_techniques, weights_capture
from finetune.memory.stream import WeightStream
from finetune.metrics import human_bytes
from finetune.model.load import (
    load_model,
    wrap_lora,
)
from finetune.objectives.grpo import GRPOLoss
from finetune.objectives.loss import CausalLMLoss, Loss
from finetune.objectives.preference import PreferenceLoss
from finetune.objectives.rewards import build_rewards
from finetune.parallel.runtime import Parallel
from finetune.plan.memory import LOAD_ON_GPU_MARGIN
from finetune.plan.recipe import loaded_weight_bytes
from finetune.runs.evaluate import exact_match_records
from finetune.trainer.callbacks import Callback
from finetune.trainer.profiling import ModelFlops, StageTimes, StepProfiler
from finetune.trainer.schedule import build_scheduler
from finetune.trainer.watch import StragglerWatch, ThroughputAlert

OptimizerArg = torch.optim.Optimizer | Callable[[list[torch.nn.Parameter]], torch.optim.Optimizer] | None
SchedulerArg = torch.optim.lr_scheduler.LRScheduler | Callable[[torch.optim.Optimizer], Any] | None


def load_data(cfg: RecipeConfig, tokenizer, accelerator, say: Callable[[str], None]) -> DataBundle:
    t0 = time.perf_counter()
    # Rank 0 tokenizes (and fills the cache) while the others wait, then they read its cache.
    with accelerator.main_process_first():
        data = build_datasets(cfg, tokenizer)
    how = "read from the tokenized cache" if data.from_cache else "tokenized"
    say(f"data: {how} in {time.perf_counter() - t0:.1f}s")
    return data


def describe_data(data: DataBundle, say: Callable[[str], None]) -> None:
    say(f"data: {data.train_stats.summary()}")
    for line in data.train_stats.warnings:
        say(f"warning: {line}")
    if data.eval_stats is not None:
        say(f"eval data: {data.eval_stats.summary()}")


def recipe_for_parts(model, output_dir, settings: dict[str, Any]) -> RecipeConfig:
    """The recipe of a run on parts in memory (Trainer.from_parts): settings as given, no paths needed.
    The model's own name (config._name_or_path) stands for model.path; the data is "in-memory"."""
    name = getattr(getattr(model, "config", None), "_name_or_path", "") or f"in-memory:{type(model).__name__}"
    recipe: dict[str, Any] = {"precision": "auto", "output_dir": str(output_dir), **settings}
    recipe["model"] = {"path": name, **recipe.get("model", {})}
    recipe["data"] = {"path": "in-memory", **recipe.get("data", {})}
    recipe.setdefault("quant", {"bits": None})  # the model is already loaded as the user wanted it
    return build_recipe(recipe, source="Trainer.from_parts")


def bundle_from_parts(cfg: RecipeConfig, tokenizer, train: Sequence[dict], eval: Sequence[dict] | None) -> DataBundle:
    """Records in cfg.data.format (tokenized and masked as a recipe's files would be), or examples
    already tokenized ({"input_ids", "labels"}), used as they are."""

    def tokenized(rows: Sequence[dict], key: str) -> tuple[Sequence[dict], DataStats]:
        if rows and all("input_ids" in r for r in rows):
            tokens = sum(len(r["input_ids"]) for r in rows)
            trained = sum(sum(1 for t in r.get("labels", r["input_ids"])[1:] if t != IGNORE_INDEX) for r in rows)
            return rows, DataStats(examples=len(rows), dropped=0, truncated=0, tokens=tokens, trained_tokens=trained)
        return build_examples(list(rows), cfg, tokenizer, key=key)

    train_set, train_stats = tokenized(train, "train_data")
    eval_set, eval_stats = tokenized(eval, "eval_data") if eval else (None, None)
    return DataBundle(train=train_set, eval=eval_set, train_stats=train_stats, eval_stats=eval_stats)


def ready_given_model(cfg: RecipeConfig, model):
    """A model built by the user, made ready as load_model makes a loaded one: LoRA per lora.* unless it
    carries adapters already (memory.*, activation checkpointing among them, is memory/apply.py's, for both)."""
    from peft import PeftModel

    if isinstance(model, PeftModel) or cfg.lora is None:
        return model
    for p in model.parameters():
        p.requires_grad_(False)
    torch.manual_seed(cfg.seed)  # LoRA's init, drawn as a recipe's run draws it
    wrapped = wrap_lora(cfg, model)
    # The generator as a recipe's run leaves it after the init: setup() resumes from here, so
    # dropout draws the same masks (it reseeds in between, for the tokenizer and data).
    wrapped.finetune_rng_after_init = torch.get_rng_state()
    return wrapped


def load_model_and_store(
    cfg: RecipeConfig, precision: str, parallel: Parallel, say: Callable[[str], None], given=None
) -> tuple[Any, Applied]:
    """The model (loaded unless given), with memory/apply.py's techniques applied, and what the loop
    keeps of them (the store its frozen layer weights live in for memory.base_weights=cpu|disk, the
    forward's context). A failure deletes a weights file already written."""
    streaming = cfg.memory.base_weights != "device"
    disk_store = None
    model = given
    after_init = getattr(given, "finetune_rng_after_init", None)
    if after_init is not None:  # Trainer.from_parts wrapped it: continue from its LoRA init
        torch.set_rng_state(after_init)
    try:
        if model is None:
            torch.manual_seed(cfg.seed)  # LoRA init is drawn from the global RNG: the same on every rank
            load_on = load_device(cfg, precision, parallel, streaming, say)
            disk_store = weights_capture(cfg)
            if disk_store is not None:
                with disk_store.capture():
                    model = load_model(cfg, precision=precision, device=load_on, shardable=parallel.sharded)
            else:
                placement = parallel.placement()  # a pipeline stage: its own modules only
                model = load_model(
                    cfg,
                    precision=precision,
                    device=load_on,
                    shardable=parallel.sharded,
                    placement=placement,
                    split=parallel.split(),
                )
            parallel.loaded(model)  # (a model given in memory was not read split: nothing to finish)
        if getattr(model, "finetune_attention_note", None):
            say(model.finetune_attention_note)
        applied = apply_techniques(model, cfg, parallel.device, say, given=given is not None, disk_store=disk_store)
    except BaseException:
        if disk_store is not None:
            disk_store.discard()  # tens of GB written for a model that will not train
        raise
    return model, applied


def load_device(cfg: RecipeConfig, precision: str, parallel: Parallel, streaming: bool, say: Callable[[str], None]):
    """Where the model loads: the room's choice (streaming: host RAM), except that a streaming run keeping layers on
    a CUDA device (memory.device_layers) loads there when this process's whole (share of the) model fits its free
    memory with LOAD_ON_GPU_MARGIN to spare: only the streamed layers then move to host RAM, which never holds the
    kept ones (the planner counts the same: plan/memory.streaming_loads_on_gpu)."""
    room = parallel.load_device(streaming)
    if not (streaming and cfg.memory.device_layers and parallel.device.type == "cuda"):
        return room
    need = loaded_weight_bytes(cfg, precision, TENSOR.size(cfg))
    free, _ = torch.cuda.mem_get_info(parallel.device)
    # Every rank alike (a collective): the ranks of a tensor-parallel group quantize where they load.
    if all(fits for (fits,) in parallel.every_rank(float(need <= (1 - LOAD_ON_GPU_MARGIN) * free))):
        return parallel.device
    say(
        f"memory: the model loads in host RAM first ({human_bytes(need)} of weights do not fit the "
        f"{human_bytes(free)} free on {parallel.device} with {LOAD_ON_GPU_MARGIN:.0%} to spare)"
    )
    return room


def describe_store(stream: WeightStream, device, say: Callable[[str], None]) -> None:
    where = f"a file in {stream.store.parent}" if stream.store else "CPU RAM"
    say(
        f"memory: {human_bytes(stream.streamed_bytes)} of frozen decoder-layer weights live in {where} "
        f"and stream to {device} one layer at a time"
    )


def default_loss(cfg: RecipeConfig, reward_fns: Sequence[Callable] = ()) -> Loss:
    """The loss of train.objective (finetune/declarations/objectives.py); grpo's with the recipe's rewards, then yours."""
    objective = objectives.get(cfg.train.objective)
    if objective.online:
        return GRPOLoss(cfg.train, build_rewards(cfg.train.rewards, reward_fns), cfg.seed)
    if reward_fns:
        raise ConfigError(
            [f"reward functions were given, but train.objective={objective.name} reads none; set train.objective=grpo"]
        )
    if not objective.pairs:
        return CausalLMLoss()
    gamma = objectives.simpo_gamma(cfg.train) if objective.name == "simpo" else 0.0
    return PreferenceLoss(objective.name, objectives.beta(cfg.train), gamma)


def build_optimizer(
    cfg: RecipeConfig, params: list[torch.nn.Parameter], given: OptimizerArg, parallel: Parallel, applied: Applied
) -> torch.optim.Optimizer:
    """The recipe's AdamW (the class memory/apply.py chose: in host RAM with memory.optimizer_offload), or the user's:
    an optimizer, or a function of the trainable parameters that builds one (needed under FSDP, whose parameters are
    the shards)."""
    if given is None:
        return applied.optimizer(params, lr=cfg.train.lr, weight_decay=cfg.train.weight_decay)
    if cfg.memory.optimizer_offload:
        raise ConfigError(
            [
                "memory.optimizer_offload builds its own host AdamW; it cannot offload an optimizer passed "
                "to Trainer(optimizer=...). Set memory.optimizer_offload=false, or pass no optimizer."
            ]
        )
    if isinstance(given, torch.optim.Optimizer):
        if parallel.sharded:
            raise ConfigError(
                [
                    "Trainer(optimizer=...): FSDP replaces the parameters with shards after the model is "
                    "built; pass a function of the parameters instead, e.g. optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1)"
                ]
            )
        return given
    return given(params)


def build_lr_schedule(cfg: RecipeConfig, optimizer: torch.optim.Optimizer, total_steps: int, given: SchedulerArg):
    """The recipe's warmup + decay, or the user's scheduler (or function of the optimizer that builds one)."""
    if given is None:
        return build_scheduler(optimizer, cfg.train, total_steps)
    if isinstance(given, torch.optim.lr_scheduler.LRScheduler):
        return given
    return given(optimizer)


def recipe_callbacks(trainer: Any) -> list[Callback]:
    """The callbacks a recipe asks for, run before the user's: MFU (and a pipeline's stage times) on every step,
    torch.profiler on profile.steps, then the stragglers' and the throughput's watch (they read mfu).
    They read the trainer's parts (model, device, precision) when training begins."""
    found: list[Callback] = [ModelFlops(trainer), StageTimes(trainer)]
    if trainer.cfg.profile.steps:
        found.append(StepProfiler(trainer, trainer.cfg.profile.steps))
    return [*found, StragglerWatch(trainer), ThroughputAlert(trainer)]


def exact_match_prompts(cfg: RecipeConfig, parallel, say: Callable[[str], None]) -> list[dict] | None:
    """eval.exact_match_path's records, scored before and after training; None in a pipeline, where no
    process holds the whole model to generate with (said, with the command that scores the run after)."""
    records = exact_match_records(cfg)
    if records and not parallel.holds_whole_model:
        say(
            f"eval: exact match is not generated in a pipeline (each process holds its stage); `finetune eval {cfg.output_dir}` scores it"
        )
        return None
    return records
