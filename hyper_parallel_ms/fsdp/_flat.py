"""One flat buffer per rank for the pieces of a group of parameters, and the way back.

Each parameter's cut dim (``Chunks.dim``, 0 unless ``shard_placement_fn`` picked another) is
cut into ``torch.chunk`` pieces over ``n`` ranks (:class:`Chunks`: ``rows = ceil(d / n)``, the
last pieces shorter); every piece, seen with that dim in front, is zero-padded to ``rows``
rows, flattened and concatenated, so every rank holds a buffer of one length ``L`` and the
gathered buffer, seen as ``(n, L)``, holds rank ``i``'s pieces in row ``i``. Parameters kept
whole are the case ``n == 1``. Every step is linear slicing and concatenation; :func:`fold`
and :func:`split` go the way back (the gradients' way).

Example:
    >>> flat = FlatLayout([Chunks((5, 2), 2, 1), Chunks((3,), 2, 1)])
    >>> flat.numels, flat.offsets, flat.length
    ((6, 2), (0, 6), 8)
"""
from __future__ import annotations

from typing import List, Sequence

from mindspore import mint, ops

from ..comm._tensor import move_from_front, move_to_front
from ._chunks import Chunks

__all__ = ["FlatLayout", "pack", "unpack", "fold", "split"]


class FlatLayout:
    """Offsets of the padded pieces of ``chunks`` (one parameter each, same ``n`` and rank) in
    one flat buffer of ``length`` elements.

    Args:
        chunks: the :class:`Chunks` of each parameter, in the buffer's order.
    """

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


def _flat_piece(piece, chunks: Chunks, numel: int):
    """``piece`` flattened and zero-padded to ``numel`` elements (sizes from ``chunks``: reading a
    tensor's shape in PyNative waits for queued kernels)."""
    local = chunks.local * chunks.row_numel
    flat = move_to_front(piece, chunks.dim).reshape((local,))
    if local == numel:
        return flat
    return mint.cat((flat, ops.zeros((numel - local,), flat.dtype)), 0)


def pack(layout: FlatLayout, pieces: Sequence) -> object:
    """This rank's pieces as one flat buffer."""
    parts = [_flat_piece(pieces[i], layout.chunks[i], layout.numels[i]) for i in range(len(layout.chunks))]
    return parts[0] if len(parts) == 1 else mint.cat(parts, 0)


def _cut(layout: FlatLayout, table, index: int):
    """Parameter ``index``'s full value (a view) from the gathered buffer seen as ``(n, length)``."""
    chunks, offset, numel = layout.chunks[index], layout.offsets[index], layout.numels[index]
    block = table if numel == layout.length else mint.narrow(table, 1, offset, numel)
    if not chunks.shape:
        return block.reshape(())
    length = chunks.front_shape[0]
    block = block.reshape((chunks.padded,) + chunks.front_shape[1:])
    return move_from_front(block if chunks.padded == length else mint.narrow(block, 0, 0, length), chunks.dim)


def unpack(layout: FlatLayout, gathered) -> List[object]:
    """Every parameter's full value (views) from the gathered ``(n * length,)`` buffer."""
    table = gathered.reshape((layout.n, layout.length))
    return [_cut(layout, table, i) for i in range(len(layout.chunks))]


def fold(layout: FlatLayout, values: Sequence) -> object:
    """The inverse of :func:`unpack`: full-shape tensors (the values' gradients) laid out as the
    gathered ``(n * length,)`` buffer (padding rows zero)."""
    n, blocks = layout.n, []
    for chunks, numel, value in zip(layout.chunks, layout.numels, values):
        value = move_to_front(value, chunks.dim)
        if chunks.shape and chunks.padded != chunks.front_shape[0]:
            value = mint.cat((value, ops.zeros((chunks.padded - chunks.front_shape[0],) + chunks.front_shape[1:],
                                               value.dtype)), 0)
        blocks.append(value.reshape((n, numel)))
    table = blocks[0] if len(blocks) == 1 else mint.cat(blocks, 1)
    return table.reshape((n * layout.length,))


def split(layout: FlatLayout, flat) -> List[object]:
    """The inverse of :func:`pack`: this rank's pieces (views) from its ``(length,)`` buffer."""
    pieces = []
    for chunks, offset in zip(layout.chunks, layout.offsets):
        local = chunks.local * chunks.row_numel
        part = flat if local == layout.length else mint.narrow(flat, 0, offset, local)
        pieces.append(move_from_front(part.reshape(chunks.front_piece_shape), chunks.dim))
    return pieces
