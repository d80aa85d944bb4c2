"""Collectives on the device's native primitives (HCCL on Ascend).

``ops.AllGather`` / ``ops.ReduceScatter`` work on dim 0 and ``ops.AlltoAll`` needs equal
blocks, so other dims are moved to the front and uneven pieces are padded to the
largest one, then trimmed. Every step is linear, and MindSpore's own backward of each
primitive (AllGather <-> ReduceScatter sum, AlltoAll <-> inverse AlltoAll, AllReduce sum
-> AllReduce) gives the exact adjoint. ``ops.Broadcast``'s own backward passes the
gradient through unchanged, which is wrong for SPMD losses; :mod:`._broadcast` supplies
the right one. ReduceScatter has a backward for sum only, so reduce-scatter with
max/min runs as an all-reduce plus the local chunk.

dtypes HCCL's all-reduce lacks (its list: int8/16/32/64, float16/32, bfloat16) are
adapted: bool and uint8 reduce as int32 (a bool sum is a logical or, as in PyTorch), and
float64 reductions all-gather the pieces and reduce them locally in rank order. bool
travels as uint8 through the data-moving primitives.

Example (Ascend, group ``g`` of 2 ranks, each holding a (1, 3) piece)::

    y = all_gather(x, 0, (1, 1), g)     # (2, 3) on both ranks
"""
from __future__ import annotations

from typing import Sequence, Tuple

import mindspore as ms
from mindspore import ops

from .._mindspore import cached_in_python
from ._exact import wire_sum
from ._tensor import move_to_front, move_from_front, narrow, pad_dim, pad_to_block, select_pieces

__all__ = ["all_gather", "all_reduce", "reduce_scatter", "all_to_all"]

_OPS = {"sum": ops.ReduceOp.SUM, "max": ops.ReduceOp.MAX, "min": ops.ReduceOp.MIN}


@cached_in_python
def _all_reduce_prim(op: str, group_name: str):
    return ops.AllReduce(_OPS[op], group_name)


@cached_in_python
def all_gather_prim(group_name: str):
    return ops.AllGather(group_name)


@cached_in_python
def _reduce_scatter_prim(group_name: str):
    return ops.ReduceScatter(ops.ReduceOp.SUM, group_name)


@cached_in_python
def _all_to_all_prim(n: int, split_dim: int, concat_dim: int, group_name: str):
    return ops.AlltoAll(n, split_dim, concat_dim, group_name)


def all_gather(x, dim: int, sizes: Sequence[int], group):
    """Concatenate every rank's piece along ``dim`` (piece ``i`` has ``sizes[i]``)."""
    if x.dtype == ms.bool_:
        return all_gather(x.astype(ms.uint8), dim, sizes, group).astype(ms.bool_)
    block = max(sizes)
    padded = pad_to_block(x, dim, sizes)    # uneven pieces: the same ops on every rank
    gathered = move_from_front(all_gather_prim(group.name)(move_to_front(padded, dim)), dim)
    return gathered if min(sizes) == block else select_pieces(gathered, dim, block, sizes)


def all_reduce(x, op: str, group):
    """Element-wise reduction (sum, avg, max, min) over the group."""
    if x.dtype == ms.bool_:
        return all_reduce(x.astype(ms.int32), "min" if op == "min" else "max", group).astype(ms.bool_)
    if x.dtype == ms.uint8:
        return all_reduce(x.astype(ms.int32), op, group).astype(ms.uint8)
    if x.dtype == ms.float64:
        slots = all_gather(x.expand_dims(0), 0, (1,) * group.size, group)
        if op in ("max", "min"):
            return ops.amax(slots, 0) if op == "max" else ops.amin(slots, 0)
        total = slots[0]
        for r in range(1, group.size):
            total = total + slots[r]
        return total / group.size if op == "avg" else total
    if op in ("sum", "avg"):       # GRAPH_MODE: with its own backward (see ._exact.wire_sum)
        total = wire_sum(x, group.name)
        return total / group.size if op == "avg" else total
    return _all_reduce_prim(op, group.name)(x)


def reduce_scatter(x, dim: int, op: str, group, kept: Tuple[int, int]):
    """Reduce over the group, keep this rank's ``torch.chunk`` piece along ``dim`` (``kept``: its
    offset and length, from the planned call)."""
    size, n = x.shape[dim], group.size
    start, length = kept
    if op in ("max", "min") or x.dtype in (ms.bool_, ms.uint8, ms.float64):
        return narrow(all_reduce(x, op, group), dim, start, length)
    step = -(-size // n)
    padded = move_to_front(pad_dim(x, dim, 0, step * n - size), dim)
    out = move_from_front(_reduce_scatter_prim(group.name)(padded), dim)
    if op == "avg":
        out = out / n
    return narrow(out, dim, 0, length)


def all_to_all(x, split_dim: int, concat_dim: int, concat_sizes: Sequence[int], group, kept: Tuple[int, int]):
    """Send chunk ``j`` of ``split_dim`` to rank ``j``; concatenate what arrives on ``concat_dim``
    (``kept``: this rank's chunk of ``split_dim``, offset and length, from the planned call)."""
    if x.dtype == ms.bool_:
        return all_to_all(x.astype(ms.uint8), split_dim, concat_dim, concat_sizes, group, kept).astype(ms.bool_)
    size, n = x.shape[split_dim], group.size
    step, block = -(-size // n), max(concat_sizes)
    padded = pad_dim(x, split_dim, 0, step * n - size)
    padded = pad_to_block(padded, concat_dim, concat_sizes)     # uneven pieces: as all_gather
    out = _all_to_all_prim(n, split_dim, concat_dim, group.name)(padded)
    out = narrow(out, split_dim, 0, kept[1])
    if min(concat_sizes) == block:
        return out
    return select_pieces(out, concat_dim, block, concat_sizes)

