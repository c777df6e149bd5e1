"""When a run checkpoints and on which thread: every checkpoint.every_steps steps, once checkpoint.every_minutes
minutes have passed since the last checkpoint (rank 0's clock, which every rank follows), at the last step and on a
stop signal. A LoRA run's periodic checkpoints are written in the background (runs/background.py: its adapter and
optimizer state are small, copied to host RAM in a moment); the last one, a preempted run's and a full fine-tune's
are written before the run goes on (a full model's copy would double its host RAM)."""

from __future__ import annotations

import time
from typing import Any

from finetune.errors import CheckpointError
from finetune.parallel.rank_state import RankState, rng_states
from finetune.runs.background import BackgroundWriter
from finetune.runs.checkpoint import checkpoint_dir, snapshot


class Saving:
    def __init__(self, cfg: Any) -> None:
        self.every_steps, self.every_minutes = cfg.checkpoint.every_steps, cfg.checkpoint.every_minutes
        self.background = cfg.lora is not None
        self.writer = BackgroundWriter()
        self.last = time.monotonic()  # the run's start, then each checkpoint's

    @property
    def periodic(self) -> bool:
        return bool(self.every_steps or self.every_minutes)

    def writes_behind(self, parallel: Any) -> bool:
        """Whether periodic checkpoints go to the writer thread. Split rooms (pipeline, tensor, context) write on the
        spot: a pp2 x tp2 checkpoint written in the background resumed to other losses in the suite
        (tests/e2e/test_tensor_parallel.py, twice, not reproduced alone)."""
        return self.background and not parallel.room.sums_own_gradients

    def due(self, trainer: Any, step: int) -> bool:
        """Whether `step` is checkpointed now (every rank calls: with every_minutes, a collective on rank 0's clock)."""
        on_step = bool(self.every_steps) and step % self.every_steps == 0
        if self.every_minutes:
            late = trainer.parallel.is_main and time.monotonic() - self.last >= 60 * self.every_minutes
            on_step = trainer.parallel.global_sum(1.0 if late else 0.0) > 0 or on_step
        return on_step

    def save(self, trainer: Any, step: int, background: bool = False) -> None:
        """Checkpoint after `step` completed optimizer steps (every rank calls: gathering states is a collective)."""
        parallel = trainer.parallel
        background = background and self.writes_behind(parallel)
        parallel.wait()
        optimizer = getattr(trainer.optimizer, "optimizer", trainer.optimizer)
        model_state, optimizer_state = parallel.full_states(trainer.model, optimizer)  # collectives: every rank
        rank_states = parallel.every_rank_state(trainer.loss_fn.state_dict())  # grpo: completions sampled ahead
        self.last = time.monotonic()
        if parallel.is_main:
            model = parallel.unwrap(trainer.model)
            args = (step, model, optimizer, trainer.scheduler, trainer.state.counters())
            if background:  # the generators as they are now, not as the write finds them
                rank_states = rank_states or [RankState(rng_states())]
                states = snapshot(model, optimizer, trainer.scheduler, model_state, optimizer_state)
                self.writer.submit(step, lambda: trainer.resume.save(*args, rank_states=rank_states, **states))
            else:
                self.wait(trainer)  # the checkpoints keep their order (keep_last prunes the oldest)
                trainer.resume.save(*args, model_state, optimizer_state, rank_states)
        if background:
            return  # said by poll() once written
        parallel.wait()
        self.report(trainer, [step])

    def poll(self, trainer: Any) -> None:
        """The background writes that ended since the last poll said; a failed one stops the run on every rank (rank 0
        with its error, the others saying so), not only on rank 0 while the others wait in the next collective."""
        try:
            done, failed = self.writer.finished(), None
        except Exception as err:  # noqa: BLE001 - raised below, on every rank
            done, failed = [], err
        parallel = trainer.parallel
        if self.periodic and parallel.world > 1 and self.writes_behind(parallel):  # the same answer on every rank
            if parallel.global_sum(1.0 if failed is not None else 0.0) > 0 and failed is None:  # a collective: every rank
                raise CheckpointError("rank 0's checkpoint written in the background failed; its error is in rank 0's output")
        if failed is not None:
            raise failed
        self.report(trainer, done)

    def wait(self, trainer: Any, raise_errors: bool = True) -> None:
        """The background write in flight ended (its on_save said)."""
        self.report(trainer, self.writer.wait(raise_errors))

    def report(self, trainer: Any, steps: list[int]) -> None:
        for step in steps:
            trainer.callbacks(
                "on_save", trainer.state, {"step": step, "path": str(checkpoint_dir(trainer.out, step)), "kind": "checkpoint"}
            )
