"""Loading part of a model: the modules a placement puts on a device are read from the checkpoint, the
modules it puts on "meta" are never read (a pipeline stage holds its own layers; finetune/parallel/pipeline.py).

    with only_placed(placement):
        model = AutoModelForCausalLM.from_pretrained(src, device_map=placement, ...)

transformers alone reads every tensor of the checkpoint and moves those bound for the meta device there:
the whole model's bytes from disk in every process. Here each such tensor is handed to the loader as an
empty meta tensor of its shape and dtype (it takes the path it always takes, 4-bit layers included), and
no dispatch hooks are attached (a stage runs on one device).
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

from finetune.model.shards import DTYPES  # safetensors' dtype names as torch dtypes


def _skipped(placement: dict[str, Any]) -> re.Pattern[str]:
    """The checkpoint keys of the modules placed on the meta device."""
    names = [re.escape(name) for name, device in placement.items() if device == "meta"]
    return re.compile(rf"^({'|'.join(names)})\.") if names else re.compile(r"(?!)")


class _Unread:
    """A checkpoint tensor's slice that yields an empty meta tensor of its shape and dtype: no bytes read."""

    def __init__(self, lazy: Any):
        self.lazy = lazy

    def __getitem__(self, index: Any) -> torch.Tensor:
        dtype = DTYPES[self.lazy.get_dtype()]
        return torch.empty(self.lazy.get_shape(), dtype=dtype, device="meta")[index]

    def __getattr__(self, name: str) -> Any:
        return getattr(self.lazy, name)


class _File:
    """A safetensors file whose tensors of skipped modules are never read."""

    def __init__(self, opened: Any, skipped: re.Pattern[str]):
        self.opened, self.skipped = opened, skipped

    def get_slice(self, key: str) -> Any:
        lazy = self.opened.get_slice(key)
        return _Unread(lazy) if self.skipped.match(key) else lazy

    def __getattr__(self, name: str) -> Any:
        return getattr(self.opened, name)

    def __enter__(self) -> _File:
        return self

    def __exit__(self, *exc: Any) -> Any:
        return self.opened.__exit__(*exc)


@contextmanager
def only_placed(placement: dict[str, Any] | None) -> Iterator[None]:
    """While from_pretrained runs: the meta-placed modules' tensors unread, accelerate's dispatch left out."""
    from transformers import modeling_utils

    if not placement:
        yield
        return
    skipped = _skipped(placement)
    names = vars(modeling_utils)  # the loader's module globals, swapped for the duration of one load
    open_file, dispatch = names["safe_open"], names.get("accelerate_dispatch")
    names["safe_open"] = lambda *args, **kwargs: _File(open_file(*args, **kwargs), skipped)
    if dispatch is not None:
        names["accelerate_dispatch"] = lambda *args, **kwargs: None
    try:
        yield
    finally:
        names["safe_open"] = open_file
        if dispatch is not None:
            names["accelerate_dispatch"] = dispatch
