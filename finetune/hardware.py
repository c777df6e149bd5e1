"""What this machine can compute in, decided once, before any weight is loaded.

precision=auto picks:
  CUDA GPU with bf16 (Ampere and newer)   -> bf16
  CUDA GPU without bf16 (Turing, Volta)    -> fp16 (+ GradScaler in the trainer)
  CPU with native bf16 (AVX512-BF16, AMX)  -> bf16
  any other CPU                            -> fp32 (bf16 matmul there is hundreds of times slower)
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
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
    # fp16 on CPU has no fast kernels and no GradScaler benefit: never offer it.
    return Device(kind="cpu", name="cpu", supports_bf16=cpu_has_native_bf16(), supports_fp16=False)


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
        raise HardwareError(f"precision=bf16 requested but {why}.", hint="use precision=auto (or fp32 on CPU, fp16 on older GPUs)")
    if requested == "fp16" and not dev.supports_fp16:
        raise HardwareError(
            "precision=fp16 requested on a CPU, which has no fast fp16 kernels.", hint="use precision=auto or precision=fp32"
        )
    return requested


def torch_dtype(precision: str) -> torch.dtype:
    return DTYPES[precision]
