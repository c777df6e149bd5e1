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

import atexit
import gc
import json
import os
import signal
import socket
import sys
import threading
import time
import weakref
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch

from finetune.config.schema import RecipeConfig
from finetune.errors import Preempted, TrainingError
from finetune.parallel.launch import mark_exit
from finetune.parallel.runtime import SETUP_TIMEOUT_S
from finetune.runs.checkpoint import checkpoint_dir
from finetune.runs.resume import OOM_BACKOFF
from finetune.trainer.order import Window

GRACE_S = 20  # the watchdog's margin over distributed.timeout_s: a collective's own timeout should speak first
PEERS_GRACE_S = 5  # how long a rank that leaves lets this host's other ranks end on their own before it stops them

# How a collective says its peer is gone: gloo (plain RuntimeErrors), NCCL's watchdog (DistBackendError).
_PEER_GONE = (
    "Timed out waiting",  # gloo
    "Connection closed by peer",
    "Connection reset by peer",
    "Broken pipe",
    "Watchdog caught collective operation timeout",  # NCCL
    "NCCL communicator was aborted",
)


class PeerLost(Preempted):
    """Another rank stopped answering inside a collective (a hang, a lost node or network): this rank left
    with the restartable exit code; resume=auto continues from the last complete checkpoint."""

    label = "restartable"


class OutOfMemoryRestart(Preempted):
    """Out of memory inside a step of several processes: the others are inside the step's collectives, so
    it cannot be redone in place; the job leaves restartable and resumes with half the micro-batch."""

    label = "restartable"


def back_off(failed: BaseException, split: Window, cfg: RecipeConfig, step: int) -> Window:
    """The window in half as large micro-batches after an out-of-memory in step `step` (train.oom_backoff),
    or a TrainingError saying why there is none; `failed` raised again where no out-of-memory is behind it."""
    err = out_of_memory(failed)
    if err is None:
        raise failed
    smaller = split.halved()
    fixed = smaller.resume_problem(cfg) if smaller else None  # DeepSpeed's come from the recipe; a pipeline schedule's rules
    if cfg.train.oom_backoff and smaller is not None and not fixed:
        return smaller
    why = "train.oom_backoff is off" if smaller else "the micro-batch is one example already"
    why = f"half the micro-batch cannot run: {fixed}" if fixed and cfg.train.oom_backoff else why
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


def _causes(err: BaseException | None) -> Iterator[BaseException]:
    """`err` and the errors behind it (a pipeline stage re-raises its forward's errors as RuntimeErrors), each once
    (`raise e from e` makes a cycle)."""
    seen: set[int] = set()
    while err is not None and id(err) not in seen:
        seen.add(id(err))
        yield err
        err = err.__cause__


def out_of_memory(err: BaseException | None) -> torch.OutOfMemoryError | None:
    """The out-of-memory error behind `err`, or None."""
    return next((e for e in _causes(err) if isinstance(e, torch.OutOfMemoryError)), None)


def window_gradients(trainer: Any) -> tuple[Any, int]:
    """trainer.accumulate_gradients of the current step, and how often the step was retried: after an
    out-of-memory inside it, the same step again in half as large micro-batches (train.oom_backoff)."""
    state, order, retry = trainer.state, trainer.order, 0
    while True:
        try:
            return trainer.accumulate_gradients(state.step), retry
        except Exception as err:  # an out-of-memory, or what re-raised one (back_off raises anything else again)
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


def set_timeouts(seconds: float) -> None:
    """Every process group's collectives (the default one, and those a layout made) wait at most `seconds`."""
    from torch.distributed import distributed_c10d as c10d

    for group in list(c10d._world.pg_map):
        try:
            c10d._set_pg_timeout(timedelta(seconds=seconds), group)
        except (ValueError, RuntimeError, AssertionError):  # a group of ranks this one is not in
            continue


def close_at_exit(trainer: Any) -> None:
    """A Trainer never closed (`Trainer(cfg).train()` under torchrun) would leave its process group to the
    interpreter's teardown, where a rank can abort after a good run ("terminate called without an active
    exception", SIGABRT; seen in CI under a pipeline): close it at exit, while the interpreter is whole."""
    ref = weakref.ref(trainer)  # a Trainer let go earlier is not kept alive for this

    def close() -> None:
        alive = ref()
        if alive is not None:
            alive.close()

    atexit.register(close)


def free_memory() -> None:
    """What a failed step held goes back to the allocator (and CUDA's cache to the driver)."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def lost_peer(err: BaseException | None, world: int) -> bool:
    """Whether `err` (or an error behind it: a pipeline stage re-raises its forward's errors as RuntimeErrors) is a
    collective that failed because another rank is gone or silent."""
    if world <= 1:
        return False
    gone = tuple(getattr(torch.distributed, n) for n in ("DistNetworkError", "DistStoreError") if hasattr(torch.distributed, n))
    # A backend error is a lost peer only when it says so (a timeout, an abort): not NCCL's invalid usage (a bug).
    return any(
        isinstance(e, gone) or (isinstance(e, RuntimeError) and any(s in str(e) for s in _PEER_GONE)) for e in _causes(err)
    )


def leave_if_peer_lost(err: BaseException, peers: Sequence[Any], parallel: Any) -> None:
    """Raise PeerLost (exit 75) when `err` is a collective whose peer is gone, after leave()."""
    if lost_peer(err, parallel.world):
        leave(peers, f"rank {parallel.rank}: a collective failed: {str(err)[:300]}")
        raise PeerLost(
            f"rank {parallel.rank}: {str(err)[:300]}", hint="resume=auto continues from the last complete checkpoint"
        ) from err


def leave(peers: Sequence[Any], reason: str) -> None:
    """Leave the job restartable: say why, mark the exit for `finetune run --nproc`'s launcher, and stop this
    host's other ranks that have not ended within PEERS_GRACE_S (a frozen one would hold its launcher for
    the whole shutdown grace); a rank ending on an error of its own has the time to say so first."""
    print(
        f"error: {reason}; exiting 75 (restartable): resume=auto continues from the last complete checkpoint",
        file=sys.stderr,
        flush=True,
    )
    mark_exit(Preempted.exit_code)
    here, launcher = socket.gethostname(), os.getppid()
    mine = [p.pid for p in peers if getattr(p, "host", None) == here and p.pid != os.getpid() and _parent(p.pid) == launcher]
    deadline = time.monotonic() + PEERS_GRACE_S
    while mine and time.monotonic() < deadline:
        time.sleep(0.2)
        mine = [pid for pid in mine if _parent(pid) == launcher]
    for pid in mine:
        try:
            os.kill(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


def _parent(pid: int) -> int | None:
    """The parent of a live process (None once it ended): a peer shares this rank's launcher (torchrun's
    agent), never a process of another container that happens to have the same pid."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat.rsplit(")", 1)[1].split()
    return None if fields[0] == "Z" else int(fields[1])  # a zombie has ended: nothing to stop


class Watchdog:
    """A host thread that ends this process with exit 75 when no step ends for timeout_s + GRACE_S (or 3 x
    the longest step so far, + GRACE_S): the hang no collective timeout sees (a host-side loop, a stuck
    read, a driver call)."""

    def __init__(self, timeout_s: float, peers: Sequence[Any] = (), world: int = 2):
        """peers: the ranks (health.RankInfo: host, pid) to stop on the way out; world 1: no watch."""
        self.limit, self.peers, self.world, self.timeout_s = timeout_s + GRACE_S, peers, world, timeout_s
        self._last = time.monotonic()
        self._paused = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="finetune-watchdog", daemon=True)

    def __enter__(self) -> Watchdog:
        if self.world > 1:  # one process waits for nobody: its long steps (long context) are not hangs
            set_timeouts(self.timeout_s)
            self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self.world > 1 and not exc[0]:  # the final eval, save and exact match: setup's patience again
            set_timeouts(max(SETUP_TIMEOUT_S, self.timeout_s))

    def beat(self) -> None:
        """A step ended: the limit grows with the longest step seen."""
        now = time.monotonic()
        self.limit = max(self.limit, 3 * (now - self._last) + GRACE_S)
        self._last = now

    @contextmanager
    def paused(self) -> Iterator[None]:
        """After a step (which it counts): work bounded by collectives of its own (an eval, a checkpoint)."""
        self.beat()
        self._paused += 1
        try:
            yield
        finally:
            self._paused -= 1
            self._last = time.monotonic()  # the next step starts now

    def _watch(self) -> None:
        while not self._stop.wait(min(5.0, self.limit / 4)):
            idle = time.monotonic() - self._last
            if not self._paused and idle > self.limit:
                leave(
                    self.peers,
                    f"no training step ended for {idle:.0f} s (distributed.timeout_s + {GRACE_S} s, or 3 x the "
                    "longest step so far); if steps are this long, raise distributed.timeout_s",
                )
                os._exit(Preempted.exit_code)
