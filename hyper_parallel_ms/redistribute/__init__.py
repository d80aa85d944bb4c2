"""Redistribution of sharded tensors: a pure planner and an executor on local tensors.

Example::

    from hyper_parallel_ms.redistribute import plan_redistribute, redistribution
    steps = plan_redistribute(src_layout, dst_layout, (8, 8))       # pure, cached
    y_local = redistribution(mesh, src_layout, dst_layout, (8, 8))(x_local)
"""
from ._executor import Redistribution, execute, lower, redistribution
from ._gradient import gradient_layout, gradient_placements, replicate_partials, shared_dims
from ._local import LocalRedistribute, plan_global_shape, plan_layouts
from ._planner import Step, plan_redistribute
from ._steps import AllGather, AllReduce, AllToAll, LocalStep, Multiply, Narrow, Partition, ReduceScatter

__all__ = ["LocalRedistribute", "plan_layouts", "plan_global_shape", "Step", "plan_redistribute", "lower", "execute",
           "Redistribution", "redistribution", "replicate_partials", "gradient_layout", "gradient_placements",
           "shared_dims", "LocalStep", "AllGather", "AllToAll", "Narrow", "AllReduce", "ReduceScatter", "Partition",
           "Multiply"]


def __getattr__(name: str):
    """``Chunk``, the old name of :class:`Narrow` (deprecated: warns; it goes in the next release)."""
    if name == "Chunk":
        from .._deprecated import renamed
        renamed("hyper_parallel_ms.redistribute.Chunk", "hyper_parallel_ms.redistribute.Narrow")
        return Narrow
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
