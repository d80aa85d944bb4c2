"""Element-wise ops: unary, binary with broadcasting and scalar arguments.

Per mesh dim the output is sharded like a sharded (non-broadcast) input dim; inputs are
brought to that dim's placement (broadcast and missing dims stay Replicate). Partial
values stay Partial where the op is linear in them: the sum or difference of Partials with
the same op, a product or quotient of one Partial (numerator) with replicated values, and
negation, scaling by a scalar or a cast of one Partial. Everything else reduces Partials
first (``x + 1`` on a Partial would add 1 once per rank).

Example::

    y = x_dt * w_dt + 1          # S(0) * S(0) + scalar -> S(0), no communication
"""
from __future__ import annotations

from typing import List

import numpy as np

from ...placement import Placement, Replicate, Shard
from .._registry import register_sharding
from .._schema import OpSchema, OutputSharding, TensorArg
from ._common import layout_like

__all__ = ["UNARY", "LINEAR_UNARY", "ADDITIVE", "MULTIPLICATIVE", "OTHER_BINARY", "MONOTONE"]

LINEAR_UNARY = ("Neg", "Muls", "Divs", "ToDtype", "Cast", "Clone", "Contiguous", "Identity", "StopGradient")
UNARY = ("ReLU", "Exp", "Log", "Erf", "Sqrt", "Rsqrt", "Square", "Sigmoid", "Tanh", "SiLU", "GeLU", "Abs",
         "Reciprocal", "Sin", "Cos", "Softplus", "PowTensorScalar", "AddScalar", "SubScalar", "Sign", "Floor",
         "Ceil", "Round", "LogicalNot", "IsNan", "IsInf", "ZerosLike", "OnesLike", "Clamp", "ClampScalar",
         "Log1p", "Expm1", "Trunc", "ReLU6", "Softsign", "Mish", "MishExt", "Elu", "EluExt", "HSwish", "HSigmoid",
         "SoftplusExt", "LeakyReLUExt", "Hardtanh", "LogSigmoid", "GeluExt", "IsFinite", "NanToNum", "FmodScalar",
         "RemainderTensorScalar", "FloorDivScalar", "EqScalar", "LessScalar", "LessEqualScalar", "GreaterScalar",
         "GreaterEqualScalar", "Log2", "Exp2", "Frac", "AtanExt", "AsinExt",
         "Sinh", "Cosh", "Tan", "Erfinv", "ZerosLikeExt", "OnesLikeExt", "FullLike", "EmptyLike")
ADDITIVE = ("AddExt", "Add", "SubExt", "Sub")
MULTIPLICATIVE = ("Mul", "Div", "RealDiv")
OTHER_BINARY = ("Maximum", "Minimum", "Pow", "Equal", "NotEqual", "Greater", "GreaterEqual", "Less", "LessEqual",
                "Atan2", "LogicalAnd", "LogicalOr", "LogicalXor", "SquaredDifference", "FloorDiv",
                "BitwiseAndTensor", "BitwiseOrTensor", "BitwiseXorTensor", "RemainderTensorTensor", "FmodTensor",
                "Lerp", "ClampTensor", "Select", "MaskedFill", "MaskedFillScalar", "IsClose", "Addcmul", "Addcdiv")
# Monotonic non-decreasing and defined everywhere: max_i f(x_i) = f(max_i x_i), so a Partial(max)
# or Partial(min) operand stays Partial (Muls / Divs only by a non-negative / positive scalar).
MONOTONE = ("ReLU", "Exp", "Sigmoid", "Tanh", "Erf", "Floor", "Ceil", "Round", "Trunc", "Sign", "ClampScalar",
            "Softplus", "SoftplusExt", "AddScalar", "SubScalar", "Expm1", "ReLU6", "HSigmoid", "Hardtanh",
            "LogSigmoid", "ToDtype", "Cast", "Clone", "Contiguous", "Muls", "Divs")
_LINEAR_PARTIALS = ("sum", "avg")
_CASTS = ("ToDtype", "Cast")


def _to_float(schema: OpSchema) -> bool:
    """Whether a cast's target type is floating (a cast to int or bool rounds, so a sum of
    cast pieces is not the cast of the sum)."""
    target = schema.args[1] if len(schema.args) > 1 else schema.kwarg("dtype")
    return target is None or str(target).lower().startswith(("float", "bfloat"))


def _partial_kept(schema: OpSchema, placements: List[Placement]) -> bool:
    """Whether a Partial output is exact for this op, given the inputs' placements on one mesh dim."""
    tensors = [a for a in schema.args if isinstance(a, TensorArg)]
    partial = [p for p in placements if p.is_partial()]
    ops = {p.reduce_op for p in partial}
    if len(ops) != 1:
        return False
    if next(iter(ops)) in ("max", "min"):
        return _extremum_kept(schema, len(tensors), len(partial))
    if next(iter(ops)) not in _LINEAR_PARTIALS:
        return False
    if schema.op in _CASTS:
        return _to_float(schema)
    if schema.op in LINEAR_UNARY:
        return True
    operands = schema.args[:2]
    if not all(isinstance(a, TensorArg) for a in operands):
        return False  # a scalar operand would be added once per rank
    if schema.op in ADDITIVE:
        return len(partial) == len(tensors) == 2
    if schema.op in MULTIPLICATIVE:
        return len(partial) == 1 and (schema.op == "Mul" or placements[0].is_partial())
    return False


def _extremum_kept(schema: OpSchema, tensors: int, partials: int) -> bool:
    """A Partial(max / min) stays through a monotonic op of it alone. Not through
    ``maximum(p, r)``: every rank where ``r`` wins would hold the maximum and receive its
    gradient (n times the single-device gradient)."""
    if tensors != 1 or schema.op not in MONOTONE:
        return False
    if schema.op in ("Muls", "Divs"):
        factor = schema.args[1] if len(schema.args) > 1 else None
        return isinstance(factor, (int, float)) and (factor > 0 or (factor == 0 and schema.op == "Muls"))
    return partials == 1


def pointwise_rule(schema: OpSchema) -> OutputSharding:
    """The sharding of an element-wise op (see the module docstring)."""
    tensors = [(i, a) for i, a in enumerate(schema.args) if isinstance(a, TensorArg)]
    out_shape = tuple(int(s) for s in np.broadcast_shapes(*(a.shape for _, a in tensors)))
    out_ndim, template = len(out_shape), tensors[0][1].layout
    out_placements: List[Placement] = []
    needs = {i: [] for i, _ in tensors}
    for axis in range(len(template.mesh_shape)):
        here = [a.layout.placements[axis] for _, a in tensors]
        shard_dims = [p.dim + out_ndim - a.ndim for (_, a), p in zip(tensors, here)
                      if p.is_shard() and a.shape[p.dim] == out_shape[p.dim + out_ndim - a.ndim]]
        if shard_dims:
            out_p: Placement = Shard(max(set(shard_dims), key=shard_dims.count))
        elif any(p.is_partial() for p in here) and _partial_kept(schema, here):
            out_p = next(p for p in here if p.is_partial())
        else:
            out_p = Replicate()
        out_placements.append(out_p)
        for (i, a), p in zip(tensors, here):
            if out_p.is_shard():
                d = out_p.dim - (out_ndim - a.ndim)
                needs[i].append(Shard(d) if d >= 0 and a.shape[d] == out_shape[out_p.dim] else Replicate())
            elif out_p.is_partial():
                needs[i].append(p if p.is_partial() else Replicate())
            else:
                needs[i].append(Replicate())
    inputs = tuple(layout_like(template, needs[i], ndim=a.ndim) if isinstance(a, TensorArg) else None
                   for i, a in enumerate(schema.args))
    return OutputSharding(inputs, ((layout_like(template, out_placements, ndim=out_ndim), out_shape),))


register_sharding(*LINEAR_UNARY, *UNARY, *ADDITIVE, *MULTIPLICATIVE, *OTHER_BINARY)(pointwise_rule)


_CHANNELS_FIRST = (0, "NCHW", "NCDHW", "NCL", "NC")


@register_sharding("BiasAdd")
def bias_add_rule(schema: OpSchema) -> OutputSharding:
    """``BiasAdd`` (``nn.Dense``, ``nn.Conv2d``): the bias added along the channel dim (dim 1, channels
    first; the last dim otherwise): element-wise for 2-D inputs; an N-D input keeps its sharding, the
    bias cut alike where the channels are sharded, a Partial input reduced first (the bias is added once)."""
    x = schema.args[0]
    if x.ndim == 2:
        return pointwise_rule(schema)
    fmt = schema.attr("data_format", 0)
    channel = 1 if fmt in _CHANNELS_FIRST or str(fmt).upper() in _CHANNELS_FIRST else x.ndim - 1
    x_needs: List[Placement] = []
    b_needs: List[Placement] = []
    for p in x.layout.placements:
        if p.is_shard():
            x_needs.append(p)
            b_needs.append(Shard(0) if p.dim % x.ndim == channel else Replicate())
        else:
            x_needs.append(Replicate())
            b_needs.append(Replicate())
    x_layout = layout_like(x.layout, x_needs, dict(x.layout.shard_order) or None, ndim=x.ndim)
    b_layout = layout_like(x.layout, b_needs, ndim=1)
    inputs = (x_layout,) + tuple(b_layout if isinstance(a, TensorArg) else None for a in schema.args[1:])
    return OutputSharding(inputs, ((x_layout, x.shape),))


@register_sharding("NewZeros", "NewOnes")
def new_tensor_rule(schema: OpSchema) -> OutputSharding:
    """``x.new_zeros(size)`` / ``x.new_ones(size)``: a replicated tensor of the global ``size`` (only
    ``x``'s dtype is read, so it is not moved)."""
    x = schema.args[0]
    size = schema.args[1] if len(schema.args) > 1 else schema.kwarg("size")
    shape = (int(size),) if isinstance(size, int) else tuple(int(s) for s in size)
    inputs = (x.layout,) + (None,) * (len(schema.args) - 1)
    return OutputSharding(inputs, ((layout_like(x.layout, [Replicate()] * len(x.layout.mesh_shape),
                                                ndim=len(shape)), shape),))
