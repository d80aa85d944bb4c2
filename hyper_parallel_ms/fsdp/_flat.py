"""Flattening a group of parameter pieces into one buffer per rank, and unflattening the
gathered buffer into the full parameters.

Each parameter of global dim 0 ``d0`` is cut into ``torch.chunk`` pieces over ``n`` ranks
(``c = ceil(d0 / n)`` rows, the last pieces shorter); every piece is zero-padded to ``c``
rows, flattened and concatenated, so all ranks send buffers of one length ``L`` and the
gathered buffer, seen as ``(n, L)``, holds rank ``i``'s pieces in row ``i``. All steps
are linear slicing and concatenation: their autodiff adjoint routes each gradient
element back to the piece it came from.

Example:
    >>> flat = FlatLayout(((5, 2),), 2)
    >>> flat.rows, flat.numels, flat.length, flat.piece_shape(0, 1)
    ((3,), (6,), 6, (2, 2))
"""
from __future__ import annotations

from math import prod
from typing import List, Sequence, Tuple

from mindspore import mint, ops

from ..layout import chunk_offsets, chunk_sizes

__all__ = ["FlatLayout", "split_flat", "concat_flat"]


class FlatLayout:
    """Offsets of ``shapes`` (global shapes) sharded on dim 0 over ``n`` ranks in one flat buffer."""

    def __init__(self, shapes: Sequence[Tuple[int, ...]], n: int) -> None:
        self.shapes = tuple(tuple(s) for s in shapes)
        self.n = n
        self.rows = tuple(-(-s[0] // n) for s in self.shapes)
        self.numels = tuple(r * prod(s[1:]) for r, s in zip(self.rows, self.shapes))
        offsets, total = [], 0
        for m in self.numels:
            offsets.append(total)
            total += m
        self.offsets = tuple(offsets)
        self.length = total

    def piece_shape(self, index: int, rank: int) -> Tuple[int, ...]:
        shape = self.shapes[index]
        return (chunk_sizes(shape[0], self.n)[rank],) + shape[1:]

    def piece_slice(self, index: int, rank: int) -> slice:
        shape = self.shapes[index]
        start = chunk_offsets(shape[0], self.n)[rank]
        return slice(start, start + chunk_sizes(shape[0], self.n)[rank])

    def pack(self, pieces: Sequence, rank: int) -> object:
        """This rank's pieces as one flat buffer of ``length`` elements. Shapes come from the
        layout, not from the tensors: reading a shape in PyNative waits for queued kernels."""
        parts = []
        for index, (piece, rows, numel) in enumerate(zip(pieces, self.rows, self.numels)):
            shape = self.piece_shape(index, rank)
            if shape[0] < rows:
                piece = mint.cat((piece, ops.zeros((rows - shape[0],) + shape[1:], piece.dtype)), 0)
            parts.append(piece.reshape((numel,)))
        return parts[0] if len(parts) == 1 else mint.cat(parts, 0)

    def unpack(self, gathered) -> List[object]:
        """The full parameters from the gathered ``(n * length,)`` buffer."""
        table = gathered.reshape((self.n, self.length))
        out = []
        for shape, rows, offset, numel in zip(self.shapes, self.rows, self.offsets, self.numels):
            block = table if numel == self.length else mint.narrow(table, 1, offset, numel)
            block = block.reshape((self.n * rows,) + shape[1:])
            out.append(block if shape[0] == self.n * rows else mint.narrow(block, 0, 0, shape[0]))
        return out


def split_flat(flat, shapes: Sequence[Tuple[int, ...]]) -> List[object]:
    """Cut a flat buffer into tensors of ``shapes`` (inverse of :func:`concat_flat`)."""
    if len(shapes) == 1:
        return [flat.reshape(shapes[0])]
    out, start = [], 0
    for shape in shapes:
        numel = prod(shape)
        out.append(mint.narrow(flat, 0, start, numel).reshape(shape))
        start += numel
    return out


def concat_flat(tensors: Sequence, shapes: Sequence[Tuple[int, ...]]) -> object:
    """Concatenate the flattenings of ``tensors`` (of ``shapes``)."""
    parts = [t.reshape((prod(s),)) for t, s in zip(tensors, shapes)]
    return parts[0] if len(parts) == 1 else mint.cat(parts, 0)
