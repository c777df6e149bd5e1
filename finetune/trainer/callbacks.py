"""Callbacks: code of yours that runs at fixed points of a run.

    from finetune import Callback, Trainer

    class StopAtLoss(Callback):
        def on_step_end(self, state, metrics):
            if metrics["loss"] < 0.05:
                state.should_stop = True    # finish after this step: adapter saved as at the end

    Trainer(cfg, callbacks=[StopAtLoss()]).train()

Every hook gets the live TrainState and a dict of numbers. They run on every process
of a multi-process run (the same numbers on each); write files only where
`state.is_main`. A callback that raises stops the run with its error.

A hook gets a copy of the numbers: what it changes is not logged. A callback whose
`adds_metrics` is True gets the step's row itself in on_step_end: keys it adds go to
metrics.jsonl (on logged steps), the progress bar and the callbacks after it. The
recipe's own callbacks (MFU, the profiler: finetune/trainer/profiling.py) run first.
"""

from __future__ import annotations

from typing import Any

from finetune.trainer.state import TrainState

HOOKS = ("on_train_begin", "on_step_begin", "on_step_end", "on_eval", "on_save", "on_train_end", "on_train_exit")


class Callback:
    """Override the hooks you need; the others do nothing."""

    adds_metrics = False  # True: on_step_end gets the row that is logged, not a copy (see above)

    def on_train_begin(self, state: TrainState, metrics: dict[str, Any]) -> None:
        """Before the first step (after a resume: before the first resumed step). metrics: start_step, total_steps."""

    def on_step_begin(self, state: TrainState, metrics: dict[str, Any]) -> None:
        """Before every optimizer step, its gradients included. metrics: step (the one about to run, from 1)."""

    def on_step_end(self, state: TrainState, metrics: dict[str, Any]) -> None:
        """After every optimizer step, logged or not. metrics: step, loss, lr, grad_norm, tokens,
        trained_tokens, tokens_per_s, elapsed_s, tflops and mfu (when the model's FLOPs are known; see
        finetune/trainer/profiling.py), and skipped/spike when they happen."""

    def on_eval(self, state: TrainState, metrics: dict[str, Any]) -> None:
        """After an evaluation. metrics: step and eval_loss, or step, when ("before training" /
        "after training"), exact_match and contains_match."""

    def on_save(self, state: TrainState, metrics: dict[str, Any]) -> None:
        """After a checkpoint or the final adapter is complete on disk. metrics: step, path, kind
        ("checkpoint" or "adapter")."""

    def on_train_end(self, state: TrainState, metrics: dict[str, Any]) -> None:
        """When the run finished (not when it stopped on an error or a signal). metrics: final_loss,
        eval_loss, steps, tokens, trained_tokens, elapsed_s, adapter_dir."""

    def on_train_exit(self, state: TrainState, metrics: dict[str, Any]) -> None:
        """When the training loop is left however it ends (finished, preempted, an error): release what
        you hold. metrics: step (the last one completed)."""


class CallbackList:
    """Calls a hook on every callback, in the order given."""

    def __init__(self, callbacks: list[Callback] | None = None):
        self.callbacks = list(callbacks or [])
        for cb in self.callbacks:
            if not any(callable(getattr(cb, hook, None)) for hook in HOOKS):
                raise TypeError(f"{cb!r} is not a callback: it has none of {', '.join(HOOKS)}")

    def __call__(self, hook: str, state: TrainState, metrics: dict[str, Any]) -> None:
        for cb in self.callbacks:
            method = getattr(cb, hook, None)
            if method is not None:
                # A copy, unless the callback says it adds metrics: others cannot change what is logged.
                method(state, metrics if getattr(cb, "adds_metrics", False) else dict(metrics))
