"""Every memory technique, declared once: its recipe keys, its `plan --fit` choices, its place in
resume's harmless list, what it asks of host RAM, and the rules between it and the rest.

    modes(cfg.memory)                       -> {field: value} of Modes, from a recipe (or a plan Setup)
    problems(recipe_settings(cfg))          config: the recipe's cross-field rules
    problems(launch_settings(cfg, fsdp=.., processes=n), (LAUNCH,))   parallel.runtime: this launch
    problems(Settings(**modes(setup), ...)) plan.fitting: the setups --fit tries

`Modes` holds the techniques' settings under the names config.sections.MemoryConfig gives them; the
planner's Setup and the rules' Settings extend it, so a value goes from the recipe to the planner,
the search and the rules without a translator. Where each technique acts: its module of memory/,
applied in memory/apply.py's order. This module stands before config/ and imports no model code.

A new technique: its field(s) in MemoryConfig and `Modes`, its entry in TECHNIQUES, its rules in
RULES, its module and step in memory/apply.py, its terms in plan/ (tests/test_memory_modes.py checks
that every Modes field has its recipe key and every key its field).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, fields, replace
from typing import Any

from finetune import errors
from finetune.declarations import strategies

# Rule groups. RECIPE rules need the recipe only; FSDP rules apply whenever FSDP runs (the recipe
# asks for it, or distributed.strategy=auto chose it at launch); LAUNCH rules need the number of
# processes, which a recipe does not say.
RECIPE, FSDP, LAUNCH = "recipe", "fsdp", "launch"


@dataclass(frozen=True, kw_only=True)
class Modes:
    """The memory techniques' settings, named as config.sections.MemoryConfig names them. The defaults
    are every technique off (the planner's published runs state theirs)."""

    # In the order `plan --json` has always printed them.
    checkpoint_every: int = 1  # memory.activation_checkpointing: 1 every layer, 0 none, k every k-th
    activation_offload: bool | str = False  # saved activations wait in pinned host RAM; "disk": checkpointed inputs in files
    base_weights: str = "device"  # device | cpu | disk: frozen layer weights streamed from host RAM or a file
    optimizer_offload: bool = False  # AdamW's state and step in host RAM
    loss: str = "full"  # full (every target's logits at once) | chunked | liger | auto (a recipe's default)
    loss_chunk: int = 256  # target positions per chunk
    tiled_mlp: str | int = "off"  # off | auto | N (a recipe's default is auto)
    embeddings: str = "device"  # device | cpu: the frozen vocabulary tables in host RAM
    device_layers: int = 0  # base_weights=cpu|disk: decoder layers whose frozen weights stay on the GPU (0: none)

    @property
    def streams_weights(self) -> bool:
        return self.base_weights != "device"


def modes(source: Any) -> dict[str, Any]:
    """The Modes fields' values of anything that has them: a MemoryConfig, a Setup, Settings."""
    return {f.name: getattr(source, f.name) for f in fields(Modes)}


def _off(_: Any) -> Any:
    return None


@dataclass(frozen=True)
class Technique:
    """One memory technique as the rest of finetune sees it. Its hooks read a plan Setup."""

    name: str
    field: str  # its switch: a Modes field (and --fit's knob)
    keys: tuple[str, ...]  # every recipe key it owns, its switch's first
    fit: Callable[[Any], list[Any]] | None = None  # the values `plan --fit` tries, given the recipe's Setup
    resume_harmless: bool = False  # a resumed run may change it: the numbers stay the same
    host_rank: Callable[[Any], int] = lambda s: 0  # how much it leans on host RAM (--fit's ties go to the least)
    offload_label: Callable[[Any], str | None] = _off  # what `plan` lists after "offload:" when it is on


TECHNIQUES: tuple[Technique, ...] = (
    Technique(
        "activation checkpointing",
        "checkpoint_every",
        ("memory.activation_checkpointing",),
        # none, every 4th, every 2nd, all: each keeps more activations and replays fewer layers.
        fit=lambda s: sorted({0, 4, 2, 1, s.checkpoint_every}),
    ),
    Technique(
        "activation offload",
        "activation_offload",
        ("memory.activation_offload",),
        fit=lambda s: [False, True, "disk"],
        resume_harmless=True,  # where bytes wait, not what is computed (tests/test_offload.py)
        host_rank=lambda s: {False: 0, True: 1}.get(s.activation_offload, 2),  # disk: as base_weights ranks it, after cpu
        offload_label=lambda s: {False: None, True: "activations"}.get(
            s.activation_offload, "activations (checkpointed inputs on disk)"
        ),
    ),
    Technique(
        "optimizer offload",
        "optimizer_offload",
        ("memory.optimizer_offload",),
        fit=lambda s: [False, True],
        host_rank=lambda s: int(s.optimizer_offload),
        # ZeRO's own label names its optimizer offload.
        offload_label=lambda s: "optimizer" if s.optimizer_offload and not s.strategy.deepspeed else None,
    ),
    Technique(
        "weight streaming",
        "base_weights",
        ("memory.base_weights", "memory.offload_dir", "memory.device_layers"),
        fit=lambda s: ["device", "cpu", "disk"],
        host_rank=lambda s: {"device": 0, "cpu": 2, "disk": 3}.get(s.base_weights, 3),
        offload_label=lambda s: f"base weights streamed from {s.base_weights}" if s.streams_weights else None,
    ),
    Technique(
        "host tables",
        "embeddings",
        ("memory.embeddings",),
        fit=lambda s: ["device", "cpu"],
        resume_harmless=True,  # bitwise-equal runs (tests/test_host_tables.py)
        host_rank=lambda s: int(s.embeddings == "cpu"),
        offload_label=lambda s: "vocabulary tables" if s.embeddings == "cpu" else None,
    ),
    # How the same numbers are computed, not which: only rounding differs (chunks, tiles).
    Technique("chunked loss", "loss", ("memory.loss", "memory.loss_chunk"), resume_harmless=True),
    Technique("tiled MLP", "tiled_mlp", ("memory.tiled_mlp",), resume_harmless=True),
)
# memory.offload_dir: where files wait (base_weights=disk's, activation_offload=disk's), not what is computed
RESUME_HARMLESS: tuple[str, ...] = (*(key for t in TECHNIQUES if t.resume_harmless for key in t.keys), "memory.offload_dir")


@dataclass(frozen=True, kw_only=True)
class Settings(Modes):
    """What the rules read: the techniques' settings and the rest of the run they meet. The defaults
    are a one-GPU QLoRA run with every technique off."""

    quant_bits: int | None = 4
    lora: bool = True  # False: full fine-tuning (lora: null)
    offload_dir: str | None = None  # memory.offload_dir (base_weights=disk's file, activation_offload=disk's folder)
    fsdp: bool = False  # the run shards with FSDP
    fsdp_by: str = "distributed.strategy=fsdp"  # what chose FSDP, as the messages name it
    cpu_offload: bool = False  # distributed.cpu_offload
    processes: int | None = None  # None: not known (a recipe alone)
    compile: bool = False  # train.compile

    @property
    def activation_checkpointing(self) -> str | int:
        """memory.activation_checkpointing as the recipe spells it."""
        return checkpointing_value(self.checkpoint_every)


def checkpoint_every(value: str | int) -> int:
    return {"all": 1, "none": 0}[value] if isinstance(value, str) else int(value)


def checkpointing_value(every: int) -> str | int:
    """The recipe's memory.activation_checkpointing for every-k (1: all, 0: none)."""
    return {1: "all", 0: "none"}.get(every, every)


@dataclass(frozen=True, kw_only=True)
class Rule(errors.Rule[Settings]):
    """One conflict between techniques (errors.Rule, with its keys and group). `problem` and `fix` are
    formatted with the Settings' fields."""

    keys: tuple[str, ...]  # the recipe keys that conflict
    problem: str  # what goes wrong, naming the keys
    fix: str  # how to fix it (the message's last sentence)
    group: str = RECIPE

    def message(self, x: Settings, **_: Any) -> str:
        values = {f.name: getattr(x, f.name) for f in fields(x)} | {"activation_checkpointing": x.activation_checkpointing}
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
        conflicts=lambda s: s.fsdp and s.streams_weights,
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
        conflicts=lambda s: s.streams_weights and s.checkpoint_every != 1,
        problem=_STREAMED + " brings each layer's weights back for the recomputation in backward,",
        fix="so it needs memory.activation_checkpointing=all (got {activation_checkpointing!r}).",
    ),
    Rule(
        keys=("memory.activation_offload", "memory.activation_checkpointing"),
        conflicts=lambda s: s.activation_offload == "disk" and s.checkpoint_every == 0,
        problem="memory.activation_offload=disk parks the checkpointed layers' inputs in files; with "
        "activation_checkpointing=none no layer is checkpointed,",
        fix="so set memory.activation_checkpointing=all (or every k-th layer), or activation_offload=true (host RAM).",
    ),
    Rule(
        keys=("memory.device_layers", "memory.base_weights"),
        conflicts=lambda s: s.device_layers > 0 and not s.streams_weights,
        problem="memory.device_layers={device_layers} keeps that many of the streamed layers on the GPU; "
        "memory.base_weights=device keeps every layer there.",
        fix="Set memory.base_weights=cpu (or disk), or memory.device_layers=0.",
    ),
    Rule(
        keys=("memory.base_weights", "quant.bits"),
        conflicts=lambda s: s.streams_weights and s.quant_bits == 8,
        problem=_STREAMED + " streams 4-bit or 16-bit weights; 8-bit (LLM.int8) layers keep state it cannot move.",
        fix="Use quant.bits=4.",
    ),
    Rule(
        keys=("memory.base_weights", "lora"),
        conflicts=lambda s: s.streams_weights and not s.lora,
        problem=_STREAMED + " streams frozen weights; with full fine-tuning (lora: null) every weight trains.",
        fix="Use LoRA.",
    ),
    Rule(
        # FSDP's root (the head) stays gathered from forward to backward, so the chunked head runs under it (tested
        # on CPU); liger's kernel takes the gathered weight too, but has never run under FSDP here (CUDA only).
        keys=("distributed.strategy", "memory.loss"),
        conflicts=lambda s: s.fsdp and s.loss == "liger",
        problem="{fsdp_by}: memory.loss=liger is not run under FSDP yet;",
        fix="use memory.loss=auto or chunked (the head and the loss in chunks of targets, tested under FSDP).",
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
        conflicts=lambda s: s.compile and s.streams_weights,
        problem="train.compile cannot trace " + _STREAMED + ": each layer's weights are swapped in as it runs.",
        fix="Set train.compile=false, or memory.base_weights=device.",
    ),
    Rule(
        keys=("train.compile", "memory.activation_offload"),
        conflicts=lambda s: bool(s.compile and s.activation_offload and s.checkpoint_every > 0),
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
        conflicts=lambda s: s.offload_dir is not None and s.base_weights != "disk" and s.activation_offload != "disk",
        problem="memory.offload_dir is only used by memory.base_weights=disk and memory.activation_offload=disk;",
        fix="set one of them, or remove offload_dir.",
    ),
    Rule(
        keys=("memory.base_weights",),
        conflicts=lambda s: s.streams_weights and (s.processes or 1) > 1,
        problem=_STREAMED + " streams the weights of one process; this launch has {processes} processes.",
        fix="Run on one GPU, or use distributed.strategy=fsdp with distributed.cpu_offload=true.",
        group=LAUNCH,
    ),
)


def problems(s: Settings, groups: tuple[str, ...] = (RECIPE, FSDP, LAUNCH)) -> list[str]:
    """The message of every rule in `groups` that these settings break, in table order."""
    return errors.broken((rule for rule in RULES if rule.group in groups), s)


def recipe_settings(cfg: Any, **override: Any) -> Settings:
    """The Settings of a config.RecipeConfig (a recipe alone: processes unknown)."""
    s = Settings(
        **modes(cfg.memory),
        offload_dir=cfg.memory.offload_dir,
        quant_bits=cfg.quant.bits,
        lora=cfg.lora is not None,
        compile=cfg.train.compile,
        fsdp=strategies.of_recipe(cfg).wraps_layers,
        cpu_offload=cfg.distributed.cpu_offload,
    )
    return replace(s, **override)


def launch_settings(cfg: Any, *, fsdp: bool, processes: int) -> Settings:
    """The Settings of a launch: the recipe, whether the strategy it resolved to is FSDP, its processes."""
    by = "distributed.strategy=fsdp" if strategies.of_recipe(cfg).wraps_layers else "FSDP (chosen by distributed.strategy=auto)"
    return recipe_settings(cfg, fsdp=fsdp, fsdp_by=by, processes=processes)
