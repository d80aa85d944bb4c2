"""Layers' primitives: ``LayerNorm`` (``nn.LayerNorm``), ``LayerNormExt``
(``mint.nn.functional.layer_norm``), ``RmsNorm`` (``ops.rms_norm``), ``Gather``
(``nn.Embedding`` and ``ops.gather``), ``Embedding`` (``mint.nn.Embedding``), ``Swiglu``
(``ops.swiglu``), ``RotaryPositionEmbedding`` (``ops.rotary_position_embedding``), ``Softmax`` /
``LogSoftmax``, and in-place updates (``add_``, ``mul_``, ``copy_``, ``+=``, ``ops.assign``).

A norm (and a softmax) needs the normalised dims whole and the values reduced: those are gathered /
reduced first, the leading dims keep their sharding (its statistics outputs too); the
weight and bias are replicated.
Gather along dim 0 of a table: a column-sharded table gives output sharded on its last dim;
sharded indices give output sharded like them; a row-sharded table gives Partial(sum): each
rank looks up the rows it holds and writes zeros for the others (a masked lookup). An in-place
op keeps the target's layout: the other operands are brought to the placements that make the
update exact (a Partial(sum) target accepts Partial(sum) addends and scalar factors).

Example::

    y = nn.LayerNorm((hidden,))(x_dt)     # x S(0) (sequence sharded): y S(0), no communication
    acc += grad_dt                        # acc stays a DTensor with its placements
"""
from __future__ import annotations

import math
from typing import List, Tuple

from mindspore import ops

from ...placement import Partial, Placement, Replicate, Shard
from .._registry import register_sharding
from .._schema import OpSchema, OutputSharding, TensorArg
from ._common import ints, layout_like, replicate_all, whole_and_reduced
from .pointwise import pointwise_rule

__all__ = ["layer_norm_rule", "layer_norm_ext_rule", "rms_norm_rule", "softmax_rule", "swiglu_rule",
           "rotary_position_embedding_rule", "gather_rule", "embedding_rule", "index_select_rule",
           "gather_elements_rule", "inplace_rule", "conv2d_rule", "batch_norm_rule"]


def _norm(schema: OpSchema, axis: int, statistics: int) -> OutputSharding:
    """Normalised over dims ``axis..``: those whole, Partial reduced, the rest kept; the
    output plus ``statistics`` outputs of shape ``x.shape[:axis] + (1, ...)``."""
    x = schema.args[0]
    axis %= x.ndim
    layout = whole_and_reduced(x.layout, range(axis, x.ndim), x.ndim)
    stats_shape = x.shape[:axis] + (1,) * (x.ndim - axis)
    rep = replicate_all(x.layout)
    inputs = (layout,) + tuple(rep if isinstance(a, TensorArg) else None
                               for a in schema.args[1:])
    return OutputSharding(inputs, ((layout, x.shape),) + ((layout, stats_shape),) * statistics)


@register_sharding("LayerNorm")
def layer_norm_rule(schema: OpSchema) -> OutputSharding:
    """``nn.LayerNorm``: ``LayerNorm(x, gamma, beta)`` with ``begin_norm_axis``; output, mean, variance."""
    return _norm(schema, schema.attr("begin_norm_axis", -1), statistics=2)


@register_sharding("LayerNormExt")
def layer_norm_ext_rule(schema: OpSchema) -> OutputSharding:
    """``mint.nn.functional.layer_norm(x, normalized_shape, weight, bias, eps)``: output, mean, rstd."""
    x, normalized = schema.args[0], schema.args[1]
    return _norm(schema, x.ndim - len(tuple(normalized)), statistics=2)


@register_sharding("RmsNorm")
def rms_norm_rule(schema: OpSchema) -> OutputSharding:
    """``ops.rms_norm(x, gamma, eps)`` normalises the last ``gamma.ndim`` dims: output, rstd."""
    x, gamma = schema.args[0], schema.args[1]
    return _norm(schema, x.ndim - gamma.ndim, statistics=1)


@register_sharding("Softmax", "LogSoftmax", "LogSoftmaxExt")
def softmax_rule(schema: OpSchema) -> OutputSharding:
    """``softmax`` / ``log_softmax`` over ``dim`` (default the last): that dim whole and Partial values
    reduced, as a norm's; the other dims keep their sharding."""
    x = schema.args[0]
    axes = ints(schema.args[1:2]) if len(schema.args) > 1 and schema.args[1] is not None else (-1,)
    layout = whole_and_reduced(x.layout, {a % x.ndim for a in axes}, x.ndim)
    return OutputSharding((layout,) + (None,) * (len(schema.args) - 1), ((layout, x.shape),))


@register_sharding("Swiglu")
def swiglu_rule(schema: OpSchema) -> OutputSharding:
    """``ops.swiglu(x, dim=-1)``: ``silu(a) * b`` of the two halves of ``dim``: that dim whole (its
    halves pair up) and Partial values reduced (not linear); the other dims keep their sharding,
    and the output has half of ``dim``.

    >>> from hyper_parallel_ms.layout import Layout
    >>> from hyper_parallel_ms.placement import Shard
    >>> x = TensorArg(Layout((2, 2), (Shard(0), Shard(1))), (4, 6))
    >>> out = swiglu_rule(OpSchema("Swiglu", (x, -1)))
    >>> str(out.inputs[0]), out.outputs[0][1]
    ('(S(0), R)', (4, 3))
    """
    x = schema.args[0]
    dim = (schema.args[1] if len(schema.args) > 1 and schema.args[1] is not None else -1) % x.ndim
    layout = whole_and_reduced(x.layout, {dim}, x.ndim)
    out_shape = x.shape[:dim] + (x.shape[dim] // 2,) + x.shape[dim + 1:]
    return OutputSharding((layout,) + (None,) * (len(schema.args) - 1), ((layout, out_shape),))


@register_sharding("RotaryPositionEmbedding")
def rotary_position_embedding_rule(schema: OpSchema) -> OutputSharding:
    """``ops.rotary_position_embedding(x, cos, sin, mode)``: ``x * cos + rotated(x) * sin``, element-wise
    with broadcasting except along the last dim, which each rotation mixes (its halves in mode 0,
    neighbouring pairs in mode 1): that dim whole on every input and Partial values reduced; the
    other dims are placed as an element-wise op places them (a sequence-sharded ``x`` meets ``cos``
    / ``sin`` cut alike).

    >>> from hyper_parallel_ms.layout import Layout
    >>> from hyper_parallel_ms.placement import Replicate, Shard
    >>> x = TensorArg(Layout((2,), (Shard(2),)), (1, 2, 8, 4))
    >>> cos = TensorArg(Layout((2,), (Replicate(),)), (1, 1, 8, 4))
    >>> out = rotary_position_embedding_rule(OpSchema("RotaryPositionEmbedding", (x, cos, cos, 0)))
    >>> [str(layout) for layout in out.inputs[:3]], str(out.outputs[0][0])
    (['(S(2))', '(S(2))', '(S(2))'], '(S(2))')
    """
    whole = tuple(TensorArg(whole_and_reduced(a.layout, {a.ndim - 1}, a.ndim), a.shape, a.is_dtensor)
                  if isinstance(a, TensorArg) else a for a in schema.args)
    return pointwise_rule(OpSchema("Mul", whole))


@register_sharding("Gather")
def gather_rule(schema: OpSchema) -> OutputSharding:
    table, ids = schema.args[0], schema.args[1]
    axis = (schema.args[2] if len(schema.args) > 2 and isinstance(schema.args[2], int) else 0) % table.ndim
    if axis != 0 or table.ndim != 2:
        return _select_along(schema, table, ids, axis)
    out_shape = ids.shape + (table.shape[1],)
    need_table: List[Placement] = []
    need_ids: List[Placement] = []
    out: List[Placement] = []
    row_axes = [a for a, p in enumerate(table.layout.placements) if p.is_shard(0)]
    if len(row_axes) == 1:
        return _masked_gather(schema, table, ids, row_axes[0], out_shape)
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


@register_sharding("Embedding")
def embedding_rule(schema: OpSchema) -> OutputSharding:
    """``mint.nn.functional.embedding(ids, weight, padding_idx, max_norm, norm_type, scale_grad_by_freq)``
    (``mint.nn.Embedding``): the lookup of :func:`gather_rule` (``Gather(weight, ids, 0)``), the ids
    first. A row-sharded table looks up by the masked local lookup, and there the ``padding_idx``
    row gets no gradient, as one device gives it. ``max_norm`` (renormalises, in place, the
    whole rows the ids name) needs a replicated table and unsharded ids; ``scale_grad_by_freq``
    (counts ids over the whole batch) unsharded ids and a table whose rows are whole: anything
    else is refused.

    >>> from hyper_parallel_ms.layout import Layout
    >>> from hyper_parallel_ms.placement import Shard, Replicate
    >>> ids = TensorArg(Layout((2,), (Replicate(),)), (3,))
    >>> table = TensorArg(Layout((2,), (Shard(1),)), (10, 4))
    >>> out = embedding_rule(OpSchema("Embedding", (ids, table, None, None, 2.0, False)))
    >>> str(out.outputs[0][0]), out.outputs[0][1]
    ('(S(1))', (3, 4))
    """
    ids, table = schema.args[0], schema.args[1]
    extra = tuple(schema.args[2:])
    padding_idx, max_norm, _, by_freq = (extra + (None, None, 2.0, False)[len(extra):])[:4]
    lookup = gather_rule(OpSchema("Gather", (table, ids, 0)))
    need_table, need_ids = lookup.inputs[0], lookup.inputs[1]
    if max_norm is not None and (any(not p.is_replicate() for p in table.layout.placements)
                                 or any(p.is_shard() for p in need_ids.placements)):
        raise NotImplementedError(f"embedding with max_norm={max_norm} renormalises, in place, whole rows of the "
                                  f"table that the ids name; the table is placed {table.layout.placements} and "
                                  f"the ids {ids.layout.placements}, so a rank would renormalise a piece, or "
                                  f"replicas different rows: replicate both first (.redistribute(placements="
                                  f"[Replicate(), ...])) or drop max_norm")
    if by_freq and (lookup.local_fn is not None or any(p.is_shard() for p in need_ids.placements)):
        raise NotImplementedError("embedding with scale_grad_by_freq=True counts every id of the whole batch; "
                                  f"ids placed {ids.layout.placements} and a table placed {table.layout.placements} "
                                  "leave each rank a part of them: replicate the ids and keep the table's rows "
                                  "whole (Replicate or Shard(1)), or drop scale_grad_by_freq")
    inputs = (need_ids, need_table) + (None,) * len(extra)
    if lookup.local_fn is None:
        return OutputSharding(inputs, lookup.outputs)
    pad = None if padding_idx is None else int(padding_idx) % table.shape[0]

    def local_fn(coord):
        masked = lookup.local_fn(coord)

        def run(local_ids, local_table, *rest):
            found = masked(local_table, local_ids)
            if pad is None:
                return found
            # the padding row's lookups keep their value and pass no gradient to the table
            is_pad = ops.expand_dims(local_ids == pad, -1).astype(found.dtype)
            return ops.stop_gradient(found) * is_pad + found * (1 - is_pad)
        return run
    return OutputSharding(inputs, lookup.outputs, local_fn=local_fn)


def _select_along(schema: OpSchema, x: TensorArg, ids: TensorArg, axis: int) -> OutputSharding:
    """``Gather(x, ids, axis)`` / ``IndexSelect(x, axis, ids)`` in general: ``axis`` gathered,
    ``ids`` replicated, the other dims of ``x`` keep their sharding (shifted past the ids'
    dims); Partial(sum) values stay Partial (picking entries is linear)."""
    out_shape = x.shape[:axis] + ids.shape + x.shape[axis + 1:]
    need: List[Placement] = []
    out: List[Placement] = []
    for p in x.layout.placements:
        if (p.is_shard() and p.dim == axis) or (p.is_partial() and not p.is_partial("sum")):
            need.append(Replicate())
            out.append(Replicate())
        else:
            need.append(p)
            out.append(Shard(p.dim if p.dim < axis else p.dim - 1 + ids.ndim) if p.is_shard() else p)
    need_x = layout_like(x.layout, need, ndim=x.ndim)
    rep_ids = layout_like(x.layout, [Replicate()] * len(need), ndim=ids.ndim)
    inputs = tuple(need_x if a is x else rep_ids if a is ids else None for a in schema.args)
    return OutputSharding(inputs, ((layout_like(x.layout, out, ndim=len(out_shape)), out_shape),))


@register_sharding("IndexSelect")
def index_select_rule(schema: OpSchema) -> OutputSharding:
    """``mint.index_select(x, dim, index)``: like ``Gather`` along ``dim``."""
    x, dim, ids = schema.args[0], int(schema.args[1]), schema.args[2]
    return _select_along(schema, x, ids, dim % x.ndim)


@register_sharding("GatherD")
def gather_elements_rule(schema: OpSchema) -> OutputSharding:
    """``mint.gather(x, dim, index)`` / ``ops.gather_elements``: ``dim`` gathered on both; a
    dim of the same size in ``x`` and ``index`` stays sharded on both (the output is placed
    like ``index``); a Partial(sum) ``x`` stays Partial."""
    x, dim, index = schema.args[0], int(schema.args[1]) % schema.args[0].ndim, schema.args[2]
    need_x: List[Placement] = []
    need_i: List[Placement] = []
    for px, pi in zip(x.layout.placements, index.layout.placements):
        shard = next((p for p in (px, pi) if p.is_shard() and p.dim != dim
                      and x.shape[p.dim] == index.shape[p.dim]), None)
        if shard is not None:
            need_x.append(shard)
            need_i.append(shard)
        elif px.is_partial("sum"):
            need_x.append(px)
            need_i.append(Replicate())
        else:
            need_x.append(Replicate())
            need_i.append(Replicate())
    out = layout_like(x.layout, need_i if not any(p.is_partial() for p in need_x) else
                      [px if px.is_partial() else pi for px, pi in zip(need_x, need_i)], ndim=index.ndim)
    return OutputSharding((layout_like(x.layout, need_x, ndim=x.ndim), None,
                           layout_like(x.layout, need_i, ndim=index.ndim)), ((out, index.shape),))


def _masked_gather(schema: OpSchema, table: TensorArg, ids: TensorArg, row_axis: int,
                   out_shape) -> OutputSharding:
    """A table row-sharded on one mesh dim: output Partial(sum) there, by a masked local lookup."""
    need_table = [p if a == row_axis or p.is_shard(1) else Replicate()
                  for a, p in enumerate(table.layout.placements)]
    need_ids = [Replicate() if a == row_axis or table.layout.placements[a].is_shard(1) or not p.is_shard() else p
                for a, p in enumerate(ids.layout.placements)]
    out = [Partial() if a == row_axis else Shard(len(out_shape) - 1) if table.layout.placements[a].is_shard(1)
           else need_ids[a] for a in range(len(need_ids))]
    table_layout = layout_like(table.layout, need_table, ndim=2)

    def local_fn(coord):
        start = table_layout.global_offset(table.shape, coord)[0]
        rows = table_layout.local_shape(table.shape, coord)[0]

        def lookup(local_table, local_ids, *rest):
            if rows == 0:  # an empty piece of the table: every id is elsewhere
                return ops.zeros(tuple(local_ids.shape) + tuple(local_table.shape[1:]), local_table.dtype)
            shifted = local_ids - start
            outside = ops.logical_or(shifted < 0, shifted >= rows)
            safe = ops.select(outside, ops.zeros_like(shifted), shifted)
            found = ops.gather(local_table, safe, 0)
            return found * ops.expand_dims(ops.logical_not(outside), -1).astype(found.dtype)
        return lookup
    inputs = (table_layout, layout_like(table.layout, need_ids, ndim=ids.ndim)) + (None,) * (len(schema.args) - 2)
    return OutputSharding(inputs, ((layout_like(table.layout, out, ndim=len(out_shape)), out_shape),),
                          local_fn=local_fn)


_ADDING = ("InplaceAddExt", "InplaceAdd", "InplaceSubExt", "InplaceSub")
# in-place ops of a tensor and scalars: ``x.add_(1.0)``, ``x += 1.0``, ``x.sub_(1.0)``, ``x.fill_(3)``,
# ``x.zero_()``, ``x.clamp_(0, 5)``: element-wise on the pieces; on a Partial only zero_ is exact
_SCALAR_INPLACE = ("InplaceAddsExt", "InplaceSubScalar", "InplaceFillScalar", "InplaceZero", "InplaceClampScalar")


@register_sharding(*_SCALAR_INPLACE)
def scalar_inplace_rule(schema: OpSchema) -> OutputSharding:
    """An in-place op of a DTensor and scalars: each rank updates its piece; a Partial target is
    refused (adding, filling or clamping every piece is not the op on the sum), except ``zero_``."""
    target = schema.args[0]
    if schema.op != "InplaceZero" and any(p.is_partial() for p in target.layout.placements):
        raise NotImplementedError(
            f"{schema.op} on a DTensor with placements {target.layout.placements}: applied to every Partial piece "
            "it would not be the op on their sum. Reduce it first (x = x.reduce_partial(), or redistribute to "
            "Replicate) and then update it in place")
    inputs = (target.layout,) + tuple(None if not isinstance(a, TensorArg) else a.layout for a in schema.args[1:])
    return OutputSharding(inputs, ((target.layout, target.shape),), inplace=True)


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


def _conv_length(size: int, kernel: int, stride: int, dilation: int, pad_mode: str, pads: Tuple[int, int]) -> int:
    """Output length of one spatial dim of ``Conv2D``."""
    if pad_mode == "same":
        return math.ceil(size / stride)
    span = dilation * (kernel - 1) + 1
    extra = sum(pads) if pad_mode == "pad" else 0
    return (size + extra - span) // stride + 1


def _pair(value, last: int = 2) -> Tuple[int, ...]:
    value = tuple(value) if isinstance(value, (tuple, list)) else (value,) * last
    return value[-last:]


@register_sharding("Conv2D")
def conv2d_rule(schema: OpSchema) -> OutputSharding:
    """``nn.Conv2d`` / ``ops.conv2d`` (NCHW): a batch-sharded input gives a batch-sharded output
    (data parallelism, no communication); a weight sharded on its output channels gives an output
    sharded on dim 1 (groups 1); a Partial input with a replicated weight stays Partial (the
    convolution is linear in its input); anything else is gathered first."""
    x, w = schema.args[0], schema.args[1]
    if str(schema.attr("data_format", "NCHW")).upper() != "NCHW" or x.ndim != 4:
        rep = replicate_all(x.layout)
        return OutputSharding((rep, rep) + (None,) * (len(schema.args) - 2), ((rep, _conv_shape(schema)),))
    groups = int(schema.attr("group", 1))
    out_p: List[Placement] = []
    x_needs: List[Placement] = []
    w_needs: List[Placement] = []
    for px, pw in zip(x.layout.placements, w.layout.placements):
        if px.is_shard() and px.dim == 0:
            out_p.append(Shard(0)); x_needs.append(px); w_needs.append(Replicate())
        elif pw.is_shard() and pw.dim == 0 and groups == 1:
            out_p.append(Shard(1)); x_needs.append(Replicate()); w_needs.append(pw)
        elif px.is_partial("sum") and not pw.is_partial():
            out_p.append(px); x_needs.append(px); w_needs.append(Replicate())
        else:
            out_p.append(Replicate()); x_needs.append(Replicate()); w_needs.append(Replicate())
    order = dict(x.layout.shard_order)
    order = {0: order[0]} if 0 in order else None
    w_layout = layout_like(w.layout, w_needs, ndim=4)
    inputs = (layout_like(x.layout, x_needs, order, ndim=4), w_layout) + (None,) * (len(schema.args) - 2)
    outputs = ((layout_like(x.layout, out_p, order, ndim=4), _conv_shape(schema)),)
    if not any(p.is_shard() for p in w_needs):
        return OutputSharding(inputs, outputs)
    attrs = dict(schema.attrs)

    def local_conv(coordinate):
        """The primitive fixes ``out_channel``: this rank's piece of the output channels."""
        rows = w_layout.local_shape(w.shape, coordinate)[0]
        prim = ops.Conv2D(rows, attrs["kernel_size"], mode=attrs.get("mode", 1), pad_mode=attrs.get("pad_mode", "valid"),
                          pad=attrs.get("pad", 0), stride=attrs.get("stride", 1), dilation=attrs.get("dilation", 1),
                          group=groups, data_format="NCHW")
        return lambda x_local, w_local, *rest: prim(x_local, w_local)
    return OutputSharding(inputs, outputs, local_fn=local_conv)


def _conv_shape(schema: OpSchema) -> Tuple[int, ...]:
    x, w = schema.args[0], schema.args[1]
    kernel = _pair(schema.attr("kernel_size", w.shape[2:]))
    stride, dilation = _pair(schema.attr("stride", 1)), _pair(schema.attr("dilation", 1))
    pad_mode = str(schema.attr("pad_mode", "valid")).lower()
    pad = tuple(schema.attr("pad", (0, 0, 0, 0)))
    pad = pad * 4 if len(pad) == 1 else pad
    pads = ((pad[0], pad[1]), (pad[2], pad[3]))
    spatial = tuple(_conv_length(x.shape[2 + i], kernel[i], stride[i], dilation[i], pad_mode, pads[i]) for i in range(2))
    return (x.shape[0], w.shape[0]) + spatial


@register_sharding("BatchNorm")
def batch_norm_rule(schema: OpSchema) -> OutputSharding:
    """``nn.BatchNorm1d/2d`` (``BatchNorm(x, scale, bias, mean, variance)``, NCHW): per channel, so
    a channel-sharded input keeps its sharding and the four per-channel tensors are cut alike. In
    training the statistics are over every other dim, so those are gathered first (the one-device
    values: each rank computes the whole batch's statistics and updates its moving averages with
    them, as SyncBatchNorm); in inference a batch- or space-sharded input stays so. Training updates
    the moving averages in place, so their layout is kept and the input follows it: channels cut on
    the mesh dims where the averages are cut, whole elsewhere. Outputs: the normalised tensor and
    four per-channel vectors."""
    x = schema.args[0]
    training = bool(schema.attr("is_training", True))
    channels = x.shape[1]
    moving = [a for a in schema.args[3:5] if isinstance(a, TensorArg)]
    x_needs: List[Placement] = []
    c_needs: List[Placement] = []
    for axis, p in enumerate(x.layout.placements):
        if training and moving:
            # the moving averages are updated in place: they keep their own layout (a redistributed
            # copy would take the update instead), and the input follows them on the channels
            kept = {m.layout.placements[axis] for m in moving}
            if len(kept) != 1 or not all(k.is_replicate() or k == Shard(0) for k in kept):
                raise NotImplementedError(
                    f"BatchNorm in training: the moving averages are laid out {sorted(map(str, kept))} on mesh dim "
                    f"{axis}; they must be Replicate or Shard(0) there, both alike (they are updated in place)")
            if kept == {Shard(0)}:
                x_needs.append(Shard(1)); c_needs.append(Shard(0))
            else:
                x_needs.append(Replicate()); c_needs.append(Replicate())
        elif p.is_shard() and p.dim == 1:
            x_needs.append(p); c_needs.append(Shard(0))
        elif p.is_shard() and not training:
            x_needs.append(p); c_needs.append(Replicate())
        else:
            x_needs.append(Replicate()); c_needs.append(Replicate())
    x_layout = layout_like(x.layout, x_needs, ndim=x.ndim)
    c_layout = layout_like(x.layout, c_needs, ndim=1)
    inputs = (x_layout,) + tuple(c_layout if isinstance(a, TensorArg) else None for a in schema.args[1:])
    return OutputSharding(inputs, ((x_layout, x.shape),) + ((c_layout, (channels,)),) * 4)
