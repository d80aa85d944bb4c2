"""Run a redistribution plan on a local tensor, with the DTensor backward.

:func:`lower` turns a plan into this rank's concrete steps (plain tuples of ints and
strings: piece sizes and offsets for its mesh coordinate), so that executing them needs
no layout objects and works in PyNative and inside ``ms.jit``. :class:`Redistribution`
is a Cell running the forward steps, whose ``bprop`` runs the steps that carry the
gradient back: from the target placements to the source placements with Partial turned
into Replicate, as PyTorch's ``redistribute`` backward does.

Example::

    cell = redistribution(mesh, src_layout, dst_layout, (8, 8))
    y_local = cell(x_local)
"""
from __future__ import annotations

from typing import Tuple

from mindspore import nn, ops

from .._mindspore import cached_in_python
from .. import comm
from ..comm._tensor import narrow
from ..layout import Layout, chunk_offsets, chunk_sizes
from ._gradient import gradient_layout
from ._planner import Step, plan_redistribute

__all__ = ["lower", "lowered_steps", "execute", "step_cells", "Redistribution", "redistribution",
           "average_scaling"]

# (kind, mesh_dim, dim, other_dim, sizes, op, offset, length)
LocalStep = Tuple[str, int, int, int, Tuple[int, ...], str, int, int]


def lower(plan: Tuple[Step, ...], coordinate: Tuple[int, ...], shape: Tuple[int, ...]) -> Tuple[LocalStep, ...]:
    """This rank's concrete steps for ``plan`` on a tensor of global ``shape``."""
    out = []
    for step in plan:
        a, before = step.mesh_dim, step.before
        n = before.mesh_shape[a]
        if step.kind in ("all_gather", "all_to_all"):
            sizes = before.shard_sizes(shape, coordinate, a)
            out.append((step.kind, a, step.dim, step.to_dim, sizes, step.op, 0, 0))
        elif step.kind == "chunk":
            local = before.local_shape(shape, coordinate)[step.dim]
            k = coordinate[a]
            out.append(("chunk", a, step.dim, -1, (), "sum", chunk_offsets(local, n)[k], chunk_sizes(local, n)[k]))
        elif step.kind == "partition" and step.op != "sum":
            continue  # avg / max / min of equal values is the value itself
        else:
            out.append((step.kind, a, step.dim, -1, (), step.op, n, 0))
    return tuple(out)


class _Step(nn.Cell):
    """One lowered step as a Cell: its kind and arguments are constants of the compiled graph."""

    def __init__(self, mesh, step: LocalStep) -> None:
        super().__init__()
        self.mesh = mesh
        self.kind, self.mesh_dim, self.dim, self.other, self.sizes, self.op, self.offset, self.length = step

    def construct(self, x):
        if self.kind == "all_gather":
            return comm.all_gather(x, self.mesh, self.mesh_dim, dim=self.dim, sizes=self.sizes)
        if self.kind == "all_to_all":
            return comm.all_to_all(x, self.mesh, self.mesh_dim, split_dim=self.other, concat_dim=self.dim,
                                   concat_sizes=self.sizes)
        if self.kind == "chunk":
            return narrow(x, self.dim, self.offset, self.length)
        if self.kind == "all_reduce":
            return comm.all_reduce(x, self.mesh, self.mesh_dim, op=self.op)
        if self.kind == "reduce_scatter":
            return comm.reduce_scatter(x, self.mesh, self.mesh_dim, dim=self.dim, op=self.op)
        return x / self.offset  # partition a replicated value into a sum: every rank holds value / n


@cached_in_python
def _step_cell(mesh, step: LocalStep) -> _Step:
    return _Step(mesh, step)


def step_cells(mesh, steps: Tuple[LocalStep, ...]) -> nn.CellList:
    """The (cached) Cells of lowered ``steps``, in order."""
    return nn.CellList([_step_cell(mesh, s) for s in steps])


def execute(x, mesh, steps: Tuple[LocalStep, ...]):
    """Apply lowered steps to the local tensor ``x`` (PyNative; in graphs use :class:`Redistribution`)."""
    for step in steps:
        x = _step_cell(mesh, step)(x)
    return x


class Redistribution(nn.Cell):
    """Forward: ``forward_steps`` on the local tensor; backward: ``backward_steps`` on its gradient.

    ``value_steps`` (when the forward reduces a Partial(max / min)): they bring the result
    back to the source layout, and the gradient reaches only the elements equal to it (the
    ranks that held the maximum), as the gradient of a single-device max does.
    """

    def __init__(self, mesh, forward_steps: Tuple[LocalStep, ...], backward_steps: Tuple[LocalStep, ...],
                 value_steps: Tuple[LocalStep, ...] = None) -> None:
        super().__init__()
        self.forward_cells = step_cells(mesh, forward_steps)
        self.backward_cells = step_cells(mesh, backward_steps)
        self.masked = value_steps is not None
        self.value_cells = step_cells(mesh, value_steps or ())

    def construct(self, x):
        for cell in self.forward_cells:
            x = cell(x)
        return x

    def bprop(self, x, out, dout):
        for cell in self.backward_cells:
            dout = cell(dout)
        if self.masked:
            for cell in self.value_cells:
                out = cell(out)
            dout = dout * ops.equal(x, out).astype(dout.dtype)
        # a gradient cut from a gathered one is a view at an offset into it; MindSpore's backward
        # of view ops (SplitTensorView, ...) reads such a gradient from the start of its storage,
        # so hand back a fresh tensor (the CPU backend has no Clone kernel)
        return (dout * 1 if self.backward_cells else dout,)


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


@cached_in_python
def redistribution(mesh, src: Layout, dst: Layout, shape: Tuple[int, ...],
                   grad_src: Layout = None) -> Redistribution:
    """The cached Cell moving a tensor of global ``shape`` from ``src`` to ``dst`` on ``mesh``,
    with the backward of :func:`lowered_steps`."""
    forward, backward, scaling = lowered_steps(src, dst, shape, mesh.get_coordinate(), grad_src)
    extremum = any(p.is_partial() and p.reduce_op in ("max", "min") and q != p
                   for p, q in zip(src.placements, dst.placements))
    return Redistribution(mesh, forward, backward + scaling, backward if extremum else None)


def average_scaling(src: Layout, dst: Layout) -> Tuple[LocalStep, ...]:
    """Backward steps for the mesh dims where the forward averaged a Partial(avg): each rank's
    value counts 1/n in the average, so its gradient is divided by n."""
    return tuple(("partition", a, -1, -1, (), "sum", n, 0)
                 for a, (p, q, n) in enumerate(zip(src.placements, dst.placements, src.mesh_shape))
                 if p.is_partial("avg") and not q.is_partial("avg") and n > 1)
