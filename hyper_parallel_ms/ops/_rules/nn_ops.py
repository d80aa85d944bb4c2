"""Layers' primitives: ``LayerNorm`` (``nn.LayerNorm``), ``Gather`` (``nn.Embedding`` and
``ops.gather``), and in-place updates (``add_``, ``mul_``, ``copy_``, ``+=``, ``ops.assign``).

LayerNorm needs the normalised dims whole and the values reduced: those are gathered /
reduced first, the leading dims keep their sharding (its mean and variance outputs too).
Gather along dim 0 of a table: a column-sharded table gives output sharded on its last dim;
sharded indices give output sharded like them; a row-sharded table is gathered first (a
masked lookup is not implemented yet). An in-place op keeps the target's layout: the other
operands are brought to the placements that make the update exact (a Partial(sum) target
accepts Partial(sum) addends and scalar factors).

Example::

    y = nn.LayerNorm((hidden,))(x_dt)     # x S(0) (sequence sharded): y S(0), no communication
    acc += grad_dt                        # acc stays a DTensor with its placements
"""
from __future__ import annotations

from typing import List

from ...placement import Placement, Replicate, Shard
from .._registry import register_sharding
from .._schema import OpSchema, OutputSharding, TensorArg
from ._common import layout_like, replicate_all

__all__ = ["layer_norm_rule", "gather_rule", "inplace_rule"]


@register_sharding("LayerNorm")
def layer_norm_rule(schema: OpSchema) -> OutputSharding:
    x = schema.args[0]
    axis = schema.attr("begin_norm_axis", -1) % x.ndim
    need = [Replicate() if (p.is_shard() and p.dim >= axis) or p.is_partial() else p for p in x.layout.placements]
    layout = layout_like(x.layout, need, ndim=x.ndim)
    stats_shape = x.shape[:axis] + (1,) * (x.ndim - axis)
    rep = replicate_all(x.layout)
    inputs = (layout,) + tuple(rep if isinstance(a, TensorArg) else None
                               for a in schema.args[1:])
    return OutputSharding(inputs, ((layout, x.shape), (layout, stats_shape), (layout, stats_shape)))


@register_sharding("Gather")
def gather_rule(schema: OpSchema) -> OutputSharding:
    table, ids = schema.args[0], schema.args[1]
    axis = (schema.args[2] if len(schema.args) > 2 and isinstance(schema.args[2], int) else 0) % table.ndim
    if axis != 0 or table.ndim != 2:
        rep = replicate_all(table.layout)
        out_shape = table.shape[:axis] + ids.shape + table.shape[axis + 1:]
        return OutputSharding(tuple(rep if isinstance(a, TensorArg) else None for a in schema.args),
                              ((rep, out_shape),))
    out_shape = ids.shape + (table.shape[1],)
    need_table: List[Placement] = []
    need_ids: List[Placement] = []
    out: List[Placement] = []
    for pt, pi in zip(table.layout.placements, ids.layout.placements):
        if pt.is_shard(1):
            need_table.append(pt)
            need_ids.append(Replicate())
            out.append(Shard(len(out_shape) - 1))
        elif pi.is_shard():
            need_table.append(Replicate())
            need_ids.append(pi)
            out.append(pi)
        else:
            need_table.append(Replicate())
            need_ids.append(Replicate())
            out.append(Replicate())
    inputs = (layout_like(table.layout, need_table, ndim=2), layout_like(table.layout, need_ids, ndim=ids.ndim)) \
        + (None,) * (len(schema.args) - 2)
    return OutputSharding(inputs, ((layout_like(table.layout, out, ndim=len(out_shape)), out_shape),))


_ADDING = ("InplaceAddExt", "InplaceAdd", "InplaceSubExt", "InplaceSub")


@register_sharding("InplaceAddExt", "InplaceAdd", "InplaceSubExt", "InplaceSub", "InplaceMul", "InplaceMuls",
                   "InplaceDiv", "InplaceDivs", "InplaceCopy", "Assign", "AssignAdd")
def inplace_rule(schema: OpSchema) -> OutputSharding:
    target = schema.args[0]
    inputs = [target.layout]
    for other in schema.args[1:]:
        if not isinstance(other, TensorArg):
            inputs.append(None)
            continue
        offset = target.ndim - other.ndim
        need: List[Placement] = []
        for p in target.layout.placements:
            if p.is_shard():
                d = p.dim - offset
                need.append(Shard(d) if d >= 0 and other.shape[d] == target.shape[p.dim] else Replicate())
            elif p.is_partial() and (schema.op in _ADDING + ("InplaceCopy", "Assign", "AssignAdd")):
                need.append(p)  # adding or copying partial values keeps the sum exact
            else:
                need.append(Replicate())
        inputs.append(layout_like(target.layout, need, ndim=other.ndim))
    return OutputSharding(tuple(inputs), ((target.layout, target.shape),), inplace=True)
