"""Helpers shared by the rule modules.

Example::

    layout_like(x.layout, (Shard(0), Replicate()))
"""
from __future__ import annotations

from typing import Dict, List, Optional, Sequence, Tuple

from ...layout import Layout
from ...placement import Placement, Replicate

__all__ = ["ints", "layout_like", "replicate_all", "whole_and_reduced", "gathered_on"]


def ints(values: Sequence) -> Tuple[int, ...]:
    """The ints of an op's arguments, tuples and lists flattened (``(2, (0, 1))`` -> ``(2, 0, 1)``)."""
    flat: List[int] = []
    for v in values:
        flat.extend(v if isinstance(v, (tuple, list)) else [v])
    return tuple(int(v) for v in flat)


def layout_like(template: Layout, placements: Sequence[Placement],
                order: Optional[Dict[int, Tuple[int, ...]]] = None, ndim: Optional[int] = None) -> Layout:
    """A layout on ``template``'s mesh with ``placements`` (and shard ``order``), normalised."""
    layout = Layout(template.mesh_shape, tuple(placements), mesh_dim_names=template.mesh_dim_names,
                    shard_order=order or {})
    return layout if ndim is None else layout.normalized(ndim)


def replicate_all(template: Layout) -> Layout:
    """Every mesh dim Replicate."""
    return Layout.replicated(template.mesh_shape, template.mesh_dim_names)


def whole_and_reduced(layout: Layout, dims, ndim: int) -> Layout:
    """``layout`` with tensor ``dims`` gathered and Partial values reduced, for ops that need
    whole values along some dims (softmax, norms) or whole values at all (dropout)."""
    dims = set(dims)
    return layout_like(layout, [Replicate() if (p.is_shard() and p.dim in dims) or p.is_partial() else p
                                for p in layout.placements], ndim=ndim)


def gathered_on(layout: Layout, dim: int, ndim: int) -> Layout:
    """``layout`` with tensor ``dim`` gathered (every other placement kept)."""
    return layout_like(layout, [Replicate() if p.is_shard(dim) else p for p in layout.placements], ndim=ndim)
