"""The launch's processes as one torch DeviceMesh over the split dimensions, numbered as declarations/layout.Layout
numbers them (pipeline outermost, tensor-parallel innermost): each split room takes its process group from its own
dimension of it (torchtitan's ParallelDims), none builds groups of its own.

    mesh = build_mesh(layout, device)    # None for one process or data parallelism alone (DDP, FSDP, ZeRO use the world)
    group = dim_group(mesh, "tp")        # this rank's tensor-parallel group; None where the dimension is 1
    group = dims_group(mesh, ("dp", "cp"))   # the ranks holding the same share: data x context flattened
"""

from __future__ import annotations

from typing import Any

import torch

from finetune.declarations.layout import Layout


def build_mesh(layout: Layout, device: torch.device) -> Any:
    """The mesh of the dimensions larger than 1 (a dimension of 1 would cost a process group per rank), or None when
    nothing is split. A collective: every rank builds it, at the same point of the launch."""
    if layout.pp * layout.cp * layout.tp == 1:
        return None
    from torch.distributed.device_mesh import init_device_mesh

    grid = {"pp": layout.pp, "dp": layout.replicas, "cp": layout.cp, "tp": layout.tp}  # outermost first: Layout's numbering
    used = [(name, n) for name, n in grid.items() if n > 1]
    return init_device_mesh(device.type, tuple(n for _, n in used), mesh_dim_names=tuple(name for name, _ in used))


def dim_group(mesh: Any, dim: str) -> Any:
    """This rank's process group along `dim`, or None where the dimension is 1 (no group: nothing to sum over)."""
    if mesh is None or dim not in (mesh.mesh_dim_names or ()):
        return None
    return mesh[dim].get_group()


def dims_group(mesh: Any, dims: tuple[str, ...]) -> Any:
    """This rank's process group over several dimensions at once (their ranks flattened, as torchtitan's dp_cp), or
    None where every one is 1. A collective: every rank asks, at the same point."""
    names = tuple(d for d in dims if mesh is not None and d in (mesh.mesh_dim_names or ()))
    if len(names) <= 1:
        return dim_group(mesh, names[0]) if names else None
    return mesh[names]._flatten().get_group()
