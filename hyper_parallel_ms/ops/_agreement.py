"""A first run of an op decision that every rank of the mesh finishes alike.

A wrong sharding rule, or a kernel that fails on some local shapes only, can fail on some
ranks while the others go on and wait forever in their next collective. Where every rank's
local input shapes and promised output shapes are the same, the kernel behaves the same on
every rank and so does the check: nothing is sent. Otherwise (uneven or empty pieces, local
argument overrides) the first run of the decision ends with the ranks agreeing on failure
flags through ``comm``'s agreement service (:func:`~hyper_parallel_ms.comm._agreement.failed_coordinates`),
and every rank raises if any rank failed.

Example::

    shapes_alike(layouts_and_shapes)          # decided from layouts alone
"""
from __future__ import annotations

from typing import Iterable, Tuple

from ..layout import Layout

__all__ = ["shapes_alike"]


def shapes_alike(layouts_and_shapes: Iterable[Tuple[Layout, Tuple[int, ...]]]) -> bool:
    """True when each (layout, global shape) gives every mesh coordinate the same local shape.

    Example:
        >>> from hyper_parallel_ms.placement import Shard
        >>> shapes_alike([(Layout((2,), (Shard(0),)), (4, 3))])
        True
        >>> shapes_alike([(Layout((2,), (Shard(0),)), (5, 3))])
        False
    """
    return all(len(set(layout.local_shapes(shape).values())) == 1 for layout, shape in layouts_and_shapes)
