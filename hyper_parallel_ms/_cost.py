"""Communication cost: the one model that the redistribution planner, the op rules' choice
between candidate layouts and ``CommDebugMode``'s textbook figures share.

Textbook figures: what a bandwidth-optimal (ring) implementation sends per rank.

==================  ==================================  ================================
kind                ``total``                           sent per rank
==================  ==================================  ================================
``all_gather``      the gathered result                 ``total - kept`` (``kept``: own piece)
``reduce_scatter``  the reduced input                   ``total - kept`` (``kept``: own chunk)
``all_to_all``      the input                           ``total - kept`` (``kept``: own chunk)
``all_reduce``      the reduced tensor                  ``2 (n - 1) / n * total``
``broadcast``       the tensor                          ``total`` (the source's send)
``chunk``           --                                  0 (local)
``partition``       --                                  0 (local)
==================  ==================================  ================================

``kept`` defaults to ``total / n`` (even pieces), which gives the usual ``(n - 1) / n``.

A :class:`Cost` is (elements sent, steps), compared in that order: the fewest elements
win, and among equal ones the fewest steps, so keeping a placement (no step) wins every
tie it is part of; among equal costs the candidate met first wins. Costs of tensors of
different sizes add with :meth:`Cost.scaled`, which counts a step on a bigger tensor more.

Pure Python (no MindSpore). Example:
    >>> from hyper_parallel_ms.placement import Shard, Replicate, Partial
    >>> textbook_sent("all_gather", 4, 32)
    24.0
    >>> change_cost(Shard(0), Replicate(), 2) < change_cost(Partial(), Replicate(), 2)
    True
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Tuple

__all__ = ["textbook_sent", "step_elements", "change_steps", "change_cost", "Cost"]

_GATHER_LIKE = ("all_gather", "reduce_scatter", "all_to_all")
_LOCAL = ("chunk", "partition")


def textbook_sent(kind: str, n: int, total: float, kept: Optional[float] = None) -> float:
    """What each rank sends for a collective ``kind`` over ``n`` ranks (same unit as ``total``:
    elements or bytes; see the module's table)."""
    if kind in _LOCAL:
        return 0.0
    if kind in _GATHER_LIKE:
        return (n - 1) * total / n if kept is None else float(total - kept)
    if kind == "all_reduce":
        return 2 * (n - 1) * total / n
    if kind == "broadcast":
        return float(total)
    raise ValueError(f"unknown communication step {kind!r}")


def step_elements(kind: str, n: int, local: float) -> float:
    """Elements each rank sends when a redistribution step ``kind`` over ``n`` ranks starts
    from a piece of ``local`` elements (even pieces: an all-gather's result is ``n`` pieces).

    >>> step_elements("all_gather", 4, 8), step_elements("reduce_scatter", 4, 8)
    (24.0, 6.0)
    """
    if kind == "all_gather":
        return textbook_sent(kind, n, n * local, local)
    return textbook_sent(kind, n, local)


@dataclass(frozen=True, order=True)
class Cost:
    """Elements sent per rank, then steps taken; compared in that order."""

    elements: float = 0.0
    steps: float = 0.0

    def __add__(self, other: "Cost") -> "Cost":
        return Cost(self.elements + other.elements, self.steps + other.steps)

    def scaled(self, size: float) -> "Cost":
        """The cost for a tensor of ``size`` elements, when ``self`` is per element (steps too)."""
        return Cost(self.elements * size, self.steps * size)


def change_steps(src, dst) -> Tuple[str, ...]:
    """The step kinds that change one mesh dim's placement from ``src`` to ``dst`` (as the
    planner does it on that mesh dim alone).

    >>> from hyper_parallel_ms.placement import Shard, Partial
    >>> change_steps(Shard(0), Partial())
    ('all_gather', 'partition')
    """
    if src == dst:
        return ()
    if src.is_replicate():
        return ("chunk",) if dst.is_shard() else ("partition",)
    if src.is_shard():
        if dst.is_shard():
            return ("all_to_all",)
        return ("all_gather",) if dst.is_replicate() else ("all_gather", "partition")
    if dst.is_shard():
        return ("reduce_scatter",)
    return ("all_reduce",) if dst.is_replicate() else ("all_reduce", "partition")


def change_cost(src, dst, n: int) -> Cost:
    """The cost, per element of the whole tensor, of changing one mesh dim of ``n`` ranks from
    placement ``src`` to ``dst`` (a Shard holds ``1 / n`` of the tensor, others all of it)."""
    local = 1.0 / n if src.is_shard() else 1.0
    sent = 0.0
    kinds = change_steps(src, dst)
    for kind in kinds:
        sent += step_elements(kind, n, local)
        if kind == "all_gather":
            local *= n
    return Cost(sent, len(kinds))
