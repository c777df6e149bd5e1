"""What a run survives without losing a step: out of memory inside a step, a rank that stops
answering (a hang, a lost node), and the host-side hang no collective would notice.

    totals, retried = window_gradients(trainer)      # out of memory: the same step in half the micro-batch
    with Watchdog(cfg.distributed.timeout_s, peers, world) as dog:   # exit 75 when no step ends in time
        ...                                          # each step's end beats; dog.paused() around evals and saves
    leave_if_peer_lost(err, peers, parallel)         # a collective failed: exit 75, restartable

Exit 75 (errors.Preempted's code) tells torchrun --max-restarts, Slurm and Kubernetes to start the
job again; resume=auto then continues from the last complete checkpoint (checkpoints are written
whole or not at all, runs/checkpoint.py), with the run's window (trainer/order.py).
"""

from __future__ import annotations

import gc
import json
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from finetune.config.schema import RecipeConfig
from finetune.errors import Preempted, TrainingError
from finetune.parallel.launch import EXIT_DIR
from finetune.runs.checkpoint import checkpoint_dir
from finetune.runs.resume import OOM_BACKOFF
from finetune.trainer.order import Window

GRACE_S = 20  # the watchdog's margin over distributed.timeout_s: a collective's own timeout should speak first

# How gloo says a peer is gone (plain RuntimeErrors); NCCL's watchdog and c10d raise torch.distributed.DistError.
_PEER_GONE = ("Timed out waiting", "Connection closed by peer", "Connection reset by peer", "Broken pipe")


class PeerLost(Preempted):
    """Another rank stopped answering inside a collective (a hang, a lost node or network): this rank left
    with the restartable exit code; resume=auto continues from the last complete checkpoint."""

    label = "restartable"


class OutOfMemoryRestart(Preempted):
    """Out of memory inside a step of several processes: the others are inside the step's collectives, so
    it cannot be redone in place; the job leaves restartable and resumes with half the micro-batch."""

    label = "restartable"


def back_off(err: BaseException, split: Window, cfg: RecipeConfig, step: int) -> Window:
    """The window in half as large micro-batches after an out-of-memory in step `step` (train.oom_backoff),
    or a TrainingError saying why there is none."""
    smaller = split.halved()
    if cfg.train.oom_backoff and smaller is not None:
        return smaller
    why = "train.oom_backoff is off" if smaller else "the micro-batch is one example already"
    fix = f"train.batch_size={smaller.micro_batch} train.grad_accum={smaller.accum}" if smaller else "a memory mode"
    raise TrainingError(
        f"out of memory in step {step} at micro-batch {split.micro_batch} ({why}): {str(err).splitlines()[0][:200]}",
        hint=f"rerun with resume=auto and {fix} (the same examples per step), or see `finetune plan RECIPE --fit`",
    ) from err


def restart_smaller(trainer: Any, split: Window, step: int) -> None:
    """Several processes: note the smaller micro-batch in output_dir (resume=auto reads it: runs/resume.py),
    and leave restartable. The step is retried after the restart, from the last complete checkpoint."""
    rank, was = trainer.parallel.rank, trainer.order.split.micro_batch
    note = {"micro_batch": split.micro_batch, "step": step, "rank": rank}
    tmp = trainer.out / f".{OOM_BACKOFF}.rank{rank}"
    tmp.write_text(json.dumps(note), encoding="utf-8")
    tmp.replace(trainer.out / OOM_BACKOFF)  # whole or absent, as checkpoints
    reason = f"rank {rank}: out of memory in step {step} at micro-batch {was}; the restart uses micro-batch {split.micro_batch}"
    leave(trainer.ranks, reason)
    raise OutOfMemoryRestart(reason, hint="resume=auto (torchrun --max-restarts, Slurm, Kubernetes) continues with it")


def window_gradients(trainer: Any) -> tuple[Any, int]:
    """trainer.accumulate_gradients of the current step, and how often the step was retried: after an
    out-of-memory inside it, the same step again in half as large micro-batches (train.oom_backoff)."""
    state, order, retry = trainer.state, trainer.order, 0
    while True:
        try:
            return trainer.accumulate_gradients(state.step), retry
        except torch.OutOfMemoryError as err:
            split = back_off(err, order.split, trainer.cfg, state.step + 1)
            if trainer.parallel.world > 1:
                restart_smaller(trainer, split, state.step + 1)
        # Out of the except clause: the failed forward's frames (and tensors) went with its traceback.
        retry += 1
        trainer.optimizer.zero_grad(set_to_none=True)
        free_memory()
        was, state.cut = order.split, split.counters()
        order.use(split)
        trainer.say(
            f"step {state.step + 1}: out of memory at micro-batch {was.micro_batch}; retrying it as "
            f"{split.describe()} (the same {split.size} {trainer.unit} per step, train.oom_backoff)"
        )


def after_nonfinite(trainer: Any, row: dict[str, Any], progress: Any) -> None:
    """A non-finite loss or gradient (its update was skipped): stop with a checkpoint of the last good
    state, or with train.on_nonfinite=skip go on, saying so."""
    done, parallel = trainer.state.step, trainer.parallel
    where = f"step {done}: loss {row['loss']}, grad_norm {row['grad_norm']}"
    if trainer.cfg.train.on_nonfinite == "stop":
        if not parallel.updates_in_backward:  # the weights are still the last good step's: keep them
            trainer.save_checkpoint(done - 1)
        raise TrainingError(
            f"non-finite {where}; {parallel.after_nonfinite(checkpoint_dir(trainer.out, done - 1))}",
            hint="lower train.lr, keep train.max_grad_norm set, check this step's data, "
            "or set train.on_nonfinite=skip; resume=auto continues from the checkpoint",
        )
    progress.write(f"{where}: non-finite, {parallel.after_nonfinite(None)} ({trainer.state.skipped_steps} so far)")


def free_memory() -> None:
    """What a failed step held goes back to the allocator (and CUDA's cache to the driver)."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def lost_peer(err: BaseException, world: int) -> bool:
    """Whether `err` is a collective that failed because another rank is gone or silent."""
    if world <= 1:
        return False
    dist_error = getattr(torch.distributed, "DistError", ())
    return isinstance(err, dist_error) or (isinstance(err, RuntimeError) and any(s in str(err) for s in _PEER_GONE))


def leave_if_peer_lost(err: BaseException, peers: Sequence[Any], parallel: Any) -> None:
    """Raise PeerLost (exit 75) when `err` is a collective whose peer is gone, after leave()."""
    if lost_peer(err, parallel.world):
        leave(peers, f"rank {parallel.rank}: a collective failed: {str(err)[:300]}")
        raise PeerLost(
            f"rank {parallel.rank}: {str(err)[:300]}", hint="resume=auto continues from the last complete checkpoint"
        ) from err


def leave(peers: Sequence[Any], reason: str) -> None:
    """Leave the job restartable: say why, stop this host's other ranks (a frozen one would hold its
    launcher for the whole shutdown grace), and mark the exit for `finetune run --nproc`'s launcher."""
    print(
        f"error: {reason}; exiting 75 (restartable): resume=auto continues from the last complete checkpoint",
        file=sys.stderr,
        flush=True,
    )
    mark_restartable()
    here, me = socket.gethostname(), os.getpid()
    for peer in peers:
        if getattr(peer, "host", None) == here and getattr(peer, "pid", me) != me:
            try:
                os.kill(peer.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass


def mark_restartable() -> None:
    """Tell the launcher of `finetune run --nproc` this worker left with exit 75 (torchrun says only 'failed')."""
    folder = os.environ.get(EXIT_DIR)
    if folder:
        Path(folder, f"rank{os.environ.get('RANK', '0')}").write_text(str(Preempted.exit_code))


class Watchdog:
    """A host thread that ends this process with exit 75 when no step ends for timeout_s + GRACE_S:
    the hang no collective timeout sees (a host-side loop, a stuck read, a driver call)."""

    def __init__(self, timeout_s: float, peers: Sequence[Any] = (), world: int = 2):
        """peers: the ranks (health.RankInfo: host, pid) to stop on the way out; world 1: no watch."""
        self.limit, self.peers, self.world = timeout_s + GRACE_S, peers, world
        self._last = time.monotonic()
        self._paused = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="finetune-watchdog", daemon=True)

    def __enter__(self) -> Watchdog:
        if self.world > 1:  # one process waits for nobody: its long steps (long context) are not hangs
            self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()

    def beat(self) -> None:
        self._last = time.monotonic()

    @contextmanager
    def paused(self) -> Iterator[None]:
        """Work bounded by collectives of its own (an eval, a checkpoint) is not a step."""
        self._paused += 1
        try:
            yield
        finally:
            self._paused -= 1
            self.beat()

    def _watch(self) -> None:
        while not self._stop.wait(min(5.0, self.limit / 4)):
            idle = time.monotonic() - self._last
            if not self._paused and idle > self.limit:
                leave(self.peers, f"no training step ended for {idle:.0f} s (distributed.timeout_s + {GRACE_S} s)")
                os._exit(Preempted.exit_code)
