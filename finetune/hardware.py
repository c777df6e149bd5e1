"""What this machine can compute in, decided once, before any weight is loaded.

precision=auto picks:
  CUDA GPU with bf16 (Ampere and newer)   -> bf16
  CUDA GPU without bf16 (Turing, Volta)    -> fp16 (+ GradScaler in the trainer)
  CPU with native bf16 (AVX512-BF16, AMX)  -> bf16
  any other CPU                            -> fp32 (bf16 matmul there is hundreds of times slower)
"""

from __future__ import annotations

import ctypes
import sys
from dataclasses import dataclass
from functools import cache, lru_cache
from pathlib import Path

import torch

from finetune.errors import HardwareError

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


@lru_cache(maxsize=1)
def cpu_has_native_bf16() -> bool:
    """True when the CPU executes bf16 dot products natively (Linux /proc/cpuinfo flags)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    flags: set[str] = set()
    for line in text.splitlines():
        if line.startswith("flags"):
            flags.update(line.split(":", 1)[1].split())
            break
    return bool(flags & {"avx512_bf16", "amx_bf16"})


@dataclass(frozen=True)
class Device:
    kind: str  # "cuda" | "cpu"
    name: str
    supports_bf16: bool
    supports_fp16: bool


def detect_device() -> Device:
    if torch.cuda.is_available():
        return Device(
            kind="cuda",
            name=torch.cuda.get_device_name(0),
            # Native bf16 only (Ampere+); torch otherwise reports emulated bf16 as supported.
            supports_bf16=torch.cuda.is_bf16_supported(including_emulation=False),
            supports_fp16=True,
        )
    return cpu_device()


def cpu_device() -> Device:
    """This machine's CPU as a Device (also on a machine with a GPU, for work sent to the CPU)."""
    # fp16 on CPU has no fast kernels and no GradScaler benefit: never offer it.
    return Device(kind="cpu", name="cpu", supports_bf16=cpu_has_native_bf16(), supports_fp16=False)


def device_free_bytes(device: torch.device) -> int | None:
    """Bytes free on a CUDA device now (what the driver reports, other processes included); None for a CPU."""
    if device.type != "cuda":
        return None
    free, _total = torch.cuda.mem_get_info(device)
    return int(free)


def resolve_precision(requested: str, device: Device | None = None) -> str:
    """'auto' | 'bf16' | 'fp16' | 'fp32' -> the concrete precision this machine will use.

    Raises HardwareError when an explicit choice is impossible or pathologically slow here.
    """
    dev = device or detect_device()
    if requested == "auto":
        if dev.supports_bf16:
            return "bf16"
        return "fp16" if dev.supports_fp16 else "fp32"
    if requested == "bf16" and not dev.supports_bf16:
        why = (
            "this CPU has no native bf16 (no avx512_bf16/amx_bf16 flag); bf16 matmul would run hundreds of times slower"
            if dev.kind == "cpu"
            else f"{dev.name} has no bf16 support"
        )
        raise HardwareError(
            f"precision=bf16 requested but {why}.", hint="use precision=auto (or fp32 on CPU, fp16 on older GPUs)"
        )
    if requested == "fp16" and not dev.supports_fp16:
        raise HardwareError(
            "precision=fp16 requested on a CPU, which has no fast fp16 kernels.", hint="use precision=auto or precision=fp32"
        )
    return requested


def torch_dtype(precision: str) -> torch.dtype:
    return DTYPES[precision]


@cache
def _malloc_trim():
    """glibc's malloc_trim, or None (another libc or OS)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        trim = ctypes.CDLL("libc.so.6").malloc_trim
    except (OSError, AttributeError):  # musl names its libc otherwise and has no malloc_trim
        return None
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    return trim


def release_free_heap() -> None:
    """Give the free pages inside the C heap back to the OS (glibc; elsewhere nothing).

    glibc gives memory back only from the top of its heap and as whole mmapped blocks
    (and its mmap threshold rises to the size of the weights' buffers, so they go to the
    heap). The heap copies of streamed weights are freed in the middle of it, between
    allocations that stay (quantization constants, norms), and most of that space is
    never reused: loading a 24-layer model left 732 MiB free inside a 957 MiB heap, all
    of it in RssAnon, and a disk load peaked as high as a device one. The same holds for
    the whole model FSDP frees once each process keeps only its shards.
    """
    trim = _malloc_trim()
    if trim is not None:
        trim(0)
