"""Safetensors files read and written one tensor at a time, so a 7B model never sits in memory whole.

    for path in weight_files(model_dir):
        header = read_header(path)
        with path.open("rb") as fh, ShardWriter(out, [(n, "BF16", shape), ...]) as writer:
            for name, entry in header.tensors.items():
                writer.write(name, read_tensor(fh, header, name).to(torch.bfloat16))

The format (https://huggingface.co/docs/safetensors): 8 bytes little-endian
header length N, N bytes of JSON {name: {dtype, shape, data_offsets: [begin,
end]}, "__metadata__": {...}}, then the raw little-endian tensor bytes. Since
every shape and dtype is known before the first byte is written, a writer can
emit the header first and then each tensor as it is produced.

Plain reads instead of safetensors.safe_open: safe_open maps the whole file, and
every page touched stays in the process's resident set until the file is
closed, so streaming through a 5 GB shard would show 5 GB of RSS.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import torch

from finetune.errors import ExportError

DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
}
NAMES = {v: k for k, v in DTYPES.items()}
INDEX = "model.safetensors.index.json"


@dataclass
class Header:
    path: Path
    tensors: dict[str, dict[str, Any]]  # name -> {"dtype", "shape", "data_offsets"}, in file order
    metadata: dict[str, str]
    data_start: int  # byte offset of the first tensor


def read_header(path: Path) -> Header:
    path = Path(path)
    try:
        with path.open("rb") as fh:
            (size,) = struct.unpack("<Q", fh.read(8))
            raw = json.loads(fh.read(size))
    except (OSError, struct.error, ValueError) as exc:
        raise ExportError(
            f"'{path}' is not a readable safetensors file: {exc}", hint="re-download or re-save the model"
        ) from None
    metadata = raw.pop("__metadata__", None) or {}
    # Sorted by offset: reading in file order keeps the disk access sequential.
    tensors = dict(sorted(raw.items(), key=lambda kv: kv[1]["data_offsets"][0]))
    return Header(path, tensors, metadata, 8 + size)


def read_tensor(fh: BinaryIO, header: Header, name: str) -> torch.Tensor:
    entry = header.tensors[name]
    dtype = DTYPES.get(entry["dtype"])
    if dtype is None:
        raise ExportError(f"'{header.path}': tensor '{name}' has dtype {entry['dtype']}, which this reader does not know")
    begin, end = entry["data_offsets"]
    buf = bytearray(end - begin)
    fh.seek(header.data_start + begin)
    if fh.readinto(buf) != len(buf):  # type: ignore[attr-defined]  # a file opened "rb": a BufferedReader
        raise ExportError(f"'{header.path}' is truncated (tensor '{name}' ends past the end of the file)", hint="re-download it")
    flat = torch.frombuffer(buf, dtype=dtype) if buf else torch.empty(0, dtype=dtype)
    return flat.reshape(entry["shape"])


def weight_files(model_dir: Path) -> list[Path]:
    """The safetensors files of a model directory, in the order its index lists them."""
    model_dir = Path(model_dir)
    index = model_dir / INDEX
    if index.is_file():
        names = json.loads(index.read_text(encoding="utf-8"))["weight_map"].values()
        return [model_dir / n for n in sorted(set(names))]
    if (model_dir / "model.safetensors").is_file():
        return [model_dir / "model.safetensors"]
    found = sorted(model_dir.glob("*.safetensors"))
    if found:
        return found
    pickled = sorted(p.name for p in model_dir.glob("*.bin"))
    what = f"only pickle weights ({', '.join(pickled[:3])})" if pickled else "no weight files"
    raise ExportError(
        f"'{model_dir}' holds {what}; export reads safetensors only (nothing is unpickled from disk)",
        hint="save the model with save_pretrained(..., safe_serialization=True) and point model.path at that copy",
    )


class ShardWriter:
    """Writes one safetensors file whose tensors (name, dtype name, shape) are declared up front."""

    def __init__(self, path: Path, plan: list[tuple[str, str, list[int]]], metadata: dict[str, str] | None = None):
        self.path = Path(path)
        header: dict[str, Any] = {"__metadata__": {"format": "pt", **(metadata or {})}}
        offset = 0
        self._expected: list[tuple[str, str, list[int], int]] = []
        for name, dtype, shape in plan:
            nbytes = torch.Size(shape).numel() * DTYPES[dtype].itemsize
            header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
            self._expected.append((name, dtype, list(shape), nbytes))
            offset += nbytes
        self.nbytes = offset
        text = json.dumps(header, separators=(",", ":")).encode()
        text += b" " * (-len(text) % 8)  # the spec pads the header so tensor data starts 8-byte aligned
        self._fh = self.path.open("wb")
        self._fh.write(struct.pack("<Q", len(text)) + text)
        self._next = 0

    def write(self, name: str, tensor: torch.Tensor) -> None:
        want_name, dtype, shape, nbytes = self._expected[self._next]
        if name != want_name or NAMES.get(tensor.dtype) != dtype or list(tensor.shape) != shape:
            raise ValueError(
                f"{self.path.name}: expected {want_name} {dtype} {shape}, got {name} {NAMES.get(tensor.dtype)} {list(tensor.shape)}"
            )
        data = tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy()
        assert data.nbytes == nbytes
        self._fh.write(data)  # type: ignore[arg-type]  # an ndarray is a buffer
        self._next += 1

    def close(self) -> None:
        if self._fh.closed:
            return
        self._fh.close()
        if self._next != len(self._expected):
            raise ValueError(f"{self.path.name}: {len(self._expected) - self._next} declared tensors were never written")

    def __enter__(self) -> ShardWriter:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close()
        else:
            self._fh.close()  # the caller's temporary directory is discarded anyway


def write_index(out_dir: Path, weight_map: dict[str, str], total_size: int) -> None:
    (Path(out_dir) / INDEX).write_text(
        json.dumps({"metadata": {"total_size": total_size}, "weight_map": weight_map}, indent=2, sort_keys=True) + "\n",
        encoding="utf-8",
    )
