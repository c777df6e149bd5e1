"""Frozen base weights streamed to the compute device one decoder layer at a time (memory.base_weights).

    stream = WeightStream.attach(model, mode="disk", device=torch.device("cuda"), directory="/nvme/tmp")
    ... train ...
    stream.close()

In (Q)LoRA the base model never changes, so the weights of its decoder layers need
not live on the GPU: they wait in CPU RAM (pinned, `cpu`) or in a file on disk
(`disk`: memory-mapped, so the OS page cache holds them, not our heap; 4-bit weights
go there as from_pretrained quantizes them, so the whole model is never in RAM) and are
copied in just before a layer runs: in forward, and again in the recomputation that
activation checkpointing does before the layer's backward. LoRA weights,
quantization constants (absmax), norms, embeddings and the head stay resident, plus
at most three layers' streamed weights. memory.device_layers keeps some layers' weights resident too
(spread evenly: each streamed layer's copy then overlaps the kept layers' compute before it): what
fits on the GPU stays there, only the rest streams.

What the hooks do with layer i's weights:
  layer pre-hook (forward)     use layer i (waiting for its prefetch), prefetch layer i+1
  layer post-hook (forward)    release layer i
  weight pre-hook, in backward (the recomputation; the layer hooks do nothing there:
                               where transformers checkpoints a layer's forward they do not
                               fire, where it checkpoints its __call__ they fire but return):
                               release the layers after i, whose backward is complete,
                               since autograd starts layer i's nodes only once the gradient
                               of its output is whole; use layer i, keep it for its
                               backward, prefetch layer i-1
  end of backward              release whatever is still resident

On a CUDA device copies run on a side stream and overlap the previous layer's
compute. On a CPU device there is nothing to copy to: a layer's parameters point at
the store while the layer is "resident" (for disk: at the page cache, so the weights
never count as the process's anonymous memory), and the same bookkeeping runs, which
is how the tests see the lifecycle.
"""

from __future__ import annotations

import atexit
import os
import tempfile
from collections import deque
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch

from finetune.errors import ConfigError
from finetune.hardware import release_free_heap
from finetune.model.load import decoder_layers


@dataclass
class Streamed:
    """One frozen weight that lives off the device: the module's parameter and where its bytes wait."""

    param: torch.nn.Parameter
    stored: torch.Tensor  # on the host: pinned RAM, or a view into the memory-mapped file

    @property
    def nbytes(self) -> int:
        return self.stored.numel() * self.stored.element_size()


def streamable_weights(layer: torch.nn.Module) -> list[torch.nn.Parameter]:
    """The frozen linear weights of a decoder layer (4-bit packed or 16/32-bit), each once."""
    seen: dict[int, torch.nn.Parameter] = {}
    for module in layer.modules():
        weight = getattr(module, "weight", None)
        # bitsandbytes' Linear4bit subclasses nn.Linear; peft's LoRA A/B are nn.Linear but trainable.
        if isinstance(module, torch.nn.Linear) and isinstance(weight, torch.nn.Parameter) and not weight.requires_grad:
            seen.setdefault(id(weight), weight)
    return list(seen.values())


class _Saved4bitMatmul(torch.autograd.Function):
    """x @ dequant(W).T for a streamed 4-bit weight, with W saved through save_for_backward.

    bitsandbytes' own MatMul4Bit keeps W in a plain ctx attribute, which activation
    checkpointing cannot see: every layer's weight would stay on the GPU from forward
    to backward, and streaming would save nothing. Saved this way, the checkpoint drops
    it after forward and the recomputation saves the freshly streamed copy. Forward and
    backward are bitsandbytes' kernels, so the numbers are the same.
    """

    @staticmethod
    def forward(ctx, x, packed, bias, state):
        import bitsandbytes as bnb

        ctx.state = state
        ctx.save_for_backward(packed)
        return bnb.matmul_4bit(x, packed.t(), bias=bias, quant_state=state)

    @staticmethod
    def backward(ctx, grad):
        import bitsandbytes.functional as bnbf

        (packed,) = ctx.saved_tensors
        grad_x = torch.matmul(grad, bnbf.dequantize_4bit(packed.view(-1, 1), ctx.state).to(grad.dtype))
        return grad_x, None, None, None


def _streamed_4bit_forward(self, x: torch.Tensor) -> torch.Tensor:
    """Linear4bit.forward for a streamed (frozen) weight, through _Saved4bitMatmul."""
    in_dtype = x.dtype
    if self.compute_dtype is not None:
        x = x.to(self.compute_dtype)
    bias = None if self.bias is None else self.bias.to(x.dtype)
    return _Saved4bitMatmul.apply(x, self.weight, bias, self.weight.quant_state).to(in_dtype)


def stream_kept(layers: int, device_layers: int) -> set[int]:
    """The indices of the decoder layers that keep their weights on the device (memory.device_layers), spread evenly
    so that each streamed layer's copy overlaps the compute of the kept layers before it."""
    if device_layers >= layers:
        raise ConfigError(
            [
                f"memory.device_layers={device_layers}: the model has {layers} decoder layers, so none would stream. "
                f"Set memory.device_layers below {layers}, or memory.base_weights=device."
            ]
        )
    return {(2 * k + 1) * layers // (2 * device_layers) for k in range(device_layers)}


def in_backward() -> bool:
    """True while autograd's engine runs a backward pass (the recomputation of a checkpointed layer)."""
    return torch._C._current_graph_task_id() != -1


class WeightStream:
    """Keeps the decoder layers' frozen weights off the device and brings each layer in when it runs."""

    def __init__(
        self,
        layers: list[torch.nn.Module],
        streamed: list[list[Streamed]],
        device: torch.device,
        disk: DiskStore | None,
        captured_while_loading: int = 0,
    ):
        self.layers = layers
        self.captured_while_loading = captured_while_loading  # weights that went to disk as the model loaded
        self.streamed = streamed
        self.device = device
        self.disk = disk  # mode=disk: the file behind the weights, deleted by close()
        self.resident: dict[int, tuple[list[torch.Tensor], torch.cuda.Event | None]] = {}
        self.active: set[int] = set()
        self.loads = 0  # layer copies made (forward + recomputation + eval)
        self.max_resident = 0  # most layers resident at once
        self._copy_stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self._done_with: deque[torch.cuda.Event] = deque()  # compute-stream events of the last releases
        self._end_of_backward_queued = False
        self._handles = []
        for i, layer in enumerate(layers):
            self._handles.append(layer.register_forward_pre_hook(self._layer_pre_hook(i)))
            self._handles.append(layer.register_forward_hook(self._layer_post_hook(i)))
            for module in layer.modules():
                if any(s.param is getattr(module, "weight", None) for s in streamed[i]):
                    self._handles.append(module.register_forward_pre_hook(self._weight_pre_hook(i)))
                    if getattr(module.weight, "quant_state", None) is not None and isinstance(module, torch.nn.Linear):
                        module.forward = _streamed_4bit_forward.__get__(module)  # type: ignore[method-assign]

    # ------------------------------------------------------------------ building

    @classmethod
    def attach(
        cls,
        model,
        mode: str,
        device: torch.device,
        directory: str | os.PathLike[str] | None = None,
        store: DiskStore | None = None,
        device_layers: int = 0,
    ) -> WeightStream:
        """Move the frozen decoder-layer weights of `model` (on the CPU) to the store, the rest to `device`.

        store: for mode=disk, a DiskStore that already holds the weights captured while
        the model loaded (see DiskStore.capture); the others are added here.
        device_layers: that many layers, spread evenly, keep their weights on `device` (stream_kept).
        """
        if mode not in ("cpu", "disk"):
            raise ValueError(f"mode must be cpu or disk, got {mode!r}")
        every = decoder_layers(model, f"memory.base_weights={mode}", "use memory.base_weights=device for this model")
        kept = stream_kept(len(every), device_layers)
        layers = [layer for i, layer in enumerate(every) if i not in kept]
        weights = [streamable_weights(layer) for layer in layers]
        pin = device.type == "cuda"
        if mode == "disk":
            store = store or DiskStore(directory)
            for params in weights:
                for p in params:
                    if p not in store:
                        store.add(p)
            stored = store.finish()
            # capture() takes every 4-bit weight the model registers; some models keep 4-bit
            # projections outside their decoder layers (Gemma 3n's per-layer and altup ones),
            # which are not streamed: they get their bytes back and stay resident.
            streaming = {id(p) for params in weights for p in params}
            # So do the layers memory.device_layers keeps: straight to the device (on a CPU, a copy out of the file).
            for p in [p for p in stored if id(p) not in streaming]:
                p.data = stored.pop(p).to(device, copy=True)
        else:
            stored = {}
            for params in weights:
                for p in params:
                    host = p.data.to("cpu")
                    stored[p] = host.pin_memory() if pin else host
                    p.data = _placeholder(p, torch.device("cpu"))
        streamed = [[Streamed(p, stored[p]) for p in params] for params in weights]
        model.to(device)  # everything that stays: LoRA, norms, embeddings, head, quant constants
        for params in weights:
            for p in params:
                p.data = _placeholder(p, device)
        disk = store if mode == "disk" else None
        return cls(layers, streamed, device, disk, disk.captured if disk is not None else 0)

    @property
    def streamed_bytes(self) -> int:
        return sum(s.nbytes for layer in self.streamed for s in layer)

    @property
    def store(self) -> Path | None:
        """The weights file (mode=disk), until close()."""
        return self.disk.path if self.disk is not None else None

    def close(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []
        if self.disk is not None:
            self.disk.discard()
            self.disk = None

    # ------------------------------------------------------------------ moving layers

    def _prefetch(self, i: int) -> None:
        """Start copying layer i to the device (no-op if it is there or out of range)."""
        if not 0 <= i < len(self.layers) or i in self.resident:
            return
        stored = [s.stored for s in self.streamed[i]]
        if self._copy_stream is not None:
            # The host runs ahead of the GPU: unchecked, it would queue copies for many layers, each
            # in fresh blocks (released ones wait for the compute stream), until the streamed weights
            # filled the card. Wait until the GPU is done with the layer released two releases ago
            # (what FSDP's limit_all_gathers does for its all-gathers).
            while len(self._done_with) >= 2:
                self._done_with.popleft().synchronize()
            with torch.cuda.stream(self._copy_stream):
                copies = [t.to(self.device, non_blocking=True) for t in stored]
                event = torch.cuda.Event()
                event.record(self._copy_stream)
        else:
            # A CPU device computes from host memory: it reads the store in place (for disk,
            # straight from the page cache), and only the bookkeeping below happens.
            copies, event = stored, None
        self.resident[i] = (copies, event)
        self.loads += 1
        self.max_resident = max(self.max_resident, len(self.resident))

    def _use(self, i: int) -> None:
        self._prefetch(i)
        copies, event = self.resident[i]
        if i in self.active:
            return
        if event is not None:
            current = torch.cuda.current_stream(self.device)
            current.wait_event(event)
            for t in copies:
                t.record_stream(current)  # made on the copy stream, used (and freed) on this one
        for s, t in zip(self.streamed[i], copies):
            s.param.data = t
        self.active.add(i)

    def _release(self, i: int) -> None:
        entry = self.resident.pop(i, None)
        if entry is None:
            return
        for s in self.streamed[i]:
            s.param.data = _placeholder(s.param, self.device)
        self.active.discard(i)
        if self._copy_stream is not None:
            done = torch.cuda.Event()
            done.record(torch.cuda.current_stream(self.device))
            self._done_with.append(done)

    def release_all(self) -> None:
        for i in list(self.resident):
            self._release(i)
        self._end_of_backward_queued = False

    # ------------------------------------------------------------------ hooks

    def _layer_pre_hook(self, i: int):
        def hook(module, args):
            if in_backward():
                # A recomputation under transformers releases that checkpoint a layer's
                # __call__ (5.17) rather than its forward (5.23): the weight pre-hooks
                # below bring the layer in, in backward order.
                return
            self._use(i)
            self._prefetch(i + 1)  # copied on the side stream while layer i computes

        return hook

    def _layer_post_hook(self, i: int):
        def hook(module, args, output):
            if not in_backward():
                self._release(i)

        return hook

    def _weight_pre_hook(self, i: int):
        # The hooks of the modules inside a layer fire in its recomputation whether
        # transformers checkpoints the layer's forward or its __call__.
        def hook(module, args):
            if i in self.active:
                return
            if in_backward():
                for j in [j for j in self.resident if j > i]:
                    self._release(j)  # their backward is complete (see the module docstring)
                if not self._end_of_backward_queued:
                    torch.autograd.Variable._execution_engine.queue_callback(self.release_all)
                    self._end_of_backward_queued = True
                self._use(i)
                self._prefetch(i - 1)
            else:
                self._use(i)

        return hook


# ---------------------------------------------------------------------- the store


def _placeholder(p: torch.Tensor, device: torch.device) -> torch.Tensor:
    """What a streamed parameter holds while its layer is not resident: no bytes, same dtype."""
    return torch.empty(0, dtype=p.dtype, device=device)


class DiskStore:
    """The file behind base_weights=disk: frozen weights appended one at a time, then memory-mapped.

    A flat file of page-aligned tensors with the index kept here: it is written once
    per run and read only by this process, so it needs no header (the one thing
    safetensors would add). Reading it back maps the file privately: pages come from
    the OS page cache, count as file-backed memory (not RssAnon), and are never written.

    Each weight goes to disk as soon as it is added and its heap copy is dropped, so
    the whole set is never in RAM at once; `capture` does this while from_pretrained
    builds the model, for the 4-bit weights bitsandbytes quantizes as they load.
    """

    ALIGN = 4096

    def __init__(self, directory: str | os.PathLike[str] | None = None):
        root = (
            Path(directory)
            if directory
            else Path(os.environ.get("FINETUNE_CACHE", Path.home() / ".cache" / "finetune")) / "offload"
        )
        root.mkdir(parents=True, exist_ok=True)
        handle, name = tempfile.mkstemp(prefix="base-weights-", suffix=".bin", dir=root)
        self.path = Path(name)
        atexit.register(self.discard)  # a crash must not leave tens of GB behind
        self._fh = os.fdopen(handle, "wb")
        self._entries: dict[torch.nn.Parameter, tuple[int, torch.dtype, torch.Size]] = {}
        self._offset = 0
        self.captured = 0

    def discard(self) -> None:
        """Close and delete the file (idempotent). Mapped views stay readable until dropped."""
        self._fh.close()
        self.path.unlink(missing_ok=True)
        atexit.unregister(self.discard)

    def __contains__(self, p: torch.nn.Parameter) -> bool:
        return p in self._entries

    def add(self, p: torch.nn.Parameter) -> None:
        """Append p's bytes and leave p empty (its bytes now live only in the file)."""
        data = p.data.detach().to("cpu").contiguous()
        raw = data.reshape(-1).view(torch.uint8).numpy()
        self._fh.write(raw)  # type: ignore[arg-type]  # contiguous: written straight from the tensor's memory
        self._entries[p] = (self._offset, data.dtype, data.shape)
        size = raw.nbytes
        pad = -size % self.ALIGN
        self._fh.write(b"\0" * pad)
        self._offset += size + pad
        p.data = _placeholder(p, torch.device("cpu"))
        del data, raw
        release_free_heap()  # the copy just freed, and the load and quantization buffers of the weight before

    def finish(self) -> dict[torch.nn.Parameter, torch.Tensor]:
        """Close the file and return each weight as a view of one private read-only mapping."""
        self._fh.close()
        if self._offset == 0:
            return {}
        raw = torch.from_file(str(self.path), shared=False, size=self._offset, dtype=torch.uint8)
        out = {}
        for p, (offset, dtype, shape) in self._entries.items():
            nbytes = shape.numel() * dtype.itemsize
            out[p] = raw[offset : offset + nbytes].view(dtype).view(shape)
        return out

    @contextmanager
    def capture(self):
        """While active, every 4-bit weight a module registers on the CPU goes straight to this store."""

        def hook(module, name, param):
            # transformers registers each weight twice: an empty (meta) one when it builds the
            # model, then the loaded one; bitsandbytes' Params4bit arrives quantized (uint8 +
            # quant_state). A 4-bit weight outside the decoder layers (the head stays 16-bit,
            # but Gemma 3n has such projections) gets its bytes back in WeightStream.attach.
            if (
                name == "weight"
                and isinstance(param, torch.nn.Parameter)
                and getattr(param, "quant_state", None) is not None
                and param.device.type == "cpu"
                and param.numel() > 0
            ):
                self.add(param)
                self.captured += 1
            return None

        handle = torch.nn.modules.module.register_module_parameter_registration_hook(hook)
        try:
            yield self
        finally:
            handle.remove()
            release_free_heap()  # the last weight's load and quantization buffers
