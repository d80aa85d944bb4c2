"""``MultiheadAttentionParallel``: MindSpore's ``nn.MultiheadAttention`` with its heads split over
the tensor-parallel ranks.

``nn.MultiheadAttention`` keeps q, k and v in one fused ``in_proj_weight`` ``(3E, E)`` (rows
``[q; k; v]``) and reads ``out_proj.weight`` itself instead of calling ``out_proj``, so
``ColwiseParallel`` / ``RowwiseParallel`` on its children cannot split it. This style cuts it
as Megatron-LM cuts attention: each rank holds the rows of its heads in each of the q, k and v
blocks and the matching columns of ``out_proj``, computes its heads' attention on the replicated
input, and the output is reduced once, ``out_proj``'s bias added after the reduction.

The fused parameters are cut per block: ``in_proj_weight`` becomes the ``(3, E, E)`` parameter
(q, k and v stacked, ``Shard(1)``; ``reshape(3 * E, E)`` gives MindSpore's layout) and
``in_proj_bias`` ``(3, E)``, so that their sharding is an ordinary layout (checkpoints, gradient
norms and ``fully_shard`` see a plain ``Shard(1)`` parameter). Separate ``q/k/v_proj_weight``
(``kdim`` / ``vdim`` given) are cut by rows, ``bias_k`` / ``bias_v`` by features.

Example::

    parallelize_module(encoder, mesh["tp"], {"layers.*.self_attn": MultiheadAttentionParallel(),
                                             "layers.*.dense1": ColwiseParallel(),
                                             "layers.*.dense2": RowwiseParallel()})
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Optional

import mindspore as ms
from mindspore import Tensor, nn, ops

from .._mindspore import cell_subclass, run_in_python, running_eagerly
from ..placement import Partial, Placement, Replicate, Shard
from ..redistribute._gradient import gradient_placements, shared_dims
from ._adapter import own_parameters
from ._edit import ConversionSpec, InputSpec, ModuleEdit
from ._hooks import GradientSum, InputHook
from ._parallelize import ParallelStyle
from ._parameter import ParameterPlacement
from ._styles import _check_bool, _check_mesh, _one_placement, _where

__all__ = ["MultiheadAttentionParallel", "head_parallel_class"]


class MultiheadAttentionParallel(ParallelStyle):
    """Split ``mindspore.nn.MultiheadAttention`` by heads over a 1-D mesh (its ``num_heads``
    must divide by the mesh size): each rank keeps ``num_heads // tp`` heads (the Cell's
    ``num_heads`` becomes that count), their rows of each of the q, k and v blocks of
    ``in_proj_weight`` / ``in_proj_bias`` and their columns of ``out_proj.weight``; the output is
    reduced over the ranks and ``out_proj.bias`` added once after the reduction. ``batch_first``
    either way, unbatched inputs, ``attn_mask`` (2-D, or 3-D ``(batch * num_heads, L, S)`` for all
    heads as on one device), ``key_padding_mask``, ``add_bias_kv``, ``add_zero_attn`` and
    ``need_weights`` (averaged or per head, gathered) work in PyNative and under ``ms.jit``
    (compiled, q, k and v given as one tensor are converted apart: a gradient reduction each).
    Attention dropout (``dropout > 0`` in training) is refused: each rank
    would draw its heads' mask apart from one device's.

    ``in_proj_weight`` becomes a ``(3, E, E)`` parameter (q, k and v stacked; each rank holds
    ``(3, E // tp, E)``) and ``in_proj_bias`` ``(3, E)``: their checkpoints hold that shape
    (``reshape(3 * E, E)`` is MindSpore's fused layout).

    Args:
        input_layouts: the layout query, key and value arrive in (default ``Replicate()``;
            ``Shard(seq_dim)`` for sequence-parallel inputs, gathered first).
        output_layouts: the layout of the reduced output (default ``Replicate()``, an
            all-reduce; ``Shard(seq_dim)`` a reduce-scatter). Attention weights are always
            returned whole.
        use_local_output: return the local piece (default True); False returns a DTensor in
            PyNative.

    Example::

        parallelize_module(encoder, mesh["tp"], {"layers.*.self_attn": MultiheadAttentionParallel()})
    """

    def __init__(self, *, input_layouts: Optional[Placement] = None, output_layouts: Optional[Placement] = None,
                 use_local_output: bool = True) -> None:
        self.input_layouts = (_one_placement(input_layouts, "MultiheadAttentionParallel input_layouts",
                                             (Shard, Replicate), Replicate()),)
        self.output_layouts = (_one_placement(output_layouts, "MultiheadAttentionParallel output_layouts",
                                              (Shard, Replicate), Replicate()),)
        self.use_local_output = _check_bool(use_local_output, "use_local_output")

    def plan(self, path, cell, mesh, src_data_rank=0) -> List[ModuleEdit]:
        where = _where(path)
        _check_mesh(self, path, mesh)
        if not isinstance(cell, nn.MultiheadAttention):
            raise TypeError(f"MultiheadAttentionParallel supports mindspore.nn.MultiheadAttention; {where} is a "
                            f"{type(cell).__name__}")
        tp, heads, embed = mesh.size(), cell.num_heads, cell.embed_dim
        if heads % tp:
            raise ValueError(f"MultiheadAttentionParallel on {where}: its {heads} heads do not divide over the {tp} "
                             f"ranks of the mesh; use a mesh size dividing {heads}")
        local = heads // tp

        def cut(placement: Placement, view=None) -> ParameterPlacement:
            return ParameterPlacement(mesh, (placement,), src_data_rank=src_data_rank, view=view)
        params = own_parameters(cell)
        cuts: Dict[str, ParameterPlacement] = {}
        if cell._qkv_same_embed_dim:
            cuts["in_proj_weight"] = cut(Shard(1), (3, embed, embed))
        else:
            cuts.update({n: cut(Shard(0)) for n in ("q_proj_weight", "k_proj_weight", "v_proj_weight")})
        if params.get("in_proj_bias") is not None:
            cuts["in_proj_bias"] = cut(Shard(1), (3, embed))
        cuts.update({n: cut(Shard(2)) for n in ("bias_k", "bias_v") if params.get(n) is not None})

        desired = (Replicate(),)
        grad = gradient_placements(desired, shared_dims(desired, (Shard(0),)))   # each rank: its heads' share
        take = ConversionSpec(mesh, self.input_layouts, desired, grad, where=where)
        output_sharded = bool(shared_dims((Replicate(),), self.output_layouts))
        edit = ModuleEdit(path, cell, parameters=cuts, swap_class=head_parallel_class(type(cell)),
                          inputs=_SharedInputSpec({0: take, 1: take, 2: take}, where=where))
        edit.attributes.update(
            num_heads=local, hpms_heads=heads, hpms_head_start=mesh.coordinate[0] * local, hpms_where=where,
            hpms_out=ConversionSpec(mesh, (Partial(),), self.output_layouts, to_dtensor=not self.use_local_output,
                                    where=where),
            hpms_mean_weights=ConversionSpec(mesh, (Partial(),), (Replicate(),), where=where),
            hpms_head_weights=ConversionSpec(mesh, (Shard(-3),), (Replicate(),), where=where),
            # the bias added to sequence pieces meets this rank's piece only: its gradient is summed
            hpms_bias_sum=GradientSum(mesh) if output_sharded else nn.Identity())
        out_path = f"{path}.out_proj" if path else "out_proj"
        out = ModuleEdit(out_path, cell.out_proj, read_by=(cell,),
                         guarded_by=f"MultiheadAttentionParallel on {where} (its out_proj)")
        out.parameters["weight"] = cut(Shard(1))
        if own_parameters(cell.out_proj).get("bias") is not None:
            out.parameters["bias"] = cut(Replicate())
        return [edit, out]


@dataclass
class _SharedInputSpec(InputSpec):
    """Query, key and value converted alike; see :class:`_SharedInputHook`."""

    def build(self) -> InputHook:
        return _SharedInputHook({i: c.build() for i, c in self.conversions.items()}, self.max_inputs, self.min_ndim,
                                self.where)


class _SharedInputHook(InputHook):
    """An :class:`InputHook` whose conversions are all the same: in PyNative one tensor given in
    several positions (self-attention's ``(x, x, x)``) is converted once, so its gradient is reduced
    once; compiled code cannot tell and converts each (the same result, a reduction per position)."""

    def pre(self, cell, args):
        if running_eagerly():
            return self._convert_once(args)
        return self.convert_tuple(args)

    def _convert_once(self, args):
        done = []
        new = []
        for i, x in enumerate(args):
            if i < len(self.slots) and self.slots[i] >= 0:
                y = next((converted for given, converted in done if given is x), None)
                if y is None:
                    y = self.convs[self.slots[i]](x)
                    done.append((x, y))
                x = y
            new.append(x)
        return tuple(new)


@run_in_python
def _check_dropout(training: bool, p: float, where: str) -> bool:
    if training and p > 0:
        raise ValueError(f"MultiheadAttentionParallel on {where}: attention dropout (dropout={p}) in training would "
                         "draw each rank's mask for its own heads, not one device's mask cut by heads; build the "
                         "attention with dropout=0.0, or run it in eval mode")
    return True


def _pad_last(x: Tensor) -> Tensor:
    """``x`` with one zero (False) appended along its last dim (a bias or zero key's column)."""
    if x.dtype == ms.bool_:
        return ops.pad(x.astype(ms.int32), (0, 1)).astype(ms.bool_)
    return ops.pad(x, (0, 1))


def _heads_mask(mask: Tensor, bsz: int, heads: int, start: int, local: int, tgt: int, src: int) -> Tensor:
    """A 3-D mask ``(bsz * heads, tgt, src)`` for every head cut to this rank's ``local`` heads."""
    return mask.view((bsz, heads, tgt, src))[:, start:start + local].reshape((bsz * local, tgt, src))


def _construct(self, query, key, value, key_padding_mask=None, need_weights=True, attn_mask=None,
               average_attn_weights=True):
    _check_dropout(self.training, self.dropout, self.hpms_where)
    is_batched = query.ndim == 3
    if key_padding_mask is not None and key_padding_mask.dtype != ms.bool_ and \
            not ops.is_floating_point(key_padding_mask):
        raise ValueError("only bool and floating types of key_padding_mask are supported")
    if self.batch_first and is_batched:
        query, key, value = query.swapaxes(1, 0), key.swapaxes(1, 0), value.swapaxes(1, 0)
    if not is_batched:
        query, key, value = query.expand_dims(1), key.expand_dims(1), value.expand_dims(1)
        if key_padding_mask is not None:
            key_padding_mask = key_padding_mask.expand_dims(0)
    out, weights = self._hpms_heads(query, key, value, key_padding_mask, attn_mask)
    if not is_batched:
        out, weights = out.squeeze(1), weights.squeeze(0)
    if self.batch_first and is_batched:
        out = out.swapaxes(1, 0)
    conv = self.hpms_out
    if self.out_proj.bias is None:
        out = conv.finish(conv.move(out), out.shape)
    else:
        out = conv.finish(conv.move(out) + self.hpms_bias_sum(self.out_proj.bias), out.shape)
    if not need_weights:
        return (out,)
    if average_attn_weights:
        return out, self.hpms_mean_weights(weights.sum(axis=-3) / self.hpms_heads)
    return out, self.hpms_head_weights(weights)


def _heads(self, query, key, value, key_padding_mask, attn_mask):
    """This rank's heads of MindSpore's ``multi_head_attention_forward`` on ``(L, N, E)`` inputs:
    the output before the reduction over the ranks (``out_proj`` without bias, ``(L, N, E)``,
    partial) and the attention weights ``(N, local heads, L, S)``."""
    tgt_len, bsz, embed_dim = query.shape
    if embed_dim != self.embed_dim:
        raise ValueError(f"The `embed_dim` should be {self.embed_dim}, but got {embed_dim}.")
    heads, local, start, head_dim = self.hpms_heads, self.num_heads, self.hpms_head_start, self.head_dim
    if self._qkv_same_embed_dim:
        w_q, w_k, w_v = self.in_proj_weight[0], self.in_proj_weight[1], self.in_proj_weight[2]
    else:
        w_q, w_k, w_v = self.q_proj_weight, self.k_proj_weight, self.v_proj_weight
    b_q = b_k = b_v = None
    if self.in_proj_bias is not None:
        b_q, b_k, b_v = self.in_proj_bias[0], self.in_proj_bias[1], self.in_proj_bias[2]
    q, k, v = ops.dense(query, w_q, b_q), ops.dense(key, w_k, b_k), ops.dense(value, w_v, b_v)
    src_len = key.shape[0]
    if attn_mask is not None:
        if attn_mask.dtype == ms.uint8:
            attn_mask = attn_mask.astype(ms.bool_)
        elif not ops.is_floating_point(attn_mask) and attn_mask.dtype != ms.bool_:
            raise ValueError(f"`attn_mask` only support float, byte, and bool types, but got not {attn_mask.dtype}.")
        if attn_mask.ndim == 2:
            if attn_mask.shape != (tgt_len, src_len):
                raise ValueError(f"The shape of the `attn_mask` should be {(tgt_len, src_len)}, but got "
                                 f"{attn_mask.shape}.")
            attn_mask = attn_mask.expand_dims(0)
        elif attn_mask.ndim == 3:
            if attn_mask.shape != (bsz * heads, tgt_len, src_len):
                raise ValueError(f"The shape of the `attn_mask` should be {(bsz * heads, tgt_len, src_len)} (every "
                                 f"head, as on one device), but got {attn_mask.shape}.")
            attn_mask = _heads_mask(attn_mask, bsz, heads, start, local, tgt_len, src_len)
        else:
            raise ValueError(f"The ndim of `attn_mask` only support 2 or 3, but got {attn_mask.ndim}.")
    if self.bias_k is not None and self.bias_v is not None:
        k = ops.cat([k, self.bias_k.tile((1, bsz, 1))])
        v = ops.cat([v, self.bias_v.tile((1, bsz, 1))])
        if attn_mask is not None:
            attn_mask = _pad_last(attn_mask)
        if key_padding_mask is not None:
            key_padding_mask = _pad_last(key_padding_mask)
    q = q.view((tgt_len, bsz * local, head_dim)).swapaxes(0, 1)
    k = k.view((k.shape[0], bsz * local, head_dim)).swapaxes(0, 1)
    v = v.view((v.shape[0], bsz * local, head_dim)).swapaxes(0, 1)
    if self.add_zero_attn:
        zeros = ops.zeros((bsz * local, 1, head_dim), k.dtype)
        k, v = ops.cat([k, zeros], axis=1), ops.cat([v, zeros], axis=1)
        if attn_mask is not None:
            attn_mask = _pad_last(attn_mask)
        if key_padding_mask is not None:
            key_padding_mask = _pad_last(key_padding_mask)
    src_len = k.shape[1]
    if key_padding_mask is not None:
        if key_padding_mask.shape != (bsz, src_len):
            raise ValueError(f"The shape of `key_padding_mask` should be {(bsz, src_len)}, but got "
                             f"{key_padding_mask.shape}.")
        key_padding_mask = key_padding_mask.view((bsz, 1, 1, src_len)).tile((1, local, 1, 1)) \
            .reshape((bsz * local, 1, src_len))
        if attn_mask is None:
            attn_mask = key_padding_mask
        elif attn_mask.dtype == ms.bool_:
            attn_mask = attn_mask.logical_or(key_padding_mask)
        else:
            attn_mask = attn_mask + key_padding_mask
    if attn_mask is not None and attn_mask.dtype == ms.bool_:
        attn_mask = ops.zeros_like(attn_mask, dtype=q.dtype).masked_fill(attn_mask, float("-inf"))
    if attn_mask is not None:
        attn_mask = attn_mask.expand_dims(0) if attn_mask.shape[0] == 1 else \
            attn_mask.view((bsz, local, -1, src_len))
    q = q.view((bsz, local, tgt_len, head_dim))
    k = k.view((bsz, local, src_len, head_dim))
    v = v.view((bsz, local, src_len, head_dim))
    scale = ops.scalar_to_tensor(head_dim, self.dtype).sqrt().sqrt()
    weights = ops.matmul(q / scale, k.swapaxes(-2, -1) / scale)
    if attn_mask is not None:
        weights = weights + attn_mask
    weights = ops.softmax(weights, -1)
    out = ops.matmul(weights, v).transpose(2, 0, 1, 3).view((bsz * tgt_len, local * head_dim))
    out = ops.dense(out, self.out_proj.weight).view((tgt_len, bsz, embed_dim))
    return out, weights


def head_parallel_class(base: type) -> type:
    """A subclass of ``nn.MultiheadAttention`` (``base``) computing this rank's heads (the attributes
    :class:`MultiheadAttentionParallel` sets): its output reduced over the ranks, out_proj's bias added once.

    Example::

        attention.__class__ = head_parallel_class(type(attention))
    """
    cached = _HEAD_PARALLEL.get(base)
    if cached is None:
        cached = _HEAD_PARALLEL[base] = cell_subclass(base.__name__, (base,), {
            "construct": _construct, "_hpms_heads": _heads, "__module__": base.__module__,
            "__qualname__": base.__qualname__})
    return cached


_HEAD_PARALLEL: Dict[type, type] = {}
