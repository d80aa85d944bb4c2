"""``FlashAttentionScore`` (``ops.flash_attention_score``, Ascend's fused attention): batch over data
parallelism, heads over tensor parallelism, the query's sequence over context parallelism.

Arguments as the primitive receives them: ``(query, key, value, real_shift, drop_mask, padding_mask,
attn_mask, prefix, actual_seq_qlen, actual_seq_kvlen, head_num, keep_prob, scale_value, pre_tokens,
next_tokens, inner_precise, input_layout, sparse_mode)``; outputs ``(softmax_max, softmax_sum,
softmax_out, attention_out)``. For each mesh dim, the query's placement decides:

- ``Shard(batch)``: every batched input cut alike;
- ``Shard(heads)`` (N of BNSD / BSND / TND, the hidden dim of BSH / SBH) when the query and key heads
  divide by the mesh size: the inputs cut by heads, ``head_num`` this rank's count;
- ``Shard(seq)`` (not TND): keys and values gathered (Replicate), the masks, shift and dropout mask
  cut by query rows, and the causal band moved to the shard's rows: a query shard at global rows
  ``[o, o + s)`` of ``S1`` keeps sparse mode 0 / 1 with ``pre_tokens - o`` / ``next_tokens + o`` (the
  band counts from the top-left corner), and turns left-up causal (2), right-down causal (3) and band
  (4) into band (4, counted from the bottom-right corner) with the tokens of its rows;
- anything else (``Partial``, a cut head size, heads not dividing): gathered first.

Sparse modes 5 to 8 (prefix and variable-length compressions) with a sharded sequence are refused.

Example::

    out = ops.flash_attention_score(q_dt, k_dt, v_dt, 8, input_layout="BNSD", sparse_mode=2,
                                    attn_mask=compressed)     # q_dt Shard(2) over cp: k, v gathered
"""
from __future__ import annotations

from typing import Dict, List, Optional, Tuple

from ...placement import Placement, Replicate, Shard
from .._registry import register_sharding
from .._schema import OpSchema, OutputSharding, TensorArg
from ._common import layout_like, replicate_all

__all__ = ["flash_attention_score_rule", "LAYOUT_DIMS", "band_for_rows", "check_layout_ranks"]

# (batch, sequence, heads) dims of query / key / value per input layout (None: no such dim)
LAYOUT_DIMS: Dict[str, Tuple[Optional[int], Optional[int], int]] = {
    "BSH": (0, 1, 2), "BNSD": (0, 2, 1), "SBH": (1, 0, 2), "BSND": (0, 1, 2), "TND": (None, None, 1)}
_LAYOUT_NAMES = ("BSH", "BNSD", "SBH", "BSND", "TND")       # the primitive's enum order
_QUERY, _KEY, _VALUE, _SHIFT, _DROP, _PADDING, _MASK = range(7)
_HEAD_NUM, _PRE, _NEXT, _LAYOUT, _SPARSE = 10, 13, 14, 16, 17
_BIG = 2147483647


def band_for_rows(sparse_mode: int, pre_tokens: int, next_tokens: int, offset: int, rows: int, q_len: int,
                  kv_len: int) -> Tuple[int, int, int]:
    """``(sparse_mode, pre_tokens, next_tokens)`` for the query rows ``[offset, offset + rows)`` of
    ``q_len`` against all ``kv_len`` keys, keeping exactly the pairs the whole call keeps.

    >>> band_for_rows(2, _BIG, 0, 4, 4, 8, 8)      # left-up causal, second half: band to the right-down
    (4, 8, 0)
    >>> band_for_rows(0, _BIG, _BIG, 4, 4, 8, 8)[1:]
    (2147483643, 2147483647)
    """
    if sparse_mode in (0, 1):                   # (kept within int32: a band wider than the keys is all of them)
        return sparse_mode, min(pre_tokens - offset, _BIG), min(next_tokens + offset, _BIG)
    if sparse_mode == 2:                        # j <= i: from the bottom-right diagonal, j - i <= o + s - kv
        return 4, kv_len, offset + rows - kv_len
    shift = q_len - rows - offset               # rows below this shard, to the bottom-right corner
    if sparse_mode == 3:
        return 4, kv_len, -shift
    if sparse_mode == 4:
        return 4, min(pre_tokens + shift, _BIG), min(next_tokens - shift, _BIG)
    raise NotImplementedError(f"FlashAttentionScore with sparse_mode={sparse_mode} (prefix / variable-length "
                              "compression) and a sequence-sharded query is not supported; gather the query's "
                              "sequence (Replicate) or use sparse_mode 0 to 4")


def _layout_name(value) -> str:
    return value if isinstance(value, str) else _LAYOUT_NAMES[int(value)]


def check_layout_ranks(name: str, shapes) -> None:
    """Refuse query / key / value ``shapes`` whose rank is not the one ``input_layout`` ``name`` reads
    (3 for BSH, SBH and TND; 4 for BNSD and BSND): the kernel would read their dims as other ones.

    Args:
        name: the ``input_layout`` ("BSH", "BNSD", "SBH", "BSND" or "TND").
        shapes: the shapes of query, key and value.

    >>> check_layout_ranks("BSH", [(1, 8, 64)] * 3)
    """
    want = 4 if name in ("BNSD", "BSND") else 3
    for what, shape in zip(("query", "key", "value"), shapes):
        if len(shape) != want:
            raise ValueError(f"FlashAttentionScore: input_layout {name!r} takes {want}-D query, key and value, got "
                             f"a {len(shape)}-D {what} of shape {tuple(shape)}; build the primitive with the layout "
                             "of the tensors it is given (a context-parallel style that hands over [B, S, H] "
                             "tensors needs input_layout 'BSH')")


def _roles(schema: OpSchema, dims, heads: int, kv_heads: int) -> List[str]:
    """Per mesh dim: what the query's placement there means ("batch", "heads", "seq" or "whole")."""
    q = schema.args[_QUERY]
    batch, seq, head = dims
    mesh_shape = q.layout.mesh_shape
    roles = []
    for axis, p in enumerate(q.layout.normalized(q.ndim).placements):
        size = mesh_shape[axis]
        if batch is not None and p.is_shard(batch):
            roles.append("batch")
        elif p.is_shard(head) and heads % size == 0 and kv_heads % size == 0:
            roles.append("heads")
        elif seq is not None and p.is_shard(seq):
            roles.append("seq")
        else:
            roles.append("whole")
    return roles


def _placements(roles: List[str], on: Dict[str, Optional[int]]) -> List[Placement]:
    """Placements of an input whose dims for each role are ``on`` (None: not cut by that role)."""
    return [Shard(on[r]) if on.get(r) is not None else Replicate() for r in roles]


def _mask_dims(arg: Optional[TensorArg], q_len: int, heads: int, batch: int, compressed: bool):
    """The (batch, heads, rows) dims of a mask / shift / dropout mask ``arg`` that follow the query."""
    if arg is None or compressed:
        return {}
    nd = arg.ndim
    shape = arg.shape
    out: Dict[str, Optional[int]] = {"seq": nd - 2 if nd >= 2 and shape[nd - 2] == q_len else None}
    if nd == 4:
        out["batch"] = 0 if shape[0] == batch and batch > 1 else None
        out["heads"] = 1 if shape[1] == heads and heads > 1 else None
    return out


@register_sharding("FlashAttentionScore")
def flash_attention_score_rule(schema: OpSchema) -> OutputSharding:
    """See the module docstring."""
    args = schema.args
    q, k, v = args[_QUERY], args[_KEY], args[_VALUE]
    name = _layout_name(args[_LAYOUT])
    check_layout_ranks(name, (q.shape, k.shape, v.shape))
    dims = LAYOUT_DIMS[name]
    batch_dim, seq_dim, head_dim = dims
    heads = int(args[_HEAD_NUM])
    kv_heads = k.shape[head_dim] if name in ("BNSD", "BSND", "TND") else heads * k.shape[head_dim] // q.shape[head_dim]
    roles = _roles(schema, dims, heads, kv_heads)
    sparse = int(args[_SPARSE])
    q_len = q.shape[seq_dim] if seq_dim is not None else q.shape[0]
    kv_len = k.shape[seq_dim] if seq_dim is not None else k.shape[0]
    batch = q.shape[batch_dim] if batch_dim is not None else 1
    if "seq" in roles and sparse > 4:
        band_for_rows(sparse, 0, 0, 0, 0, 0, 0)           # refuses, naming the mode
    mesh_shape = q.layout.mesh_shape
    qkv_on = {"batch": batch_dim, "heads": head_dim, "seq": seq_dim}
    q_need = layout_like(q.layout, _placements(roles, qkv_on), ndim=q.ndim)
    kv_need = layout_like(q.layout, _placements(roles, {"batch": batch_dim, "heads": head_dim}), ndim=k.ndim)
    inputs: List[Optional[object]] = [None] * len(args)
    inputs[_QUERY], inputs[_KEY], inputs[_VALUE] = q_need, kv_need, kv_need
    compressed_mask = sparse in (2, 3, 4)
    for index, compressed in ((_SHIFT, False), (_DROP, False), (_MASK, compressed_mask)):
        arg = args[index]
        if isinstance(arg, TensorArg):
            on = _mask_dims(arg, q_len, heads, batch, compressed)
            if index == _SHIFT and "seq" in roles and on.get("seq") is None:
                raise NotImplementedError(f"FlashAttentionScore with a sequence-sharded query and a real_shift of "
                                          f"shape {arg.shape} (ALiBi's compressed rows): gather the query's sequence")
            inputs[index] = layout_like(q.layout, _placements(roles, on), ndim=arg.ndim)
    for index in range(len(args)):
        if isinstance(args[index], TensorArg) and inputs[index] is None:
            inputs[index] = replicate_all(q.layout)
    stats_shape = (q.shape[0], heads, 8) if name == "TND" else (batch, heads, q_len, 8)
    stats_on = {"heads": 1} if name == "TND" else {"batch": 0, "heads": 1, "seq": 2}
    stats = layout_like(q.layout, _placements(roles, stats_on), ndim=len(stats_shape))
    outputs = ((stats, stats_shape), (stats, stats_shape), (replicate_all(q.layout), ()), (q_need, q.shape))
    head_shards = 1
    for axis, role in enumerate(roles):
        head_shards *= mesh_shape[axis] if role == "heads" else 1
    if head_shards == 1 and "seq" not in roles:
        return OutputSharding(tuple(inputs), outputs)
    pre, nxt = int(args[_PRE]), int(args[_NEXT])

    def local_args(coord):
        new = [None] * len(args)
        new[_HEAD_NUM] = heads // head_shards
        if "seq" in roles:
            offset = q_need.global_offset(q.shape, coord)[seq_dim]
            rows = q_need.local_shape(q.shape, coord)[seq_dim]
            new[_SPARSE], new[_PRE], new[_NEXT] = band_for_rows(sparse, pre, nxt, offset, rows, q_len, kv_len)
        return new
    return OutputSharding(tuple(inputs), outputs, local_args=local_args)
