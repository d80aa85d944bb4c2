"""Redistribution of local pieces whose global shape follows from the local shape.

Layer hooks see local tensors of any batch size and sequence length; the global shape is
this rank's shape times the mesh sizes on the sharded dims (even shards, as
``DTensor.from_local`` assumes), except on the dims whose global size the plan knows
(``dim_sizes``: a layer's features, which may be split unevenly as ``torch.chunk`` does).
A dim that a conversion newly shards without a known size must divide evenly, since later
conversions read its pieces as even; a piece that does not fit the plan raises with the
expected local shape. Since the global shape is read from each rank's own piece, ranks whose
pieces are uneven (a ``Shard`` of unknown length split as ``torch.chunk`` does) or whose
``Replicate`` tensors differ in shape (another sequence length on one tensor-parallel rank) would
plan different collectives: in PyNative every call of a conversion that moves data or records a
global shape first has the ranks of the mesh agree on it (one small all-reduce per mesh dim, not
recorded by ``CommDebugMode``) and raises on every rank where they differ. :class:`LocalRedistribute` plans for the shape it meets: in PyNative
on every call (cached per shape), inside ``ms.jit`` once while the graph compiles, so that
the compiled graph holds only the collectives. The steps run in the one step-running Cell,
:class:`.Redistribution` (PyTorch's ``redistribute`` backward, masking of a reduced
Partial(max / min)), with an optional ``grad_src`` layout for the incoming gradient.

Example::

    gather_seq = LocalRedistribute(mesh, Layout((2,), (Shard(1),)), Layout((2,), (Replicate(),)),
                                   grad_src=Layout((2,), (Partial(),)))
    y_local = gather_seq(x_local)      # all-gather forward, reduce-scatter backward
"""
from __future__ import annotations

from math import prod
from typing import Dict, List, Optional, Tuple

import numpy as np
from mindspore import nn
from mindspore.common import dtype as mstype

from .._mindspore import (cached_in_python, call_keeping_nothing, cell_per_call_site, identity_with_gradient,
                          is_compiling, run_in_python, running_eagerly)
from ..comm._agreement import extremes
from ..layout import Layout
from ._executor import Redistribution, redistribution

_FLOATS = (mstype.float16, mstype.bfloat16, mstype.float32, mstype.float64)

__all__ = ["LocalRedistribute", "plan_layouts", "plan_global_shape", "agree_on_global_shape"]

_PLANS: List[tuple] = []
_IDS: Dict[tuple, int] = {}
DimSizes = Tuple[Tuple[int, int], ...]


def _plan_id(mesh, src: Layout, dst: Layout, grad_src: Optional[Layout], dim_sizes: DimSizes) -> int:
    key = (mesh, src, dst, grad_src, dim_sizes)  # layouts may use negative dims: normalised per call's ndim
    if key not in _IDS:
        _IDS[key] = len(_PLANS)
        _PLANS.append(key)
    return _IDS[key]


def plan_layouts(plan_id: int) -> Tuple[object, Layout, Layout]:
    """(mesh, src, dst) of a registered plan.

    Args:
        plan_id: the id :class:`LocalRedistribute` registered.

    Example::

        mesh, src, dst = plan_layouts(cell.plan_id)
    """
    return _PLANS[plan_id][:3]


def plan_global_shape(plan_id: int, local_shape: Tuple[int, ...], where: str = "",
                      uneven_ok: bool = True) -> Tuple[int, ...]:
    """The global shape of a source piece of ``local_shape``: even pieces, except on the dims
    whose size the plan knows. Raises if the piece does not fit, or (unless ``uneven_ok``: the
    result becomes a DTensor that records its global shape) if the conversion shards a dim of
    unknown size that does not divide evenly (``where`` names the Cell in messages).

    Args:
        plan_id: the id :class:`LocalRedistribute` registered.
        local_shape: the shape of the source piece.
        where: the Cell named in error messages.
        uneven_ok: accept an uneven split of a dim of unknown size (the caller records the shape).

    Example::

        shape = plan_global_shape(cell.plan_id, (2, 8, 3), where="'layers.0.norm'")
    """
    mesh, src, dst, _, dim_sizes = _PLANS[plan_id]
    ndim = len(local_shape)
    src, dst = src.normalized(ndim), dst.normalized(ndim)
    shape = list(src.even_global_shape(local_shape))
    known = set()
    for dim, size in dim_sizes:
        shape[dim % ndim] = size
        known.add(dim % ndim)
    shape = tuple(shape)
    at = f" in {where}" if where else ""
    expected = src.local_shape(shape, mesh.coordinate)
    if expected != tuple(local_shape):
        raise ValueError(f"the conversion{at} from {src.placements} met a local piece of shape {tuple(local_shape)}; "
                         f"this rank's piece of the global shape {shape} is {expected}")
    src_axes, dst_axes = src.sharding_axes(ndim), dst.sharding_axes(ndim)
    for dim in range(ndim):
        n = prod(dst.mesh_shape[a] for a in dst_axes[dim] if a not in src_axes[dim])
        if n > 1 and dim not in known and shape[dim] % n and not uneven_ok:
            raise ValueError(f"the conversion{at} to {dst.placements} shards dim {dim} of length {shape[dim]} over {n} "
                             f"ranks unevenly; later conversions read such pieces as even (the global length cannot be "
                             f"told from a local piece): use a length divisible by {n}")
    return shape


_MAX_DIMS = 16
# the agreement runs every PyNative call: the shape a piece gives is read once per plan and shape
_global_shape = cached_in_python(plan_global_shape)


@run_in_python
def agree_on_global_shape(plan_id: int, local_shape: Tuple[int, ...], where: str = "") -> bool:
    """PyNative: every rank of the plan's mesh reads the same global shape from its piece
    (:func:`plan_global_shape`), or every rank raises naming the shapes read; a piece that
    does not fit the plan on one rank fails every rank. Nothing happens while compiling.
    Every rank of the mesh must call (the conversions do, each call).

    Args:
        plan_id: the id :class:`LocalRedistribute` registered.
        local_shape: the shape of this rank's source piece.
        where: the Cell named in error messages.

    Example::

        agree_on_global_shape(cell.plan_id, (2, 3, 8), where="'layers.0.attention'")
    """
    mesh, src = _PLANS[plan_id][:2]
    if is_compiling() or mesh.size() == 1:
        return True
    try:
        shape, error = _global_shape(plan_id, tuple(local_shape), where), None
    except ValueError as exc:
        shape, error = (), exc
    if len(shape) > _MAX_DIMS:
        raise ValueError(f"conversions take tensors of at most {_MAX_DIMS} dims, not {len(shape)}")
    values = np.zeros(2 + _MAX_DIMS, np.float32)
    values[:2] = (error is not None, len(shape))
    values[2:2 + len(shape)] = shape
    high, low = extremes(values, mesh)
    if error is not None:
        raise error
    if high[0]:
        raise ValueError(f"the conversion{' in ' + where if where else ''} failed on another rank of {mesh!r} "
                         f"(a piece that does not fit the plan there)")
    if (high != low).any():
        ndim = int(high[1])
        read = [f"{int(lo)}..{int(hi)}" if lo != hi else str(int(hi)) for hi, lo in zip(high[2:2 + ndim], low[2:2 + ndim])]
        raise ValueError(
            f"the conversion{' in ' + where if where else ''} from {src.placements}: the ranks of {mesh!r} read "
            f"different global shapes from their pieces (this rank, rank {mesh.get_rank()}, holds {tuple(local_shape)} "
            f"and reads {shape}; over the ranks: ({', '.join(read)})). A Shard of a dim whose length the plan does "
            f"not know is read as even pieces, and a Replicate tensor must have the same shape on every rank: feed "
            f"every rank the same sequence length, and pieces of equal length (a length divisible by the mesh size)")
    return True


@run_in_python
def _becomes_dtensor(wrapped: bool) -> bool:
    """Whether a result asked to be a DTensor becomes one (PyNative; graphs keep it local)."""
    return wrapped and not is_compiling()


@cell_per_call_site
def _redistribution(plan_id: int, local_shape: Tuple[int, ...], where: str, uneven_ok: bool) -> Redistribution:
    """The step-running Cell (:func:`.redistribution`, with its backward and the masking of a
    reduced Partial(max / min)) for a piece of ``local_shape``: layouts normalised for its
    number of dims, the global shape from :func:`plan_global_shape`."""
    mesh, src, dst, grad_src, _ = _PLANS[plan_id]
    ndim = len(local_shape)
    shape = plan_global_shape(plan_id, local_shape, where, uneven_ok)
    return redistribution(mesh, src.normalized(ndim), dst.normalized(ndim), shape,
                          None if grad_src is None else grad_src.normalized(ndim))


def _moved_eagerly(move: Redistribution, x):
    """PyNative: ``move(x)`` keeping neither ``x`` nor the result for the backward (``move``'s
    bprop, with no masked reduction, reads only the gradient). As a custom-bprop Cell, MindSpore
    keeps both (measured, 2.10: a sequence-parallel gather's result; :func:`call_keeping_nothing`)."""
    if move.is_identity:                    # nothing to do either way
        return x
    if x.dtype not in _FLOATS:
        return move(x)
    if move.backward_only:                  # the identity forward: a hooked op result
        return identity_with_gradient(x, move.gradient)
    return call_keeping_nothing(move, x)


class LocalRedistribute(nn.Cell):
    """Move a local piece from layout ``src`` to ``dst``; the gradient arrives as ``grad_src``
    (default: ``dst`` with Partial read as Replicate) and leaves as ``src`` (Partial as Replicate).
    ``dim_sizes``: {dim: global size} for dims whose pieces may be uneven (a layer's features);
    ``where``: the Cell named in error messages; ``wrapped``: the caller wraps the result as a
    DTensor (PyNative), which records an uneven global shape.

    Args:
        mesh: the :class:`DeviceMesh`.
        src: the :class:`Layout` of the input piece.
        dst: the :class:`Layout` of the output piece.
        grad_src: the layout the gradient arrives in (default: ``dst`` with Partial as Replicate).
        dim_sizes: ``{dim: global size}`` of dims whose pieces may be uneven (a layer's features).
        where: the Cell named in error messages.
        wrapped: the caller wraps the result as a DTensor (PyNative), which records an uneven global shape.

    Example::

        gather = LocalRedistribute(mesh, Layout((2,), (Shard(1),)), Layout((2,), (Replicate(),)))
        y = gather(x_piece)                       # PyNative or inside ms.jit
    """

    def __init__(self, mesh, src: Layout, dst: Layout, grad_src: Optional[Layout] = None,
                 dim_sizes: Optional[Dict[int, int]] = None, where: str = "", wrapped: bool = False) -> None:
        super().__init__()
        self.mesh = mesh
        self.plan_id = _plan_id(mesh, src, dst, grad_src, tuple(sorted((dim_sizes or {}).items())))
        self.where = where
        self.wrapped = wrapped
        # a conversion that moves data or records a global shape checks it (a local no-op, such
        # as a Colwise layer's replicated input, hands its piece on to the next one that does)
        self.checks_shape = wrapped or src != dst

    def construct(self, x):
        if self.checks_shape:
            agree_on_global_shape(self.plan_id, x.shape, self.where)
        move = _redistribution(self.plan_id, x.shape, self.where, _becomes_dtensor(self.wrapped))
        if running_eagerly() and not move.masked:
            return _moved_eagerly(move, x)
        return move(x)
