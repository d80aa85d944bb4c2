"""Attention of a block of queries against a block of keys, forward and backward, in float32, and
the log-sum-exp merge of partial results (online softmax). Plain MindSpore ops that run in PyNative
and inside ``ms.jit`` on CPU and Ascend; the backward is written out (the flash-attention backward:
``P = exp(S - lse)``, ``dV = P^T dO``, ``dS = P * (dO V^T - rowsum(dO * O))``, ``dQ = dS K * scale``,
``dK = dS^T Q * scale``), so that a block keeps nothing but its inputs, the output and the
log-sum-exp.

Shapes: ``q`` ``[B, Hq, Sq, D]``, ``k`` / ``v`` ``[B, Hkv, Sk, D]`` with ``Hq = groups * Hkv``
(grouped-query attention: each key head serves ``groups`` consecutive query heads, as
``repeat_interleave``), ``bias`` an additive float32 mask broadcast to ``[B, Hq, Sq, Sk]`` (a key-padding
mask ``[B | 1, Hq | 1, 1, Sk]``), ``blocked`` a bool ``[Sq, Sk]`` mask (True: masked out).
Rows whose keys are all masked get ``lse = -inf`` and a zero output, never NaN: merging them is a no-op.

Example::

    out, lse = block_forward(q, k, v, 0.35, None, None, 1)
    out, lse = merge(out, lse, *block_forward(q, k2, v2, 0.35, None, None, 1))
"""
from __future__ import annotations

from mindspore import ops
from mindspore.common import dtype as mstype

__all__ = ["expand_heads", "fold_heads", "block_forward", "block_backward", "merge", "neg_inf_like"]

_INF = float("inf")


def expand_heads(x, groups: int):
    """``[B, H, S, D]`` -> ``[B, H * groups, S, D]``, each head repeated ``groups`` times in place."""
    if groups == 1:
        return x
    b, h, s, d = x.shape
    return ops.broadcast_to(x.expand_dims(2), (b, h, groups, s, d)).reshape(b, h * groups, s, d)


def fold_heads(g, groups: int):
    """The adjoint of :func:`expand_heads`: ``[B, H * groups, S, D]`` summed to ``[B, H, S, D]``."""
    if groups == 1:
        return g
    b, h, s, d = g.shape
    return g.reshape(b, h // groups, groups, s, d).sum(2)


def neg_inf_like(shape):
    """A float32 tensor of ``-inf`` of ``shape`` (CPU has no fill kernel: zeros minus infinity)."""
    return ops.zeros(shape, mstype.float32) - _INF


def _scores(q, k, scale: float, bias, blocked):
    s = ops.matmul(q, k.swapaxes(-1, -2)) * scale
    if bias is not None:
        s = s + bias
    if blocked is not None:
        s = ops.masked_fill(s, blocked, -_INF)
    return s


def block_forward(q, k, v, scale: float, bias, blocked, groups: int):
    """``(out, lse)`` of softmax attention of ``q`` on ``k`` / ``v`` (float32 inputs): ``out``
    ``[B, Hq, Sq, Dv]``, ``lse`` ``[B, Hq, Sq, 1]`` the log-sum-exp of each row's scores."""
    k, v = expand_heads(k, groups), expand_heads(v, groups)
    s = _scores(q, k, scale, bias, blocked)
    m = s.max(axis=-1, keepdims=True)
    m = ops.masked_fill(m, m == -_INF, 0.0)
    p = ops.exp(s - m)
    total = p.sum(-1, keepdims=True)
    out = ops.matmul(p, v) / ops.masked_fill(total, total == 0.0, 1.0)
    return out, m + ops.log(total)


def block_backward(q, k, v, dout, lse, delta, scale: float, bias, blocked, groups: int):
    """``(dq, dk, dv)`` of one block (float32), given the final ``lse`` of the rows and ``delta =
    rowsum(dout * out)`` of the final output; ``dk`` / ``dv`` folded to the key heads."""
    ke, ve = expand_heads(k, groups), expand_heads(v, groups)
    s = _scores(q, ke, scale, bias, blocked)
    p = ops.exp(s - ops.masked_fill(lse, lse == -_INF, _INF))        # rows without keys: p = 0
    dv = ops.matmul(p.swapaxes(-1, -2), dout)
    ds = p * (ops.matmul(dout, ve.swapaxes(-1, -2)) - delta)
    dq = ops.matmul(ds, ke) * scale
    dk = ops.matmul(ds.swapaxes(-1, -2), q) * scale
    return dq, fold_heads(dk, groups), fold_heads(dv, groups)


def merge(out_a, lse_a, out_b, lse_b):
    """The attention of two key sets from the attention of each: outputs weighted by their share
    of the total ``exp(lse)`` (``-inf`` rows contribute nothing)."""
    top = ops.maximum(lse_a, lse_b)
    top = ops.masked_fill(top, top == -_INF, 0.0)
    w_a, w_b = ops.exp(lse_a - top), ops.exp(lse_b - top)
    total = w_a + w_b
    out = (out_a * w_a + out_b * w_b) / ops.masked_fill(total, total == 0.0, 1.0)
    return out, top + ops.log(total)
