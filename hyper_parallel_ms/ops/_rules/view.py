"""Views and dim-wise ops: ``Transpose`` / ``TransposeExtView`` (permute, transpose),
``ExpandDims`` (unsqueeze), ``Squeeze``, ``Reshape`` (reshape, view), ``Flatten``, ``TExt``,
``ViewAs``, ``Unstack`` (unbind) and ``Narrow``. Joins and splits (cat, stack, split, chunk) are in
:mod:`.concat`, softmax with the other normalisations in :mod:`.nn_ops`.

Placements follow the dims: a sharded dim moves with a permutation; unsqueeze / squeeze
shift indices (a squeezed sharded dim is gathered); a reshape keeps a dim sharded when it
starts at the same flat offset in the output and both sizes split evenly over the mesh dim
(or the dim is unchanged), and gathers it otherwise. Narrowing a dim gathers it (the piece cuts
across shard boundaries) unless it is kept whole; the other dims keep their placements. Partial
values pass through views unchanged (views are linear).

Example::

    y = x_dt.permute(2, 0, 1)       # S(2) -> S(0), no communication
"""
from __future__ import annotations

from math import prod
from typing import List, Tuple

from mindspore import ops

from ...placement import Placement, Replicate, Shard
from .._registry import register_sharding
from .._schema import OpSchema, OutputSharding, TensorArg
from ._common import gathered_on, ints, layout_like

__all__ = ["reshape_target"]


def _moved(schema: OpSchema, x: TensorArg, dim_map, out_shape) -> OutputSharding:
    """Sharding where input dim ``d`` becomes output dim ``dim_map(d)`` (None: gather it)."""
    need: List[Placement] = []
    out: List[Placement] = []
    for p in x.layout.placements:
        target = dim_map(p.dim) if p.is_shard() else None
        if p.is_shard() and target is None:
            need.append(Replicate())
            out.append(Replicate())
        else:
            need.append(p)
            out.append(Shard(target) if p.is_shard() else p)
    inputs = (layout_like(x.layout, need, ndim=x.ndim),) + (None,) * (len(schema.args) - 1)
    return OutputSharding(inputs, ((layout_like(x.layout, out, ndim=len(out_shape)), tuple(out_shape)),))


def _nested(x: TensorArg) -> set:
    """Tensor dims sharded by more than one mesh dim (kept simple here: they are gathered)."""
    dims = [p.dim for p in x.layout.placements if p.is_shard()]
    return {d for d in dims if dims.count(d) > 1}


@register_sharding("Transpose", "TransposeView", "DeprecatedTranspose")
def permute_rule(schema: OpSchema) -> OutputSharding:
    x = schema.args[0]
    perm = tuple(d % x.ndim for d in ints(schema.args[1:]))
    nested = _nested(x)
    return _moved(schema, x, lambda d: None if d in nested else perm.index(d), [x.shape[d] for d in perm])


@register_sharding("TransposeExtView", "TransposeExt")
def transpose_rule(schema: OpSchema) -> OutputSharding:
    x = schema.args[0]
    d0, d1 = (d % x.ndim for d in ints(schema.args[1:3]))
    swap = {d0: d1, d1: d0}
    shape = list(x.shape)
    shape[d0], shape[d1] = shape[d1], shape[d0]
    nested = _nested(x)
    return _moved(schema, x, lambda d: None if d in nested else swap.get(d, d), shape)


@register_sharding("ExpandDims", "ExpandDimsView", "Unsqueeze")
def unsqueeze_rule(schema: OpSchema) -> OutputSharding:
    x = schema.args[0]
    axis = ints(schema.args[1:2])[0] % (x.ndim + 1)
    shape = list(x.shape)
    shape.insert(axis, 1)
    return _moved(schema, x, lambda d: d + (d >= axis), shape)


@register_sharding("Squeeze")
def squeeze_rule(schema: OpSchema) -> OutputSharding:
    x = schema.args[0]
    given = ints(schema.args[1:]) if len(schema.args) > 1 else ()
    dims = {d % x.ndim for d in given if x.shape[d % x.ndim] == 1} if given else \
        {d for d, s in enumerate(x.shape) if s == 1}
    shape = [s for d, s in enumerate(x.shape) if d not in dims]
    moved = _moved(schema, x, lambda d: None if d in dims else d - sum(1 for r in dims if r < d), shape)
    out_layout = moved.outputs[0][0]

    def local_fn(coord):
        # the local op would also drop dims whose piece happens to have size 1 on this rank
        # (5 rows on 4 ranks: 2, 1, 1, 1), so each rank reshapes to its piece of the global result
        local = tuple(out_layout.local_shape(tuple(shape), coord))

        def squeeze(piece, *_args, **_kwargs):
            return ops.reshape(piece, local)
        return squeeze
    return OutputSharding(moved.inputs, moved.outputs, local_fn=local_fn)


def reshape_target(shape: Tuple[int, ...], requested: Tuple[int, ...]) -> Tuple[int, ...]:
    """``requested`` with a ``-1`` resolved against ``shape``."""
    if requested.count(-1) > 1:
        raise ValueError(f"reshape to {requested}: at most one -1")
    known = prod(s for s in requested if s != -1)
    total = prod(shape)
    if -1 in requested:
        if known == 0 or total % known:
            raise ValueError(f"cannot reshape {shape} to {requested}")
        requested = tuple(total // known if s == -1 else s for s in requested)
    if prod(requested) != total:
        raise ValueError(f"cannot reshape {shape} ({total} elements) to {requested}")
    return requested


@register_sharding("Reshape", "View")
def reshape_rule(schema: OpSchema) -> OutputSharding:
    x = schema.args[0]
    out_shape = reshape_target(x.shape, ints(schema.args[1:]))
    nested = _nested(x)
    sizes = dict((p.dim, x.layout.mesh_shape[a]) for a, p in enumerate(x.layout.placements) if p.is_shard())

    def target(d):
        if d in nested:
            return None
        before = prod(x.shape[:d])
        for o in range(len(out_shape)):
            if prod(out_shape[:o]) != before:
                continue
            same = x.shape[d] == out_shape[o] and prod(x.shape[d + 1:]) == prod(out_shape[o + 1:])
            n = sizes[d]
            if same or (x.shape[d] % n == 0 and out_shape[o] % n == 0):
                return o
        return None
    moved = _moved(schema, x, target, out_shape)
    out_layout = moved.outputs[0][0]
    packed = len(schema.args) == 2 and isinstance(schema.args[1], (tuple, list))

    def local_args(coord):
        local = out_layout.local_shape(out_shape, coord)
        return (None, tuple(local)) if packed else (None,) + tuple(local)
    return OutputSharding(moved.inputs, moved.outputs, local_args)


@register_sharding("Narrow", "NarrowView")
def narrow_rule(schema: OpSchema) -> OutputSharding:
    """``mint.narrow(x, dim, start, length)``: the narrowed dim is gathered unless it is kept whole."""
    x = schema.args[0]
    dim, start, length = (int(v) for v in schema.args[1:4])
    dim %= x.ndim
    whole = start == 0 and length == x.shape[dim]
    layout = x.layout if whole else gathered_on(x.layout, dim, x.ndim)
    shape = list(x.shape)
    shape[dim] = length

    def local_args(coord):  # a whole sharded dim: this rank's piece is narrowed to itself
        return (None, None, None, layout.local_shape(x.shape, coord)[dim])
    return OutputSharding((layout,) + (None,) * (len(schema.args) - 1), ((layout, tuple(shape)),),
                          local_args if whole else None)


@register_sharding("TExt")
def t_rule(schema: OpSchema) -> OutputSharding:
    """``x.t()`` / ``mint.t``: a transpose of dims 0 and 1 (a 1-D tensor is unchanged)."""
    x = schema.args[0]
    if x.ndim < 2:
        return _moved(schema, x, lambda d: d, x.shape)
    return _moved(schema, x, lambda d: 1 - d, x.shape[::-1])


@register_sharding("Unstack", "UnstackExtView", "UnstackExt")
def unstack_rule(schema: OpSchema) -> OutputSharding:
    """``unbind`` / ``unstack``: ``Unstack(x)`` with the ``axis`` attribute, or ``(x, dim)``;
    one output per index of the dim (gathered when sharded), the other dims shift down."""
    x = schema.args[0]
    axis = int(schema.args[1]) if len(schema.args) > 1 else int(schema.kwarg("dim", schema.attr("axis", 0)))
    axis %= x.ndim
    shape = x.shape[:axis] + x.shape[axis + 1:]
    one = _moved(schema, x, lambda d: None if d == axis else d - (d > axis), shape)
    return OutputSharding(one.inputs, one.outputs * x.shape[axis])


@register_sharding("ViewAs")
def view_as_rule(schema: OpSchema) -> OutputSharding:
    """``x.view_as(other)``: sharded like ``x.reshape(other.shape)``; only ``other``'s global shape
    is read (it is not moved), and each rank views its piece as its piece of the result."""
    x, other = schema.args[0], schema.args[1]
    as_reshape = reshape_rule(OpSchema("Reshape", (x, tuple(other.shape)), (), ()))
    out, out_shape = as_reshape.outputs[0]

    def local_fn(coord):
        local = tuple(out.local_shape(out_shape, coord))

        def view_as(piece, _other):
            return piece.reshape(local)
        return view_as
    return OutputSharding((as_reshape.inputs[0], other.layout), ((out, out_shape),), local_fn=local_fn)


@register_sharding("Flatten", "FlattenExt")
def flatten_rule(schema: OpSchema) -> OutputSharding:
    """``ops.flatten`` (legacy ``Flatten``: all dims after the first) and ``mint.flatten`` /
    ``x.flatten()`` (``FlattenExt(x, start_dim, end_dim)``): sharded like the equal reshape
    (the local op flattens the local piece, so no size argument changes)."""
    x = schema.args[0]
    if schema.op == "Flatten":
        start, end = min(1, x.ndim), x.ndim - 1
    else:
        start = int(schema.args[1]) if len(schema.args) > 1 else int(schema.kwarg("start_dim", 0))
        end = int(schema.args[2]) if len(schema.args) > 2 else int(schema.kwarg("end_dim", -1))
    if x.ndim == 0:
        shape: Tuple[int, ...] = (1,)
    else:
        start, end = start % x.ndim, end % x.ndim
        shape = x.shape[:start] + (prod(x.shape[start:end + 1]),) + x.shape[end + 1:]
    as_reshape = reshape_rule(OpSchema("Reshape", (x, shape), (), ()))
    return OutputSharding(as_reshape.inputs[:1] + (None,) * (len(schema.args) - 1), as_reshape.outputs)
