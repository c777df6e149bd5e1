"""Issue 27 spike: can torch's DTensor tensor parallelism (ColwiseParallel) carry a bitsandbytes 4-bit layer?

    python -m torch.distributed.run --nproc_per_node 2 scripts/spikes/tensor_parallel_4bit.py

Session 12 (torch 2.13 CPU, bnb 0.50.2): no. parallelize_module turns the weight into a DTensor and
bitsandbytes then fails to rebuild its Params4bit ("Creating a new Tensor subclass Params4bit but
the raw Tensor object is already associated to a python object of type DTensor"). So
distributed.tensor_parallel needs a Megatron-style column/row wrapper of our own, each rank
quantizing only its own slice of the weight (issue 27; the reason belongs in docs/design.md).
"""

from __future__ import annotations

import bitsandbytes as bnb
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module


def main() -> None:
    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    torch.manual_seed(0)
    layer = bnb.nn.Linear4bit(64, 128, bias=False, compute_dtype=torch.float32, quant_type="nf4")
    layer.weight = bnb.nn.Params4bit(torch.randn(128, 64), requires_grad=False, quant_type="nf4")
    layer = layer.to("cpu")  # quantizes
    x = torch.randn(2, 5, 64)
    try:
        parallelize_module(layer, mesh, ColwiseParallel())
        print(dist.get_rank(), "column-parallel 4-bit layer ran:", tuple(layer(x).shape))
    except Exception as exc:  # noqa: BLE001 - the finding is the failure
        print(dist.get_rank(), "column-parallel 4-bit layer failed:", type(exc).__name__, str(exc).splitlines()[0][:200])
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
