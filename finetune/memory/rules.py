"""Memory modes, and what each cannot run with: one table.

The modes: memory.activation_checkpointing (all | none | k), memory.activation_offload,
memory.base_weights (device | cpu | disk) with memory.offload_dir, memory.optimizer_offload,
memory.embeddings (device | cpu), and
FSDP's own distributed.cpu_offload. Each rule below is one row: the settings that conflict, the
message (naming the keys) and the fix. Three places ask the table, each with what it knows:

    problems(recipe_settings(cfg))                       config: the recipe's cross-field rules
    problems(launch_settings(cfg, fsdp=.., processes=n), LAUNCH)  parallel.runtime: this launch's processes
    problems(Settings(...) of a plan Setup)              plan.fitting: the setups --fit tries

A new mode: its field in config.schema.MemoryConfig and in `Settings` (and `recipe_settings`), its rows
here, where it acts (a module of memory/ and its step in memory/apply.py), and its Knob and terms in plan/.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, fields, replace
from typing import Any

from finetune.parallel import strategies

# Rule groups. RECIPE rules need the recipe only; FSDP rules apply whenever FSDP runs (the recipe
# asks for it, or distributed.strategy=auto chose it at launch); LAUNCH rules need the number of
# processes, which a recipe does not say.
RECIPE, FSDP, LAUNCH = "recipe", "fsdp", "launch"


@dataclass(frozen=True)
class Settings:
    """What the rules read. The defaults are a one-GPU QLoRA run with every mode off."""

    quant_bits: int | None = 4
    lora: bool = True  # False: full fine-tuning (lora: null)
    activation_checkpointing: str | int = "all"  # all | none | k, as the recipe spells it
    activation_offload: bool = False
    base_weights: str = "device"  # device | cpu | disk
    offload_dir: str | None = None
    optimizer_offload: bool = False
    fsdp: bool = False  # the run shards with FSDP
    fsdp_by: str = "distributed.strategy=fsdp"  # what chose FSDP, as the messages name it
    cpu_offload: bool = False  # distributed.cpu_offload
    processes: int | None = None  # None: not known (a recipe alone)
    loss: str = "auto"  # memory.loss: auto | full | chunked | liger
    embeddings: str = "device"  # memory.embeddings: device | cpu
    compile: bool = False  # train.compile

    @property
    def checkpoint_every(self) -> int:
        """Every how many decoder layers one is checkpointed; 0: none (as config.schema.MemoryConfig)."""
        return checkpoint_every(self.activation_checkpointing)

    @property
    def streams(self) -> bool:
        return self.base_weights != "device"


def checkpoint_every(value: str | int) -> int:
    return {"all": 1, "none": 0}[value] if isinstance(value, str) else int(value)


def checkpointing_value(every: int) -> str | int:
    """The recipe's memory.activation_checkpointing for every-k (1: all, 0: none)."""
    return {1: "all", 0: "none"}.get(every, every)


@dataclass(frozen=True)
class Rule:
    """One conflict. `problem` and `fix` are formatted with the Settings' fields."""

    keys: tuple[str, ...]  # the recipe keys that conflict
    conflicts: Callable[[Settings], bool]
    problem: str  # what goes wrong, naming the keys
    fix: str  # how to fix it (the message's last sentence)
    group: str = RECIPE

    def message(self, s: Settings) -> str:
        values = {f.name: getattr(s, f.name) for f in fields(s)}
        return " ".join(part.format(**values) for part in (self.problem, self.fix) if part)


_STREAMED = "memory.base_weights={base_weights}"

RULES: tuple[Rule, ...] = (
    Rule(
        keys=("distributed.cpu_offload", "distributed.strategy"),
        conflicts=lambda s: s.cpu_offload and not s.fsdp,
        problem="distributed.cpu_offload",
        fix="needs distributed.strategy=fsdp (DDP keeps a full replica per GPU).",
    ),
    Rule(
        keys=("distributed.strategy", "quant.bits"),
        conflicts=lambda s: s.fsdp and s.quant_bits == 8,
        problem="{fsdp_by} cannot shard 8-bit (int8) weights;",
        fix="use quant.bits=4 or null.",
        group=FSDP,
    ),
    Rule(
        keys=("distributed.strategy", "lora"),
        conflicts=lambda s: s.fsdp and not s.lora,
        problem="{fsdp_by} with full fine-tuning (lora: null) is not supported yet;",
        fix="use LoRA, or distributed.strategy=ddp.",
        group=FSDP,
    ),
    Rule(
        keys=("distributed.strategy", "memory.base_weights"),
        conflicts=lambda s: s.fsdp and s.streams,
        problem="{fsdp_by} shards the weights itself; " + _STREAMED + " streams them on one process.",
        fix="Use distributed.cpu_offload=true for FSDP, or run on one GPU.",
        group=FSDP,
    ),
    Rule(
        keys=("distributed.strategy", "memory.optimizer_offload"),
        conflicts=lambda s: s.fsdp and s.optimizer_offload,
        problem="{fsdp_by}: memory.optimizer_offload is for one process;",
        fix="distributed.cpu_offload=true offloads FSDP's optimizer state.",
        group=FSDP,
    ),
    Rule(
        keys=("memory.base_weights", "memory.activation_checkpointing"),
        conflicts=lambda s: s.streams and s.checkpoint_every != 1,
        problem=_STREAMED + " brings each layer's weights back for the recomputation in backward,",
        fix="so it needs memory.activation_checkpointing=all (got {activation_checkpointing!r}).",
    ),
    Rule(
        keys=("memory.base_weights", "quant.bits"),
        conflicts=lambda s: s.streams and s.quant_bits == 8,
        problem=_STREAMED + " streams 4-bit or 16-bit weights; 8-bit (LLM.int8) layers keep state it cannot move.",
        fix="Use quant.bits=4.",
    ),
    Rule(
        keys=("memory.base_weights", "lora"),
        conflicts=lambda s: s.streams and not s.lora,
        problem=_STREAMED + " streams frozen weights; with full fine-tuning (lora: null) every weight trains.",
        fix="Use LoRA.",
    ),
    Rule(
        # The chunked head runs after the model's forward, when FSDP has resharded the head again.
        keys=("distributed.strategy", "memory.loss"),
        conflicts=lambda s: s.fsdp and s.loss in ("chunked", "liger"),
        problem="{fsdp_by}: memory.loss={loss} runs the LM head after the sharded forward, when its weight is a shard again;",
        fix="use memory.loss=auto (the head on target positions only under FSDP) or full.",
        group=FSDP,
    ),
    Rule(
        keys=("distributed.strategy", "memory.embeddings"),
        conflicts=lambda s: s.fsdp and s.embeddings == "cpu",
        problem="{fsdp_by} shards the vocabulary tables itself; memory.embeddings=cpu keeps them whole in host RAM.",
        fix="Set memory.embeddings=device, or distributed.strategy=ddp.",
        group=FSDP,
    ),
    Rule(
        keys=("memory.loss", "memory.embeddings"),
        conflicts=lambda s: s.loss == "liger" and s.embeddings == "cpu",
        problem="memory.loss=liger hands the head's whole weight to its kernel; memory.embeddings=cpu keeps it in host RAM.",
        fix="Use memory.loss=auto or chunked (the head visits the GPU for them), or memory.embeddings=device.",
    ),
    Rule(
        keys=("memory.embeddings", "lora"),
        conflicts=lambda s: s.embeddings == "cpu" and not s.lora,
        problem="memory.embeddings=cpu keeps frozen tables in host RAM; with full fine-tuning (lora: null) they train.",
        fix="Use LoRA, or memory.embeddings=device.",
    ),
    Rule(
        keys=("train.compile", "memory.base_weights"),
        conflicts=lambda s: s.compile and s.streams,
        problem="train.compile cannot trace " + _STREAMED + ": each layer's weights are swapped in as it runs.",
        fix="Set train.compile=false, or memory.base_weights=device.",
    ),
    Rule(
        keys=("train.compile", "memory.activation_offload"),
        conflicts=lambda s: s.compile and s.activation_offload and s.checkpoint_every > 0,
        problem="train.compile with memory.activation_offload and checkpointing: the offloaded checkpoint's "
        "saved-tensor hooks are not traced, so the layers would run uncompiled.",
        fix="Set train.compile=false, or activation_offload=false (or activation_checkpointing=none).",
    ),
    Rule(
        keys=("distributed.strategy", "train.compile"),
        conflicts=lambda s: s.fsdp and s.compile,
        problem="{fsdp_by} with train.compile is not tested yet;",
        fix="set train.compile=false, or distributed.strategy=ddp.",
        group=FSDP,
    ),
    Rule(
        keys=("memory.offload_dir", "memory.base_weights"),
        conflicts=lambda s: s.offload_dir is not None and s.base_weights != "disk",
        problem="memory.offload_dir is only used by memory.base_weights=disk;",
        fix="set that too, or remove offload_dir.",
    ),
    Rule(
        keys=("memory.base_weights",),
        conflicts=lambda s: s.streams and (s.processes or 1) > 1,
        problem=_STREAMED + " streams the weights of one process; this launch has {processes} processes.",
        fix="Run on one GPU, or use distributed.strategy=fsdp with distributed.cpu_offload=true.",
        group=LAUNCH,
    ),
)


def problems(s: Settings, groups: tuple[str, ...] = (RECIPE, FSDP, LAUNCH)) -> list[str]:
    """The message of every rule in `groups` that these settings break, in table order."""
    return [rule.message(s) for rule in RULES if rule.group in groups and rule.conflicts(s)]


def recipe_settings(cfg: Any, **override: Any) -> Settings:
    """The Settings of a config.RecipeConfig (a recipe alone: processes unknown)."""
    mem = cfg.memory
    s = Settings(
        quant_bits=cfg.quant.bits,
        lora=cfg.lora is not None,
        activation_checkpointing=mem.activation_checkpointing,
        activation_offload=mem.activation_offload,
        base_weights=mem.base_weights,
        offload_dir=mem.offload_dir,
        optimizer_offload=mem.optimizer_offload,
        loss=mem.loss,
        embeddings=mem.embeddings,
        compile=cfg.train.compile,
        fsdp=strategies.of_recipe(cfg).wraps_layers,
        cpu_offload=cfg.distributed.cpu_offload,
    )
    return replace(s, **override)


def launch_settings(cfg: Any, *, fsdp: bool, processes: int) -> Settings:
    """The Settings of a launch: the recipe, whether the strategy it resolved to is FSDP, its processes."""
    by = "distributed.strategy=fsdp" if strategies.of_recipe(cfg).wraps_layers else "FSDP (chosen by distributed.strategy=auto)"
    return recipe_settings(cfg, fsdp=fsdp, fsdp_by=by, processes=processes)
