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

from .._mindspore import cached_in_python
from ..layout import Layout
from ._executor import lowered_steps, step_cells

__all__ = ["LocalRedistribute", "plan_layouts"]

_PLANS: List[tuple] = []
_IDS: Dict[tuple, int] = {}


def _plan_id(mesh, src: Layout, dst: Layout, grad_src: Optional[Layout]) -> int:
    key = (mesh, src, dst, grad_src)  # layouts may use negative dims: normalised per call's ndim
    if key not in _IDS:
        _IDS[key] = len(_PLANS)
        _PLANS.append(key)
    return _IDS[key]


def plan_layouts(plan_id: int) -> Tuple[object, Layout, Layout]:
    """(mesh, src, dst) of a registered plan."""
    return _PLANS[plan_id][:3]


@cached_in_python
def _cells(plan_id: int, local_shape: Tuple[int, ...]) -> Tuple[tuple, tuple]:
    """The (forward, backward) step Cells for a piece of ``local_shape`` (layouts normalised
    for its number of dims, the global shape read as even pieces)."""
    mesh, src, dst, grad_src = _PLANS[plan_id]
    ndim = len(local_shape)
    src, dst = src.normalized(ndim), dst.normalized(ndim)
    shape = src.even_global_shape(local_shape)
    forward, backward, scaling = lowered_steps(src, dst, shape, mesh.get_coordinate(),
                                               None if grad_src is None else grad_src.normalized(ndim))
    return tuple(step_cells(mesh, forward)), tuple(step_cells(mesh, backward + scaling))


class LocalRedistribute(nn.Cell):
    """Move a local piece from layout ``src`` to ``dst``; the gradient arrives as ``grad_src``
    (default: ``dst`` with Partial read as Replicate) and leaves as ``src`` (Partial as Replicate)."""

    def __init__(self, mesh, src: Layout, dst: Layout, grad_src: Optional[Layout] = None) -> None:
        super().__init__()
        self.mesh = mesh
        self.plan_id = _plan_id(mesh, src, dst, grad_src)

    def construct(self, x):
        for cell in _cells(self.plan_id, x.shape)[0]:
            x = cell(x)
        return x

    def bprop(self, x, out, dout):
        for cell in _cells(self.plan_id, x.shape)[1]:
            dout = cell(dout)
        return (dout,)
