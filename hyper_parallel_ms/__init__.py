"""hyper_parallel_ms: distributed tensors for MindSpore on Ascend, testable on CPU.

Device meshes, placements, DTensor with redistribution, and differentiable collectives in
the vocabulary of ``torch.distributed.tensor``.

Example::

    from hyper_parallel_ms import init_device_mesh, distribute_tensor, Shard, Replicate
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    dt = distribute_tensor(x, mesh, [Shard(0), Replicate()])
    y = dt.redistribute(mesh, [Replicate(), Shard(1)]).full_tensor()
"""
from . import checkpoint, comm, nn, ops
from .dtensor import (DTensor, distribute_tensor, empty, full, ones, rand, randn, sharding_table,
                      visualize_sharding, zeros)
from .layout import Layout
from .mesh import DeviceMesh, init_device_mesh
from .nn import (ColwiseParallel, GradientReducer, PrepareModuleInput, PrepareModuleInputOutput, PrepareModuleOutput,
                 RowwiseParallel, SequenceParallel, ShardingPlan, distribute_module, parallelize_module, shard_module)
from .placement import Partial, Placement, Replicate, Shard

__all__ = ["DeviceMesh", "init_device_mesh", "Placement", "Shard", "Replicate", "Partial", "Layout", "comm", "ops",
           "DTensor", "distribute_tensor", "zeros", "ones", "empty", "full", "rand", "randn",
           "visualize_sharding", "sharding_table", "nn", "ColwiseParallel", "RowwiseParallel", "SequenceParallel",
           "PrepareModuleInput", "PrepareModuleOutput", "PrepareModuleInputOutput", "parallelize_module",
           "distribute_module", "ShardingPlan", "shard_module", "GradientReducer", "checkpoint"]
__version__ = "0.1.0"
