"""Reductions: ``SumExt`` / ``MeanExt`` (``x.sum(dim, keepdim)``, ``x.mean(dim)``, ``ops.sum``),
``ReduceMax`` / ``ReduceMin`` / ``Max`` / ``Min`` (``ops.amax``, ``x.max()``) and the forms
that also return indices, ``MaxDim`` / ``MinDim`` / ``ArgMaxWithValue`` / ``ArgMinWithValue``
(``x.max(dim)``, ``ops.max(x, dim)``).

Reducing over a sharded dim leaves a Partial: sum -> P(sum); mean -> P(avg) when the dim
splits evenly (an uneven mean must see the whole dim, so that input is gathered first);
max / min -> P(max) / P(min). An index is only meaningful over the whole dim, so the
forms returning indices gather a sharded reduced dim first.
Sharded dims that are kept stay sharded (their index shifts when ``keepdim`` is False).
A Partial(sum/avg) input stays Partial under sum / mean (both are linear), a Partial(max)
under max (likewise min); other Partials are reduced first.

Example::

    loss = (y_dt * y_dt).sum()      # y S(0): loss P(sum), reduced when read (full_tensor)
"""
from __future__ import annotations

from typing import List, Tuple

from ...placement import Partial, Placement, Replicate, Shard
from .._registry import register_sharding
from .._schema import OpSchema, OutputSharding, TensorArg
from ._common import layout_like

__all__ = ["reduction_rule", "extremum_rule", "extremum_with_index_rule"]


def _reduced_dims(schema: OpSchema, ndim: int) -> Tuple[Tuple[int, ...], bool]:
    args = schema.args
    dim = args[1] if len(args) > 1 else schema.kwarg("dim")
    keepdim = args[2] if len(args) > 2 and isinstance(args[2], bool) else bool(schema.kwarg("keepdim", False))
    if dim is None or dim == ():
        return tuple(range(ndim)), keepdim
    dims = (dim,) if isinstance(dim, int) else tuple(dim)
    if any(not -ndim <= d < ndim for d in dims):
        raise ValueError(f"{schema.op}: dim {dim} is out of range for a {ndim}-D tensor")
    return tuple(sorted(d % ndim for d in dims)) or tuple(range(ndim)), keepdim


@register_sharding("SumExt", "MeanExt")
def reduction_rule(schema: OpSchema) -> OutputSharding:
    """The sharding of ``sum`` / ``mean`` over some dims (see the module docstring)."""
    return _reduce(schema, "avg" if schema.op == "MeanExt" else "sum", outputs=1)


@register_sharding("ReduceMax", "ReduceMin", "Max", "Min")
def extremum_rule(schema: OpSchema) -> OutputSharding:
    """``amax`` / ``amin`` / ``x.max()``: a sharded reduced dim gives Partial(max / min)."""
    return _reduce(schema, "max" if "Max" in schema.op else "min", outputs=1)


@register_sharding("MaxDim", "MinDim", "ArgMaxWithValue", "ArgMinWithValue")
def extremum_with_index_rule(schema: OpSchema) -> OutputSharding:
    """``x.max(dim)`` / ``ops.max(x, dim)``: values and indices; the reduced dim is gathered."""
    return _reduce(schema, None, outputs=2)


def _reduce(schema: OpSchema, partial_op, outputs: int) -> OutputSharding:
    """``partial_op``: the Partial a sharded reduced dim leaves (``None``: gather that dim)."""
    x = schema.args[0]
    dims, keepdim = _reduced_dims(schema, x.ndim)
    out_shape = tuple(1 if d in dims else s for d, s in enumerate(x.shape) if keepdim or d not in dims)
    linear = ("sum", "avg") if partial_op in ("sum", "avg") else (partial_op,)
    need: List[Placement] = []
    out: List[Placement] = []
    for axis, p in enumerate(x.layout.placements):
        n = x.layout.mesh_shape[axis]
        if p.is_shard() and p.dim in dims:
            if partial_op is None or (partial_op == "avg" and x.shape[p.dim] % n):
                need.append(Replicate())
                out.append(Replicate())
            else:
                need.append(p)
                out.append(Partial(partial_op))
        elif p.is_shard():
            need.append(p)
            out.append(Shard(p.dim if keepdim else p.dim - sum(1 for d in dims if d < p.dim)))
        elif p.is_partial() and p.reduce_op not in linear:
            need.append(Replicate())
            out.append(Replicate())
        else:
            need.append(p)
            out.append(p)
    inputs = (layout_like(x.layout, need, ndim=x.ndim),) + tuple(
        None if not isinstance(a, TensorArg) else a.layout for a in schema.args[1:])
    result = (layout_like(x.layout, out, ndim=len(out_shape)), out_shape)
    return OutputSharding(inputs, (result,) * outputs)
