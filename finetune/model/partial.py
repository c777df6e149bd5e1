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
from pathlib import Path
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


def whole_blocks(shape: tuple[int, int], dim: int, size: int, blocksize: int) -> bool:
    """Whether every rank's share along `dim` is made of whole quantization blocks of the whole weight (blocksize
    consecutive elements of it, row-major: bitsandbytes' layout), none straddling a share's edge."""
    rows, cols = shape
    if dim == 0:  # a share of whole rows: one run of elements
        return (rows // size) * cols % blocksize == 0
    return cols % blocksize == 0 and (cols // size) % blocksize == 0  # a run of columns in every row


def share_blocks(shape: tuple[int, int], dim: int, rank: int, size: int, blocksize: int) -> torch.Tensor | None:
    """The whole weight's quantization blocks that make up one rank's share along `dim`, in the share's own
    row-major order; None when a block straddles a share's edge (no share can be cut from the whole's)."""
    if not whole_blocks(shape, dim, size, blocksize):
        return None
    rows, cols = shape
    if dim == 0:
        count = (rows // size) * cols // blocksize
        return torch.arange(rank * count, (rank + 1) * count)
    width = cols // size
    per_row, first = cols // blocksize, rank * width // blocksize
    return (torch.arange(rows)[:, None] * per_row + first + torch.arange(width // blocksize)[None, :]).reshape(-1)


def cut_from_whole(weight: Any, whole: torch.Tensor, blocks: torch.Tensor) -> None:
    """A rank's 4-bit share (bitsandbytes' Params4bit, quantized alone by the loader) replaced by its blocks of the
    whole weight's quantization, as one process quantizes it: the same 4-bit codes and, with double quant, the
    whole's absmax. A share that is a run of whole 256-block groups (a column-parallel share of a large weight)
    keeps them double-quantized: the whole's 8-bit codes, their groups' scales and its offset, sliced. Any other
    (a row-parallel share's blocks are strided over the rows) keeps the absmax as one process's dequantization
    computes it, in fp32. The share then dequantizes to exactly one process's values."""
    import bitsandbytes.functional as bnbf

    state = weight.quant_state
    packed, full = bnbf.quantize_4bit(
        whole.to(device=weight.device, dtype=state.dtype).contiguous(),
        blocksize=state.blocksize,
        compress_statistics=weight.compress_statistics,
        quant_type=state.quant_type,
        quant_storage=weight.quant_storage,
    )
    codes = packed.view(torch.uint8).reshape(-1, state.blocksize // 2)[blocks.to(packed.device)].reshape(-1)
    weight.data = codes.view(weight.quant_storage).reshape(weight.data.shape)
    groups = _whole_groups(blocks, full.state2.blocksize) if full.nested else None
    if groups is not None:  # double quant kept: the share's codes and scales are runs of the whole's
        (first, last), (g0, g1) = groups
        nested = bnbf.QuantState(
            absmax=full.state2.absmax[g0:g1].contiguous(),
            code=full.state2.code,
            blocksize=full.state2.blocksize,
            dtype=full.state2.dtype,
        )
        weight.quant_state = bnbf.QuantState(
            absmax=full.absmax[first:last].contiguous(),
            shape=state.shape,
            code=full.code,
            blocksize=state.blocksize,
            quant_type=state.quant_type,
            dtype=state.dtype,
            offset=full.offset,
            state2=nested,
        )
        return
    absmax = full.absmax
    if full.nested:  # as bitsandbytes' dequantize_4bit computes it, step for step
        absmax = bnbf.dequantize_blockwise(full.absmax, full.state2)
        absmax += full.offset
        absmax = absmax.float()
    weight.quant_state = bnbf.QuantState(
        absmax=absmax[blocks.to(absmax.device)].contiguous(),
        shape=state.shape,
        code=full.code,
        blocksize=state.blocksize,
        quant_type=state.quant_type,
        dtype=state.dtype,
    )
    weight.compress_statistics = False  # its absmax is the whole's, in fp32: not quantized again


def _whole_groups(blocks: torch.Tensor, group: int) -> tuple[tuple[int, int], tuple[int, int]] | None:
    """((first, last) block, (first, last) group) when `blocks` is one run of whole groups of `group` blocks, else None."""
    first, count = int(blocks[0]), blocks.numel()
    if first % group or count % group or not torch.equal(blocks, torch.arange(first, first + count, device=blocks.device)):
        return None
    return (first, first + count), (first // group, (first + count) // group)


def checkpoint_tensors(source: str, revision: str | None) -> dict[str, Path]:
    """Each tensor name of a model's safetensors checkpoint, and its file (a hub model: the copy the loader
    downloaded; nothing is fetched)."""
    from finetune.model.shards import read_header, weight_files

    path = Path(source)
    if not path.is_dir():
        from huggingface_hub import snapshot_download

        path = Path(
            snapshot_download(source, revision=revision, local_files_only=True, allow_patterns=["*.safetensors", "*.json"])
        )
    return {name: f for f in weight_files(path) for name in read_header(f).tensors}
