"""Broadcasting copies: ``BroadcastTo`` / ``BroadcastToView`` (``x.expand``, ``broadcast_to``),
``ExpandAs`` (``x.expand_as``), ``Tile`` (``tile``) and ``Repeat`` (``x.repeat``).

A dim that keeps its size keeps its sharding (shifted by the new leading dims); a dim that is
expanded or tiled is gathered first (its pieces would be copied across shard boundaries).
Partial values stay Partial: copying is linear and keeps maxima. Sizes given to the op are
replaced by this rank's local sizes where a dim stays sharded.

Example::

    y = b_dt.expand((8, 6))      # b (1, 6) S(1): y S(1), no communication
"""
from __future__ import annotations

from typing import List, Tuple

from mindspore import ops

from ...placement import Placement, Replicate, Shard
from .._registry import register_sharding
from .._schema import OpSchema, OutputSharding, TensorArg
from ._common import ints, layout_like

__all__ = ["broadcast_to_rule", "expand_as_rule", "tile_rule"]


def _kept_placements(x: TensorArg, out_shape: Tuple[int, ...], whole) -> Tuple[List[Placement], List[Placement]]:
    """(placements ``x`` needs, output placements) when input dim ``d`` becomes output dim
    ``d + lead`` and stays sharded only where ``whole(d)`` (its size is unchanged)."""
    lead = len(out_shape) - x.ndim
    need: List[Placement] = []
    out: List[Placement] = []
    for p in x.layout.placements:
        if p.is_shard() and not whole(p.dim):
            need.append(Replicate())
            out.append(Replicate())
        else:
            need.append(p)
            out.append(Shard(p.dim + lead) if p.is_shard() else p)
    return need, out


def _broadcast(x: TensorArg, target: Tuple[int, ...]):
    lead = len(target) - x.ndim
    if lead < 0:
        raise ValueError(f"cannot expand a {x.ndim}-D tensor of shape {x.shape} to {target}")
    out_shape = tuple(x.shape[d - lead] if s == -1 and d >= lead else s for d, s in enumerate(target))
    for d, s in enumerate(x.shape):
        if s not in (1, out_shape[d + lead]):
            raise ValueError(f"cannot expand shape {x.shape} to {target}: dim {d} has size {s}")
    need, out = _kept_placements(x, out_shape, lambda d: x.shape[d] == out_shape[d + lead])
    return (layout_like(x.layout, need, ndim=x.ndim), layout_like(x.layout, out, ndim=len(out_shape)),
            out_shape)


@register_sharding("BroadcastTo", "BroadcastToView", "Expand")
def broadcast_to_rule(schema: OpSchema) -> OutputSharding:
    """``BroadcastTo(x, shape)`` or ``BroadcastTo(x, *sizes)``; ``-1`` keeps a size."""
    x = schema.args[0]
    target = ints(schema.args[1:]) if len(schema.args) > 1 else ints(schema.kwarg("shape", ()))
    need, out, out_shape = _broadcast(x, target)
    packed = len(schema.args) == 2 and isinstance(schema.args[1], (tuple, list))

    def local_args(coord):
        local = out.local_shape(out_shape, coord)
        return (None, tuple(local)) if packed else (None,) + tuple(local)
    return OutputSharding((need,) + (None,) * (len(schema.args) - 1), ((out, out_shape),),
                          local_args if len(schema.args) > 1 else None)


@register_sharding("ExpandAs")
def expand_as_rule(schema: OpSchema) -> OutputSharding:
    """``x.expand_as(other)``: only ``other``'s shape is read, so it is not moved; the local op
    broadcasts ``x``'s piece to this rank's piece of the output."""
    x, other = schema.args[0], schema.args[1]
    need, out, out_shape = _broadcast(x, other.shape)

    def local_fn(coord):
        local = tuple(out.local_shape(out_shape, coord))

        def expand(piece, _other):
            return ops.broadcast_to(piece, local)
        return expand
    return OutputSharding((need, other.layout), ((out, out_shape),), local_fn=local_fn)


@register_sharding("Tile", "Repeat")
def tile_rule(schema: OpSchema) -> OutputSharding:
    """``Tile(x, multiples)`` / ``Repeat(x, *sizes)``: dims repeated once keep their sharding."""
    x = schema.args[0]
    reps = ints(schema.args[1:])
    if len(reps) < x.ndim:
        reps = (1,) * (x.ndim - len(reps)) + reps
    lead = len(reps) - x.ndim
    out_shape = tuple(r if d < lead else x.shape[d - lead] * r for d, r in enumerate(reps))
    need, out = _kept_placements(x, out_shape, lambda d: reps[d + lead] == 1)
    return OutputSharding((layout_like(x.layout, need, ndim=x.ndim),) + (None,) * (len(schema.args) - 1),
                          ((layout_like(x.layout, out, ndim=len(out_shape)), out_shape),))
