"""The routing a simulated step of a mixture-of-experts model assumes: how many of each rank's routed
token slots go to each expert.

A simulated rank has no values, so its router's counts are unknown; expert parallelism needs them for
the shapes of its token exchange. :func:`routed_counts` states them from a routing assumption: every
rank of an expert-parallel group routes its ``rows`` slots (tokens times ``top_k``) over the experts
in the given shares, ``"uniform"`` (the default) spreading them evenly (``rows / E`` slots per expert,
so ``rows / ep`` to each peer), rounded to whole slots by largest remainder (ties to the lower expert)
so that every rank's row sums to ``rows``.

Example:
    >>> routed_counts("uniform", rows=10, num_experts=4, ranks=2).tolist()
    [[3, 3, 2, 2], [3, 3, 2, 2]]
    >>> routed_counts([0.5, 0.5, 0.0, 0.0], rows=8, num_experts=4, ranks=2).tolist()
    [[4, 4, 0, 0], [4, 4, 0, 0]]
"""
from __future__ import annotations

from typing import Any

import numpy as np

__all__ = ["routed_counts", "check_routing"]


def check_routing(routing: Any) -> Any:
    """``routing`` as :func:`routed_counts` takes it: ``"uniform"`` (also for ``None``), or a float array
    of shares (``(E,)``: every rank alike; ``(ranks, E)``: one row per rank of the expert-parallel group),
    non-negative, each row with a positive sum; raises naming what is wrong.

    Args:
        routing: ``None``, ``"uniform"`` or shares.

    >>> check_routing(None)
    'uniform'
    >>> check_routing([[1, 0], [0, 1]]).shape
    (2, 2)
    """
    if routing is None or (isinstance(routing, str) and routing == "uniform"):
        return "uniform"
    if isinstance(routing, str):
        raise ValueError(f"routing must be 'uniform' or an array of shares per expert, got {routing!r}")
    shares = np.asarray(routing, dtype=np.float64)
    if shares.ndim not in (1, 2) or shares.size == 0 or not np.all(np.isfinite(shares)) or np.any(shares < 0):
        raise ValueError(f"routing shares must be a non-negative finite array of shape (experts,) or (ep, experts), "
                         f"got shape {shares.shape}: {routing!r}")
    if np.any(shares.reshape(-1, shares.shape[-1]).sum(-1) <= 0):
        raise ValueError(f"routing shares: each row must have a positive sum (a rank routes its tokens somewhere), "
                         f"got {routing!r}")
    return shares


def _rounded(shares: np.ndarray, rows: int) -> np.ndarray:
    exact = shares / shares.sum() * rows
    counts = np.floor(exact).astype(np.int64)
    left = rows - int(counts.sum())
    order = np.argsort(-(exact - counts), kind="stable")       # largest remainder first, ties to the lower expert
    counts[order[:left]] += 1
    return counts


def routed_counts(routing: Any, *, rows: int, num_experts: int, ranks: int) -> np.ndarray:
    """The ``(ranks, num_experts)`` slots each rank of an expert-parallel group of ``ranks`` sends to each
    expert, every rank routing ``rows`` slots by ``routing`` (see the module docstring).

    Args:
        routing: ``"uniform"``, ``None`` (uniform), or shares ``(E,)`` / ``(ranks, E)``.
        rows: the routed slots of each rank (its tokens times ``top_k``).
        num_experts: the experts ``E``.
        ranks: the ranks of the expert-parallel group.

    >>> routed_counts([[1, 0], [1, 1]], rows=4, num_experts=2, ranks=2).tolist()
    [[4, 0], [2, 2]]
    """
    routing = check_routing(routing)
    if isinstance(routing, str):
        shares = np.ones((ranks, num_experts))
    else:
        shares = routing if routing.ndim == 2 else np.broadcast_to(routing, (ranks, routing.shape[0]))
        if shares.shape != (ranks, num_experts):
            raise ValueError(f"routing shares of shape {routing.shape} do not fit {num_experts} experts over {ranks} "
                             f"expert-parallel ranks: give ({num_experts},) or ({ranks}, {num_experts})")
    return np.stack([_rounded(np.asarray(row, dtype=np.float64), int(rows)) for row in shares])
