"""The CPU twin of ``FlashAttentionScore`` (``ops.flash_attention_score``): softmax(scale q k^T + shift,
masked) v in float32, every layout and sparse mode the twin computes (:mod:`._twins` puts it in place).

Example::

    with cpu_twins():
        out = ops.flash_attention_score(q, k, v, head_num=4, input_layout="BNSD")
"""
from __future__ import annotations

import types
from typing import Any, Optional

import mindspore as ms
import numpy as np
from mindspore import mint, ops

from ._twin_values import _host

__all__ = ["_flash_attention_score"]


_LAYOUTS = {"BSH": "bsh", "SBH": "sbh", "BNSD": "bnsd", "BSND": "bsnd"}


_LAYOUT_ENUM = {0: "BSH", 1: "BNSD", 2: "SBH", 3: "BSND", 4: "TND"}     # MindSpore's input_layout enum


def _layout_name(value: Any) -> str:
    return value if isinstance(value, str) else _LAYOUT_ENUM.get(int(value), str(value))


def _to_bnsd(x, layout: str, heads: int):
    if layout == "BNSD":
        return x
    if layout == "BSND":
        return x.transpose(0, 2, 1, 3)
    if layout == "BSH":
        b, s, h = x.shape
        return x.reshape(b, s, heads, h // heads).transpose(0, 2, 1, 3)
    s, b, h = x.shape                                                   # SBH
    return x.reshape(s, b, heads, h // heads).transpose(1, 2, 0, 3)


def _from_bnsd(x, layout: str):
    if layout == "BNSD":
        return x
    if layout == "BSND":
        return x.transpose(0, 2, 1, 3)
    b, n, s, d = x.shape
    if layout == "BSH":
        return x.transpose(0, 2, 1, 3).reshape(b, s, n * d)
    return x.transpose(2, 0, 1, 3).reshape(s, b, n * d)                 # SBH


def _band(sq: int, skv: int, sparse_mode: int, pre_tokens: int, next_tokens: int) -> Optional[np.ndarray]:
    """True where a query row may not see a key column, from ``sparse_mode`` and the token band
    (mode 0 counts the band from the top-left corner, mode 4 from the bottom-right one, as mode 3)."""
    i = np.arange(sq)[:, None]
    j = np.arange(skv)[None, :]
    if sparse_mode in (0, 4):
        d = j - i - (skv - sq if sparse_mode == 4 else 0)
        return (d > next_tokens) | (-d > pre_tokens)
    if sparse_mode == 1:
        return None
    if sparse_mode == 2:                                                # causal from the top left
        return j > i
    if sparse_mode == 3:                                                # causal from the bottom right
        return j - i > skv - sq
    raise ValueError(f"cpu_twins: the FlashAttentionScore twin computes sparse_mode 0 to 4, got {sparse_mode}")


_FLASH_ATTRS = ("head_num", "keep_prob", "scale_value", "pre_tokens", "next_tokens", "inner_precise",
                "input_layout", "sparse_mode")      # the primitive's attributes, in its flat call's order


class _LocalFlashAttention:
    """The twin as the dispatcher's local op: called with ``FlashAttentionScore``'s 18 flat arguments
    (the 10 tensors, then :data:`_FLASH_ATTRS`, as the sharding rule's ``local_args`` set them)."""

    name = "FlashAttentionScore"

    def __call__(self, *flat):
        from .._mindspore import plain_view
        attrs = types.SimpleNamespace(**dict(zip(_FLASH_ATTRS, flat[10:])))
        pieces = [plain_view(t) if hasattr(t, "placements") else t for t in flat[:10]]   # this rank's pieces
        return _flash_attention_score(attrs, *pieces)


def _flash_attention_score(self, query, key, value, real_shift=None, drop_mask=None, padding_mask=None,
                           attn_mask=None, prefix=None, actual_seq_qlen=None, actual_seq_kvlen=None):
    attrs = self.attrs if hasattr(self, "attrs") else {}
    get = lambda name: _host(getattr(self, name, attrs.get(name)))      # noqa: E731
    tensors = (query, key, value, real_shift, drop_mask, padding_mask, attn_mask, prefix, actual_seq_qlen,
               actual_seq_kvlen)
    if any(hasattr(t, "placements") for t in tensors):     # DTensors: FlashAttentionScore's sharding rule decides
        from ..ops._dispatch import dispatch
        return dispatch(_LocalFlashAttention(), tensors + tuple(get(n) for n in _FLASH_ATTRS), {})
    layout = _layout_name(get("input_layout"))
    if layout not in _LAYOUTS:
        raise ValueError(f"cpu_twins: the FlashAttentionScore twin computes input_layout BSH, SBH, BNSD or BSND, "
                         f"got {layout!r}")
    from ..ops._rules.attention import check_layout_ranks
    check_layout_ranks(layout, (query.shape, key.shape, value.shape))
    if float(get("keep_prob")) != 1.0:
        raise ValueError("cpu_twins: the FlashAttentionScore twin computes keep_prob=1.0 only (no attention "
                         "dropout); set attention_dropout to 0 in tests")
    unsupported = [n for n, v in (("padding_mask", padding_mask), ("prefix", prefix),
                                  ("actual_seq_qlen", actual_seq_qlen), ("actual_seq_kvlen", actual_seq_kvlen))
                   if v is not None]
    if unsupported:
        raise ValueError(f"cpu_twins: the FlashAttentionScore twin does not compute {unsupported}")
    heads = int(get("head_num"))
    kv_heads = _kv_heads(key, layout, query, heads)
    q, k, v = _to_bnsd(query, layout, heads), _to_bnsd(key, layout, kv_heads), _to_bnsd(value, layout, kv_heads)
    groups = q.shape[1] // k.shape[1]
    if groups > 1:                                                      # grouped-query attention
        k, v = (_repeat_heads(t, groups) for t in (k, v))
    scores = mint.matmul(q.astype(ms.float32), k.astype(ms.float32).swapaxes(-1, -2)) * float(get("scale_value"))
    if real_shift is not None:
        scores = scores + real_shift.astype(ms.float32)
    sq, skv = scores.shape[-2:]
    sparse_mode = int(get("sparse_mode"))
    masked = None if sparse_mode == 0 and attn_mask is None else (     # mode 0 without a mask: no band
        _band(sq, skv, sparse_mode, int(get("pre_tokens")), int(get("next_tokens"))))
    hidden = None if masked is None else ms.Tensor(masked)
    if attn_mask is not None and sparse_mode in (0, 1):               # 2 to 4: the compressed mask is the band
        user = attn_mask.astype(ms.bool_)
        hidden = user if hidden is None else ops.logical_or(user, hidden)
    if hidden is not None:
        scores = ops.select(ops.broadcast_to(hidden, scores.shape), ms.Tensor(-1e30, ms.float32), scores)
    row_max = scores.max(axis=-1, keepdims=True)
    weights = ops.exp(scores - ops.stop_gradient(row_max))
    row_sum = weights.sum(axis=-1, keepdims=True)
    out = mint.matmul(weights / row_sum, v.astype(ms.float32)).astype(query.dtype)
    stats = tuple(ops.broadcast_to(ops.stop_gradient(t), t.shape[:-1] + (8,)) for t in (row_max, row_sum))
    reserved = ms.Tensor(np.zeros((), np.float32)).astype(query.dtype)      # softmax_out: shape (), unused
    return stats[0], stats[1], reserved, _from_bnsd(out, layout)


def _repeat_heads(t, groups: int):
    """Each key / value head repeated ``groups`` times in place (BNSD), as ``repeat_interleave`` on
    dim 1 (which has no CPU kernel in MindSpore 2.10)."""
    b, n, s, d = t.shape
    return ops.broadcast_to(t.reshape(b, n, 1, s, d), (b, n, groups, s, d)).reshape(b, n * groups, s, d)


def _kv_heads(t, layout: str, query, heads: int) -> int:
    if layout in ("BNSD", "BSND"):
        return t.shape[1 if layout == "BNSD" else 2]
    return heads * t.shape[-1] // query.shape[-1]
