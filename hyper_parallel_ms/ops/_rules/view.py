"""Views and dim-wise ops: ``Transpose`` / ``TransposeExtView`` (permute, transpose),
``ExpandDims`` (unsqueeze), ``Squeeze``, ``Reshape`` (reshape, view), ``Softmax`` /
``LogSoftmax``.

Placements follow the dims: a sharded dim moves with a permutation; unsqueeze / squeeze
shift indices (a squeezed sharded dim is gathered); a reshape keeps a dim sharded when it
starts at the same flat offset in the output and both sizes split evenly over the mesh dim
(or the dim is unchanged), and gathers it otherwise. Softmax needs its dim whole: a
sharded softmax dim and Partial values are gathered / reduced first. Partial values pass
through views unchanged (views are linear).

Example::

    y = x_dt.permute(2, 0, 1)       # S(2) -> S(0), no communication
"""
from __future__ import annotations

from math import prod
from typing import List, Sequence, Tuple

from ...placement import Placement, Replicate, Shard
from .._registry import register_sharding
from .._schema import OpSchema, OutputSharding, TensorArg
from ._common import layout_like

__all__ = ["reshape_target"]


def _ints(values: Sequence) -> Tuple[int, ...]:
    flat: List[int] = []
    for v in values:
        flat.extend(v if isinstance(v, (tuple, list)) else [v])
    return tuple(int(v) for v in flat)


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


@register_sharding("Transpose", "TransposeView")
def permute_rule(schema: OpSchema) -> OutputSharding:
    x = schema.args[0]
    perm = tuple(d % x.ndim for d in _ints(schema.args[1:]))
    nested = _nested(x)
    return _moved(schema, x, lambda d: None if d in nested else perm.index(d), [x.shape[d] for d in perm])


@register_sharding("TransposeExtView", "TransposeExt")
def transpose_rule(schema: OpSchema) -> OutputSharding:
    x = schema.args[0]
    d0, d1 = (d % x.ndim for d in _ints(schema.args[1:3]))
    swap = {d0: d1, d1: d0}
    shape = list(x.shape)
    shape[d0], shape[d1] = shape[d1], shape[d0]
    nested = _nested(x)
    return _moved(schema, x, lambda d: None if d in nested else swap.get(d, d), shape)


@register_sharding("ExpandDims", "Unsqueeze")
def unsqueeze_rule(schema: OpSchema) -> OutputSharding:
    x = schema.args[0]
    axis = _ints(schema.args[1:2])[0] % (x.ndim + 1)
    shape = list(x.shape)
    shape.insert(axis, 1)
    return _moved(schema, x, lambda d: d + (d >= axis), shape)


@register_sharding("Squeeze")
def squeeze_rule(schema: OpSchema) -> OutputSharding:
    x = schema.args[0]
    given = _ints(schema.args[1:]) if len(schema.args) > 1 else ()
    dims = {d % x.ndim for d in given if x.shape[d % x.ndim] == 1} if given else \
        {d for d, s in enumerate(x.shape) if s == 1}
    shape = [s for d, s in enumerate(x.shape) if d not in dims]
    return _moved(schema, x, lambda d: None if d in dims else d - sum(1 for r in dims if r < d), shape)


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
    out_shape = reshape_target(x.shape, _ints(schema.args[1:]))
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


@register_sharding("Softmax", "LogSoftmax", "LogSoftmaxExt")
def softmax_rule(schema: OpSchema) -> OutputSharding:
    x = schema.args[0]
    axes = _ints(schema.args[1:2]) if len(schema.args) > 1 and schema.args[1] is not None else (-1,)
    dims = {a % x.ndim for a in axes}
    need = [Replicate() if (p.is_shard() and p.dim in dims) or p.is_partial() else p
            for p in x.layout.placements]
    layout = layout_like(x.layout, need, ndim=x.ndim)
    return OutputSharding((layout,) + (None,) * (len(schema.args) - 1), ((layout, x.shape),))


@register_sharding("Concat", "Cat")
def concat_rule(schema: OpSchema) -> OutputSharding:
    """``ops.cat(tensors, dim)``: the tensors arrive as consecutive arguments, then ``dim``.
    Per mesh dim: a dim other than ``dim`` sharded in any input shards all of them; ``dim``
    itself is gathered; Partial(sum) of every input stays Partial."""
    tensors = [a for a in schema.args if isinstance(a, TensorArg)]
    rest = [a for a in schema.args if not isinstance(a, TensorArg)]
    dim = (rest[0] if rest and isinstance(rest[0], int) else 0) % tensors[0].ndim
    out_shape = list(tensors[0].shape)
    out_shape[dim] = sum(t.shape[dim] for t in tensors)
    need: List[Placement] = []
    for axis in range(len(tensors[0].layout.mesh_shape)):
        here = [t.layout.placements[axis] for t in tensors]
        shards = [p for p in here if p.is_shard() and p.dim != dim]
        if shards:
            need.append(shards[0])
        elif all(p.is_partial("sum") for p in here):
            need.append(here[0])
        else:
            need.append(Replicate())
    layout = layout_like(tensors[0].layout, need, ndim=len(out_shape))
    inputs = tuple(layout_like(a.layout, need, ndim=a.ndim) if isinstance(a, TensorArg) else None
                   for a in schema.args)
    return OutputSharding(inputs, ((layout, tuple(out_shape)),))


@register_sharding("Split")
def split_rule(schema: OpSchema) -> OutputSharding:
    """``ops.split`` / ``ops.chunk`` into equal pieces: ``Split(x, axis, output_num)``; the
    split dim is gathered, the other placements are kept."""
    x = schema.args[0]
    axis, count = int(schema.args[1]) % x.ndim, int(schema.args[2])
    need = [Replicate() if p.is_shard(axis) else p for p in x.layout.placements]
    layout = layout_like(x.layout, need, ndim=x.ndim)
    piece = list(x.shape)
    piece[axis] = x.shape[axis] // count
    return OutputSharding((layout,) + (None,) * (len(schema.args) - 1), ((layout, tuple(piece)),) * count)
