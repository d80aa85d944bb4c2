"""Plans must be the same on every rank: a digest of what a call applies is compared across
the mesh before anything changes, and a difference raises naming the first Cell or parameter
that differs (instead of a collective failing or pairing up wrongly later).

Each entry's description is hashed to 60 bits, carried as three 20-bit chunks in float32
(exact), and reduced with max and min over the mesh: an entry differs where they disagree.
Every rank sees the same reduction, so every rank raises. A mesh whose exchange sees one rank
only takes the entries over, to compare once every rank has run
(:meth:`~..comm._exchange.Exchange.defer_agreement`).

Example::

    check_same_on_all_ranks([("up", "ColwiseParallel() weight (16, 8) S(0)")], mesh, "parallelize_module")
"""
from __future__ import annotations

from typing import Callable, Sequence, Tuple, TypeVar

import numpy as np

from ..comm._agreement import DIGEST_LENGTH, digest, extremes

__all__ = ["check_same_on_all_ranks", "agreed"]

T = TypeVar("T")

_ABSENT = -1.0


def check_same_on_all_ranks(entries: Sequence[Tuple[str, str]], mesh, what: str) -> None:
    """Raise ``ValueError`` on every rank of ``mesh`` if the ``(name, description)`` entries
    differ between ranks, naming the first entry that differs."""
    if mesh.size() == 1:
        return
    if mesh.exchange.defer_agreement(what, mesh, entries):
        return
    high, low = extremes(np.array([float(len(entries))]), mesh)
    count = int(high[0])
    table = np.full((count, DIGEST_LENGTH), _ABSENT)
    for i, (_, description) in enumerate(entries):
        table[i] = digest(description)
    high, low = extremes(table.reshape(-1), mesh)
    differs = (high != low).reshape(count, DIGEST_LENGTH).any(axis=1)
    if not differs.any():
        return
    first = int(np.argmax(differs))
    mine = f"'{entries[first][0]}' ({entries[first][1]})" if first < len(entries) else "nothing (its plan is shorter)"
    raise ValueError(f"{what}: the ranks of {mesh!r} apply different plans; the first difference is entry {first}, "
                     f"where this rank (rank {mesh.get_rank()}) has {mine}. Every rank must apply the same plan to the "
                     f"same model (same keys, styles and sizes)")


def agreed(prepare: Callable[[], T], describe: Callable[[T], Sequence[Tuple[str, str]]], mesh, what: str) -> T:
    """``prepare()`` (checks only, no change, no communication), once every rank of ``mesh``
    agrees on ``describe`` of its result. A ``TypeError`` / ``ValueError`` of ``prepare`` is
    compared too and re-raised after, so a rank failing alone fails every rank instead of
    leaving the others waiting in a collective."""
    try:
        result, error = prepare(), None
    except (TypeError, ValueError) as exc:
        result, error = None, exc
    entries = [("<plan error>", f"{type(error).__name__}: {error}")] if error is not None else describe(result)
    check_same_on_all_ranks(entries, mesh, what)
    if error is not None:
        raise error
    return result
