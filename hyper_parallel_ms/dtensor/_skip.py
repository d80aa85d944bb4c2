"""``SkipDTensorDispatch`` (HyperParallel's): ops on DTensors computed on this rank's pieces.

Inside the context no op is dispatched: an op given a DTensor computes on its local piece and
returns a plain tensor, and ``dt.shape`` is the piece's shape (as MindSpore's ops written in
Python read it to size their results). Use it where code must handle pieces as plain tensors,
e.g. a gradient hook that scales each rank's piece.

Example::

    with SkipDTensorDispatch():
        piece_doubled = dt * 2           # a plain tensor: 2 x this rank's piece
"""
from __future__ import annotations

from typing import Any, Optional, Set

from .. import _mindspore as _ms_seam

__all__ = ["SkipDTensorDispatch"]


class SkipDTensorDispatch:
    """A context in which ops on DTensors run on their local pieces (no DTensor dispatch).

    Args:
        no_skip: HyperParallel's ops still dispatched inside; only ``None`` or an empty set is
            accepted here: leave the context for those ops.

    Example::

        with SkipDTensorDispatch():
            y = ops.mul(dt, 2)            # plain tensor: this rank's piece times 2
    """

    def __init__(self, no_skip: Optional[Set[Any]] = None) -> None:
        if no_skip:
            raise NotImplementedError(
                f"SkipDTensorDispatch(no_skip={no_skip!r}): ops still dispatched inside the context are not "
                "supported; run those ops outside the `with` block (on DTensors) and the rest inside")
        self._context: Any = None

    def __enter__(self) -> "SkipDTensorDispatch":
        if self._context is not None:
            raise RuntimeError("SkipDTensorDispatch is already entered; make one per `with` block")
        self._context = _ms_seam.no_hook()
        self._context.__enter__()
        return self

    def __exit__(self, *exc: Any) -> Optional[bool]:
        context, self._context = self._context, None
        return context.__exit__(*exc)
