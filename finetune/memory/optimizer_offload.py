"""memory.optimizer_offload: AdamW's state and step in host RAM.

    optimizer = HostAdamW(params, lr=2e-4)

Results are unchanged: the host runs the same AdamW on fp32 copies of the trainable weights,
and the device keeps only the weights and their gradients.
"""

from __future__ import annotations

from typing import Any

import torch


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
