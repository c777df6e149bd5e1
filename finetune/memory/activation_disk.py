"""memory.activation_offload=disk: each checkpointed layer's input waits in a file (an NVMe disk) instead of host RAM.

    files = ParkingFiles(directory)        # this process's own folder, removed at exit
    files.wait_for_room()                  # before the host block is made: at most WRITES_IN_FLIGHT wait for the disk
    slot = files.put(host, copied)         # written by a thread once the device->host copy (event) is done
    slot.read_ahead()                      # a thread reads it back into host RAM while another layer recomputes
    host = slot.take()                     # the bytes as they were parked (waits for the read); the file removed

At a million tokens a row the checkpointed inputs of a 32-layer 8B model are ~86 GB a sequence: more than the host
RAM of most machines with two consumer cards, and a disk writes and reads them faster than the layers that made them
run (a layer of 165k tokens computes for seconds; its 1.35 GB input takes ~0.5 s of an NVMe disk). Host RAM holds
only the blocks in flight. The bytes on disk are raw (this process wrote them and reads them back within one step:
no format, nothing to trust).
"""

from __future__ import annotations

import atexit
import itertools
import os
import shutil
import tempfile
import threading
import weakref
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import torch

from finetune.errors import TrainingError

WRITES_IN_FLIGHT = 2  # host blocks waiting for the disk at most: a forward faster than the disk waits for it


def default_root() -> Path:
    """Where parked files go without memory.offload_dir: the cache folder base_weights=disk uses too."""
    return Path(os.environ.get("FINETUNE_CACHE", Path.home() / ".cache" / "finetune")) / "offload"


class ParkingFiles:
    """A process's folder of parked inputs, and the one thread that writes and reads them in order (one disk)."""

    def __init__(self, directory: str | os.PathLike[str] | None = None, pinned: bool = False):
        root = Path(directory) if directory else default_root()
        try:
            root.mkdir(parents=True, exist_ok=True)
            self.folder = Path(tempfile.mkdtemp(prefix="activations-", dir=root))
        except OSError as e:
            raise TrainingError(
                f"memory.activation_offload=disk: cannot make a folder for the checkpointed inputs in {root}: {e}",
                hint="set memory.offload_dir to a writable folder on an NVMe disk",
            ) from e
        atexit.register(self.discard)  # a crash must not leave tens of GB behind
        self.pinned = pinned  # read back into pinned host RAM (a CUDA device: the copy to it is then asynchronous)
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="finetune-parking")
        self._room = threading.BoundedSemaphore(WRITES_IN_FLIGHT)  # released as each write ends
        self._closed = False
        self._names = itertools.count()
        self.written_bytes = 0  # bytes parked on disk so far (the tests and the plan's disk figure)

    def discard(self) -> None:
        """Delete the folder and whatever is still in it (idempotent; nothing is parked after)."""
        self._closed = True
        self._pool.shutdown(wait=True, cancel_futures=True)
        shutil.rmtree(self.folder, ignore_errors=True)
        atexit.unregister(self.discard)

    def wait_for_room(self) -> None:
        """Wait while WRITES_IN_FLIGHT host blocks wait for the disk (call before making the next one: host RAM stays
        bounded, the forward waits for a slower disk)."""
        if self._closed:
            raise RuntimeError("memory.activation_offload=disk: this process's parking folder was discarded")
        self._room.acquire()

    def put(self, host: torch.Tensor, copied: torch.cuda.Event | None) -> ParkedFile:
        """`host` written to a file of its own once `copied` (the device->host copy filling it) is done; its host
        RAM is free once written (wait_for_room() first)."""
        slot = ParkedFile(self, self.folder / f"{next(self._names)}.bin", host.shape, host.dtype)
        self.written_bytes += host.numel() * host.element_size()
        slot.write = self._pool.submit(_write, slot.path, host, copied, self._room)
        # A slot whose backward never comes (a forward retried after running out of memory) takes its file with it
        # once written. A callback on the write, not a task: a finalizer may run inside the pool's own locks (GC).
        weakref.finalize(slot, _forget, slot.write, slot.path).atexit = False
        return slot

    def read(self, slot: ParkedFile) -> Future[torch.Tensor]:
        return self._pool.submit(_read, slot, self.pinned)


class ParkedFile:
    """One parked tensor: its file, and the thread's write and read of it."""

    __slots__ = ("files", "path", "shape", "dtype", "write", "reading", "__weakref__")  # weakref: its file's finalizer

    def __init__(self, files: ParkingFiles, path: Path, shape: torch.Size, dtype: torch.dtype):
        self.files, self.path, self.shape, self.dtype = files, path, shape, dtype
        self.write: Future[None] | None = None
        self.reading: Future[torch.Tensor] | None = None

    def read_ahead(self) -> None:
        if self.reading is None:
            self.reading = self.files.read(self)

    def take(self) -> torch.Tensor:
        """The tensor as it was parked, in host RAM (waits for its read). Once: the file is gone after, and the
        slot lets go of the bytes (the caller's copy to the device holds them as long as it needs)."""
        self.read_ahead()
        reading, self.reading = self.reading, None
        assert reading is not None
        return reading.result()


def _forget(write: Future[None], path: Path) -> None:
    write.add_done_callback(lambda _: path.unlink(missing_ok=True))


def _write(path: Path, host: torch.Tensor, copied: torch.cuda.Event | None, room: threading.BoundedSemaphore) -> None:
    try:
        if copied is not None:
            copied.synchronize()  # the side stream's copy has filled `host`
        with open(path, "wb") as f:
            f.write(host.reshape(-1).view(torch.uint8).numpy().data)  # straight from the tensor's memory
    except OSError as e:
        path.unlink(missing_ok=True)  # a partial file is never read
        raise _failed("writing", path, host.numel() * host.element_size(), e) from e
    finally:
        room.release()


def _read(slot: ParkedFile, pinned: bool) -> torch.Tensor:
    assert slot.write is not None
    slot.write.result()  # a failed write raises here, where the bytes are wanted
    host = torch.empty(slot.shape, dtype=slot.dtype, pin_memory=pinned)
    raw = host.reshape(-1).view(torch.uint8).numpy().data  # the file read straight into the tensor's memory
    try:
        with open(slot.path, "rb") as f:
            got = f.readinto(raw)
        slot.path.unlink()
    except OSError as e:
        raise _failed("reading", slot.path, raw.nbytes, e) from e
    if got != raw.nbytes:
        raise _failed("reading", slot.path, raw.nbytes, OSError(f"the file holds {got} bytes, not {raw.nbytes}"))
    return host


def _failed(doing: str, path: Path, size: int, e: OSError) -> TrainingError:
    return TrainingError(
        f"memory.activation_offload=disk: {doing} a checkpointed layer's input ({size:,} bytes) at {path} failed: {e}",
        hint="free space on that disk (`finetune plan` gives what a step parks), set memory.offload_dir to another "
        "folder, or set memory.activation_offload=true (host RAM)",
    )
