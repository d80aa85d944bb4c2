"""Bytes moved by redistribution, for every pair of placement lists on a mesh.

For each (source, target) pair, on this rank: the bytes CommDebugMode records (textbook
ring figures of the collectives issued), the bytes the issued primitives send on this
device (``wire``: on CPU the all-reduces the collectives are composed of), the cheapest
sequence of textbook collectives (the planner's optimum) and a naive route through
Replicate (gather everything, then cut), as PyTorch's first redistribute did.

Example (on every rank of a 4-rank job)::

    rows = measure(init_device_mesh("cpu", (2, 2)), (8, 8))
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import List, Sequence, Tuple

import mindspore as ms
import numpy as np

from ..comm import CommDebugMode
from ..dtensor import distribute_tensor
from ..layout import Layout
from ..placement import Partial, Replicate, Shard
from .._cost import step_elements
from ..redistribute import plan_redistribute

__all__ = ["PairBytes", "measure", "measure_on", "placement_lists", "plan_bytes"]


@dataclass(frozen=True)
class PairBytes:
    src: Tuple[str, ...]
    dst: Tuple[str, ...]
    recorded: int
    wire: int
    optimum: float
    naive: float


def placement_lists(mesh_ndim: int, ndim: int) -> List[tuple]:
    """Every list of R, P(sum), S(0..ndim-1) for a mesh of ``mesh_ndim`` dims."""
    options = [Replicate(), Partial()] + [Shard(d) for d in range(ndim)]
    return list(itertools.product(options, repeat=mesh_ndim))


def plan_bytes(src: Layout, dst: Layout, shape: Tuple[int, ...], itemsize: int = 4) -> float:
    """Textbook bytes per rank of the planned steps (largest local piece at each step)."""
    total = 0.0
    for step in plan_redistribute(src, dst, shape):
        local = max(int(np.prod(s)) for s in step.before.local_shapes(shape).values())
        total += step_elements(step.kind, step.before.mesh_shape[step.mesh_dim], local) * itemsize
    return total


def measure(mesh, shape: Sequence[int]) -> List[PairBytes]:
    """Redistribute a float32 tensor of ``shape`` between every pair of placement lists."""
    shape = tuple(shape)
    x = ms.Tensor(np.ones(shape, np.float32))
    replicated = Layout.replicated(mesh.shape)
    rows = []
    lists = placement_lists(mesh.ndim, len(shape))
    for src, dst in itertools.product(lists, lists):
        dt = distribute_tensor(x, mesh, src, src_data_rank=None)
        with CommDebugMode() as mode:
            dt.redistribute(mesh, dst)
        src_layout, dst_layout = dt.layout, Layout(mesh.shape, dst).normalized(len(shape))
        naive = plan_bytes(src_layout, replicated, shape) + plan_bytes(replicated, dst_layout, shape)
        rows.append(PairBytes(tuple(map(str, src)), tuple(map(str, dst)), mode.total_bytes(),
                              mode.total_wire_bytes(), plan_bytes(src_layout, dst_layout, shape), naive))
    return rows


def measure_on(device_type: str, mesh_shape: Sequence[int], shape: Sequence[int]) -> List[PairBytes]:
    """:func:`measure` on a new mesh of ``mesh_shape`` (for running through the rank harness)."""
    from ..mesh import init_device_mesh
    return measure(init_device_mesh(device_type, tuple(mesh_shape)), shape)
