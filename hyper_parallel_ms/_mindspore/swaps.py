"""Swappable entry points: MindSpore's functions, Cell methods and compile entry points are
looked up as module / class attributes at call time, so replacing the attribute reroutes every
call made after it. :func:`swap_entry_points` (for the process) and :func:`entry_points_swapped`
(for a scope) are the only places that replace them, and put back exactly what was there.
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Callable, Iterator, List, Sequence, Tuple

from ._release import ABSENT as _ABSENT

__all__ = ["Swap", "swap_entry_points", "entry_points_swapped"]

Swap = Tuple[Any, str, Callable[[Callable], Callable]]   # (owner, attribute, wrap: original -> replacement)


def swap_entry_points(swaps: Sequence[Swap]) -> Callable[[], None]:
    """Replace each ``owner.name`` (a module function, a class's method) by ``wrap(current)``
    (``wrap(None)`` where there is none) and return the function that puts back exactly what
    was there (the same objects; an attribute that ``owner`` only inherited or lacked is
    removed again), last swap first. If a ``wrap``
    raises, the swaps made so far are undone before the error propagates.

    >>> import types
    >>> space = types.SimpleNamespace(double=lambda x: 2 * x)
    >>> original = space.double
    >>> undo = swap_entry_points([(space, "double", lambda f: lambda x: f(x) + 1)])
    >>> space.double(3)
    7
    >>> undo(); space.double is original
    True
    """
    saved: List[Tuple[Any, str, Any]] = []

    def undo() -> None:
        while saved:
            owner, name, before = saved.pop()
            if before is _ABSENT:
                delattr(owner, name)
            else:
                setattr(owner, name, before)

    try:
        for owner, name, wrap in swaps:
            before = vars(owner).get(name, _ABSENT)
            replacement = wrap(getattr(owner, name, None) if before is _ABSENT else before)
            setattr(owner, name, replacement)
            saved.append((owner, name, before))
    except BaseException:
        undo()
        raise
    return undo


@contextmanager
def entry_points_swapped(swaps: Sequence[Swap]) -> Iterator[None]:
    """Inside, each ``owner.name`` is ``wrap(current)`` (:func:`swap_entry_points`); on leaving,
    normally or by an exception, exactly what was there before is back. Scopes nest: an inner
    scope wraps (and then restores) what the outer one installed.

    Example::

        with entry_points_swapped([(mindspore.ops, "cross_entropy", my_wrapper)]):
            ops.cross_entropy(logits, target)      # my_wrapper(original)(logits, target)
    """
    undo = swap_entry_points(swaps)
    try:
        yield
    finally:
        undo()
