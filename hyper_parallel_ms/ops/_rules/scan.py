"""Ops that need one dim whole but keep the others: scans (``CumSum`` / ``CumsumExt`` /
``DeprecatedCumsum``, ``CumProd``, ``Cummax`` / ``Cummin``), ``Sort`` / ``SortExt``,
``TopK`` / ``TopkExt``, ``ReverseV2`` (flip), ``Tril`` / ``TrilExt`` / ``Triu`` (the last two dims).

The dim the op runs along is gathered if sharded (its result at one index depends on the
pieces of other ranks); the other dims keep their sharding, so a scan along an unsharded dim
needs no communication. Partial(sum) values stay Partial through a cumulative sum (it is
linear) and a flip; every other op here reduces them first.

Example::

    c = ops.cumsum(x_dt, 1)        # x S(0): c S(0), no communication
    v, i = ops.topk(x_dt, 2)       # x S(0): top-2 of each row, S(0)
"""
from __future__ import annotations

from math import prod
from typing import Iterable, Tuple

from ...placement import Replicate
from .._registry import register_sharding
from .._schema import OpSchema, OutputSharding, TensorArg
from ._common import layout_like

__all__ = ["scan_rule", "sort_rule", "topk_rule", "flip_rule", "triangle_rule"]

_LINEAR = ("CumSum", "CumsumExt", "DeprecatedCumsum", "ReverseV2")


def _whole_along(schema: OpSchema, x: TensorArg, dims: Iterable[int]):
    """``x``'s layout with ``dims`` gathered; Partial values kept only for linear ops."""
    dims = set(dims)
    keep_partial = schema.op in _LINEAR
    return layout_like(x.layout, [Replicate() if (p.is_shard() and p.dim in dims) or
                                  (p.is_partial() and not (keep_partial and p.is_partial("sum"))) else p
                                  for p in x.layout.placements], ndim=x.ndim)


def _dim(schema: OpSchema, x: TensorArg, position: int, default) -> int:
    dim = schema.args[position] if len(schema.args) > position else schema.kwarg(
        "dim", schema.kwarg("axis", schema.attr("axis", default)))
    return int(dim) % max(x.ndim, 1)


def _rest(schema: OpSchema) -> Tuple[None, ...]:
    return (None,) * (len(schema.args) - 1)


@register_sharding("CumSum", "CumsumExt", "DeprecatedCumsum", "CumProd", "Cummax", "Cummin")
def scan_rule(schema: OpSchema) -> OutputSharding:
    """``cumsum`` / ``cumprod`` (one output), ``cummax`` / ``cummin`` (values and indices);
    ``x.cumsum()`` without an axis scans the flattened tensor (everything gathered)."""
    x = schema.args[0]
    if schema.op == "DeprecatedCumsum" and len(schema.args) < 2 and schema.kwarg("axis") is None:
        layout = _whole_along(schema, x, range(x.ndim))
        return OutputSharding((layout,) + _rest(schema), ((layout, (prod(x.shape),)),))
    layout = _whole_along(schema, x, (_dim(schema, x, 1, 0),))
    outputs = 2 if schema.op in ("Cummax", "Cummin") else 1
    return OutputSharding((layout,) + _rest(schema), ((layout, x.shape),) * outputs)


@register_sharding("Sort", "SortExt")
def sort_rule(schema: OpSchema) -> OutputSharding:
    """``ops.sort`` (``Sort`` with the ``axis`` attribute) / ``SortExt(x, dim, ...)``: values, indices."""
    x = schema.args[0]
    dim = schema.attr("axis", -1) if schema.op == "Sort" else _dim(schema, x, 1, -1)
    layout = _whole_along(schema, x, (int(dim) % x.ndim,))
    return OutputSharding((layout,) + _rest(schema), ((layout, x.shape),) * 2)


@register_sharding("TopK", "TopkExt")
def topk_rule(schema: OpSchema) -> OutputSharding:
    """``TopK(x, k)`` (last dim) / ``TopkExt(x, k, dim, largest, sorted)``: values, indices."""
    x, k = schema.args[0], int(schema.args[1])
    dim = x.ndim - 1 if schema.op == "TopK" else _dim(schema, x, 2, -1)
    layout = _whole_along(schema, x, (dim,))
    shape = x.shape[:dim] + (k,) + x.shape[dim + 1:]
    return OutputSharding((layout,) + _rest(schema), ((layout, shape),) * 2)


@register_sharding("ReverseV2")
def flip_rule(schema: OpSchema) -> OutputSharding:
    """``flip(x, dims)``: the flipped dims are gathered."""
    x = schema.args[0]
    dims = schema.args[1] if len(schema.args) > 1 else schema.kwarg("dims", schema.attr("axis", ()))
    dims = (dims,) if isinstance(dims, int) else tuple(dims)
    layout = _whole_along(schema, x, (int(d) % x.ndim for d in dims))
    return OutputSharding((layout,) + _rest(schema), ((layout, x.shape),))


@register_sharding("Tril", "TrilExt", "Triu")
def triangle_rule(schema: OpSchema) -> OutputSharding:
    """``tril`` / ``triu``: the mask depends on row and column index, so the last two dims are whole."""
    x = schema.args[0]
    layout = _whole_along(schema, x, (x.ndim - 2, x.ndim - 1))
    return OutputSharding((layout,) + _rest(schema), ((layout, x.shape),))
