"""A small catalogue of GPUs people fine-tune on, for `finetune plan`.

    from finetune.gpus import find_gpu, parse_bytes
    gpu = find_gpu("rtx4090")                 # GpuSpec(memory_bytes=24 GiB, bf16_tflops=165.2, ...)
    gpu = find_gpu("custom", memory="11GB")  # anything else: memory only, a generic speed

Figures are the vendors' spec-sheet numbers: memory as sold (GiB; "24 GB"
cards hold 24 GiB), dense (not 2:4-sparse) bf16 tensor TFLOPs with fp32
accumulate (GeForce cards run that at half their fp16-accumulate rate), memory
bandwidth, and the link between two cards of the kind (NVLink where the
product has it, else PCIe). `pcie_gbps` is the effective host link one
direction (about 80% of the PCIe generation's x16 peak); offload streams over it.
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Iterable
from dataclasses import dataclass, replace

from finetune.errors import GpuError

GiB = 1024**3


@dataclass(frozen=True)
class GpuSpec:
    name: str
    memory_bytes: int
    bf16_tflops: float  # dense tensor-core TFLOPs in the compute dtype the GPU trains in
    bandwidth_gbps: float  # device memory bandwidth, GB/s
    interconnect_gbps: float  # GPU<->GPU, one direction, GB/s (NVLink or PCIe)
    pcie_gbps: float  # host<->GPU, one direction, GB/s (effective)
    supports_bf16: bool = True
    description: str = ""
    gpus_per_node: int = 0  # several nodes (plan --nodes): GPUs in each; 0: every GPU in one node
    node_link_gbps: float = 0.0  # between nodes, one direction, GB/s (plan --node-link, given in Gbit/s)

    def link_gbps(self, ranks: Iterable[int]) -> float:
        """The slowest link a collective among these global ranks crosses: the nodes' link where they span
        nodes (ranks fill one node, then the next), else the GPUs' own."""
        if self.gpus_per_node and len({r // self.gpus_per_node for r in ranks}) > 1:
            return self.node_link_gbps
        return self.interconnect_gbps

    def nodes_of(self, gpus: int) -> int:
        """The nodes `gpus` GPUs fill."""
        return -(-gpus // self.gpus_per_node) if self.gpus_per_node else 1


_PCIE4 = 25.0  # 32 GB/s x16 peak, ~80% reached in practice
_PCIE5 = 50.0

CATALOGUE: dict[str, GpuSpec] = {
    g.name: g
    for g in [
        GpuSpec("rtx3060", 12 * GiB, 25.4, 360, _PCIE4, _PCIE4, description="GeForce RTX 3060 12GB"),
        GpuSpec(
            "rtx3090",
            24 * GiB,
            71.0,
            936,
            _PCIE4,
            _PCIE4,
            description="GeForce RTX 3090 24GB (PCIe between cards; NVLink bridge is rare)",
        ),
        GpuSpec("rtx4090", 24 * GiB, 165.2, 1008, _PCIE4, _PCIE4, description="GeForce RTX 4090 24GB"),
        GpuSpec("a10g", 24 * GiB, 70.0, 600, _PCIE4, _PCIE4, description="NVIDIA A10G 24GB (AWS g5)"),
        GpuSpec("l4", 24 * GiB, 121.0, 300, _PCIE4, _PCIE4, description="NVIDIA L4 24GB"),
        GpuSpec("a6000", 48 * GiB, 154.8, 768, _PCIE4, _PCIE4, description="NVIDIA RTX A6000 48GB"),
        GpuSpec("l40s", 48 * GiB, 362.0, 864, _PCIE4, _PCIE4, description="NVIDIA L40S 48GB"),
        GpuSpec("a100-40gb", 40 * GiB, 312.0, 1555, 300, _PCIE4, description="NVIDIA A100 SXM 40GB (NVLink 600 GB/s both ways)"),
        GpuSpec("a100-80gb", 80 * GiB, 312.0, 2039, 300, _PCIE4, description="NVIDIA A100 SXM 80GB"),
        GpuSpec("h100", 80 * GiB, 989.0, 3350, 450, _PCIE5, description="NVIDIA H100 SXM 80GB (NVLink 900 GB/s both ways)"),
        GpuSpec("h100-pcie", 80 * GiB, 756.0, 2000, _PCIE5, _PCIE5, description="NVIDIA H100 PCIe 80GB"),
        GpuSpec("h200", 141 * GiB, 989.0, 4800, 450, _PCIE5, description="NVIDIA H200 SXM 141GB"),
        GpuSpec("t4", 16 * GiB, 65.0, 320, _PCIE4 / 2, _PCIE4 / 2, supports_bf16=False, description="NVIDIA T4 16GB (fp16 only)"),
    ]
}

# Spellings people type for the same card.
_ALIASES = {
    "3060": "rtx3060",
    "3090": "rtx3090",
    "4090": "rtx4090",
    "a100": "a100-80gb",
    "a10080gb": "a100-80gb",
    "a10040gb": "a100-40gb",
    "a100-40": "a100-40gb",
    "a100-80": "a100-80gb",
    "h100-sxm": "h100",
    "h100sxm": "h100",
    "h10080gb": "h100",
    "a10": "a10g",
    "rtxa6000": "a6000",
}

# A card the catalogue does not know: its memory comes from --gpu-mem; its speed
# is a mid-range guess (RTX 3090-like), said in the plan's output.
_GENERIC = GpuSpec("custom", 0, 71.0, 900, _PCIE4, _PCIE4, description="unknown GPU (speed assumed RTX 3090-like)")

_SIZE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([kmgt]?i?b?)?\s*$", re.IGNORECASE)
_UNITS = {"": GiB, "b": 1, "k": 1024, "m": 1024**2, "g": GiB, "t": 1024**4}


def parse_bytes(text: str, what: str = "size") -> int:
    """'11GB' / '11 GiB' / '11g' / '11' -> bytes. GB means GiB here, as on GPU and RAM labels."""
    m = _SIZE.match(str(text))
    if not m:
        raise GpuError(f"{what}: cannot read '{text}' as a size", hint="write it like 11GB, 24GiB or 64G")
    unit = (m.group(2) or "").lower().rstrip("b").rstrip("i")
    return int(float(m.group(1)) * _UNITS[unit])


def _key(name: str) -> str:
    return re.sub(r"^(nvidia|geforce|rtx)[\s_-]*", "", name.strip().lower()).replace(" ", "").replace("_", "-")


def find_gpu(name: str | None, memory: str | int | None = None) -> GpuSpec:
    """The catalogue entry for `name` (memory overridden by `memory` when given), or a custom GPU of that memory."""
    if name in (None, "", "custom"):
        if memory is None:
            raise GpuError("no GPU given", hint=f"pass --gpu NAME ({', '.join(CATALOGUE)}) or --gpu-mem 11GB")
        mem = memory if isinstance(memory, int) else parse_bytes(memory, "--gpu-mem")
        return replace(_GENERIC, memory_bytes=mem)
    raw = name.strip().lower()
    key = (
        raw
        if raw in CATALOGUE
        else _ALIASES.get(raw) or _ALIASES.get(_key(raw)) or ("rtx" + _key(raw) if "rtx" + _key(raw) in CATALOGUE else _key(raw))
    )
    if key not in CATALOGUE:
        close = difflib.get_close_matches(raw, list(CATALOGUE) + list(_ALIASES), n=1, cutoff=0.5)
        guess = _ALIASES.get(close[0], close[0]) if close else None
        hint = f"did you mean '{guess}'? " if guess else ""
        raise GpuError(
            f"--gpu: unknown GPU '{name}'. Known: {', '.join(CATALOGUE)}",
            hint=f"{hint}for any other card pass its memory: --gpu-mem 11GB",
        )
    spec = CATALOGUE[key]
    if memory is not None:
        spec = replace(spec, memory_bytes=memory if isinstance(memory, int) else parse_bytes(memory, "--gpu-mem"))
    return spec


# Substrings of torch.cuda.get_device_name() -> catalogue name; the first match wins.
_DEVICE_NAMES = [
    ("rtx 3060", "rtx3060"),
    ("rtx 3090", "rtx3090"),
    ("rtx 4090", "rtx4090"),
    ("a10g", "a10g"),
    ("l40s", "l40s"),
    ("l4", "l4"),
    ("rtx a6000", "a6000"),
    ("h100 pcie", "h100-pcie"),
    ("h100", "h100"),
    ("h200", "h200"),
    ("a100-sxm4-80gb", "a100-80gb"),
    ("a100 80gb", "a100-80gb"),
    ("a100-pcie-80gb", "a100-80gb"),
    ("a100", "a100-40gb"),
    ("t4", "t4"),
]


def gpu_for_device(device_name: str, total_memory: int) -> GpuSpec:
    """The spec of a GPU torch reports ('NVIDIA GeForce RTX 4090', bytes): catalogue speed when known, real memory."""
    low = device_name.lower()
    for part, key in _DEVICE_NAMES:
        if part in low:
            return replace(CATALOGUE[key], memory_bytes=total_memory)
    return replace(_GENERIC, name=device_name, memory_bytes=total_memory)
