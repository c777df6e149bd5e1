"""Watching a run's speed: a rank slower than the rest, and throughput that falls.

StragglerWatch (world > 1) replaces each rank's compute_s and step_s in a step's row (this rank's own work in
the step, and its wall time) with every rank's spread, gathered in a collective:
    compute_s_min, compute_s_median, compute_s_max, compute_s_max_rank
    wait_s_min, wait_s_median, wait_s_max, wait_s_max_rank      (wait: step_s - compute_s, time in collectives)
A rank whose compute exceeds distributed.straggler_ratio x the other ranks' median for distributed.straggler_steps
steps running is named once (with its host, from the health check) and its rank logged as straggler_rank
while it stays so: every step waits for the slowest rank.

ThroughputAlert warns once per episode when the step's MFU (tokens/s where MFU is unknown) stays below
report.alert_below x its running median for report.alert_steps steps running, and logs throughput_alert.
"""

from __future__ import annotations

import statistics
from collections import deque
from typing import Any

from finetune.trainer.callbacks import Callback
from finetune.trainer.profiling import _say
from finetune.trainer.state import TrainState

HISTORY_STEPS = 100  # the running median's window (see ThroughputAlert)
LABELS = {"mfu": "MFU", "tokens_per_s": "tokens/s"}


class StragglerWatch(Callback):
    """Every rank's compute and wait time per step, and a warning naming a straggler (see the module's docstring)."""

    adds_metrics = True

    def __init__(self, trainer: Any) -> None:
        self.trainer = trainer
        self.streaks: list[int] = []  # per rank: steps running above straggler_ratio x the median

    def on_train_begin(self, state: TrainState, metrics: dict[str, Any]) -> None:
        self.streaks = [0] * self.trainer.parallel.world

    def on_step_end(self, state: TrainState, metrics: dict[str, Any]) -> None:
        parallel = self.trainer.parallel
        if parallel.world == 1:  # nobody to wait for: the step's time alone
            metrics.pop("compute_s", None)
            return
        if "compute_s" not in metrics or "step_s" not in metrics:
            return
        every = parallel.every_rank(metrics.pop("compute_s"), metrics.pop("step_s"))  # a collective: every rank gets here
        computes = [c for c, _ in every]
        waits = [max(0.0, s - c) for c, s in every]  # clocks read apart can put compute a hair past the step
        for name, values in (("compute_s", computes), ("wait_s", waits)):
            metrics[f"{name}_min"] = round(min(values), 6)
            metrics[f"{name}_median"] = round(statistics.median(values), 6)
            metrics[f"{name}_max"] = round(max(values), 6)
            metrics[f"{name}_max_rank"] = values.index(max(values))
        slow = self.stragglers(computes, metrics["step"])
        if slow:
            metrics["straggler_rank"] = max(slow, key=lambda r: computes[r])

    def stragglers(self, computes: list[float], step: int) -> list[int]:
        """The ranks above the ratio for straggler_steps steps running, this step included; warns as each gets there."""
        dist = self.trainer.cfg.distributed
        if len(self.streaks) != len(computes):  # on_train_begin was not called (a callback list built by hand)
            self.streaks = [0] * len(computes)
        for rank, compute in enumerate(computes):
            # Against the others' median: with two ranks a median of all would include the straggler itself.
            median = statistics.median(computes[:rank] + computes[rank + 1 :])
            self.streaks[rank] = self.streaks[rank] + 1 if compute > dist.straggler_ratio * median else 0
            if self.streaks[rank] == dist.straggler_steps:  # once per streak: it must break before it warns again
                _say(
                    self.trainer,
                    f"warning: step {step}: {self.where(rank)} is a straggler: {compute:.2f} s of compute per step vs "
                    f"the others' median {median:.2f} s for {dist.straggler_steps} steps running "
                    f"(distributed.straggler_ratio {dist.straggler_ratio}); every step waits for it",
                )
        return [r for r, n in enumerate(self.streaks) if n >= dist.straggler_steps]

    def where(self, rank: int) -> str:
        ranks = getattr(self.trainer, "ranks", None)  # the health check's RankInfo list, when the loop kept it
        return f"rank {rank} ({ranks[rank].host})" if ranks and rank < len(ranks) else f"rank {rank}"


class ThroughputAlert(Callback):
    """A warning, and throughput_alert in the row, when the step's speed stays below report.alert_below x its
    running median for report.alert_steps steps running.

    The row's tokens_per_s and mfu average over the launch so far, which a slowdown late in a run barely moves; the
    alert reads each step's own rate, recovered from two consecutive averages: the launch's seconds so far are its
    tokens / tokens_per_s, and a rate x seconds is the work done, so the step's rate is the work it added over the
    seconds it added. The same on every rank (the tokens are global, the clocks nearly so): no collective."""

    adds_metrics = True

    def __init__(self, trainer: Any) -> None:
        self.trainer = trainer
        # A window, not the whole run: a slowdown that lasts half of it becomes the new normal and the alert ends;
        # and steps below the threshold move a median of 100 by one place each, so they do not hide themselves.
        self.history: deque[float] = deque(maxlen=HISTORY_STEPS)
        self.low = 0  # steps running below the threshold
        self.tokens = 0.0  # this launch's tokens so far (the averages are over this launch)
        self.before: dict[str, tuple[float, float]] = {}  # metric -> (seconds, its average) when last seen

    def on_train_begin(self, state: TrainState, metrics: dict[str, Any]) -> None:
        self.history.clear()
        self.low, self.tokens, self.before = 0, 0.0, {}

    def on_step_end(self, state: TrainState, metrics: dict[str, Any]) -> None:
        name = "mfu" if metrics.get("mfu") is not None else "tokens_per_s"
        value = self.step_rate(metrics, name)
        if value is None:
            return
        report = self.trainer.cfg.report
        if report.alert_below is not None and self.history:
            median = statistics.median(self.history)
            self.low = self.low + 1 if value < report.alert_below * median else 0
            if self.low >= report.alert_steps:
                metrics["throughput_alert"] = True
            if self.low == report.alert_steps:  # once per episode: it must recover before it warns again
                _say(
                    self.trainer,
                    f"warning: step {metrics['step']}: {LABELS[name]} {shown(name, value)} per step vs its running median "
                    f"{shown(name, median)}, below report.alert_below {report.alert_below} x the median for "
                    f"{report.alert_steps} steps running",
                )
        self.history.append(value)

    def step_rate(self, metrics: dict[str, Any], name: str) -> float | None:
        """This step's own `name` from the launch's averages before and after it; None for the launch's first step
        (warm-up: kernel selection, allocator growth) or when no time was counted."""
        self.tokens += metrics.get("tokens") or 0
        average = metrics.get(name)
        if average is None or not metrics.get("tokens_per_s"):
            return None
        seconds = self.tokens / metrics["tokens_per_s"]
        before = self.before.get(name)
        self.before[name] = (seconds, float(average))
        if before is None or seconds <= before[0]:
            return None
        return (average * seconds - before[1] * before[0]) / (seconds - before[0])


def shown(name: str, value: float) -> str:
    return f"{value:.1%}" if name == "mfu" else f"{value:,.0f}"
