"""Redistribution of local pieces whose global shape follows from the local shape.

Layer hooks see local tensors of any batch size and sequence length; the global shape is
this rank's shape times the mesh sizes on the sharded dims (even shards, as
``DTensor.from_local`` assumes). :class:`LocalRedistribute` plans for the shape it meets:
in PyNative on every call (cached per shape), inside ``ms.jit`` once while the graph
compiles, so that the compiled graph holds only the collectives. The backward follows
PyTorch's ``redistribute`` (see :func:`.redistribution`), with an optional ``grad_src``
layout for the incoming gradient.

Example::

    gather_seq = LocalRedistribute(mesh, Layout((2,), (Shard(1),)), Layout((2,), (Replicate(),)),
                                   grad_src=Layout((2,), (Partial(),)))
    y_local = gather_seq(x_local)      # all-gather forward, reduce-scatter backward
"""
from __future__ import annotations

from typing import Dict, List, Optional, Tuple

from mindspore import nn

from .._jit import cached_in_python
from ..layout import Layout
from ._executor import LocalStep, average_scaling, lower, replicate_partials, step_cells
from ._planner import plan_redistribute

__all__ = ["LocalRedistribute", "global_shape_of"]

_PLANS: List[tuple] = []
_IDS: Dict[tuple, int] = {}


def _plan_id(mesh, src: Layout, dst: Layout, grad_src: Optional[Layout]) -> int:
    key = (mesh, src, dst, grad_src)  # layouts may use negative dims: normalised per call's ndim
    if key not in _IDS:
        _IDS[key] = len(_PLANS)
        _PLANS.append(key)
    return _IDS[key]


def global_shape_of(layout: Layout, local_shape: Tuple[int, ...]) -> Tuple[int, ...]:
    """The global shape whose even pieces under ``layout`` have ``local_shape``."""
    layout = layout.normalized(len(local_shape))
    factor = [1] * len(local_shape)
    for axis, p in enumerate(layout.placements):
        if p.is_shard():
            factor[p.dim] *= layout.mesh_shape[axis]
    return tuple(s * f for s, f in zip(local_shape, factor))


def _planned(plan_id: int, local_shape: Tuple[int, ...]):
    """(mesh, src, dst, grad_src, global shape) of a registered plan, its layouts normalised
    for the tensor's number of dims."""
    mesh, src, dst, grad_src = _PLANS[plan_id]
    ndim = len(local_shape)
    src, dst = src.normalized(ndim), dst.normalized(ndim)
    grad_src = None if grad_src is None else grad_src.normalized(ndim)
    return mesh, src, dst, grad_src, global_shape_of(src, tuple(local_shape))


@cached_in_python
def _forward_steps(plan_id: int, local_shape: Tuple[int, ...]) -> Tuple[LocalStep, ...]:
    mesh, src, dst, _, shape = _planned(plan_id, local_shape)
    return lower(plan_redistribute(src, dst, shape), mesh.get_coordinate(), shape)


@cached_in_python
def _backward_steps(plan_id: int, local_shape: Tuple[int, ...]) -> Tuple[LocalStep, ...]:
    mesh, src, dst, grad_src, shape = _planned(plan_id, local_shape)
    grad_from = replicate_partials(dst) if grad_src is None else grad_src
    steps = lower(plan_redistribute(grad_from, replicate_partials(src), shape), mesh.get_coordinate(), shape)
    return steps + average_scaling(src, dst)


@cached_in_python
def _forward_cells(plan_id: int, local_shape: Tuple[int, ...]) -> tuple:
    return tuple(step_cells(_PLANS[plan_id][0], _forward_steps(plan_id, local_shape)))


@cached_in_python
def _backward_cells(plan_id: int, local_shape: Tuple[int, ...]) -> tuple:
    return tuple(step_cells(_PLANS[plan_id][0], _backward_steps(plan_id, local_shape)))


class LocalRedistribute(nn.Cell):
    """Move a local piece from layout ``src`` to ``dst``; the gradient arrives as ``grad_src``
    (default: ``dst`` with Partial read as Replicate) and leaves as ``src`` (Partial as Replicate)."""

    def __init__(self, mesh, src: Layout, dst: Layout, grad_src: Optional[Layout] = None) -> None:
        super().__init__()
        self.mesh = mesh
        self.plan_id = _plan_id(mesh, src, dst, grad_src)

    def construct(self, x):
        for cell in _forward_cells(self.plan_id, x.shape):
            x = cell(x)
        return x

    def bprop(self, x, out, dout):
        for cell in _backward_cells(self.plan_id, x.shape):
            dout = cell(dout)
        return (dout,)
