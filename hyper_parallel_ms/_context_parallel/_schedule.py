"""The blocks of attention on sequence shards: which keys each step of a ring meets, and the part
of each block that the causal mask leaves to compute. Pure numpy, no MindSpore.

A ring of ``size`` members holds the keys in ``size`` equal shards, member ``j`` the tokens at global
positions ``kv_positions[j]``; this member's queries sit at ``q_positions``. At step ``s`` the member
``index`` meets the shard of member ``(index - s) % size`` (its own first: the diagonal, where every
causal query finds at least itself). A :class:`Block` keeps the smallest rectangle of rows (queries)
and columns (keys) holding every allowed pair, so that a load-balanced causal shard computes half of
each off-diagonal block (head chunks attend to earlier shards' head chunks, tail chunks to all), and
a block with no allowed pair is skipped (its keys still pass along the ring).

Example:
    >>> import numpy as np
    >>> blocks = ring_blocks(np.array([0, 1, 6, 7]), (np.array([0, 1, 6, 7]), np.array([2, 3, 4, 5])), 0, True)
    >>> [(b.member, b.rows, b.cols, b.kind) for b in blocks]
    [(0, (0, 4), (0, 4), 'masked'), (1, (2, 4), (0, 4), 'full')]
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence, Tuple

import numpy as np

__all__ = ["Block", "ring_blocks", "block_mask"]


@dataclass(frozen=True)
class Block:
    """One step of the ring: the keys of ``member``, rows ``[rows[0], rows[1])`` of this member's
    queries against columns ``[cols[0], cols[1])`` of those keys; ``kind`` ``"skip"`` (no allowed
    pair: nothing computed), ``"full"`` (every pair of the rectangle allowed) or ``"masked"``
    (:func:`block_mask` gives the pairs masked out)."""

    member: int
    rows: Tuple[int, int]
    cols: Tuple[int, int]
    kind: str


def _allowed(q_positions: np.ndarray, kv_positions: np.ndarray, causal: bool) -> np.ndarray:
    if not causal:
        return np.ones((len(q_positions), len(kv_positions)), dtype=bool)
    return kv_positions[None, :] <= q_positions[:, None]


def block_mask(q_positions: np.ndarray, kv_positions: np.ndarray, block: Block) -> np.ndarray:
    """The pairs of ``block``'s rectangle masked out by the causal mask (True: masked), shape
    ``(rows, cols)``.

    >>> import numpy as np
    >>> block_mask(np.arange(2), np.arange(2), Block(0, (0, 2), (0, 2), "masked")).tolist()
    [[False, True], [False, False]]
    """
    (r0, r1), (c0, c1) = block.rows, block.cols
    return ~_allowed(q_positions[r0:r1], kv_positions[c0:c1], True)


def ring_blocks(q_positions: np.ndarray, kv_positions: Sequence[np.ndarray], index: int, causal: bool,
                order: Optional[Sequence[int]] = None) -> Tuple[Block, ...]:
    """The block of each ring step (see the module docstring); ``order``: the members in the order
    met (default the ring's: ``index``, ``index - 1``, ...).

    >>> import numpy as np
    >>> [b.kind for b in ring_blocks(np.arange(2), (np.arange(2), np.arange(2, 4)), 0, True)]
    ['masked', 'skip']
    """
    size = len(kv_positions)
    if order is None:
        order = [(index - s) % size for s in range(size)]
    q_positions = np.asarray(q_positions)
    out = []
    for member in order:
        keys = np.asarray(kv_positions[member])
        allowed = _allowed(q_positions, keys, causal)
        rows, cols = np.flatnonzero(allowed.any(1)), np.flatnonzero(allowed.any(0))
        if not len(rows):
            out.append(Block(member, (0, 0), (0, 0), "skip"))
            continue
        r0, r1, c0, c1 = int(rows[0]), int(rows[-1]) + 1, int(cols[0]), int(cols[-1]) + 1
        kind = "full" if allowed[r0:r1, c0:c1].all() else "masked"
        out.append(Block(member, (r0, r1), (c0, c1), kind))
    return tuple(out)
