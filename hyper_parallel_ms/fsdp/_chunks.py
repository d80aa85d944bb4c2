"""Where one parameter's ``torch.chunk`` pieces lie: the one place fully_shard computes chunk
boundaries (piece sizes, offsets, the padding that makes every rank's piece as long as the
first), for cutting pieces, flat buffers and gathers alike. A parameter is cut on one dim
(``dim``, 0 by default; FSDP2's ``shard_placement_fn`` may pick another); flat buffers and
gathers see it with that dim moved to the front (``front_shape``), so their pieces are runs of
``rows`` slices. A parameter kept whole is one piece (``n == 1``); a 0-d one is a single row.

Example:
    >>> c = Chunks((5, 2), 4, 3)
    >>> c.sizes, c.rows, c.local, c.start, c.padding, c.piece_shape
    ((2, 2, 1, 0), 2, 0, 5, 2, (0, 2))
    >>> c = Chunks((2, 5), 2, 1, dim=1)
    >>> c.piece_shape, c.front_shape, c.front_piece_shape, c.row_numel
    ((2, 2), (5, 2), (2, 2), 2)
    >>> Chunks((), 1, 0).padded_numel
    1
"""
from __future__ import annotations

from math import prod
from typing import Tuple

from ..layout import chunk_offsets, chunk_sizes

__all__ = ["Chunks", "cut_dim"]


def cut_dim(shape: Tuple[int, ...], dim: int) -> int:
    """``dim`` of a parameter of ``shape``, counted from the front (0 for a 0-d one, cut as a single
    row); a dim the shape does not have is refused.

    Example:
        >>> cut_dim((4, 3), -1), cut_dim((), 0)
        (1, 0)
    """
    ndim = max(len(shape), 1)
    if not -ndim <= dim < ndim:
        raise ValueError(f"dim {dim} is out of range for a parameter of shape {tuple(shape)}")
    return dim % ndim


class Chunks:
    """Dim ``dim`` of a parameter of global ``shape`` cut into ``n`` pieces, seen from the rank at
    index ``rank`` of the shard mesh dim: ``sizes``, ``rows`` (every padded piece's slices along
    ``dim``, the first's), this rank's ``local`` slices from slice ``start``, its ``padding``,
    ``padded`` (the gathered slices, ``n * rows``), ``piece_shape``, ``front_shape`` /
    ``front_piece_shape`` (the whole and the piece with ``dim`` moved to the front, as flat
    buffers and gathers hold them), ``row_numel`` (elements per slice) and ``padded_numel``
    (of one padded piece).

    Args:
        shape: the parameter's full shape (``()`` only with ``n == 1``).
        n: the number of pieces (ranks of the shard mesh dim).
        rank: this rank's index on that dim.
        dim: the dim cut (negative counts from the end).
    """

    def __init__(self, shape: Tuple[int, ...], n: int, rank: int, dim: int = 0) -> None:
        self.shape, self.n, self.rank = tuple(int(s) for s in shape), n, rank
        if not self.shape and n != 1:
            raise ValueError(f"a 0-d parameter cannot be cut into {n} pieces")
        self.dim = cut_dim(self.shape, dim)
        lead = self.shape[self.dim] if self.shape else 1
        rest = self.shape[:self.dim] + self.shape[self.dim + 1:]
        self.sizes = chunk_sizes(lead, n)
        self.rows, self.local = self.sizes[0], self.sizes[rank]
        self.start = chunk_offsets(lead, n)[rank]
        self.padding, self.padded = self.rows - self.local, self.rows * n
        self.front_shape = (lead,) + rest if self.shape else ()
        self.front_piece_shape = (self.local,) + rest if self.shape else ()
        self.piece_shape = (self.shape[:self.dim] + (self.local,) + self.shape[self.dim + 1:]) if self.shape else ()
        self.row_numel = prod(rest)
        self.padded_numel = self.rows * self.row_numel

    def any_empty(self) -> bool:
        """Whether some rank's piece would have no slices."""
        return 0 in self.sizes
