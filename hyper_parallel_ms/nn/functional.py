"""Portable functional ops: ``scaled_dot_product_attention`` with PyTorch's semantics, the one seam
through which attention becomes context-parallel.

On Ascend it calls MindSpore's fused ``ops.flash_attention_score`` where that kernel takes the call
(float16 / bfloat16 inputs, no dropout); elsewhere (CPU, float32) it computes the attention from
its definition, the softmax in float32. Inside :func:`~hyper_parallel_ms.nn.context_parallel` the
same call computes attention of this rank's sequence shards (plain tensors in and out) on every
rank's keys: see :doc:`/context-parallel`.

Example::

    from hyper_parallel_ms.nn.functional import scaled_dot_product_attention
    out = scaled_dot_product_attention(q, k, v, is_causal=True)        # [batch, heads, seq, head_dim]
"""
from __future__ import annotations

import math
from typing import Optional

import numpy as np
from mindspore import Tensor, ops
from mindspore.common import dtype as mstype

from .._cluster import rank_device_target
from .._mindspore import cached_in_python, run_in_python, running_eagerly
from .._context_parallel._dispatch import active_context, attention_spec, context_parallel_attention

__all__ = ["scaled_dot_product_attention"]

_HALF = (mstype.float16, mstype.bfloat16)
_FLOATS = (mstype.float16, mstype.bfloat16, mstype.float32, mstype.float64)
_COMPRESSED_CAUSAL = 2048      # flash attention's compressed causal mask: (2048, 2048), sparse_mode 2


@run_in_python
def _check(q_shape, k_shape, v_shape, dtypes, mask_shape, mask_dtype, dropout_p, is_causal, enable_gqa) -> bool:
    """Refuse what PyTorch refuses (shapes, dtypes, a mask beside is_causal)."""
    what = "scaled_dot_product_attention"
    if min(len(q_shape), len(k_shape), len(v_shape)) < 2:
        raise ValueError(f"{what}: query, key and value need at least 2 dims [..., seq, head_dim], got shapes "
                         f"{q_shape}, {k_shape}, {v_shape}")
    if any(d not in _FLOATS for d in dtypes) or len(set(dtypes)) != 1:
        raise TypeError(f"{what}: query, key and value must share one float dtype, got {dtypes}")
    if q_shape[-1] != k_shape[-1] or k_shape[-2] != v_shape[-2]:
        raise ValueError(f"{what}: query {q_shape} and key {k_shape} must share head_dim, key and value {v_shape} "
                         "the sequence length")
    if not 0.0 <= dropout_p <= 1.0:
        raise ValueError(f"{what}: dropout_p must be in [0, 1], got {dropout_p}")
    if is_causal and mask_shape is not None:
        raise ValueError(f"{what}: give attn_mask or is_causal=True, not both (PyTorch refuses both)")
    if mask_dtype is not None and mask_dtype != mstype.bool_ and mask_dtype not in _FLOATS:
        raise TypeError(f"{what}: attn_mask must be bool (True: take part) or float (added), got {mask_dtype}")
    if len(q_shape) >= 3 and len(k_shape) >= 3 and q_shape[-3] != k_shape[-3]:
        if not enable_gqa:
            raise ValueError(f"{what}: query has {q_shape[-3]} heads and key {k_shape[-3]}; pass enable_gqa=True for "
                             "grouped-query attention")
        if q_shape[-3] % k_shape[-3]:
            raise ValueError(f"{what}: the {q_shape[-3]} query heads must divide by the {k_shape[-3]} key heads")
    return True


@cached_in_python
def _above_diagonal(length: int, keys: int, dtype=mstype.bool_) -> Tensor:
    """The ``(length, keys)`` mask of the pairs a causal query skips (True above the top-left diagonal)."""
    return Tensor(np.triu(np.ones((length, keys), np.bool_), 1)).astype(dtype)


@run_in_python
def _fused(dtype, q_ndim: int, dropout_p: float, mask_dtype) -> bool:
    """Whether the call goes to Ascend's flash attention (its dtypes and layouts; dropout drawn apart) on the
    device this rank computes on (``rank_device_target``: the cluster's, wherever this code runs)."""
    return (rank_device_target() == "Ascend" and dtype in _HALF and q_ndim == 4 and dropout_p == 0.0
            and mask_dtype in (None, mstype.bool_) + _HALF)


def _groups(q, k) -> int:
    return q.shape[-3] // k.shape[-3] if q.ndim >= 3 and k.ndim >= 3 else 1


def _repeat_heads(x, groups: int):
    """``[..., H, S, D]`` -> ``[..., H * groups, S, D]``, each head repeated in place (``repeat_interleave``)."""
    shape = x.shape
    wide = ops.broadcast_to(x.expand_dims(x.ndim - 2), shape[:-2] + (groups,) + shape[-2:])
    return wide.reshape(shape[:-3] + (shape[-3] * groups,) + shape[-2:])


def _math(query, key, value, attn_mask, dropout_p, is_causal, scale, groups):
    """Attention from its definition; the scores' softmax in float32 for half inputs."""
    if groups > 1:
        key, value = _repeat_heads(key, groups), _repeat_heads(value, groups)
    dtype = query.dtype
    if dtype in _HALF:
        query, key, value = query.astype(mstype.float32), key.astype(mstype.float32), value.astype(mstype.float32)
    scores = ops.matmul(query, key.swapaxes(-1, -2)) * scale
    if is_causal:
        scores = ops.masked_fill(scores, _above_diagonal(query.shape[-2], key.shape[-2]), float("-inf"))
    if attn_mask is not None:
        if attn_mask.dtype == mstype.bool_:
            scores = ops.masked_fill(scores, ops.logical_not(attn_mask), float("-inf"))
        else:
            scores = scores + attn_mask.astype(scores.dtype)
    weights = ops.softmax(scores, -1)
    if dropout_p > 0.0:
        weights = ops.dropout(weights, p=dropout_p)
    return ops.matmul(weights, value).astype(dtype)


def _flash(query, key, value, attn_mask, is_causal, scale):
    """Ascend: ``ops.flash_attention_score`` on ``[B, N, S, D]`` (BNSD; grouped key heads native)."""
    pse, mask, sparse_mode = None, None, 0
    if is_causal:
        mask = _above_diagonal(_COMPRESSED_CAUSAL, _COMPRESSED_CAUSAL, mstype.uint8)
        sparse_mode = 2                                # leftUpCausal: PyTorch's top-left diagonal
    elif attn_mask is not None:
        if attn_mask.dtype == mstype.bool_:            # flash attention: 1 discards, PyTorch's bool: True keeps
            mask = ops.logical_not(attn_mask).astype(mstype.uint8)
            mask = mask.reshape((1,) * (4 - mask.ndim) + mask.shape)
            heads = 1 if mask.shape[1] == 1 else query.shape[1]
            mask = ops.broadcast_to(mask, (query.shape[0], heads, query.shape[2], key.shape[2]))
        else:                                          # an additive mask is flash attention's position shift
            pse = attn_mask.astype(query.dtype)
            pse = pse.reshape((1,) * (4 - pse.ndim) + pse.shape)
            pse = ops.broadcast_to(pse, (pse.shape[0], query.shape[1], query.shape[2], key.shape[2]))
    return ops.flash_attention_score(query, key, value, query.shape[1], real_shift=pse, attn_mask=mask,
                                     scalar_value=scale, input_layout="BNSD", sparse_mode=sparse_mode)


def scaled_dot_product_attention(query, key, value, attn_mask=None, dropout_p: float = 0.0, is_causal: bool = False,
                                 scale: Optional[float] = None, enable_gqa: bool = False):
    """Softmax attention of ``query`` on ``key`` / ``value`` (PyTorch's
    ``torch.nn.functional.scaled_dot_product_attention``): ``softmax(query @ key^T * scale + mask) @ value``.

    Shapes ``[..., heads, seq, head_dim]`` (``[batch, heads, seq, head_dim]`` for the fused kernel and
    context parallelism). On Ascend, float16 / bfloat16 calls without dropout run
    ``ops.flash_attention_score``; others compute the definition (softmax in float32). Inside
    :func:`~hyper_parallel_ms.nn.context_parallel` the tensors are this rank's sequence shards and
    the attention runs over every rank's keys (``attn_mask`` then only as a key-padding mask sharded
    like the keys; no dropout); there q, k and v may also be DTensors whose placements cut only the
    heads over a tensor-parallel mesh (each rank's heads attended, a DTensor returned).

    Args:
        query: ``[..., Hq, L, E]``.
        key: ``[..., Hkv, S, E]``.
        value: ``[..., Hkv, S, Ev]``.
        attn_mask: broadcastable to ``[..., Hq, L, S]``: bool (True: the pair takes part) or float (added
            to the scores).
        dropout_p: probability of dropping an attention weight (applied whenever > 0, as PyTorch).
        is_causal: mask out keys after each query (top-left diagonal); not with ``attn_mask``.
        scale: factor of the scores (default ``1 / sqrt(E)``).
        enable_gqa: allow fewer key heads than query heads (each key head serving ``Hq // Hkv``
            consecutive query heads).

    Returns:
        ``[..., Hq, L, Ev]`` in the query's dtype.

    Example::

        out = scaled_dot_product_attention(q, k, v, is_causal=True)
    """
    if running_eagerly() and active_context() >= 0 and any(hasattr(t, "placements") for t in (query, key, value)):
        return _on_local_heads(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)
    mask_shape = None if attn_mask is None else attn_mask.shape
    mask_dtype = None if attn_mask is None else attn_mask.dtype
    context = active_context()
    if context >= 0:
        spec = attention_spec(context, query.shape, key.shape, value.shape, query.dtype, mask_shape, mask_dtype,
                              dropout_p, is_causal, scale, enable_gqa)
        return context_parallel_attention(spec)(query, key, value, attn_mask)
    _check(query.shape, key.shape, value.shape, (query.dtype, key.dtype, value.dtype), mask_shape, mask_dtype,
           dropout_p, is_causal, enable_gqa)
    factor = 1.0 / math.sqrt(query.shape[-1]) if scale is None else scale
    if _fused(query.dtype, query.ndim, dropout_p, mask_dtype):
        return _flash(query, key, value, attn_mask, is_causal, factor)
    return _math(query, key, value, attn_mask, dropout_p, is_causal, factor, _groups(query, key))


def _heads_only(placements) -> bool:
    """Whether DTensor placements cut nothing but the heads (dim 1 of ``[batch, heads, seq, head_dim]``)."""
    return all(p.is_replicate() or p.is_shard(1) or p.is_shard(-3) for p in placements)


def _on_local_heads(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa):
    """Inside context_parallel, DTensor q, k, v whose heads are cut over a tensor-parallel mesh (and whose
    local pieces are this rank's sequence shards): the context-parallel attention of this rank's heads,
    as a DTensor with the query's placements (tensor parallelism over heads composed with context
    parallelism over the sequence)."""
    tensors = (query, key, value)
    if not all(hasattr(t, "placements") for t in tensors) or hasattr(attn_mask, "placements"):
        raise TypeError("scaled_dot_product_attention inside context_parallel: give query, key and value all as "
                        "DTensors (heads cut over a tensor-parallel mesh) or all as plain tensors (this rank's "
                        "shards), and attn_mask as a plain tensor")
    mesh = query.device_mesh
    for name, t in zip(("query", "key", "value"), tensors):
        if t.device_mesh != mesh or tuple(t.placements) != tuple(query.placements) or not _heads_only(t.placements):
            raise ValueError(f"scaled_dot_product_attention inside context_parallel: {name} is a DTensor on "
                             f"{t.device_mesh} with placements {tuple(t.placements)}; query, key and value must share "
                             "one mesh and placements that cut only the heads (Shard(1) or Replicate): the sequence "
                             "is context_parallel's (each local piece this rank's sequence shard)")
    out = scaled_dot_product_attention(query.to_local(), key.to_local(), value.to_local(), attn_mask, dropout_p,
                                       is_causal, scale, enable_gqa)
    return type(query).from_local(out, mesh, query.placements)
