"""Matrix products: ``MatMulExt`` (``ops.matmul``, batched with broadcasting), ``MatMul`` and
``BatchMatMul`` (with transpose flags, as inside ``nn.Dense``) and ``Dense``
(``mint.nn.functional.linear``: ``x @ w.T + b``).

Every dim of the inputs gets a label (batch dims, ``m``, ``k``, ``n``). Per mesh dim the
candidate strategies are: shard a batch dim or ``m`` of the first input (output sharded
there), shard ``n`` of the second (output sharded on its last dim), shard ``k`` of both
(output Partial(sum): the contraction is completed by whoever reduces it), keep one
input's Partial(sum) with the other replicated, or replicate both. The strategy with the
least redistribution cost from the current placements wins (:mod:`..._cost`: fewest elements
sent, then fewest steps weighted by the size of the tensor they change). A bias follows the output:
sharded with ``n``, Partial (its value split as ``b / n``, so it is added once) when the
output is Partial, replicated otherwise.

Example::

    h = ops.matmul(x, w1)        # w1 S(1): h S(1), no communication
    y = ops.matmul(h, w2)        # w2 S(0): y P(sum); one all-reduce when y is reduced
"""
from __future__ import annotations

from typing import List, Sequence, Tuple

import numpy as np

from ..._cost import change_cost
from ...placement import Partial, Placement, Replicate, Shard
from .._registry import register_sharding
from .._schema import OpSchema, OutputSharding, TensorArg
from ._common import layout_like, replicate_all

__all__ = ["contraction_rule"]

Labels = Tuple[str, ...]


def _labels(a_ndim: int, b_ndim: int, out_batch: int, ta: bool, tb: bool) -> Tuple[Labels, Labels, Labels]:
    batch = tuple(f"b{i}" for i in range(out_batch))
    a = batch[out_batch - (a_ndim - 2):] + (("k", "m") if ta else ("m", "k"))
    b = batch[out_batch - (b_ndim - 2):] + (("n", "k") if tb else ("k", "n"))
    return a, b, batch + ("m", "n")


def _strategies(a: Labels, b: Labels, out: Labels, a_shape, b_shape, out_shape) -> List[Tuple[Placement, ...]]:
    """(a placement, b placement, output placement) candidates for one mesh dim."""
    sizes_a, sizes_b = dict(zip(a, a_shape)), dict(zip(b, b_shape))
    found: List[Tuple[Placement, ...]] = [(Replicate(), Replicate(), Replicate()),
                                          (Partial(), Replicate(), Partial()), (Replicate(), Partial(), Partial()),
                                          (Shard(a.index("k")), Shard(b.index("k")), Partial())]
    for label, size in zip(out, out_shape):
        in_a = label in a and sizes_a[label] == size
        in_b = label in b and sizes_b[label] == size
        if not (in_a or in_b):
            continue
        pa = Shard(a.index(label)) if in_a else Replicate()
        pb = Shard(b.index(label)) if in_b else Replicate()
        found.append((pa, pb, Shard(out.index(label))))
    return found


def contraction_rule(schema: OpSchema, a: TensorArg, b: TensorArg, labels: Tuple[Labels, Labels, Labels],
                     out_shape: Tuple[int, ...]) -> Tuple[List[Placement], List[Placement], List[Placement]]:
    """Per mesh dim, the cheapest (a, b, output) placements for the labelled contraction."""
    la, lb, lo = labels
    mesh_shape = a.layout.mesh_shape
    elems_a, elems_b = float(np.prod(a.shape)), float(np.prod(b.shape))
    need_a, need_b, out = [], [], []
    for axis, n in enumerate(mesh_shape):
        pa, pb = a.layout.placements[axis], b.layout.placements[axis]
        best = min(_strategies(la, lb, lo, a.shape, b.shape, out_shape),
                   key=lambda s: change_cost(pa, s[0], n).scaled(elems_a) + change_cost(pb, s[1], n).scaled(elems_b))
        need_a.append(best[0])
        need_b.append(best[1])
        out.append(best[2])
    return need_a, need_b, out


def _bias_placements(out: Sequence[Placement], out_ndim: int) -> List[Placement]:
    return [Shard(0) if p.is_shard(out_ndim - 1) else Partial() if p.is_partial() else Replicate() for p in out]


def _matmul(schema: OpSchema, ta: bool, tb: bool) -> OutputSharding:
    a, b = schema.args[0], schema.args[1]
    if not (isinstance(a, TensorArg) and isinstance(b, TensorArg)) or a.ndim < 2 or b.ndim < 2:
        return _replicated(schema)
    m, k = (a.shape[-1], a.shape[-2]) if ta else (a.shape[-2], a.shape[-1])
    n = b.shape[-2] if tb else b.shape[-1]
    batch = tuple(int(s) for s in np.broadcast_shapes(a.shape[:-2], b.shape[:-2]))
    out_shape = batch + (m, n)
    labels = _labels(a.ndim, b.ndim, len(batch), ta, tb)
    need_a, need_b, out = contraction_rule(schema, a, b, labels, out_shape)
    ndim = len(out_shape)
    inputs = (layout_like(a.layout, need_a, ndim=a.ndim), layout_like(a.layout, need_b, ndim=b.ndim))
    return OutputSharding(inputs + (None,) * (len(schema.args) - 2),
                          ((layout_like(a.layout, out, ndim=ndim), out_shape),))


def _replicated(schema: OpSchema) -> OutputSharding:
    """Fallback for shapes the labelled rule does not cover (1-D operands): everything replicated."""
    tensors = [a for a in schema.args if isinstance(a, TensorArg)]
    rep = replicate_all(tensors[0].layout)
    a, b = tensors[0], tensors[1]
    out_shape = tuple(np.matmul(np.zeros(a.shape), np.zeros(b.shape)).shape)
    return OutputSharding(tuple(rep if isinstance(x, TensorArg) else None for x in schema.args), ((rep, out_shape),))


@register_sharding("MatMulExt", "BatchMatMulExt", "Mm")
def matmul_ext_rule(schema: OpSchema) -> OutputSharding:
    """``ops.matmul`` / ``mint.matmul``: numpy matmul semantics."""
    return _matmul(schema, False, False)


@register_sharding("MatMul", "BatchMatMul")
def matmul_transposed_rule(schema: OpSchema) -> OutputSharding:
    """``MatMul(a, b, transpose_a, transpose_b)`` (the primitive inside ``nn.Dense``)."""
    ta, tb = (bool(flag) for flag in (list(schema.args[2:4]) + [False, False])[:2])
    result = _matmul(OpSchema(schema.op, schema.args[:2], schema.kwargs), ta, tb)
    return OutputSharding(result.inputs + (None,) * (len(schema.args) - 2), result.outputs)


@register_sharding("Dense")
def dense_rule(schema: OpSchema) -> OutputSharding:
    """``Dense(x, w, b)`` = ``x @ w.T + b`` with ``w`` stored as (out, in)."""
    x, w = schema.args[0], schema.args[1]
    if not isinstance(w, TensorArg) or w.ndim != 2 or x.ndim < 2:
        return _replicated(schema)
    lead = x.shape[:-1]
    out_shape = lead + (w.shape[0],)
    batch = tuple(f"b{i}" for i in range(len(lead) - 1))
    labels = (batch + ("m", "k"), ("n", "k"), batch + ("m", "n"))
    need_x, need_w, out = contraction_rule(schema, x, w, labels, out_shape)
    ndim = len(out_shape)
    bias = schema.args[2] if len(schema.args) > 2 else None
    inputs = (layout_like(x.layout, need_x, ndim=x.ndim), layout_like(x.layout, need_w, ndim=2),
              layout_like(x.layout, _bias_placements(out, ndim), ndim=bias.ndim) if isinstance(bias, TensorArg)
              else None) + (None,) * max(0, len(schema.args) - 3)
    return OutputSharding(inputs[:len(schema.args)], ((layout_like(x.layout, out, ndim=ndim), out_shape),))
