"""hyper_parallel_ms: distributed tensors for MindSpore on Ascend, testable on CPU.

Device meshes, placements and differentiable collectives in the vocabulary of
``torch.distributed.tensor``.

Example::

    from hyper_parallel_ms import init_device_mesh, Shard, Replicate, comm
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    y = comm.all_gather(x, mesh, "tp", dim=0)
"""
from . import comm
from .layout import Layout
from .mesh import DeviceMesh, init_device_mesh
from .placement import Partial, Placement, Replicate, Shard

__all__ = ["DeviceMesh", "init_device_mesh", "Placement", "Shard", "Replicate", "Partial", "Layout", "comm"]
__version__ = "0.1.0"
