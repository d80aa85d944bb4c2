"""The ranks of a mesh agreeing on small host-side values (plans, shapes, failure flags).

One service for every layer that must make sure all ranks hold the same description before
they communicate: a vector of float32 values (exact for integers below 2**24) is reduced
with max and min over every mesh dim in one all-reduce per dim; entries that differ are
where max and min disagree. Every rank sees the same result, so every rank can raise.
The traffic is bookkeeping: :class:`~hyper_parallel_ms.comm.CommDebugMode` does not record it.

Example::

    high, low = extremes(np.array([4.0, 16.0]), mesh)
    if (high != low).any():
        raise ValueError("the ranks disagree")
"""
from __future__ import annotations

from typing import Tuple

import numpy as np
from mindspore import Tensor

from . import all_reduce
from .debug import unrecorded

__all__ = ["extremes"]


def extremes(values: np.ndarray, mesh) -> Tuple[np.ndarray, np.ndarray]:
    """(max, min) over every rank of ``mesh`` of each entry of the 1-D ``values`` (every rank
    of the mesh must call, with the same number of values).

    Args:
        values: this rank's values (1-D; integers below 2**24 are carried exactly).
        mesh: the :class:`DeviceMesh` whose ranks agree.

    Example::

        high, low = extremes(np.array([float(n_entries)]), mesh)
    """
    values = np.asarray(values, np.float32).reshape(-1)
    both = Tensor(np.concatenate([values, -values]))
    with unrecorded():
        for dim in range(mesh.ndim):
            both = all_reduce(both, mesh, dim, op="max")
    both = both.asnumpy()
    return both[:len(values)], -both[len(values):]
