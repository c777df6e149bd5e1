"""Errors a user can act on.

Every error says what is wrong, what was found, and what to do. The CLI maps
FinetuneError (and subclasses) to exit code 2 and prints no traceback unless
--debug is given; anything else is a bug and keeps its traceback.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

T = TypeVar("T")


@dataclass(frozen=True)
class Rule(Generic[T]):
    """One thing that cannot run with another: the one shape of every cross-field rule (adapter
    methods, memory techniques, objectives, ZeRO, gradient compression). `conflicts(x)` says whether
    `x` (a recipe, or the settings a rule table reads) has it; `says` is the message naming the keys
    and the fix: a str.format template of the fields the caller gives, or a function of `x`."""

    conflicts: Callable[[T], bool]
    says: str | Callable[[T], str] = ""

    def message(self, x: T, **fields: Any) -> str:
        return self.says(x) if callable(self.says) else self.says.format(**fields)

    def check(self, x: T, **fields: Any) -> str | None:
        return self.message(x, **fields) if self.conflicts(x) else None


def broken(rules: Iterable[Rule[T]], x: T, **fields: Any) -> list[str]:
    """The message of every rule `x` breaks, in the rules' order."""
    return [m for m in (rule.check(x, **fields) for rule in rules) if m is not None]


def exception_line(exc: BaseException) -> str:
    """'Type: first line of its message': what a note or problem quotes of an exception it caught."""
    return f"{type(exc).__name__}: {(str(exc).splitlines() or [''])[0]}"


class FinetuneError(Exception):
    """Base class: a problem with the user's input or environment, with a hint."""

    def __init__(self, message: str, hint: str | None = None):
        self.message = message
        self.hint = hint
        super().__init__(self.__str__())

    def __str__(self) -> str:
        return f"{self.message}\n  hint: {self.hint}" if self.hint else self.message


class ConfigError(FinetuneError):
    """One or more problems in a recipe. `problems` lists all of them."""

    def __init__(self, problems: list[str], source: str | None = None):
        self.problems = list(problems)
        self.source = source
        where = f" in {source}" if source else ""
        n = len(self.problems)
        head = f"{n} problem{'s' if n != 1 else ''}{where}:"
        body = "\n".join(f"  - {p}" for p in self.problems)
        super().__init__(f"{head}\n{body}")

    def __str__(self) -> str:
        return self.message


class DataError(FinetuneError):
    """The dataset cannot be read or does not match the declared format."""


class ModelError(FinetuneError):
    """The base model or tokenizer cannot be loaded or wrapped."""


class HardwareError(FinetuneError):
    """The requested precision/device is not available on this machine."""


class OutputDirError(FinetuneError):
    """output_dir holds another run, or cannot be written."""


class CheckpointError(FinetuneError):
    """A checkpoint is missing, incomplete or corrupt."""


class ResumeMismatch(CheckpointError):
    """The checkpoint belongs to a run with another recipe or other data."""


class TrainingError(FinetuneError):
    """Training cannot continue meaningfully (e.g. the loss became NaN/inf)."""


class RewardError(TrainingError):
    """A reward of train.objective=grpo failed: it raised, returned no finite number, or a record lacks its column."""


class RunDirError(FinetuneError):
    """A directory given as a finished run (or an export of one) lacks what that needs."""


class ExportError(FinetuneError):
    """An export cannot be written: bad destination, dtype, or an adapter/base it cannot merge."""


class MergeCheckFailed(ExportError):
    """The merged model's logits differ from base + adapter beyond the tolerance of the export dtype."""


class ReportError(FinetuneError):
    """A reporting sink (TensorBoard, Weights & Biases) was asked for but cannot start."""


class Preempted(FinetuneError):
    """SIGTERM/SIGUSR1 arrived: a checkpoint was saved and the run stopped cleanly.

    The CLI exits with EXIT_PREEMPTED so a scheduler (Slurm, Kubernetes) can tell
    "requeue me and resume=auto" apart from success and from failure.
    """

    exit_code = 75  # EX_TEMPFAIL: temporary failure, try again
    label = "preempted"  # what the CLI's last line starts with


class PlanError(FinetuneError):
    """A memory plan cannot be made (unreadable model config, unknown GPU), or nothing fits."""


class GpuError(PlanError):
    """An unknown GPU name or an unreadable memory size."""


class RankMismatch(FinetuneError):
    """The processes of a multi-process run differ: package versions or the recipe (parallel/health.py)."""
