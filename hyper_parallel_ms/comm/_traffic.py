"""Bytes each rank sends for one collective: the textbook figure and the issued one.

``textbook``: what a bandwidth-optimal (ring) implementation sends per rank for these
tensors, by the one cost model (:func:`.._cost.textbook_sent`): all-gather ``out - local``,
reduce-scatter ``in - local out``, all-reduce ``2 (n-1)/n * size``, all-to-all ``in - the
chunk kept``, broadcast ``size`` (the source's send).
``wire``: the same measure for the primitives actually issued: padding of uneven pieces
on the native path, and on the composed (CPU) path the all-reduce (ring, ``2 (n-1)/n``)
of the buffer each collective becomes. ``wire_itemsize`` is the bytes per element the
primitives carry when a dtype travels in another form (CPU: an int32 as two float32
limbs, 8 bytes; see :mod:`._exact`); ``gathered`` marks a reduction done by gathering
every rank's piece into slots (max/min on CPU, float64 sums).

Pure Python. Example:
    >>> all_gather_bytes("composed", 4, (2, 3), 4, 0, (2, 2, 2, 2))
    (72, 144)
"""
from __future__ import annotations

from math import prod
from typing import Optional, Sequence, Tuple

from .._cost import textbook_sent
from ..layout import chunk_sizes

__all__ = ["all_gather_bytes", "all_reduce_bytes", "reduce_scatter_bytes", "all_to_all_bytes",
           "all_to_all_single_bytes", "broadcast_bytes"]

Bytes = Tuple[int, int]


def _ring_all_reduce(n: int, nbytes: int) -> int:
    return int(textbook_sent("all_reduce", n, nbytes))


def _slice_bytes(shape: Sequence[int], dim: int, itemsize: int) -> int:
    return prod(s for d, s in enumerate(shape) if d != dim) * itemsize


def all_gather_bytes(path: str, n: int, shape: Sequence[int], itemsize: int, dim: int,
                     sizes: Sequence[int], wire_itemsize: Optional[int] = None) -> Bytes:
    """(textbook, wire) bytes for gathering pieces of ``sizes`` slices along ``dim``."""
    slice_bytes = _slice_bytes(shape, dim, itemsize)
    textbook = int(textbook_sent("all_gather", n, sum(sizes) * slice_bytes, shape[dim] * slice_bytes))
    row = _slice_bytes(shape, dim, wire_itemsize or itemsize)
    wire = (n - 1) * max(sizes) * row if path == "native" else _ring_all_reduce(n, sum(sizes) * row)
    return textbook, wire


def all_reduce_bytes(path: str, n: int, shape: Sequence[int], itemsize: int, op: str,
                     wire_itemsize: Optional[int] = None, gathered: Optional[bool] = None) -> Bytes:
    """(textbook, wire) bytes for an element-wise reduction of ``shape``.

    >>> all_reduce_bytes("composed", 2, (4,), 4, "sum", wire_itemsize=8)   # int32 as two limbs
    (16, 32)
    """
    if gathered is None:
        gathered = path == "composed" and op in ("max", "min")
    wire = prod(shape) * (wire_itemsize or itemsize)
    if gathered and path == "native":
        wire = (n - 1) * wire                                  # an all-gather of every piece
    else:
        wire = _ring_all_reduce(n, n * wire if gathered else wire)   # composed: all-reduce of n slots
    return _ring_all_reduce(n, prod(shape) * itemsize), wire


def reduce_scatter_bytes(path: str, n: int, shape: Sequence[int], itemsize: int, dim: int, rank: int,
                         op: str, wire_itemsize: Optional[int] = None, gathered: Optional[bool] = None) -> Bytes:
    """(textbook, wire) bytes for reducing ``shape`` and keeping a chunk of ``dim``."""
    row = _slice_bytes(shape, dim, itemsize)
    textbook = int(textbook_sent("reduce_scatter", n, shape[dim] * row, chunk_sizes(shape[dim], n)[rank] * row))
    if path == "native" and op in ("sum", "avg") and not gathered and wire_itemsize in (None, itemsize):
        return textbook, (n - 1) * -(-shape[dim] // n) * row
    return textbook, all_reduce_bytes(path, n, shape, itemsize, op, wire_itemsize, gathered)[1]


def all_to_all_bytes(path: str, n: int, shape: Sequence[int], itemsize: int, split_dim: int, concat_dim: int,
                     concat_sizes: Sequence[int], rank: int, wire_itemsize: Optional[int] = None) -> Bytes:
    """(textbook, wire) bytes for an all-to-all of ``shape`` (split ``split_dim``, concat ``concat_dim``)."""
    row = _slice_bytes(shape, split_dim, itemsize)
    textbook = int(textbook_sent("all_to_all", n, shape[split_dim] * row, chunk_sizes(shape[split_dim], n)[rank] * row))
    item = wire_itemsize or itemsize
    if path == "native":
        block = -(-shape[split_dim] // n) * max(concat_sizes) * _bytes_without(shape, (split_dim, concat_dim), item)
        return textbook, (n - 1) * block
    gathered = list(shape)
    gathered[concat_dim] = sum(concat_sizes)
    return textbook, _ring_all_reduce(n, prod(gathered) * item)


def all_to_all_single_bytes(path: str, n: int, shape: Sequence[int], itemsize: int, sends: Sequence[int], rank: int,
                            gathered_rows: int, counts: int = 0, wire_itemsize: Optional[int] = None) -> Bytes:
    """(textbook, wire) bytes for an all-to-all of uneven row blocks (dim 0): this rank sends ``sends[j]``
    rows to rank ``j``. Textbook: the rows sent to the other ranks. Wire: native, the same (``ops.AlltoAllV``
    sends exactly); composed, the all-reduce of the buffer of ``gathered_rows`` rows; plus, either way, the
    all-reduce of the ``counts`` float32 split counts the ranks exchanged first (0: none).

    >>> all_to_all_single_bytes("composed", 2, (3, 4), 4, (1, 2), 0, 5, counts=8)
    (32, 112)
    """
    row = _slice_bytes(shape, 0, itemsize)
    textbook = int(textbook_sent("all_to_all", n, shape[0] * row, sends[rank] * row))
    exchange = _ring_all_reduce(n, counts * 4) if counts else 0
    if path == "native":
        return textbook, (shape[0] - sends[rank]) * _slice_bytes(shape, 0, wire_itemsize or itemsize) + exchange
    return textbook, _ring_all_reduce(n, gathered_rows * _slice_bytes(shape, 0, wire_itemsize or itemsize)) + exchange


def broadcast_bytes(path: str, n: int, shape: Sequence[int], itemsize: int,
                    wire_itemsize: Optional[int] = None) -> Bytes:
    """(textbook, wire) bytes for broadcasting ``shape``."""
    nbytes = int(textbook_sent("broadcast", n, prod(shape) * itemsize))
    wire = prod(shape) * (wire_itemsize or itemsize)
    return nbytes, wire if path == "native" else _ring_all_reduce(n, wire)


def _bytes_without(shape: Sequence[int], dims: Sequence[int], itemsize: int) -> int:
    return prod(s for d, s in enumerate(shape) if d not in dims) * itemsize
