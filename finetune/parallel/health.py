"""The health check when a multi-process run starts: every rank says who it is and what it runs on.

    ranks = health.check(parallel, cfg)     # in Trainer.setup, after Parallel.choose; a collective

Each rank contributes a RankInfo (host, pid, the versions of the packages a run's numbers depend on, a
hash of the recipe, free device memory and available host RAM); all_gather_object hands every rank the
whole list, which also proves a collective completes within the process group's timeout before any
weight loads. Versions or recipes that differ from rank 0's stop the run on every rank, naming each
rank, its host, the field and both values: two nodes with another transformers train another model.
Rank 0 prints one line per rank (a summary for many ranks) of where memory is short.
"""

from __future__ import annotations

import hashlib
import json
import os
import socket
import statistics
from dataclasses import dataclass, field
from importlib import metadata
from typing import Any

from finetune.errors import RankMismatch
from finetune.hardware import device_free_bytes
from finetune.metrics import human_bytes

# The packages whose versions change what a step computes (or how it is stored), finetune's own last.
PACKAGES = ("torch", "transformers", "peft", "bitsandbytes", "accelerate", "finetune")
MISSING = "missing"
LINES_PER_RANK_UP_TO = 8  # more ranks than this: rank 0 prints a summary, not a line each
MISMATCHES_SHOWN = 20  # a mismatch on every rank of a large job would bury the hint


@dataclass(frozen=True)
class RankInfo:
    """One process of the run, as it reported itself at start-up."""

    rank: int
    host: str
    pid: int
    versions: dict[str, str] = field(default_factory=dict)
    recipe: str = ""  # sha256[:12] of the recipe as sorted JSON
    device_free: int | None = None  # bytes free on its device; None on a CPU
    host_free: int | None = None  # bytes of host RAM available (/proc/meminfo MemAvailable); None if unknown

    def where(self) -> str:
        return f"rank {self.rank} ({self.host})"


def installed_versions() -> dict[str, str]:
    """{package: version} of PACKAGES in this process's environment; "missing" where one is not installed."""
    found = {}
    for name in PACKAGES:
        try:
            found[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            found[name] = MISSING
    if found["finetune"] == MISSING:  # run from a source tree on PYTHONPATH: the package says its own
        from finetune import __version__

        found["finetune"] = __version__
    return found


def recipe_hash(cfg: Any) -> str:
    """sha256[:12] of the recipe as sorted JSON: equal on every rank launched with the same recipe and overrides."""
    text = json.dumps(cfg.to_dict(), sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:12]


def host_available_bytes(meminfo: str = "/proc/meminfo") -> int | None:
    """MemAvailable of /proc/meminfo in bytes; None where there is no such file (macOS) or line."""
    try:
        with open(meminfo) as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024  # the kernel writes kB
    except OSError:
        return None
    return None


def this_rank(parallel: Any, cfg: Any) -> RankInfo:
    """What this process reports of itself."""
    return RankInfo(
        rank=parallel.rank,
        host=socket.gethostname(),
        pid=os.getpid(),
        versions=installed_versions(),
        recipe=recipe_hash(cfg),
        device_free=device_free_bytes(parallel.device),
        host_free=host_available_bytes(),
    )


def check(parallel: Any, cfg: Any, say: Any = print) -> list[RankInfo]:
    """Every rank's RankInfo in rank order, on every rank (a collective over the default group when world > 1).
    Raises RankMismatch, on every rank, when a rank's versions or recipe differ from rank 0's."""
    mine = this_rank(parallel, cfg)
    if parallel.world == 1:
        return [mine]
    import torch.distributed as dist

    gathered: list[Any] = [None] * parallel.world
    dist.all_gather_object(gathered, mine)
    ranks: list[RankInfo] = sorted(gathered, key=lambda r: r.rank)
    problems = mismatches(ranks)
    if problems:
        raise mismatch_error(problems)
    if parallel.is_main:
        for line in memory_lines(ranks):
            say(line)
    return ranks


def mismatches(ranks: list[RankInfo]) -> list[str]:
    """Each field of each rank that differs from rank 0's, as 'rank 1 (host-b): transformers 5.23.0, rank 0 (host-a) has 5.24.0'."""
    first, found = ranks[0], []
    for info in ranks[1:]:
        for name in sorted(first.versions.keys() | info.versions.keys()):
            theirs, ours = info.versions.get(name, MISSING), first.versions.get(name, MISSING)
            if theirs != ours:
                found.append(f"{info.where()}: {name} {theirs}, {first.where()} has {ours}")
        if info.recipe != first.recipe:
            found.append(f"{info.where()}: recipe hash {info.recipe}, {first.where()} has {first.recipe}")
    return found


def mismatch_error(problems: list[str]) -> RankMismatch:
    shown = problems[:MISMATCHES_SHOWN]
    if len(problems) > len(shown):
        shown.append(f"... and {len(problems) - len(shown)} more")
    recipes = sum(": recipe hash " in p for p in problems)
    hints = []
    if recipes < len(problems):
        hints.append(f"install the same versions of {', '.join(PACKAGES)} on every node")
    if recipes:
        hints.append("launch every node with the same recipe file and the same key=value overrides")
    return RankMismatch(
        "the processes of this run differ from rank 0:\n" + "\n".join(f"  - {p}" for p in shown), "; ".join(hints)
    )


def memory_lines(ranks: list[RankInfo]) -> list[str]:
    """Rank 0's log of where each rank stands: a line per rank, or for many ranks the least on any rank."""

    def amount(n: int | None) -> str:
        return human_bytes(n) if n is not None else "n/a"

    if len(ranks) <= LINES_PER_RANK_UP_TO:
        return [
            f"health: {r.where()} pid {r.pid}: device free {amount(r.device_free)}, host RAM available {amount(r.host_free)}"
            for r in ranks
        ]
    hosts = len({r.host for r in ranks})
    line = f"health: {len(ranks)} ranks on {hosts} hosts agree on versions and recipe"
    for label, attr in (("device free", "device_free"), ("host RAM available", "host_free")):
        known = [r for r in ranks if getattr(r, attr) is not None]
        if known:
            low = min(known, key=lambda r: getattr(r, attr))
            middle = statistics.median(getattr(r, attr) for r in known)
            line += f"; {label}: least {amount(getattr(low, attr))} on {low.where()}, median {amount(middle)}"
    return [line]
