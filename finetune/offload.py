"""Host RAM for what a training step keeps between its phases: saved activations and optimizer state.

    offload = ActivationOffload(device)          # memory.activation_offload
    with offload.saving():
        loss = model(**batch).loss               # saved activations go to pinned host RAM
    loss.backward()                              # ...and come back as backward reaches them

    optimizer = HostAdamW(params, lr=2e-4)       # memory.optimizer_offload

Both keep results unchanged: the same bytes go out and come back, and the host
optimizer runs the same AdamW on fp32 copies. On a CPU device there is no other
memory to move to; the hooks stay installed and count what they would move
(`force_copy` makes them copy anyway, which is how the tests check the path).
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any

import torch

# Smaller saved tensors (masks, scalars, norms' statistics) cost more in copy
# latency than they free; checkpoint boundaries of a 7B model are ~16 MiB each.
MIN_OFFLOAD_BYTES = 1 << 20


class ActivationOffload:
    """saved_tensors_hooks that park autograd's saved activations in host RAM between forward and backward."""

    def __init__(self, device: torch.device, min_bytes: int = MIN_OFFLOAD_BYTES, force_copy: bool = False):
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())  # tensors report cuda:N, never bare cuda
        self.device = device
        self.min_bytes = min_bytes
        self.force_copy = force_copy  # on a CPU device: copy anyway (tests), instead of the no-op
        self.moved_bytes = 0  # bytes sent to the host (or that would be, on a CPU device)
        self.moved_tensors = 0
        self._stream = torch.cuda.Stream(device) if device.type == "cuda" else None

    @contextmanager
    def saving(self):
        with torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack):
            yield

    def _worth_moving(self, t: torch.Tensor) -> bool:
        if isinstance(t, torch.nn.Parameter) or isinstance(t._base, torch.nn.Parameter):
            return False  # weights stay where they are (and a frozen one may be streamed already)
        # Non-contiguous ones (e.g. an attention bias whose rows are padded for alignment)
        # would come back with other strides, which fused attention kernels reject.
        return t.device == self.device and t.is_contiguous() and t.numel() * t.element_size() >= self.min_bytes

    def _pack(self, t: torch.Tensor) -> Any:
        if not self._worth_moving(t):
            return t
        self.moved_bytes += t.numel() * t.element_size()
        self.moved_tensors += 1
        if self._stream is not None:
            current = torch.cuda.current_stream(self.device)
            self._stream.wait_stream(current)  # t must be fully computed before it is copied
            with torch.cuda.stream(self._stream):
                host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
                host.copy_(t, non_blocking=True)
                event = torch.cuda.Event()
                event.record(self._stream)
            t.record_stream(self._stream)  # the allocator must not reuse t until the copy has read it
            return ("host", host, event)
        if self.force_copy:
            return ("host", t.detach().clone(), None)
        return t

    def _unpack(self, packed: Any) -> torch.Tensor:
        if not isinstance(packed, tuple):
            return packed
        _, host, event = packed
        if event is None:
            return host
        current = torch.cuda.current_stream(self.device)
        current.wait_event(event)
        return host.to(self.device, non_blocking=True)


class HostAdamW(torch.optim.Optimizer):
    """AdamW whose state and fp32 update live in host RAM; the device keeps only the weights and their grads.

    param_groups hold the device parameters (so gradient clipping, the LR scheduler
    and a GradScaler work as usual); the step copies each gradient to the host,
    updates an fp32 host copy of the weight there, and copies the result back. The
    state_dict is the inner torch AdamW's, so a checkpoint resumes with or without
    offload.

    The host copy is the weight the update starts from, so it must follow every change
    made to the device weight from outside: a resume loads the adapter after this
    optimizer was built, and a stale copy would write the initial weights back over it
    at the first step. Each weight's autograd version counter tells whether anything
    wrote to it since our own last copy.
    """

    def __init__(self, params, lr: float = 1e-3, weight_decay: float = 0.0, pin: bool | None = None, **adamw: Any):
        super().__init__(list(params), {"lr": lr, "weight_decay": weight_decay, **adamw})
        device_params = [p for g in self.param_groups for p in g["params"]]
        pin = any(p.is_cuda for p in device_params) if pin is None else pin
        self._host: dict[torch.Tensor, torch.Tensor] = {}
        self._version: dict[torch.Tensor, int] = {}  # p._version right after we last wrote p or read it
        host_groups = []
        for group in self.param_groups:
            copies = []
            for p in group["params"]:
                host = p.detach().to("cpu", torch.float32, copy=True)
                host = host.pin_memory() if pin else host
                self._host[p] = host
                self._version[p] = p._version
                copies.append(host)
            host_groups.append({**{k: v for k, v in group.items() if k != "params"}, "params": copies})
        self.inner = torch.optim.AdamW(host_groups, lr=lr, weight_decay=weight_decay, **adamw)

    def _sync_hyperparameters(self) -> None:
        for outer, inner in zip(self.param_groups, self.inner.param_groups):
            for key, value in outer.items():
                if key != "params":
                    inner[key] = value

    @torch.no_grad()
    def pull_weights(self, changed_only: bool = True) -> int:
        """Copy device weights written from outside (a resume, a user's load_state_dict) to the host
        copies the update starts from; returns how many were copied."""
        pulled = 0
        for p, host in self._host.items():
            if changed_only and p._version == self._version[p]:
                continue
            host.copy_(p.detach())
            self._version[p] = p._version
            pulled += 1
        return pulled

    @torch.no_grad()
    def step(self, closure=None):
        loss = closure() if closure is not None else None
        self._sync_hyperparameters()
        self.pull_weights()
        for p, host in self._host.items():
            host.grad = None if p.grad is None else p.grad.detach().to("cpu", torch.float32, non_blocking=False)
        self.inner.step()
        for p, host in self._host.items():
            if host.grad is not None:
                p.copy_(host, non_blocking=True)
                self._version[p] = p._version
        return loss

    def state_dict(self) -> dict[str, Any]:
        self._sync_hyperparameters()
        return self.inner.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.inner.load_state_dict(state_dict)
        self.pull_weights(changed_only=False)  # the weights this state belongs to are on the device now
        for outer, inner in zip(self.param_groups, self.inner.param_groups):
            for key, value in inner.items():
                if key != "params":
                    outer[key] = value
