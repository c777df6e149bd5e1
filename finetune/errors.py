"""Errors a user can act on.

Every error says what is wrong, what was found, and what to do. The CLI maps
FinetuneError (and subclasses) to exit code 2 and prints no traceback unless
--debug is given; anything else is a bug and keeps its traceback.
"""

from __future__ import annotations


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


class PlanError(FinetuneError):
    """A memory plan cannot be made (unreadable model config, unknown GPU), or nothing fits."""


class GpuError(PlanError):
    """An unknown GPU name or an unreadable memory size."""
