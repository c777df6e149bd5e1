"""memory.activation_offload: what the forward saves for backward waits in host RAM.

    offload = ActivationOffload(device)
    with offload.saving():
        loss = model(**batch).loss               # saved activations go to pinned host RAM
    loss.backward()                              # ...and come back as backward reaches them

What a checkpointed decoder layer keeps (its input) takes its own path: the layers'
checkpoint function is `offloaded_checkpoint` below (memory/apply.py installs it), which parks
the input of each layer in host RAM after the layer's forward and, in backward, brings
the input of the next layer to recompute back while this one recomputes.

Results are unchanged: the same bytes go out and come back. On a CPU device there is no other
memory to move to; the hooks stay installed and count what they would move
(`force_copy` makes them copy anyway: the same buffers and copies, made at once and unpinned, which
is how the tests check the path on CPU; pinning, the side stream and its events run on CUDA only).
memory.activation_offload=disk parks the checkpointed inputs in files instead (memory/activation_disk.py): written
by a thread once copied to the host, read back by it one layer ahead of their recomputation, copied to the device
when the recomputation asks.
"""

from __future__ import annotations

from contextlib import contextmanager, nullcontext
from contextvars import ContextVar
from typing import Any

import torch
from torch.utils.checkpoint import checkpoint as torch_checkpoint

from finetune.memory.activation_disk import ParkedFile, ParkingFiles

# Smaller saved tensors (masks, scalars, norms' statistics) cost more in copy
# latency than they free; checkpoint boundaries of a 7B model are ~16 MiB each.
MIN_OFFLOAD_BYTES = 1 << 20


class NoActivationOffload:
    """memory.activation_offload off: saving() changes nothing, so the training step calls it either way."""

    def saving(self):
        return nullcontext()


class _Parked:
    """The tensors one checkpoint keeps for its recomputation (a decoder layer's input), in host RAM."""

    __slots__ = ("index", "prev", "host", "copied", "back", "arrived", "reading")

    def __init__(self, index: int, prev: _Parked | None):
        self.index = index  # its place in the forward: the n-th checkpoint of the micro-batch
        self.prev = prev  # the checkpoint before it, whose recomputation comes next in backward
        self.host: list[torch.Tensor | ParkedFile] = []  # in host RAM, or (activation_offload=disk) in a file
        self.reading = False  # disk: its files are being read back ahead of its recomputation
        self.copied: torch.cuda.Event | None = None  # the copies to the host are done
        self.back: list[torch.Tensor | None] | None = None  # on the device again, not yet handed to autograd
        self.arrived: torch.cuda.Event | None = None  # the copies back are done


class ActivationOffload:
    """saved_tensors_hooks that park autograd's saved activations in host RAM between forward and backward."""

    def __init__(
        self,
        device: torch.device,
        min_bytes: int = MIN_OFFLOAD_BYTES,
        force_copy: bool = False,
        files: ParkingFiles | None = None,
    ):
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())  # tensors report cuda:N, never bare cuda
        self.device = device
        self.min_bytes = min_bytes
        self.force_copy = force_copy  # on a CPU device: copy anyway (tests), instead of the no-op
        self.files = files  # activation_offload=disk: where the checkpointed inputs wait (else host RAM)
        self.moved_bytes = 0  # bytes sent to the host (or that would be, on a CPU device)
        self.moved_tensors = 0
        self.checkpoint_bytes = 0  # checkpointed layers' inputs parked (counted apart from moved_*)
        self.checkpoint_tensors = 0
        self.prefetched = 0  # checkpointed inputs brought back while the layer after them recomputed
        self.fetched_late = 0  # ...and when their own recomputation asked (the first one of each backward)
        self.waiting: set[int] = set()  # checkpoints back on the device, not yet taken by their recomputation
        self._last: _Parked | None = None  # the latest checkpoint of the forward that is saving
        self._parking = False  # inside checkpoint_inputs (a checkpoint's forward)
        self._stream = torch.cuda.Stream(device) if device.type == "cuda" else None

    @contextmanager
    def saving(self):
        token = _saving.set(self)
        self._last = None  # a new forward: its first checkpoint has none before it
        try:
            with torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack):
                yield
        finally:
            _saving.reset(token)
            self._last = None  # the chain belongs to the graph now, which frees it with backward

    def _worth_moving(self, t: torch.Tensor) -> bool:
        if isinstance(t, torch.nn.Parameter) or isinstance(t._base, torch.nn.Parameter):
            return False  # weights stay where they are (and a frozen one may be streamed already)
        if t.requires_grad and t.grad_fn is None:
            # A leaf that trains (the embeddings' output under enable_input_require_grads, the first
            # layer's input): autograd's AccumulateGrad holds it until backward, so a copy frees nothing.
            return False
        # Non-contiguous ones (e.g. an attention bias whose rows are padded for alignment)
        # would come back with other strides, which fused attention kernels reject.
        return t.device == self.device and t.is_contiguous() and t.numel() * t.element_size() >= self.min_bytes

    def _to_host(self, t: torch.Tensor) -> tuple[torch.Tensor, torch.cuda.Event | None]:
        """A host copy of t and, on CUDA, the event of the side-stream copy that fills it. A CPU device
        (force_copy) takes the same buffer and copy, made at once: only pinning and the stream are CUDA's."""
        stream = self._stream
        if stream is not None:
            stream.wait_stream(torch.cuda.current_stream(self.device))  # t must be fully computed before it is copied
        with _on(stream):
            host = torch.empty(t.shape, dtype=t.dtype, pin_memory=stream is not None)
            host.copy_(t, non_blocking=stream is not None)
            event = _recorded(stream)
        if stream is not None:
            t.record_stream(stream)  # the allocator must not reuse t until the copy has read it
        return host, event

    def _pack(self, t: torch.Tensor) -> Any:
        if not self._worth_moving(t):
            return t
        self.moved_bytes += t.numel() * t.element_size()
        self.moved_tensors += 1
        if self._stream is None and not self.force_copy:
            return t
        return ("host", *self._to_host(t))

    def _unpack(self, packed: Any) -> torch.Tensor:
        if not isinstance(packed, tuple):
            return packed
        _, host, event = packed
        if event is not None:
            torch.cuda.current_stream(self.device).wait_event(event)
        return host.to(self.device, non_blocking=event is not None, copy=True)  # copy: a CPU device's own too

    # ------------------------------------------------------------------ checkpointed layers' inputs

    @contextmanager
    def checkpoint_inputs(self):
        """Hooks for what one checkpoint saves for its recomputation (its inputs): torch's checkpoint saves
        them under the hooks in force when it is called, and its own hooks then take the layer's saves."""
        parked = _Parked(0 if self._last is None else self._last.index + 1, self._last)
        self._last = parked
        self._parking = True
        try:
            with torch.autograd.graph.saved_tensors_hooks(lambda t: self._park(parked, t), self._take):
                yield
        finally:
            self._parking = False

    def _park(self, parked: _Parked, t: torch.Tensor) -> Any:
        if not self._worth_moving(t):
            return t
        self.checkpoint_bytes += t.numel() * t.element_size()
        self.checkpoint_tensors += 1
        if self._stream is None and not self.force_copy:
            return t
        if self.files is not None:
            self.files.wait_for_room()  # before the host block is made: the blocks waiting for the disk stay bounded
        host, parked.copied = self._to_host(t)  # events of one stream: the last one covers the earlier copies
        parked.host.append(self.files.put(host, parked.copied) if self.files is not None else host)
        return parked, len(parked.host) - 1

    def _bring_back(self, parked: _Parked, ahead: bool) -> None:
        """Copy a checkpoint's inputs to the device: ahead (on the side stream, while another layer
        recomputes) or now (on the compute stream, which its recomputation waits on anyway). A CPU
        device (force_copy) makes the same copies at once. Parked on disk, ahead starts the files' reads only: the
        copy to the device is made when the recomputation asks (the read has had a layer's time)."""
        if self.files is not None and ahead:
            for slot in parked.host:
                assert isinstance(slot, ParkedFile)
                slot.read_ahead()
            parked.reading = True
            return
        current = None if self._stream is None else torch.cuda.current_stream(self.device)
        stream = self._stream if ahead else current
        with _on(stream):
            if stream is not None:
                assert parked.copied is not None  # set by _park with the first host copy
                stream.wait_event(parked.copied)  # the host copy is complete
            hosts = [h.take() if isinstance(h, ParkedFile) else h for h in parked.host]
            back = [h.to(self.device, non_blocking=stream is not None, copy=True) for h in hosts]
            parked.arrived = _recorded(stream)
        if ahead and current is not None:
            for t in back:
                t.record_stream(current)  # made on the side stream, used and freed on the compute stream
        parked.back = list(back)

    def _take(self, packed: Any) -> torch.Tensor:
        if not isinstance(packed, tuple):
            return packed
        parked, i = packed
        if parked.back is None or parked.back[i] is None:
            self.fetched_late += not parked.reading  # (disk: read ahead, copied to the device now)
            self._bring_back(parked, ahead=False)
        assert parked.back is not None
        t = parked.back[i]
        assert t is not None
        parked.back[i] = None  # autograd holds it from here; our reference would outlive the recomputation
        if all(b is None for b in parked.back):
            parked.back = None
            parked.host = []  # consumed: a later checkpoint's prefetch (a pipeline's next micro-batch) skips it
            self.waiting.discard(parked.index)
        if parked.arrived is not None:
            torch.cuda.current_stream(self.device).wait_event(parked.arrived)
        before = parked.prev
        if before is not None and before.host and before.back is None and not before.reading:
            # Backward recomputes the checkpoints in reverse: the one before this is next. Its copy runs
            # on the side stream while this layer recomputes and runs backward; two layers' inputs at most.
            self._bring_back(before, ahead=True)
            self.prefetched += 1
            self.waiting.add(before.index)
        return t


def _on(stream: torch.cuda.Stream | None):
    """The stream's context on CUDA; on a CPU device (no stream) copies run in order anyway."""
    return torch.cuda.stream(stream) if stream is not None else nullcontext()


def _recorded(stream: torch.cuda.Stream | None) -> torch.cuda.Event | None:
    """An event marking what `stream` has queued so far (None without a stream: nothing is queued)."""
    if stream is None:
        return None
    event = torch.cuda.Event()
    event.record(stream)
    return event


# The ActivationOffload whose saving() is in force: what `offloaded_checkpoint` parks the layers' inputs with.
# A context variable rather than an argument: transformers calls the layers' checkpoint function.
_saving: ContextVar[ActivationOffload | None] = ContextVar("finetune_activation_offload", default=None)


def offloaded_checkpoint(function, *args, **kwargs):
    """torch's non-reentrant checkpoint (the one transformers uses), whose saved inputs (a decoder
    layer's input, ~1/30 of what the layer would keep) wait in host RAM while an ActivationOffload is
    saving: the layers' checkpoint function under memory.activation_offload (model.load.checkpoint_with)."""
    offload = _saving.get()
    # A checkpoint inside another's forward (a model that checkpoints itself and its layers) saves its
    # inputs under the outer one's hooks, as its recomputation will: parking them would break that count.
    if offload is None or offload._parking:
        return torch_checkpoint(function, *args, use_reentrant=False, **kwargs)
    with offload.checkpoint_inputs():
        return torch_checkpoint(function, *args, use_reentrant=False, **kwargs)
