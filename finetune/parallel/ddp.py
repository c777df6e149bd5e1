"""DDP's room: a whole replica per process, gradients all-reduced by torch's DistributedDataParallel
(accelerate's wrapper), with distributed.grad_compression's communication hook (ddp_hooks.py)."""

from __future__ import annotations

from typing import Any

from finetune.parallel import ddp_hooks
from finetune.parallel.room import Room, data_parallel_line


class DDP(Room):
    name = "ddp"

    def __init__(self, accelerator, cfg, layout, mesh=None) -> None:
        super().__init__(accelerator, cfg, layout, mesh)
        self.powersgd: ddp_hooks.PowerSGD | None = None  # its state goes into every checkpoint, per rank

    def describe(self) -> str:
        return data_parallel_line(self)

    def prepare(self, model, optimizer):
        """accelerate's DDP wrapper, with the compression hook registered by us: accelerate's own comm_hook option
        keeps PowerSGD's state where a checkpoint cannot reach it, and refuses bf16 on gloo."""
        model, optimizer = self.accelerator.prepare(model, optimizer)
        self.powersgd = ddp_hooks.register(model, self.cfg)
        return model, optimizer

    def rank_state(self) -> Any:
        return self.powersgd.state_dict() if self.powersgd is not None else None
