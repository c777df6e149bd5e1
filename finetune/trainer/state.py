"""What a run counts, declared in one place: the live TrainState, and the TrainResult it ends with."""

from __future__ import annotations

import math
import signal
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from finetune.metrics import human_bytes, human_duration
from finetune.runs.evaluate import ExactMatch


@dataclass
class TrainState:
    """The state of a run between optimizer steps.

    The counters are what a checkpoint's trainer_state.json keeps, so a resumed run
    continues them; callbacks get this object (read it; set `should_stop` to end the
    run after the current step, as early stopping does).
    """

    total_steps: int = 0  # optimizer steps the run will take
    steps_per_epoch: int = 0
    window: int = 0  # examples (or packed rows) per optimizer step, over every process
    cut: dict[str, int] = field(default_factory=dict)  # how this launch cuts the window (order.Window.counters())
    choices: dict[str, str] = field(default_factory=dict)  # what the recipe's auto keys chose (runs/choices.py)
    is_main: bool = True  # rank 0: the process that writes files and prints
    step: int = 0  # optimizer steps completed
    tokens: int = 0  # non-padding tokens trained on, all processes
    trained_tokens: int = 0  # target tokens (those with a label)
    skipped_steps: int = 0  # non-finite steps whose update was skipped (train.on_nonfinite=skip)
    loss: float = math.nan  # the last step's loss (token mean over the whole window)
    loss_ema: float | None = None  # recent mean, for loss-spike warnings
    eval_loss: float | None = None  # the last eval loss
    stop_signal: str | None = None  # SIGTERM/SIGUSR1 received: checkpoint and stop at the next step boundary
    should_stop: bool = False  # a callback asks to end the run (finished normally) after this step
    earlier_s: float = 0.0  # time spent by earlier attempts of this run (resume)
    started_at: float = field(default_factory=time.perf_counter)

    @property
    def elapsed_s(self) -> float:
        """Seconds of training over every attempt of the run."""
        return self.earlier_s + time.perf_counter() - self.started_at

    def record_loss(self, loss: float, finite: bool, spike_factor: float) -> bool:
        """Fold a step's loss into the recent mean (finite steps only); whether it was a spike above it."""
        if not finite:
            return False
        # A spike is relative to a positive mean (an online objective's loss sits around 0 and changes sign).
        spike = self.loss_ema is not None and self.loss_ema > 0 and loss > spike_factor * self.loss_ema
        self.loss_ema = loss if self.loss_ema is None else 0.9 * self.loss_ema + 0.1 * loss
        return spike

    def counters(self) -> dict[str, Any]:
        """What a checkpoint keeps of this state (besides the step, which names it)."""
        return {
            "tokens": self.tokens,
            "trained_tokens": self.trained_tokens,
            "elapsed_s": self.elapsed_s,
            "total_steps": self.total_steps,
            "skipped_steps": self.skipped_steps,
            "loss_ema": self.loss_ema,  # a resumed run flags the spikes the uninterrupted one did
            **self.cut,
            "choices": self.choices,
        }

    def result(self, **parts: Any) -> TrainResult:
        """The run's outcome: what this state counted, and the parts the trainer made (paths, evals)."""
        return TrainResult(
            final_loss=self.loss,
            steps=self.step if self.should_stop else self.total_steps,
            tokens=self.tokens,
            trained_tokens=self.trained_tokens,
            elapsed_s=self.elapsed_s,
            eval_loss=self.eval_loss,
            **parts,
        )

    def restore(self, saved: dict[str, Any]) -> None:
        """Continue the counters of a checkpoint's trainer_state.json (empty: a fresh start)."""
        self.step = int(saved.get("step", 0))
        self.tokens = int(saved.get("tokens", 0))
        self.trained_tokens = int(saved.get("trained_tokens", 0))
        self.skipped_steps = int(saved.get("skipped_steps", 0))
        self.earlier_s = float(saved.get("elapsed_s", 0.0))
        self.loss_ema = saved.get("loss_ema", self.loss_ema)
        self.started_at = time.perf_counter()


STOP_SIGNALS = ("SIGTERM", "SIGUSR1")  # what Slurm (--signal) and Kubernetes send before killing


@dataclass
class StepTotals:
    """What one optimizer step's window added up to on this process (units: all processes)."""

    loss_sum: float  # summed loss here
    units: float  # what the loss is a mean over, on all processes: target tokens (sft) or pairs
    tokens: int  # tokens here
    trained_tokens: int  # target tokens here
    sums: dict[str, float] = field(default_factory=dict)  # the loss's own metrics (summed over its units), here


@contextmanager
def stop_signals(state: TrainState) -> Iterator[None]:
    """While training, SIGTERM/SIGUSR1 set state.stop_signal: the run checkpoints and stops at the
    next step boundary (instead of dying mid-step). The previous handlers come back after."""
    state.stop_signal = None
    previous: dict[int, Any] = {}
    if threading.current_thread() is threading.main_thread():  # handlers can only be set from there

        def request_stop(signum, frame):
            state.stop_signal = signal.Signals(signum).name

        for name in STOP_SIGNALS:
            sig = getattr(signal, name, None)
            if sig is not None:
                previous[sig] = signal.signal(sig, request_stop)
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


@dataclass
class TrainResult:
    final_loss: float
    steps: int
    tokens: int
    trained_tokens: int
    elapsed_s: float
    peak_memory_bytes: int
    output_dir: Path
    adapter_dir: Path
    metrics_path: Path
    exact_match_before: ExactMatch | None = None
    exact_match_after: ExactMatch | None = None
    preference_accuracy_before: float | None = None  # preference objectives: held-out pairs the model ranks right
    preference_accuracy_after: float | None = None
    reward_before: float | None = None  # grpo: the mean reward of greedy completions of held-out prompts
    reward_after: float | None = None
    eval_loss: float | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    def end_metrics(self) -> dict[str, Any]:
        """What Callback.on_train_end is given."""
        keys = ("final_loss", "eval_loss", "steps", "tokens", "trained_tokens", "elapsed_s")
        return {**{k: getattr(self, k) for k in keys}, "adapter_dir": str(self.adapter_dir)}

    def summary(self, memory_kind: str = "RSS") -> str:
        """The lines printed when a run ends."""
        lines = [
            "done.",
            f"  steps        {self.steps}",
            f"  final loss   {self.final_loss:.4f}"
            + (f"   eval loss {self.eval_loss:.4f}" if self.eval_loss is not None else ""),
            f"  tokens       {self.tokens:,} ({self.trained_tokens:,} trained)",
            f"  time         {human_duration(self.elapsed_s)}",
            f"  peak {memory_kind:<8}{human_bytes(self.peak_memory_bytes)}",
        ]
        if self.exact_match_before is not None or self.exact_match_after is not None:
            before = f"{100 * self.exact_match_before.accuracy:.1f}%" if self.exact_match_before else "-"
            after = f"{100 * self.exact_match_after.accuracy:.1f}%" if self.exact_match_after else "-"
            lines.append(f"  exact match  {before} -> {after}")
        if self.preference_accuracy_before is not None or self.preference_accuracy_after is not None:
            before, after = (
                f"{100 * a:.1f}%" if a is not None else "-"
                for a in (self.preference_accuracy_before, self.preference_accuracy_after)
            )
            lines.append(f"  preference   {before} -> {after} (held-out pairs ranked right)")
        if self.reward_before is not None or self.reward_after is not None:
            before, after = (f"{r:.3f}" if r is not None else "-" for r in (self.reward_before, self.reward_after))
            lines.append(f"  reward       {before} -> {after} (held-out prompts, greedy)")
        lines.append(f"  adapter      {self.adapter_dir}")
        lines.append(f"  metrics      {self.metrics_path}")
        if self.extra.get("plot"):
            lines.append(f"  loss curve   {self.extra['plot']}")
        return "\n".join(lines)
