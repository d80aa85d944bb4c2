"""Collectives composed from ``ops.AllReduce`` (sum), for MindSpore's CPU backend.

MCCL on CPU offers ``AllReduce`` (sum, float32/float16) on every group, inside ``ms.jit``
and with a backward; every other collective is built from it with linear local ops
(other dtypes travel exactly as float32, see :mod:`._exact`), so
MindSpore's autodiff gives each one its exact adjoint (all-gather <-> reduce-scatter,
all-to-all <-> inverse all-to-all). An all-gather where some rank's piece is empty runs
as a Cell with an explicit ``bprop``: that rank contributes nothing to the forward buffer,
and without the Cell autodiff would skip its backward all-reduce while the others wait.

Example (two ranks, group ``g``, each holding one row)::

    y = all_gather(x, 0, (1, 1), g)     # rank 0 writes rows [x0, 0], rank 1 [0, x1]; all-reduce
"""
from __future__ import annotations

from typing import Sequence, Tuple

import mindspore as ms
from mindspore import nn, ops

from .._mindspore import cell_per_call_site
from . import _native
from ._exact import check_dtype, place_over, sum_over
from ._tensor import narrow, pad_slot

__all__ = ["all_gather", "world_all_gather", "all_reduce", "reduce_scatter", "all_to_all", "sum_over", "place_over",
           "check_dtype"]

def _slot(sizes: Sequence[int], rank: int) -> Tuple[int, int]:
    """Slices before and after ``rank``'s piece in the gathered buffer."""
    return sum(sizes[:rank]), sum(sizes[rank + 1:])


class _AllGather(nn.Cell):
    """All-gather of pieces ``sizes`` along ``dim``: this rank's piece padded into its slot of a
    zero buffer, then all-reduced. Backward: all-reduce the gradient, keep this rank's slot."""

    def __init__(self, dim: int, sizes: Tuple[int, ...], group) -> None:
        super().__init__()
        self.dim, self.group = dim, group
        self.before, self.after = _slot(sizes, group.rank)
        self.length = sizes[group.rank]

    def construct(self, x):
        return place_over(pad_slot(x, self.dim, self.before, self.after), self.group)

    def bprop(self, x, out, dout):
        return (narrow(sum_over(dout, self.group), self.dim, self.before, self.length),)


@cell_per_call_site
def _all_gather_cell(dim: int, sizes: Tuple[int, ...], group) -> _AllGather:
    return _AllGather(dim, sizes, group)


class _WorldGather(_AllGather):
    """MCCL's own AllGather (on CPU: world group only), with :class:`_AllGather`'s backward
    (MCCL has no ReduceScatter, the primitive's own backward)."""

    def __init__(self, dim: int, sizes: Tuple[int, ...], group) -> None:
        super().__init__(dim, sizes, group)
        self.sizes = sizes

    def construct(self, x):
        return _native.all_gather(x, self.dim, self.sizes, self.group)


class _WorldGatherRows(_AllGather):
    """:class:`_WorldGather` for equal pieces gathered on dim 0: the primitive alone. Compiled, this
    is the only form: MindSpore 2.10 failed to compile ("The func graph is empty") a graph where a
    helper (``pad_dim``, ``min``) runs inside this Cell's ``construct`` and elsewhere in the graph."""

    def __init__(self, sizes: Tuple[int, ...], group) -> None:
        super().__init__(0, sizes, group)
        self.gather = _native.all_gather_prim(group.name)

    def construct(self, x):
        return self.gather(x)


@cell_per_call_site
def _world_gather_cell(dim: int, sizes: Tuple[int, ...], group) -> _AllGather:
    if dim == 0 and len(set(sizes)) == 1:
        return _WorldGatherRows(sizes, group)
    return _WorldGather(dim, sizes, group)


def world_all_gather(x, dim: int, sizes: Sequence[int], group):
    """:func:`all_gather` on the world group through MCCL's AllGather (forward bytes halved)."""
    return _world_gather_cell(dim, tuple(sizes), group)(x)


def all_gather(x, dim: int, sizes: Sequence[int], group):
    """Concatenate every rank's piece along ``dim`` (piece ``i`` has ``sizes[i]``); every rank pads its
    piece into its slot with the same ops (:func:`._tensor.pad_slot`)."""
    if 0 in sizes:
        return _all_gather_cell(dim, tuple(sizes), group)(x)
    before, after = _slot(sizes, group.rank)
    return place_over(pad_slot(x, dim, before, after), group)


def all_reduce(x, op: str, group):
    """Element-wise reduction (sum, avg, max, min) over the group; on bool, sum and max are
    a logical or, min a logical and (avg of integers and bool is refused while planning)."""
    if op == "sum":
        return sum_over(x, group)
    if op == "avg":
        return sum_over(x, group) / group.size
    slots = place_over(pad_slot(x.expand_dims(0), 0, group.rank, group.size - 1 - group.rank), group)
    if x.dtype == ms.bool_:
        return slots.any(0) if op == "max" else slots.all(0)
    if op == "max":
        return ops.amax(slots, 0)
    return ops.amin(slots, 0)


def reduce_scatter(x, dim: int, op: str, group, kept: Tuple[int, int]):
    """Reduce over the group, keep this rank's ``torch.chunk`` piece along ``dim`` (``kept``: its
    offset and length, computed in Python: compiled, no chunk arithmetic is left to the graph)."""
    return narrow(all_reduce(x, op, group), dim, kept[0], kept[1])


def all_to_all(x, split_dim: int, concat_dim: int, concat_sizes: Sequence[int], group, kept: Tuple[int, int]):
    """Send chunk ``j`` of ``split_dim`` to rank ``j``; concatenate what arrives on ``concat_dim``
    (``kept``: this rank's chunk of ``split_dim``, offset and length)."""
    return narrow(all_gather(x, concat_dim, concat_sizes, group), split_dim, kept[0], kept[1])
