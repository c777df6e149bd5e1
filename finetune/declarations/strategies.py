"""The ways to spread a run over GPUs, one declaration each: what the planner, --fit and the rules ask of them.

    strategy = planned(setup.sharding)       # the Strategy a plan's Setup names: ddp | fsdp | zero2 | zero3
    strategy = of_recipe(cfg)                # the one a recipe asks for on several GPUs (auto plans as ddp)
    strategy.partitions_weights              # ... the questions below, never a comparison with a name

A declaration says what a strategy does to memory and which recipe keys choose it; how it runs
(wrapping, gradient sync, whole states for a checkpoint) is parallel/distribute.py and runtime.py.
This module imports nothing of ours: config, declarations/techniques and plan/ ask it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Strategy:
    """A strategy names only what it does; every trait it lacks stays False."""

    name: str  # the planner's Setup.sharding
    recipe: dict[str, Any]  # the recipe keys that choose it (distributed.*)
    replicates: bool = False  # a whole replica per GPU: DDP's all-reduce buckets mirror the gradients
    partitions_weights: bool = False  # the base weights split over the GPUs, gathered a layer at a time
    partitions_optimizer: bool = False  # gradients and AdamW state split over the GPUs
    partitions_root: bool = False  # the embeddings, head and final norm split too (FSDP keeps its root unit whole)
    wraps_layers: bool = False  # each decoder layer wrapped by FSDP2's fully_shard: the memory rules' FSDP rows apply
    # Runs through DeepSpeed's engine: its keys (declarations/zero_config.py) set the offloads, and
    # distributed.cpu_offload means its weight partitions (offload_params), not every shard as under FSDP.
    deepspeed: bool = False
    loads_whole_on_host: bool = False  # each process builds the whole model in CPU RAM before it shards
    starts_whole_on_gpu: bool = False  # the engine is built from the whole model on each GPU, partitioned after
    searched: bool = False  # `plan --fit` tries it
    # `plan --gpus N` compares these rows: (label, Setup fields); memory.* as the recipe writes them
    # for a replica, the vocabulary tables on the GPUs for the rest (declarations/techniques.py).
    compared: tuple[tuple[str, dict[str, Any]], ...] = ()

    def describe(self, cpu_offload: bool, optimizer_offload: bool) -> str:
        """The words `describe_setup` adds on several GPUs: '', ' (FSDP)', ' (ZeRO-3, optimizer + weights on CPU)'."""
        if self.replicates:
            return ""
        if not self.deepspeed:
            return " (FSDP, CPU offload)" if cpu_offload else " (FSDP)"
        offload = [name for name, on in (("optimizer", optimizer_offload), ("weights", cpu_offload)) if on]
        return f" (ZeRO-{self.recipe['distributed.zero_stage']}{', ' + ' + '.join(offload) + ' on CPU' if offload else ''})"


DDP = Strategy(
    "ddp", {"distributed.strategy": "ddp"}, replicates=True, searched=True, compared=(("ddp", {"cpu_offload": False}),)
)
FSDP = Strategy(
    "fsdp",
    {"distributed.strategy": "fsdp"},
    partitions_weights=True,
    partitions_optimizer=True,
    wraps_layers=True,
    loads_whole_on_host=True,
    searched=True,
    compared=(
        ("fsdp", {"cpu_offload": False, "optimizer_offload": False}),
        ("fsdp cpu_offload", {"cpu_offload": True, "optimizer_offload": False}),
    ),
)
ZERO2 = Strategy(
    "zero2",
    {"distributed.strategy": "deepspeed", "distributed.zero_stage": 2},
    partitions_optimizer=True,
    deepspeed=True,
    compared=(
        ("deepspeed zero2", {"cpu_offload": False, "optimizer_offload": False}),
        ("deepspeed zero2 offload_optimizer=cpu", {"cpu_offload": False, "optimizer_offload": True}),
    ),
)
ZERO3 = Strategy(
    "zero3",
    {"distributed.strategy": "deepspeed", "distributed.zero_stage": 3},
    partitions_weights=True,
    partitions_optimizer=True,
    partitions_root=True,
    deepspeed=True,
    starts_whole_on_gpu=True,
    compared=(
        ("deepspeed zero3", {"cpu_offload": False, "optimizer_offload": False}),
        ("deepspeed zero3 offload_optimizer+params=cpu", {"cpu_offload": True, "optimizer_offload": True}),
    ),
)
STRATEGIES: dict[str, Strategy] = {s.name: s for s in (DDP, FSDP, ZERO2, ZERO3)}


def planned(name: str) -> Strategy:
    return STRATEGIES[name]


def of_recipe(cfg: Any) -> Strategy:
    """The strategy a recipe runs on several GPUs; auto plans as DDP (parallel/distribute.py's resolve_strategy
    picks FSDP at launch when a replica does not fit)."""
    d = cfg.distributed
    for s in STRATEGIES.values():
        if all(getattr(d, key.split(".", 1)[1]) == value for key, value in s.recipe.items()):
            return s
    return DDP
