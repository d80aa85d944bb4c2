"""The sequence order of context parallelism: which global positions each cp rank holds.

Load balanced (the default, PyTorch's head-tail round robin): the sequence is cut into ``2 * cp``
equal chunks and rank ``r`` holds chunk ``r`` followed by chunk ``2 * cp - 1 - r``, so that under a
causal mask every rank attends to the same number of keys (rank 0 holds the first and the last
chunk, rank ``cp - 1`` the two middle ones). Not balanced: rank ``r`` holds the ``r``-th of ``cp``
contiguous chunks. Pure Python and numpy (no MindSpore): the planner and the tests use it as is.

Example:
    >>> rank_chunks(2, load_balance=True)
    ((0, 3), (1, 2))
    >>> shard_positions(8, 2, 1).tolist()
    [2, 3, 4, 5]
    >>> sequence_order(8, 2).tolist()            # global position of each slot, ranks in order
    [0, 1, 6, 7, 2, 3, 4, 5]
"""
from __future__ import annotations

from typing import Tuple

import numpy as np

__all__ = ["rank_chunks", "check_sequence_length", "shard_positions", "sequence_order", "restoring_order"]


def rank_chunks(cp: int, load_balance: bool = True) -> Tuple[Tuple[int, ...], ...]:
    """For each of the ``cp`` ranks, the chunks it holds, in order (of ``2 * cp`` chunks when
    balanced, else of ``cp``).

    >>> rank_chunks(4)
    ((0, 7), (1, 6), (2, 5), (3, 4))
    >>> rank_chunks(3, load_balance=False)
    ((0,), (1,), (2,))
    """
    if load_balance:
        return tuple((r, 2 * cp - 1 - r) for r in range(cp))
    return tuple((r,) for r in range(cp))


def check_sequence_length(seq_len: int, cp: int, load_balance: bool = True, what: str = "the sequence") -> int:
    """The length of one rank's shard; raises when ``seq_len`` does not cut into equal chunks.

    >>> check_sequence_length(16, 4)
    4
    >>> check_sequence_length(12, 4)
    Traceback (most recent call last):
    ...
    ValueError: the sequence has length 12, which does not cut into 2 * cp = 8 equal chunks (load-balanced context parallelism over 4 ranks); pad it to a multiple of 8, or pass load_balance=False (then a multiple of 4)
    """
    chunks = 2 * cp if load_balance else cp
    if seq_len % chunks:
        if load_balance:
            raise ValueError(f"{what} has length {seq_len}, which does not cut into 2 * cp = {chunks} equal chunks "
                             f"(load-balanced context parallelism over {cp} ranks); pad it to a multiple of {chunks}, "
                             f"or pass load_balance=False (then a multiple of {cp})")
        raise ValueError(f"{what} has length {seq_len}, which does not cut into {cp} equal shards (context "
                         f"parallelism over {cp} ranks); pad it to a multiple of {cp}")
    return seq_len // cp


def shard_positions(seq_len: int, cp: int, rank: int, load_balance: bool = True) -> np.ndarray:
    """The global positions (int64) of the ``seq_len // cp`` tokens rank ``rank`` holds, in order.

    >>> shard_positions(8, 2, 0).tolist(), shard_positions(8, 2, 0, load_balance=False).tolist()
    ([0, 1, 6, 7], [0, 1, 2, 3])
    """
    check_sequence_length(seq_len, cp, load_balance)
    chunk = seq_len // (2 * cp if load_balance else cp)
    return np.concatenate([np.arange(c * chunk, (c + 1) * chunk, dtype=np.int64)
                           for c in rank_chunks(cp, load_balance)[rank]])


def sequence_order(seq_len: int, cp: int, load_balance: bool = True) -> np.ndarray:
    """The global position held at each slot of the ranks' shards concatenated in rank order (what an
    all-gather of the shards gives): ``gathered[i]`` is token ``sequence_order(...)[i]``.

    >>> sequence_order(4, 1).tolist()
    [0, 1, 2, 3]
    """
    return np.concatenate([shard_positions(seq_len, cp, r, load_balance) for r in range(cp)])


def restoring_order(seq_len: int, cp: int, load_balance: bool = True) -> np.ndarray:
    """The inverse of :func:`sequence_order`: ``gathered[restoring_order(...)]`` is the sequence in
    its own order (what :func:`~hyper_parallel_ms.nn.context_parallel_unshard` takes).

    >>> order = sequence_order(8, 2)
    >>> order[restoring_order(8, 2)].tolist()
    [0, 1, 2, 3, 4, 5, 6, 7]
    """
    return np.argsort(sequence_order(seq_len, cp, load_balance), kind="stable")
