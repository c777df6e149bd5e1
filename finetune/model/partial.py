"""Loading part of a model: the modules a placement puts on a device are read from the checkpoint, the
modules it puts on "meta" are never read (a pipeline stage holds its own layers; finetune/parallel/pipeline.py),
and a tensor-parallel rank reads only its rows or columns of each split weight (finetune/parallel/tensor.py).

    with only_placed(placement):
        model = AutoModelForCausalLM.from_pretrained(src, device_map=placement, ...)

transformers alone reads every tensor of the checkpoint and moves those bound for the meta device there:
the whole model's bytes from disk in every process. Here each such tensor is handed to the loader as an
empty meta tensor of its shape and dtype (it takes the path it always takes, 4-bit layers included), and
no dispatch hooks are attached (a stage runs on one device).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
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


@dataclass(frozen=True)
class Split:
    """A tensor-parallel rank's reading: the dimension each checkpoint key is split along (None: whole), this
    rank's share of `size`, and the narrowed config its model is built from (parallel/tensor.py)."""

    dim_of: Callable[[str], int | None]
    rank: int
    size: int
    config: Any


class _Share:
    """A checkpoint tensor's slice that reads only one rank's share along `dim` (tensor parallelism)."""

    def __init__(self, lazy: Any, dim: int, rank: int, size: int):
        self.lazy, self.dim, self.rank, self.size = lazy, dim, rank, size

    def get_shape(self) -> list[int]:
        shape = list(self.lazy.get_shape())
        shape[self.dim] //= self.size
        return shape

    def __getitem__(self, index: Any) -> torch.Tensor:
        shape = self.lazy.get_shape()
        n = shape[self.dim] // self.size
        share = [slice(None)] * len(shape)
        share[self.dim] = slice(self.rank * n, (self.rank + 1) * n)
        return self.lazy[tuple(share)][index]

    def __getattr__(self, name: str) -> Any:
        return getattr(self.lazy, name)


class _File:
    """A safetensors file whose tensors of skipped modules are never read, and whose split tensors are
    read as this rank's share."""

    def __init__(self, opened: Any, skipped: re.Pattern[str], split: Split | None = None):
        self.opened, self.skipped, self.split = opened, skipped, split

    def get_slice(self, key: str) -> Any:
        lazy = self.opened.get_slice(key)
        split = self.split
        dim = split.dim_of(key) if split is not None else None
        if split is not None and dim is not None:
            lazy = _Share(lazy, dim, split.rank, split.size)
        # A skipped module of a split layer (another stage's, under pipeline x tensor parallelism): its share's shape.
        return _Unread(lazy) if self.skipped.match(key) else lazy

    def __getattr__(self, name: str) -> Any:
        return getattr(self.opened, name)

    def __enter__(self) -> _File:
        return self

    def __exit__(self, *exc: Any) -> Any:
        return self.opened.__exit__(*exc)


@contextmanager
def only_placed(placement: dict[str, Any] | None, split: Split | None = None) -> Iterator[None]:
    """While from_pretrained runs: the meta-placed modules' tensors unread, accelerate's dispatch left out;
    with split (tensor parallelism: parallel/tensor.py), each split tensor read as this rank's share."""
    from transformers import modeling_utils

    if not placement and split is None:
        yield
        return
    skipped = _skipped(placement or {})
    names = vars(modeling_utils)  # the loader's module globals, swapped for the duration of one load
    open_file, dispatch = names["safe_open"], names.get("accelerate_dispatch")
    names["safe_open"] = lambda *args, **kwargs: _File(open_file(*args, **kwargs), skipped, split)
    if dispatch is not None:
        names["accelerate_dispatch"] = lambda *args, **kwargs: None
    try:
        yield
    finally:
        names["safe_open"] = open_file
        if dispatch is not None:
            names["accelerate_dispatch"] = dispatch
