"""A first run of an op decision that every rank of the mesh finishes alike.

A wrong sharding rule, or a kernel that fails on some local shapes only, can fail on some
ranks while the others go on and wait forever in their next collective. Where every rank's
local input shapes and promised output shapes are the same, the kernel behaves the same on
every rank and so does the check: nothing is sent. Otherwise (uneven or empty pieces, local
argument overrides) the first run of the decision ends with one small all-reduce of failure
flags over all the mesh's ranks, and every rank raises if any rank failed.

Example::

    shapes_alike(mesh_shape, layouts_and_shapes)          # decided from layouts alone
    failed = failed_coordinates(mesh, failed=error is not None)
"""
from __future__ import annotations

import itertools
from typing import Iterable, List, Tuple

import numpy as np
from mindspore import Tensor

from .. import comm
from ..layout import Layout

__all__ = ["shapes_alike", "failed_coordinates"]


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


def failed_coordinates(mesh, failed: bool) -> List[Tuple[int, ...]]:
    """The mesh coordinates of the ranks that report ``failed``, known to every rank of
    ``mesh`` (one all-reduce of ``mesh.size()`` floats over the flattened mesh; every rank must call)."""
    flags = np.zeros(mesh.shape, np.float32)
    if failed:
        flags[tuple(mesh.get_coordinate())] = 1.0
    flat = mesh._flatten() if mesh.ndim > 1 else mesh      # pylint: disable=protected-access
    reduced = comm.all_reduce(Tensor(flags.reshape(-1)), flat, 0, op="max").asnumpy().reshape(mesh.shape)
    return [c for c in itertools.product(*(range(n) for n in mesh.shape)) if reduced[c] > 0]
