"""Where one parameter's dim-0 ``torch.chunk`` pieces lie: the one place fully_shard computes
chunk boundaries (piece sizes, offsets and the padding that makes every rank's piece as long
as the first), for cutting pieces, flat buffers and the compiled gathers alike.

Example:
    >>> c = Chunks((5, 2), 4, 3)
    >>> c.sizes, c.offsets, c.rows, c.local, c.start, c.padding, c.piece_shape
    ((2, 2, 1, 0), (0, 2, 4, 5), 2, 0, 5, 2, (0, 2))
"""
from __future__ import annotations

from dataclasses import dataclass, field
from math import prod
from typing import Tuple

from ..layout import chunk_offsets, chunk_sizes

__all__ = ["Chunks"]


@dataclass(frozen=True)
class Chunks:
    """Dim 0 of a parameter of global ``shape`` cut into ``n`` ``torch.chunk`` pieces, seen
    from the rank at index ``rank`` of the shard mesh dim."""

    shape: Tuple[int, ...]
    n: int
    rank: int
    sizes: Tuple[int, ...] = field(init=False)
    offsets: Tuple[int, ...] = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "shape", tuple(int(s) for s in self.shape))
        object.__setattr__(self, "sizes", chunk_sizes(self.shape[0], self.n))
        object.__setattr__(self, "offsets", chunk_offsets(self.shape[0], self.n))

    @property
    def rows(self) -> int:
        """Rows of every padded piece (``torch.chunk``: the first piece is the longest)."""
        return self.sizes[0]

    @property
    def local(self) -> int:
        """Rows of this rank's piece."""
        return self.sizes[self.rank]

    @property
    def start(self) -> int:
        """First row of this rank's piece in the full parameter."""
        return self.offsets[self.rank]

    @property
    def padding(self) -> int:
        """Zero rows appended to this rank's piece to make it ``rows`` long."""
        return self.rows - self.local

    @property
    def padded(self) -> int:
        """Rows of the gathered, padded parameter (``n * rows``)."""
        return self.rows * self.n

    @property
    def piece_shape(self) -> Tuple[int, ...]:
        """Shape of this rank's piece."""
        return (self.local,) + self.shape[1:]

    @property
    def padded_numel(self) -> int:
        """Elements of one padded piece."""
        return self.rows * prod(self.shape[1:])

    def any_empty(self) -> bool:
        """Whether some rank's piece would have no rows."""
        return 0 in self.sizes
