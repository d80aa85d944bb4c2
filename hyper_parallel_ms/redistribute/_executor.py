"""Run a redistribution plan on a local tensor, with the DTensor backward.

:func:`lower` turns a plan into this rank's concrete step records (:mod:`._steps`: piece
sizes and offsets for its mesh coordinate), so that executing them needs no layout objects
and works in PyNative and inside ``ms.jit``. :class:`Redistribution` is a Cell running the
forward steps, whose ``bprop`` runs the steps that carry the gradient back: from the target
placements to the source placements with Partial turned into Replicate, as PyTorch's
``redistribute`` backward does.

Example::

    cell = redistribution(mesh, src_layout, dst_layout, (8, 8))
    y_local = cell(x_local)
"""
from __future__ import annotations

import dataclasses
from typing import Tuple

from mindspore import nn, ops

from .._mindspore import cell_per_call_site
from .. import comm
from ..comm._tensor import narrow
from ..layout import Layout
from ._gradient import gradient_layout
from ._planner import plan_redistribute
from ._steps import (AllGather, AllReduce, AllToAll, LocalStep, Multiply, Narrow, Partition, ReduceScatter, ends_in_narrow,
                     lower)

__all__ = ["lower", "lowered_steps", "execute", "step_cells", "Redistribution", "redistribution",
           "average_scaling"]


class _StepCell(nn.Cell):
    """One step record as a Cell: the record's fields become constants of the compiled graph."""

    def __init__(self, mesh, step: LocalStep) -> None:
        super().__init__()
        self.mesh = mesh
        for field in dataclasses.fields(step):
            setattr(self, field.name, getattr(step, field.name))


class _AllGather(_StepCell):
    def construct(self, x):
        return comm.all_gather(x, self.mesh, self.mesh_dim, dim=self.dim, sizes=self.sizes)


class _AllToAll(_StepCell):
    def construct(self, x):
        return comm.all_to_all(x, self.mesh, self.mesh_dim, split_dim=self.split_dim, concat_dim=self.concat_dim,
                               concat_sizes=self.concat_sizes)


class _Narrow(_StepCell):
    def construct(self, x):
        return narrow(x, self.dim, self.offset, self.length)


class _AllReduce(_StepCell):
    def construct(self, x):
        return comm.all_reduce(x, self.mesh, self.mesh_dim, op=self.op)


class _ReduceScatter(_StepCell):
    def construct(self, x):
        return comm.reduce_scatter(x, self.mesh, self.mesh_dim, dim=self.dim, op=self.op)


class _Partition(_StepCell):
    def construct(self, x):
        return x / self.divisor


class _Multiply(_StepCell):
    def construct(self, x):
        return x * self.factor


_CELLS = {AllGather: _AllGather, AllToAll: _AllToAll, Narrow: _Narrow, AllReduce: _AllReduce,
          ReduceScatter: _ReduceScatter, Partition: _Partition, Multiply: _Multiply}


@cell_per_call_site
def _step_cell(mesh, step: LocalStep) -> _StepCell:
    return _CELLS[type(step)](mesh, step)


def step_cells(mesh, steps: Tuple[LocalStep, ...]) -> nn.CellList:
    """The (cached) Cells of lowered ``steps``, in order."""
    return nn.CellList([_step_cell(mesh, s) for s in steps])


def execute(x, mesh, steps: Tuple[LocalStep, ...]):
    """Apply lowered steps to the local tensor ``x`` (PyNative; in graphs use :class:`Redistribution`).

    Args:
        x: this rank's piece.
        mesh: the :class:`DeviceMesh`.
        steps: the steps of :func:`lower` for this rank.

    Example::

        steps = lower(plan_redistribute(src, dst, shape), mesh.coordinate, shape)
        y = execute(x, mesh, steps)
    """
    for step in steps:
        x = _step_cell(mesh, step)(x)
    return x


class Redistribution(nn.Cell):
    """Forward: ``forward_steps`` on the local tensor; backward: ``backward_steps`` on its gradient.

    ``value_steps`` (when the forward reduces a Partial(max / min)): they bring the result
    back to the source layout, and the gradient reaches only the elements equal to it (the
    ranks that held the maximum), as the gradient of a single-device max does.

    Args:
        mesh: the :class:`DeviceMesh`.
        forward_steps: this rank's steps on the value.
        backward_steps: this rank's steps on the gradient.
        value_steps: for a Partial(max / min) reduced in forward, the steps that bring the result
            back to the source layout (``None`` otherwise).
        from_input: ``value_steps`` reduce the input piece over the max / min mesh dims instead
            (beside Partial(sum / avg) dims, where the output is no extremum to compare with).

    Example::

        cell = redistribution(mesh, src, dst, shape)     # a cached Redistribution
        y = cell(x)                                      # PyNative or inside ms.jit
    """

    def __init__(self, mesh, forward_steps: Tuple[LocalStep, ...], backward_steps: Tuple[LocalStep, ...],
                 value_steps: Tuple[LocalStep, ...] = None, from_input: bool = False) -> None:
        super().__init__()
        self.forward_cells = step_cells(mesh, forward_steps)
        self.backward_cells = step_cells(mesh, backward_steps)
        self.masked = value_steps is not None
        self.value_cells = step_cells(mesh, value_steps or ())
        self.from_input = from_input     # value_steps reduce the input itself (mixed Partial kinds)
        # a gradient cut from a gathered one is a view at an offset into it; MindSpore's backward
        # of view ops (SplitTensorView, ...) reads such a gradient from the start of its storage,
        # so a gradient whose last step narrows is handed back as a fresh tensor (the CPU backend
        # has no Clone kernel); masking makes a fresh one anyway
        self.copies_gradient = bool(backward_steps) and ends_in_narrow(backward_steps[-1]) and not self.masked
        # no step either way: the identity, which callers may skip in PyNative (as a custom-bprop
        # Cell, MindSpore keeps its input and output for the backward); no forward step: the
        # identity with :meth:`gradient` as its backward (_mindspore.identity_with_gradient)
        self.is_identity = not forward_steps and not backward_steps and not self.masked
        self.backward_only = not forward_steps and bool(backward_steps) and not self.masked

    def construct(self, x):
        for cell in self.forward_cells:
            x = cell(x)
        return x

    def gradient(self, dout):
        """The backward steps on ``dout`` (for a Redistribution with no masked reduction)."""
        for cell in self.backward_cells:
            dout = cell(dout)
        return dout * 1 if self.copies_gradient else dout

    def bprop(self, x, out, dout):
        for cell in self.backward_cells:
            dout = cell(dout)
        if self.masked:
            value = x if self.from_input else out
            for cell in self.value_cells:
                value = cell(value)
            dout = dout * ops.equal(x, value).astype(dout.dtype)
        return (dout * 1 if self.copies_gradient else dout,)


def lowered_steps(src: Layout, dst: Layout, shape: Tuple[int, ...], coordinate: Tuple[int, ...],
                  grad_src: Layout = None) -> Tuple[Tuple[LocalStep, ...], ...]:
    """This rank's (forward, backward, scaling) steps moving a tensor of global ``shape`` from
    ``src`` to ``dst``. The gradient arrives as ``grad_src`` (default: ``dst`` with Partial as
    Replicate); the backward steps bring it to ``src`` with Partial as Replicate, and the
    scaling steps divide it by the group size on the mesh dims where a Partial(avg) was averaged."""
    forward = lower(plan_redistribute(src, dst, shape), coordinate, shape)
    grad_from = gradient_layout(dst) if grad_src is None else grad_src
    backward = lower(plan_redistribute(grad_from, gradient_layout(src), shape), coordinate, shape)
    return forward, backward, average_scaling(src, dst)


@cell_per_call_site
def redistribution(mesh, src: Layout, dst: Layout, shape: Tuple[int, ...],
                   grad_src: Layout = None) -> Redistribution:
    """The cached Cell moving a tensor of global ``shape`` from ``src`` to ``dst`` on ``mesh``,
    with the backward of :func:`lowered_steps`.

    Args:
        mesh: the :class:`DeviceMesh`.
        src: the :class:`Layout` of the input.
        dst: the :class:`Layout` of the output.
        shape: the global shape.
        grad_src: the layout the gradient arrives in (default: ``dst`` with Partial as Replicate).

    Example::

        y = redistribution(mesh, Layout((2,), (Shard(0),)), Layout((2,), (Replicate(),)), (4, 3))(x)
    """
    forward, backward, scaling = lowered_steps(src, dst, shape, mesh.coordinate, grad_src)
    reduced = tuple(AllReduce(a, p.reduce_op) for a, (p, q) in enumerate(zip(src.placements, dst.placements))
                    if p.is_partial() and p.reduce_op in ("max", "min") and q != p)
    if not reduced:
        return Redistribution(mesh, forward, backward + scaling)
    if any(p.is_partial("sum") or p.is_partial("avg") for p in src.placements + dst.placements):
        # beside Partial(sum / avg) pieces, the output is no extremum to compare with: the
        # holders are the ranks whose piece equals its reduction over the extremum dims alone
        return Redistribution(mesh, forward, backward + scaling, reduced, from_input=True)
    return Redistribution(mesh, forward, backward + scaling, backward)


def average_scaling(src: Layout, dst: Layout) -> Tuple[LocalStep, ...]:
    """Backward steps for the mesh dims where a Partial(avg) ends or begins: where the forward
    averaged one, each rank's value counts 1/n in the average, so its gradient is divided by n;
    where it made one from another placement, the gradient of the average arrives divided by n
    (each piece counts 1/n), and is multiplied back."""
    steps = []
    for a, (p, q, n) in enumerate(zip(src.placements, dst.placements, src.mesh_shape)):
        if n > 1 and p.is_partial("avg") != q.is_partial("avg"):
            steps.append(Partition(a, n) if p.is_partial("avg") else Multiply(a, n))
    return tuple(steps)
