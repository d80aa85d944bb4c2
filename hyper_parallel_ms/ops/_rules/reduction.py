"""Reductions: ``SumExt`` / ``MeanExt`` (``x.sum(dim, keepdim)``, ``x.mean(dim)``, ``ops.sum``),
``ReduceMax`` / ``ReduceMin`` / ``Max`` / ``Min`` (``ops.amax``, ``x.max()``) and the forms
that also return indices, ``MaxDim`` / ``MinDim`` / ``ArgMaxWithValue`` / ``ArgMinWithValue``
(``x.max(dim)``, ``ops.max(x, dim)``); the legacy Tensor-method spellings (``DeprecatedSum``
for ``x.sum(axis=1, keepdims=True)``, ``DeprecatedMean``, ``DeprecatedMax`` ...) and legacy
primitives (``ReduceSum``, ``ReduceMean``); and reductions with no Partial of their own
(``prod``, ``all`` / ``any``, ``argmax`` / ``argmin``, ``std`` / ``var``, ``logsumexp``), which
gather a sharded reduced dim.

Reducing over a sharded dim leaves a Partial: sum -> P(sum); mean -> P(sum) of each piece's sum
over the global count (exact for uneven and nested pieces, empty ones included; a gradient seeded
with ones on every rank gives each element 1 / count, which a P(avg) of the pieces' means did not:
it gave the group size times the gradient); max / min -> P(max) / P(min). An index is only meaningful over the whole dim, so the
forms returning indices gather a sharded reduced dim first.
Sharded dims that are kept stay sharded (their index shifts when ``keepdim`` is False).
A Partial(sum/avg) input stays Partial under sum / mean (both are linear), a Partial(max)
under max (likewise min); other Partials are reduced first.

Example::

    loss = (y_dt * y_dt).sum()      # y S(0): loss P(sum), reduced when read (full_tensor)
"""
from __future__ import annotations

from math import prod
from typing import List, Tuple

from mindspore import mint

from ...placement import Partial, Placement, Replicate, Shard
from .._empty import zero_padded
from .._registry import register_sharding
from .._schema import OpSchema, OutputSharding, TensorArg
from ._common import layout_like

__all__ = ["reduction_rule", "extremum_rule", "extremum_with_index_rule", "gathering_reduction_rule"]


# Where each op takes its reduced dims and keepdim: (dim position, keepdim position); keyword
# forms (dim= / axis=, keepdim= / keepdims= / keep_dims=) are read for every op.
_SIGNATURES = {
    "DeprecatedSum": (1, 3), "DeprecatedMean": (1, 2), "DeprecatedMax": (1, 2), "DeprecatedMin": (1, 2),
    "DeprecatedProd": (1, 2), "DeprecatedArgmax": (1, 2), "DeprecatedArgmin": (1, 2),
    "DeprecatedStd": (1, 3), "DeprecatedVar": (1, 3), "ReduceStd": (1, 3),
}
_DIM_NAMES = ("dim", "axis")
_KEEP_NAMES = ("keepdim", "keepdims", "keep_dims")


def _reduced_dims(schema: OpSchema, ndim: int) -> Tuple[Tuple[int, ...], bool]:
    """(sorted reduced dims, keepdim) of a reduction call, in any of MindSpore's spellings."""
    args = schema.args
    dim_at, keep_at = _SIGNATURES.get(schema.op, (1, 2))
    dim = args[dim_at] if len(args) > dim_at else next(
        (schema.kwarg(n) for n in _DIM_NAMES if schema.kwarg(n) is not None), None)
    keep = args[keep_at] if len(args) > keep_at and isinstance(args[keep_at], bool) else next(
        (schema.kwarg(n) for n in _KEEP_NAMES if schema.kwarg(n) is not None), schema.attr("keep_dims", False))
    keepdim = bool(keep)
    if dim is None or dim == () or dim == []:
        return tuple(range(ndim)), keepdim
    dims = (dim,) if isinstance(dim, int) else tuple(dim)
    if any(not -ndim <= d < ndim for d in dims):
        raise ValueError(f"{schema.op}: dim {dim} is out of range for a {ndim}-D tensor")
    return tuple(sorted(d % ndim for d in dims)) or tuple(range(ndim)), keepdim


SUMS = ("SumExt", "DeprecatedSum", "ReduceSum")
MEANS = ("MeanExt", "DeprecatedMean", "ReduceMean")
MAXIMA = ("ReduceMax", "Max", "DeprecatedMax")
MINIMA = ("ReduceMin", "Min", "DeprecatedMin")
# Reductions without a Partial of their own (no Partial(prod) / Partial(all), indices need the
# whole dim): a sharded reduced dim is gathered first.
GATHERING = ("ProdExt", "DeprecatedProd", "ReduceProd", "ReduceAll", "ReduceAny", "AnyExt", "Any", "All",
             "Argmax", "Argmin", "ArgMaxExt", "ArgMinExt", "DeprecatedArgmax", "DeprecatedArgmin",
             "DeprecatedStd", "DeprecatedVar", "Std", "Var", "LogSumExp")


@register_sharding(*SUMS, *MEANS)
def reduction_rule(schema: OpSchema) -> OutputSharding:
    """The sharding of ``sum`` / ``mean`` over some dims (see the module docstring)."""
    decided = _reduce(schema, "sum", outputs=1)
    if schema.op not in MEANS:
        return decided
    x = schema.args[0]
    dims, keepdim = _reduced_dims(schema, x.ndim)
    need = decided.inputs[0]
    if not any(p.is_shard() and p.dim in dims for p in need.placements):
        return decided
    count = prod(x.shape[d] for d in dims)
    dtype = schema.kwarg("dtype")

    def local_fn(coord):
        def piece_sum_over_count(piece, *_args, **_kwargs):
            # a sum, not this rank's mean: an empty piece contributes 0 (its mean would be NaN;
            # MindSpore's CPU sum of an empty tensor is uninitialised memory, so it sums zeros)
            piece = zero_padded(piece if dtype is None else piece.astype(dtype), dims)
            return mint.sum(piece, dim=list(dims), keepdim=keepdim) / count
        return piece_sum_over_count
    return OutputSharding(decided.inputs, decided.outputs, local_fn=local_fn)


@register_sharding(*MAXIMA, *MINIMA)
def extremum_rule(schema: OpSchema) -> OutputSharding:
    """``amax`` / ``amin`` / ``x.max()`` / ``x.max(axis=1)``: a sharded reduced dim gives
    Partial(max / min); the legacy ``return_indices=True`` form gathers it (values and indices)."""
    if schema.kwarg("return_indices", False):
        return _reduce(schema, None, outputs=2)
    return _reduce(schema, "max" if schema.op in MAXIMA else "min", outputs=1)


@register_sharding("MaxDim", "MinDim", "ArgMaxWithValue", "ArgMinWithValue")
def extremum_with_index_rule(schema: OpSchema) -> OutputSharding:
    """``x.max(dim)`` / ``ops.max(x, dim)``: values and indices; the reduced dim is gathered."""
    return _reduce(schema, None, outputs=2)


@register_sharding(*GATHERING)
def gathering_reduction_rule(schema: OpSchema) -> OutputSharding:
    """``prod``, ``all`` / ``any``, ``argmax`` / ``argmin``, ``std`` / ``var``, ``logsumexp``:
    a sharded reduced dim is gathered, Partial inputs are reduced, kept dims stay sharded."""
    return _reduce(schema, None, outputs=1)


@register_sharding("ReduceStd")
def reduce_std_rule(schema: OpSchema) -> OutputSharding:
    """``ops.std`` / ``ops.var``: ``ReduceStd(x, axis, unbiased, keep_dims)`` gives (std, mean)."""
    return _reduce(schema, None, outputs=2)


def _reduce(schema: OpSchema, partial_op, outputs: int) -> OutputSharding:
    """``partial_op``: the Partial a sharded reduced dim leaves (``None``: gather that dim)."""
    x = schema.args[0]
    dims, keepdim = _reduced_dims(schema, x.ndim)
    out_shape = tuple(1 if d in dims else s for d, s in enumerate(x.shape) if keepdim or d not in dims)
    linear = ("sum", "avg") if partial_op in ("sum", "avg") else (partial_op,)
    need: List[Placement] = []
    out: List[Placement] = []
    for p in x.layout.placements:
        if p.is_shard() and p.dim in dims:
            if partial_op is None:
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
