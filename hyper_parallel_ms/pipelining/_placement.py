"""Which pipeline rank holds which stage.

* ``"loop"`` (GPipe, 1F1B, interleaved schedules): stage ``s`` on rank ``s % pp``, so rank
  ``r`` holds stages ``r, r + pp, r + 2 pp, ...``.
* ``"v"`` (ZBV, DualPipeV): stages go down the ranks and back up, a V: rank ``r`` holds stages
  ``r`` and ``2 pp - 1 - r``, so the last rank holds the two middle stages and rank 0 the first and
  the last stage. More stages repeat the V (ranks ``0..pp-1``, then ``pp-1..0``, then again), so any
  number of stages per rank has a V placement (an odd number ends on a downward leg, as PyTorch's).

Pure Python.

Example:
    >>> stage_to_rank("loop", pp=2, num_stages=4), stage_to_rank("v", pp=2, num_stages=4)
    ((0, 1, 0, 1), (0, 1, 1, 0))
    >>> stage_to_rank("v", pp=2, num_stages=8)
    (0, 1, 1, 0, 0, 1, 1, 0)
    >>> stages_of_rank((0, 1, 1, 0), 1)
    (1, 2)
"""
from __future__ import annotations

from typing import Sequence, Tuple

__all__ = ["PLACEMENTS", "stage_to_rank", "stages_of_rank"]

PLACEMENTS = ("loop", "v")


def stage_to_rank(style: str, pp: int, num_stages: int) -> Tuple[int, ...]:
    """The rank of each stage, indexed by stage, for placement ``style`` over ``pp`` ranks.

    Args:
        style: ``"loop"`` (stage s on rank s % pp) or ``"v"`` (down the ranks and back: rank r holds
            r and 2 pp - 1 - r, and with more stages the same V again).
        pp: the number of pipeline ranks.
        num_stages: the number of stages (a multiple of ``pp``).

    Raises:
        ValueError: ``pp`` or ``num_stages`` not a positive int, stages that do not divide over the
            ranks, or another ``style``.

    Example:
        >>> stage_to_rank("v", pp=2, num_stages=4)
        (0, 1, 1, 0)
    """
    if isinstance(pp, bool) or not isinstance(pp, int) or pp < 1:
        raise ValueError(f"the number of pipeline ranks must be a positive int, got {pp!r}")
    if isinstance(num_stages, bool) or not isinstance(num_stages, int) or num_stages < 1:
        raise ValueError(f"the number of stages must be a positive int, got {num_stages!r}")
    if num_stages % pp:
        raise ValueError(f"{num_stages} stages do not divide evenly over {pp} pipeline ranks; "
                         f"use a multiple of {pp} stages")
    if style == "loop":
        return tuple(s % pp for s in range(num_stages))
    if style == "v":
        # stages go down the ranks in even legs of the V, back up in odd ones (an odd number of stages
        # per rank ends on a downward leg, as PyTorch's mapping does)
        return tuple(s % pp if (s // pp) % 2 == 0 else pp - 1 - s % pp for s in range(num_stages))
    raise ValueError(f"unknown stage placement {style!r}; expected one of {PLACEMENTS}")


def stages_of_rank(placement: Sequence[int], rank: int) -> Tuple[int, ...]:
    """The stages ``rank`` holds under ``placement`` (a stage-to-rank tuple), in stage order.

    Args:
        placement: the rank of each stage, indexed by stage (:func:`stage_to_rank`).
        rank: a pipeline rank.

    Example:
        >>> stages_of_rank((0, 1, 1, 0), 0)
        (0, 3)
    """
    return tuple(s for s, r in enumerate(placement) if r == rank)
