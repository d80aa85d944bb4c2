"""This rank's concrete redistribution steps: one small record per step kind.

:func:`lower` turns a plan of :class:`.Step` (layouts, mesh dims) into records holding only
what running the step on this rank needs: ints, tuples of ints and reduce-op names, so they
hash (they key caches) and become constants of a compiled graph. Each field means one thing.

Pure Python (no MindSpore).

Example:
    >>> from hyper_parallel_ms.layout import Layout
    >>> from hyper_parallel_ms.placement import Shard, Replicate
    >>> from hyper_parallel_ms.redistribute._planner import plan_redistribute
    >>> src, dst = Layout((2,), (Replicate(),)), Layout((2,), (Shard(0),))
    >>> lower(plan_redistribute(src, dst, (5, 4)), (1,), (5, 4))
    (Narrow(mesh_dim=0, dim=0, offset=3, length=2),)
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Tuple, Union

from ..layout import chunk_offsets, chunk_sizes
from ._planner import Step

__all__ = ["AllGather", "AllToAll", "Narrow", "AllReduce", "ReduceScatter", "Partition", "Multiply", "LocalStep",
           "lower",
           "ends_in_narrow"]


@dataclass(frozen=True)
class AllGather:
    """Concatenate the pieces of the ranks along ``mesh_dim`` on tensor ``dim`` (piece ``i``
    has ``sizes[i]`` slices).

    Args:
        mesh_dim: the index of the mesh dim whose ranks gather.
        dim: the tensor dim the pieces are concatenated on.
        sizes: every rank's length along ``dim``, in group order.

    >>> AllGather(mesh_dim=0, dim=1, sizes=(3, 2))
    AllGather(mesh_dim=0, dim=1, sizes=(3, 2))
    """

    mesh_dim: int
    dim: int
    sizes: Tuple[int, ...]


@dataclass(frozen=True)
class AllToAll:
    """Split tensor ``split_dim`` into ``torch.chunk`` pieces, one per rank along ``mesh_dim``,
    and concatenate what arrives on ``concat_dim`` (piece ``i`` has ``concat_sizes[i]`` slices).

    Args:
        mesh_dim: the index of the mesh dim.
        split_dim: the tensor dim chunked and sent out.
        concat_dim: the tensor dim the received chunks are concatenated on.
        concat_sizes: every rank's length along ``concat_dim``.

    >>> AllToAll(mesh_dim=0, split_dim=1, concat_dim=0, concat_sizes=(2, 2)).split_dim
    1
    """

    mesh_dim: int
    split_dim: int
    concat_dim: int
    concat_sizes: Tuple[int, ...]


@dataclass(frozen=True)
class Narrow:
    """Keep slices ``offset .. offset + length`` of tensor ``dim`` (local, no communication): a
    ``chunk`` step of the plan, this rank's ``torch.chunk`` piece. (Named ``Chunk`` before, as the
    checkpoints' stored boxes are.)

    Args:
        mesh_dim: the index of the mesh dim the cut is for.
        dim: the tensor dim cut.
        offset: the first slice kept.
        length: the number of slices kept.

    >>> Narrow(mesh_dim=0, dim=0, offset=3, length=2)
    Narrow(mesh_dim=0, dim=0, offset=3, length=2)
    """

    mesh_dim: int
    dim: int
    offset: int
    length: int


@dataclass(frozen=True)
class AllReduce:
    """Reduce element-wise with ``op`` (sum, avg, max, min) over the ranks along ``mesh_dim``.

    Args:
        mesh_dim: the index of the mesh dim whose ranks reduce.
        op: ``"sum"``, ``"avg"``, ``"max"`` or ``"min"``.

    >>> AllReduce(mesh_dim=1, op="avg").op
    'avg'
    """

    mesh_dim: int
    op: str


@dataclass(frozen=True)
class ReduceScatter:
    """Reduce with ``op`` over the ranks along ``mesh_dim``, keep this rank's chunk of ``dim``.

    Args:
        mesh_dim: the index of the mesh dim.
        dim: the tensor dim scattered in ``torch.chunk`` pieces.
        op: ``"sum"``, ``"avg"``, ``"max"`` or ``"min"``.

    >>> ReduceScatter(mesh_dim=0, dim=0, op="sum").dim
    0
    """

    mesh_dim: int
    dim: int
    op: str


@dataclass(frozen=True)
class Partition:
    """Split a replicated value into a Partial(sum): every rank keeps ``value / divisor``.

    Args:
        mesh_dim: the index of the mesh dim of the new Partial(sum).
        divisor: the number of ranks along it.

    >>> Partition(mesh_dim=0, divisor=2).divisor
    2
    """

    mesh_dim: int
    divisor: int


@dataclass(frozen=True)
class Multiply:
    """Scale a value by ``factor`` (the number of ranks along a mesh dim): the backward of a
    Partial(avg) made from a value that is not one, whose gradient arrives divided by them.

    Args:
        mesh_dim: the index of the mesh dim.
        factor: the number of ranks along it.

    >>> Multiply(mesh_dim=0, factor=4).factor
    4
    """

    mesh_dim: int
    factor: int


LocalStep = Union[AllGather, AllToAll, Narrow, AllReduce, ReduceScatter, Partition, Multiply]


def lower(plan: Tuple[Step, ...], coordinate: Tuple[int, ...], shape: Tuple[int, ...]) -> Tuple[LocalStep, ...]:
    """This rank's records for ``plan`` on a tensor of global ``shape``.

    A partition into Partial(avg / max / min) is left out: every rank keeps the value itself.

    Args:
        plan: the steps of :func:`plan_redistribute`.
        coordinate: this rank's mesh coordinate.
        shape: the tensor's global shape.

    >>> from hyper_parallel_ms.layout import Layout
    >>> from hyper_parallel_ms.placement import Replicate, Shard
    >>> from hyper_parallel_ms.redistribute import plan_redistribute
    >>> lower(plan_redistribute(Layout((2,), (Replicate(),)), Layout((2,), (Shard(0),)), (5, 3)), (1,), (5, 3))
    (Narrow(mesh_dim=0, dim=0, offset=3, length=2),)
    """
    out = []
    for step in plan:
        a, before = step.mesh_dim, step.before
        n = before.mesh_shape[a]
        if step.kind == "all_gather":
            out.append(AllGather(a, step.dim, before.shard_sizes(shape, coordinate, a)))
        elif step.kind == "all_to_all":
            out.append(AllToAll(a, step.to_dim, step.dim, before.shard_sizes(shape, coordinate, a)))
        elif step.kind == "chunk":
            local, k = before.local_shape(shape, coordinate)[step.dim], coordinate[a]
            out.append(Narrow(a, step.dim, chunk_offsets(local, n)[k], chunk_sizes(local, n)[k]))
        elif step.kind == "all_reduce":
            out.append(AllReduce(a, step.op))
        elif step.kind == "reduce_scatter":
            out.append(ReduceScatter(a, step.dim, step.op))
        elif step.kind == "partition" and step.op == "sum":
            out.append(Partition(a, n))
    return tuple(out)


def ends_in_narrow(step: LocalStep) -> bool:
    """Whether the result of ``step`` may be a narrowed view into a larger buffer (a chunk, the
    kept piece of a reduce-scatter or all-to-all, a gather keeping one non-empty piece).

    >>> ends_in_narrow(Narrow(0, 0, 2, 2)), ends_in_narrow(AllGather(0, 0, (2, 2)))
    (True, False)
    """
    if isinstance(step, AllGather):
        return sum(1 for s in step.sizes if s) == 1 and len(step.sizes) > 1
    return isinstance(step, (Narrow, ReduceScatter, AllToAll))
