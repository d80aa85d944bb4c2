"""Redistribution planner: the cheapest sequence of steps from one layout to another.

Pure Python (no MindSpore). A layout is seen as one placement per mesh dim plus, per
tensor dim, the mesh dims that shard it, major first. Legal steps on a mesh dim ``a``:

=================  ===============  =============================================
step               from -> to       condition / effect
=================  ===============  =============================================
``all_gather``     S(d) -> R        ``a`` is the minor-most mesh dim of ``d``
``all_to_all``     S(d) -> S(e)     ``a`` minor-most of ``d``; becomes minor-most of ``e``
``chunk``          R -> S(e)        local, no communication; ``a`` becomes minor-most of ``e``
``all_reduce``     P(op) -> R
``reduce_scatter`` P(op) -> S(e)    ``a`` becomes minor-most of ``e``
``partition``      R -> P(op)       local: sum divides by the group size (PyTorch's rule)
=================  ===============  =============================================

A Dijkstra search over these states finds the cheapest plan by :mod:`.._cost` (fewest
textbook elements sent per rank for the largest local piece, then fewest steps), so several mesh dims
change in the order that keeps the tensors small, and a tensor dim sharded over several mesh
dims is un-sharded minor-first. Plans are cached per (source, target, global shape).

Example:
    >>> from hyper_parallel_ms.layout import Layout
    >>> from hyper_parallel_ms.placement import Shard, Replicate, Partial
    >>> plan = plan_redistribute(Layout((2, 2), (Shard(0), Partial())), Layout((2, 2), (Replicate(), Shard(1))), (8, 8))
    >>> [str(s) for s in plan]
    ['reduce_scatter(mesh dim 1, tensor dim 1, sum)', 'all_gather(mesh dim 0, tensor dim 0)']
"""
from __future__ import annotations

import functools
import heapq
import itertools
from dataclasses import dataclass
from typing import Dict, Iterator, List, Sequence, Tuple

from .._cost import Cost, step_elements
from ..layout import Layout
from ..placement import Partial, Placement, Replicate, Shard

__all__ = ["Step", "plan_redistribute"]

Orders = Tuple[Tuple[int, ...], ...]  # per tensor dim, the sharding mesh dims, major first


@dataclass(frozen=True)
class Step:
    """One step on mesh dim ``mesh_dim``; ``before`` is the layout it starts from.

    ``dim``: the gathered / chunked / scattered tensor dim; for ``all_to_all`` the dim
    sharded before (concatenated) and ``to_dim`` the dim sharded after (split).

    Args:
        kind: ``"all_gather"``, ``"all_to_all"``, ``"chunk"``, ``"all_reduce"``, ``"reduce_scatter"``
            or ``"partition"``.
        mesh_dim: the index of the mesh dim.
        before: the :class:`Layout` the step starts from.
        dim: the tensor dim gathered / chunked / scattered (for ``all_to_all``: the dim sharded before).
        to_dim: for ``all_to_all``, the dim sharded after.
        op: the reduce op (``all_reduce``, ``reduce_scatter``, ``partition``).

    >>> from hyper_parallel_ms.placement import Shard
    >>> Step("all_gather", 0, Layout((2,), (Shard(0),)), dim=0).kind
    'all_gather'
    """

    kind: str
    mesh_dim: int
    before: Layout
    dim: int = -1
    to_dim: int = -1
    op: str = "sum"

    def __str__(self) -> str:
        if self.kind == "all_to_all":
            return f"all_to_all(mesh dim {self.mesh_dim}, tensor dim {self.dim} -> {self.to_dim})"
        parts = [f"mesh dim {self.mesh_dim}"]
        if self.dim >= 0:
            parts.append(f"tensor dim {self.dim}")
        if self.kind in ("all_reduce", "reduce_scatter", "partition"):
            parts.append(self.op)
        return f"{self.kind}({', '.join(parts)})"


@dataclass(frozen=True)
class _State:
    placements: Tuple[Placement, ...]
    orders: Orders

    @classmethod
    def of(cls, layout: Layout, ndim: int) -> "_State":
        norm = layout.normalized(ndim)
        return cls(norm.placements, norm.sharding_axes(ndim))

    def layout(self, mesh_shape: Tuple[int, ...], names) -> Layout:
        order = {d: axes for d, axes in enumerate(self.orders) if len(axes) > 1}
        return Layout(mesh_shape, self.placements, mesh_dim_names=names, shard_order=order).normalized(
            len(self.orders))

    def moved(self, axis: int, placement: Placement) -> "_State":
        placements = list(self.placements)
        placements[axis] = placement
        orders = [tuple(a for a in axes if a != axis) for axes in self.orders]
        if placement.is_shard():
            orders[placement.dim] = orders[placement.dim] + (axis,)
        return _State(tuple(placements), tuple(orders))


def _local_elements(state: _State, mesh_shape: Tuple[int, ...], shape: Tuple[int, ...]) -> int:
    """Elements of the largest local piece (ceil at every split)."""
    total = 1
    for size, axes in zip(shape, state.orders):
        for a in axes:
            size = -(-size // mesh_shape[a])
        total *= size
    return total


def _moves(state: _State, ndim: int, ops_wanted: Sequence[str]) -> Iterator[Tuple[str, int, Placement, int, int]]:
    """(kind, mesh dim, new placement, dim, to_dim) for every legal step from ``state``."""
    for axis, p in enumerate(state.placements):
        if p.is_shard():
            if state.orders[p.dim][-1] != axis:
                continue
            yield "all_gather", axis, Replicate(), p.dim, -1
            for e in range(ndim):
                if e != p.dim:
                    yield "all_to_all", axis, Shard(e), p.dim, e
        elif p.is_replicate():
            for e in range(ndim):
                yield "chunk", axis, Shard(e), e, -1
            for op in ops_wanted:
                yield "partition", axis, Partial(op), -1, -1
        else:
            yield "all_reduce", axis, Replicate(), -1, -1
            for e in range(ndim):
                yield "reduce_scatter", axis, Shard(e), e, -1


@functools.lru_cache(maxsize=4096)
def plan_redistribute(src: Layout, dst: Layout, shape: Tuple[int, ...]) -> Tuple[Step, ...]:
    """Steps that turn a tensor of global ``shape`` laid out as ``src`` into ``dst``.

    Raises ``ValueError`` when the layouts are for different meshes or the placements do
    not fit the shape.

    Args:
        src: the :class:`Layout` the tensor is in.
        dst: the :class:`Layout` it should be in (same mesh shape).
        shape: its global shape.

    >>> from hyper_parallel_ms.placement import Replicate, Shard
    >>> [s.kind for s in plan_redistribute(Layout((2,), (Shard(0),)), Layout((2,), (Replicate(),)), (4, 3))]
    ['all_gather']
    """
    shape = tuple(shape)
    if src.mesh_shape != dst.mesh_shape:
        raise ValueError(f"cannot redistribute between meshes of shapes {src.mesh_shape} and {dst.mesh_shape}")
    ndim, mesh_shape = len(shape), src.mesh_shape
    start, goal = _State.of(src, ndim), _State.of(dst, ndim)
    names = src.mesh_dim_names
    ops_wanted = tuple(sorted({p.reduce_op for p in goal.placements if p.is_partial()}))
    counter = itertools.count()
    frontier: List = [(Cost(), next(counter), start, ())]
    best: Dict[_State, Cost] = {start: Cost()}
    while frontier:
        cost, _, state, path = heapq.heappop(frontier)
        if state == goal:
            return tuple(path)
        if best[state] < cost:
            continue
        local = _local_elements(state, mesh_shape, shape)
        for kind, axis, placement, dim, to_dim in _moves(state, ndim, ops_wanted):
            nxt = state.moved(axis, placement)
            new = cost + Cost(step_elements(kind, mesh_shape[axis], local), 1)
            if nxt not in best or new < best[nxt]:
                best[nxt] = new
                op = placement.reduce_op if kind == "partition" else (
                    state.placements[axis].reduce_op if kind in ("all_reduce", "reduce_scatter") else "sum")
                step = Step(kind, axis, state.layout(mesh_shape, names), dim, to_dim, op)
                heapq.heappush(frontier, (new, next(counter), nxt, path + (step,)))
    raise ValueError(f"no redistribution from {src} to {dst} for shape {shape}")  # unreachable: R connects all

