"""Where one parameter's dim-0 ``torch.chunk`` pieces lie: the one place fully_shard computes
chunk boundaries (piece sizes, offsets, the padding that makes every rank's piece as long as
the first), for cutting pieces, flat buffers and gathers alike. A parameter kept whole is one
piece (``n == 1``); a 0-d one is a single row.

Example:
    >>> c = Chunks((5, 2), 4, 3)
    >>> c.sizes, c.rows, c.local, c.start, c.padding, c.piece_shape
    ((2, 2, 1, 0), 2, 0, 5, 2, (0, 2))
    >>> Chunks((), 1, 0).padded_numel
    1
"""
from __future__ import annotations

from math import prod
from typing import Tuple

from ..layout import chunk_offsets, chunk_sizes

__all__ = ["Chunks"]


class Chunks:
    """Dim 0 of a parameter of global ``shape`` cut into ``n`` pieces, seen from the rank at
    index ``rank`` of the shard mesh dim: ``sizes``, ``rows`` (every padded piece's, the
    first's), this rank's ``local`` rows from row ``start``, its ``padding``, ``padded`` (the
    gathered rows, ``n * rows``), ``piece_shape``, ``row_numel`` (elements per row) and
    ``padded_numel`` (of one padded piece).

    Args:
        shape: the parameter's full shape (``()`` only with ``n == 1``).
        n: the number of pieces (ranks of the shard mesh dim).
        rank: this rank's index on that dim.
    """

    def __init__(self, shape: Tuple[int, ...], n: int, rank: int) -> None:
        self.shape, self.n, self.rank = tuple(int(s) for s in shape), n, rank
        if not self.shape and n != 1:
            raise ValueError(f"a 0-d parameter cannot be cut into {n} pieces")
        lead = self.shape[0] if self.shape else 1
        self.sizes = chunk_sizes(lead, n)
        self.rows, self.local = self.sizes[0], self.sizes[rank]
        self.start = chunk_offsets(lead, n)[rank]
        self.padding, self.padded = self.rows - self.local, self.rows * n
        self.piece_shape = (self.local,) + self.shape[1:] if self.shape else ()
        self.row_numel = prod(self.shape[1:])
        self.padded_numel = self.rows * self.row_numel

    def any_empty(self) -> bool:
        """Whether some rank's piece would have no rows."""
        return 0 in self.sizes
