"""Checkpoints written off the training thread. The states are copied to host RAM on the training thread (the next
step changes the originals); one thread behind it writes the files, one checkpoint at a time. A write that fails is
raised on the training thread at the next check, and a write cut short by a crash leaves no checkpoint: the
directory takes its name only when complete (checkpoint.atomic_dir).

    writer = BackgroundWriter()
    writer.submit(step, lambda: save_checkpoint(...))   # returns at once; waits for the write before, if any
    for step in writer.finished(): ...                  # the writes done since (raises one that failed)
    writer.wait()                                       # before a process ends, or a checkpoint must exist now
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any


class BackgroundWriter:
    def __init__(self) -> None:
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._done: list[int] = []

    def submit(self, step: int, write: Callable[[], Any]) -> None:
        """Write step's checkpoint on the writer's thread (after the write in flight, if any, has ended)."""
        self.wait()

        def run() -> None:
            try:
                write()
                self._done.append(step)
            except BaseException as err:  # noqa: BLE001 - raised on the training thread by finished() or wait()
                self._error = err

        # Not a daemon: an interpreter that exits lets the write end (a killed one leaves no checkpoint, see above).
        self._thread = threading.Thread(target=run, name=f"checkpoint-step-{step}")
        self._thread.start()

    @property
    def busy(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def finished(self) -> list[int]:
        """The steps whose checkpoints were written since the last call; a failed write is raised here."""
        if self._thread is not None and not self._thread.is_alive():
            self._thread.join()
            self._thread = None
        return self._collect()

    def wait(self, raise_errors: bool = True) -> list[int]:
        """Wait for the write in flight; the steps written since the last call (a failed write raised, if asked)."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        return self._collect(raise_errors)

    def _collect(self, raise_errors: bool = True) -> list[int]:
        error, self._error = self._error, None
        if error is not None and raise_errors:
            raise error
        done, self._done = self._done, []
        return done
