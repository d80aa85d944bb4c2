"""Flattening a group of parameter pieces into one buffer per rank, and unflattening the
gathered buffer into the full parameters.

Each parameter of global dim 0 ``d0`` is cut into ``torch.chunk`` pieces over ``n`` ranks
(``c = ceil(d0 / n)`` rows, the last pieces shorter); every piece is zero-padded to ``c``
rows, flattened and concatenated, so all ranks send buffers of one length ``L`` and the
gathered buffer, seen as ``(n, L)``, holds rank ``i``'s pieces in row ``i``. All steps
are linear slicing and concatenation: their autodiff adjoint routes each gradient
element back to the piece it came from.

Example:
    >>> flat = FlatLayout([Chunks((5, 2), 2, 1)])
    >>> flat.numels, flat.length
    ((6,), 6)
"""
from __future__ import annotations

from math import prod
from typing import List, Sequence, Tuple

from mindspore import mint, ops

from ._chunks import Chunks

__all__ = ["FlatLayout", "padded_piece", "split_flat", "concat_flat"]


def padded_piece(piece, chunks: Chunks):
    """``piece`` zero-padded to ``chunks.rows`` rows. Shapes come from ``chunks``, not from the
    tensor: reading a shape in PyNative waits for queued kernels."""
    if not chunks.padding:
        return piece
    return mint.cat((piece, ops.zeros((chunks.padding,) + chunks.shape[1:], piece.dtype)), 0)


class FlatLayout:
    """Offsets of the padded pieces of ``chunks`` (one parameter each, same ``n`` and rank) in one flat buffer."""

    def __init__(self, chunks: Sequence[Chunks]) -> None:
        self.chunks = tuple(chunks)
        self.n = self.chunks[0].n
        self.numels = tuple(c.padded_numel for c in self.chunks)
        offsets, total = [], 0
        for m in self.numels:
            offsets.append(total)
            total += m
        self.offsets = tuple(offsets)
        self.length = total

    def pack(self, pieces: Sequence) -> object:
        """This rank's pieces as one flat buffer of ``length`` elements."""
        parts = [padded_piece(piece, chunks).reshape((numel,))
                 for piece, chunks, numel in zip(pieces, self.chunks, self.numels)]
        return parts[0] if len(parts) == 1 else mint.cat(parts, 0)

    def unpack(self, gathered) -> List[object]:
        """The full parameters from the gathered ``(n * length,)`` buffer."""
        table = gathered.reshape((self.n, self.length))
        out = []
        for chunks, offset, numel in zip(self.chunks, self.offsets, self.numels):
            block = table if numel == self.length else mint.narrow(table, 1, offset, numel)
            block = block.reshape((chunks.padded,) + chunks.shape[1:])
            out.append(block if chunks.padded == chunks.shape[0] else mint.narrow(block, 0, 0, chunks.shape[0]))
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
