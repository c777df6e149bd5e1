"""The frozen vocabulary tables in host RAM (memory.embeddings=cpu).

    tables = HostTables.attach(model, device)       # after loading, before the trainer wraps it
    loss = chunked_linear_cross_entropy(...)          # the head visits the GPU for the loss only

A model with a 128k vocabulary carries two tables QLoRA never trains, the input embeddings
and the LM head: 1 GiB each in bf16 for an 8B model, 2 GiB of a 24 GB card. Neither is
used while the decoder layers run backward, which is where a checkpointed step peaks, so
there they are held for nothing:

  input embeddings  the table stays in host RAM and the lookup runs there; only the rows
                    looked up (tokens x hidden, 32 MiB at 2 x 2048 for 8B) cross to the GPU
  LM head           its weight waits in (pinned) host RAM and visits the GPU for the loss:
                    copied in at the head's first call of a forward, kept while the loss
                    runs forward and backward (the chunked loss calls the head again for each
                    chunk it recomputes), and dropped as soon as the gradient of every input
                    the head was given is complete, before the decoder layers' backward
                    starts. Without autograd (eval, generation) the visit stays until the
                    next training backward drops it, so generating costs one copy, not one
                    per token.

A tied head (one table for both) works the same way: the lookup reads the host table, the
visit copies it. Values and gradients are bitwise those of the tables on the GPU (a copy,
and the same kernels on the same inputs). On a CPU device nothing moves; the same
bookkeeping runs (how the tests see the visit come and go).

The module tree, parameter names and state_dict are untouched: the tables are the same
Parameters, living on the host. A `.to(device)` of the whole model (accelerate does one for
16-bit models) would bring them back; the next forward puts them back on the host.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch

from finetune.errors import ConfigError
from finetune.model.load import base_of

KEY = "memory.embeddings"
HOST = torch.device("cpu")


def _plain(module: Any, kind: Any) -> Any:
    """The frozen 16-bit module that holds a table (peft's LoRA wrapper's base layer), or None."""
    plain: Any = getattr(module, "base_layer", module)
    if not isinstance(plain, kind) or hasattr(plain.weight, "quant_state"):
        return None
    return plain


@dataclass
class HostTables:
    device: torch.device
    embed: Any = None  # the nn.Embedding whose table lives on the host
    head: Any = None  # the nn.Linear whose weight visits
    visit: torch.Tensor | None = None  # the head's weight on `device` while the loss needs it
    _waiting: dict[int, Any] = field(default_factory=dict, repr=False)  # head inputs whose gradient is not complete
    _keys: int = 0
    visits: int = 0  # copies of the head made (for tests and the log)
    _store: torch.Tensor | None = field(default=None, repr=False)  # the head's weight in host RAM
    _embed_store: torch.Tensor | None = field(default=None, repr=False)  # the embedding table in host RAM
    # On a CPU device .to() returns the store itself; tests set this so the visit is a real copy, as on a GPU.
    copy_on_host: ClassVar[bool] = False

    @classmethod
    def attach(cls, model: Any, device: torch.device) -> HostTables:
        base = base_of(model)
        embed = _plain(base.get_input_embeddings(), torch.nn.Embedding)
        head = _plain(base.get_output_embeddings(), torch.nn.Linear)
        if embed is None:
            raise ConfigError(
                [f"{KEY}=cpu: {type(base).__name__} has no plain 16-bit embedding table to keep in host RAM; set {KEY}=device."]
            )
        trained = [
            name for name, m in (("input embeddings", embed), ("LM head", head)) if m is not None and m.weight.requires_grad
        ]
        if trained:
            raise ConfigError(
                [
                    f"{KEY}=cpu keeps frozen tables in host RAM, but the {' and '.join(trained)} train here; "
                    f"set {KEY}=device (tables that train stay on the GPU), or do not train them."
                ]
            )
        tables = cls(device)
        tables.embed = embed
        if not embed.weight.is_meta:  # a pipeline stage without the embeddings holds them on the meta device
            embed.to(HOST)
            tables._embed_store = embed.weight.data
            embed.forward = tables._lookup(embed.forward)
        if head is not None and not head.weight.is_meta:
            tables.head = head
            store = head.weight.data.to(HOST)
            if device.type == "cuda":
                store = store.pin_memory()  # the visit copies at full link speed
            head.weight.data = tables._store = store
            if head.weight is embed.weight:
                tables._embed_store = store
            if head.bias is not None:
                head.bias.data = head.bias.data.to(device)
            head.forward = tables._visiting(head)
        # DDP must neither broadcast these nor refuse a module on two devices.
        names = [n for n, p in model.named_parameters() if p is embed.weight or (tables.head is not None and p is head.weight)]
        names += [n for n, b in model.named_buffers() if any(b is x for x in embed.buffers())]
        model._ddp_params_and_buffers_to_ignore = [*getattr(model, "_ddp_params_and_buffers_to_ignore", []), *names]
        # The model's first parameter is now the host table, so `model.device` says cpu and generate()
        # moves its inputs there: every call's tensors go to the compute device first.
        base.register_forward_pre_hook(tables._inputs_to_device, with_kwargs=True)
        return tables

    def _inputs_to_device(self, module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        move = lambda v: v.to(self.device) if isinstance(v, torch.Tensor) and v.device != self.device else v  # noqa: E731
        return tuple(move(a) for a in args), {k: move(v) for k, v in kwargs.items()}

    @property
    def parked_bytes(self) -> int:
        """Host RAM the tables take (a tied table once)."""
        stores = {t.data_ptr(): t for t in (self._embed_store, self._store) if t is not None}
        return sum(t.numel() * t.element_size() for t in stores.values())

    def _lookup(self, forward):
        def lookup(ids: torch.Tensor) -> torch.Tensor:
            self._repark()
            return forward(ids.to(HOST)).to(self.device)

        return lookup

    def _repark(self) -> None:
        """After a .to() of the whole model: the tables back to their host stores (not to copies of
        them: a tied table's copy would double its host RAM), the rest of their modules placed."""
        embed, head = self.embed, self.head
        if self._embed_store is not None and embed.weight.data_ptr() != self._embed_store.data_ptr():
            embed.weight.data = self._embed_store
            for name, buf in list(embed._buffers.items()):
                if buf is not None and buf.device != HOST:
                    embed._buffers[name] = buf.to(HOST)
        if head is not None and self._store is not None and head.weight.data_ptr() != self._store.data_ptr():
            head.weight.data = self._store
            if head.bias is not None:
                head.bias.data = head.bias.data.to(self.device)

    def _visiting(self, head: Any):
        def forward(x: torch.Tensor) -> torch.Tensor:
            self._repark()
            # A visit made under inference_mode cannot be saved for backward: a training forward copies anew.
            stale = self.visit is not None and self.visit.is_inference() and not torch.is_inference_mode_enabled()
            if self.visit is None or self.visit.device != x.device or stale:
                assert self._store is not None  # attach() installs this forward with the store
                self.visit = self._store.to(x.device, non_blocking=True, copy=self.copy_on_host)
                self.visits += 1
            # Each input that takes a gradient holds the visit until that gradient is complete (in
            # forward, and again for a chunk the loss recomputes inside backward), or until it is freed
            # with a graph that never ran backward (an abandoned loss must not pin the head for good).
            if torch.is_grad_enabled() and x.requires_grad:
                key = self._keys = self._keys + 1
                self._waiting[key] = weakref.finalize(x, self._input_done, key)
                x.register_hook(lambda grad, key=key: self._input_done(key))
            return torch.nn.functional.linear(x, self.visit, head.bias)

        return forward

    def _input_done(self, key: int) -> None:
        done = self._waiting.pop(key, None)
        if done is not None:
            done.detach()
        if not self._waiting:
            self.visit = None  # the chunks' recomputation is over: the head leaves the GPU

    @property
    def pending(self) -> int:
        """Head inputs whose gradient is not complete yet."""
        return len(self._waiting)
