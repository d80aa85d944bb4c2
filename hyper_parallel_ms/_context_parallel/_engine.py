"""The engine: attention of this rank's queries on the keys of every member of a ring, as one Cell
with its own backward (:class:`RingAttention`).

Two transports move the keys and values, chosen by the rotate method:

- ``"allgather"`` (Megatron-LM's and PyTorch's default): one all-gather of this member's keys and
  values; the blocks are computed from the gathered buffer in the ring's order. The backward keeps
  only the local shard (MindSpore keeps a custom-bprop Cell's inputs and outputs): it gathers
  again, and the key and value gradients of every member are reduce-scattered back at once.
- ``"alltoall"`` (PyTorch's name for its rotation): the keys and values pass from member to member
  with point-to-point ``send`` / ``recv`` (each step sends ``1 / size`` of the keys: the textbook
  ring), and in the backward their gradients travel with them, back to their owner after the last
  step. MindSpore has no point-to-point kernel inside compiled graphs here, so under ``ms.jit`` this
  method runs as ``"allgather"`` (same blocks, same order, same numbers).

Partial outputs are merged by log-sum-exp (:func:`._blocks.merge`); each block computes only the
rectangle of pairs its causal mask allows (:mod:`._schedule`). Inputs: ``q`` ``[B, Hq, Sq, D]``,
``k`` / ``v`` ``[B, Hkv, Sk, D | Dv]`` (every member the same ``Sk``), ``bias`` an additive
float32 key-padding mask ``[B | 1, Hq | 1, 1, Sk]`` (travelling with the keys), or a placeholder
when :attr:`RingSpec.has_bias` is False. Outputs: ``(out, lse)``, the attention (``q``'s dtype) and
its float32 log-sum-exp ``[B, Hq, Sq, 1]``.

Example::

    spec = RingSpec(mesh, 0, 2, mesh.get_local_rank(), "alltoall", tuple(q_pos), (tuple(p0), tuple(p1)),
                    True, 0.35, 1, False)
    out, lse = ring_attention(spec)(q, k, v, no_bias())
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Tuple

import numpy as np
from mindspore import Tensor, nn, ops
from mindspore.common import dtype as mstype

from .. import comm
from .._mindspore import cell_per_call_site, graph_of_its_own, one_autodiff_node, running_eagerly
from ..comm._tensor import pad_dim
from ._blocks import block_backward, block_forward, merge, neg_inf_like
from ._schedule import block_mask, ring_blocks

__all__ = ["RingSpec", "RingAttention", "ring_attention", "no_bias", "ROTATE_METHODS"]

ROTATE_METHODS = ("allgather", "alltoall")
_SKIP, _FULL, _MASKED = 0, 1, 2
_KINDS = {"skip": _SKIP, "full": _FULL, "masked": _MASKED}

# each use in a custom-bprop Cell calls a function object of its own (seam: graph_of_its_own)
_gather_forward = graph_of_its_own(comm.all_gather)
_gather_backward = graph_of_its_own(comm.all_gather)
_scatter_backward = graph_of_its_own(comm.reduce_scatter)


@dataclass(frozen=True)
class RingSpec:
    """Everything one :class:`RingAttention` computes with (hashable: one Cell per spec).

    Args:
        mesh: the mesh whose dim ``dim`` is the ring (any value when ``size`` is 1).
        dim: the ring's mesh dim.
        size: the ring's members.
        index: this rank's place in the ring.
        rotate: ``"allgather"`` or ``"alltoall"`` (see the module docstring).
        q_positions: the global positions of this rank's queries.
        kv_positions: the global positions of each member's keys.
        causal: mask out keys after the query's position.
        scale: the factor of the scores.
        groups: query heads per key head.
        has_bias: whether a key-padding bias travels with the keys.
    """

    mesh: Any
    dim: Any
    size: int
    index: int
    rotate: str
    q_positions: Tuple[int, ...]
    kv_positions: Tuple[Tuple[int, ...], ...]
    causal: bool
    scale: float
    groups: int
    has_bias: bool


def no_bias():
    """The placeholder bias of a call without a key-padding mask."""
    return ops.zeros((1, 1, 1, 1), mstype.float32)


def _rows(x, start: int, length: int):
    """``x[:, :, start:start + length]`` (indexing, not ``narrow``: MindSpore 2.10 failed to compile
    loops of view ops in a custom bprop, "The parameters number of the function is 4, but the number of
    provided arguments is 3")."""
    return x if start == 0 and length == x.shape[2] else x[:, :, start:start + length]


def _last(x, start: int, length: int):
    """``x[..., start:start + length]`` along dim 3 (indexing, as :func:`_rows`)."""
    return x if start == 0 and length == x.shape[3] else x[:, :, :, start:start + length]


def _splice(x, start: int, stop: int, middle):
    """``x`` with rows ``[start, stop)`` of dim 2 replaced by ``middle``."""
    if start == 0 and stop == x.shape[2]:
        return middle
    parts = []
    if start > 0:
        parts.append(_rows(x, 0, start))
    parts.append(middle)
    if stop < x.shape[2]:
        parts.append(_rows(x, stop, x.shape[2] - stop))
    return ops.cat(parts, 2)


def _mask_tensor(mesh, q_positions: np.ndarray, kv_positions: np.ndarray, block) -> Tensor:
    """The causal mask of a ``"masked"`` block (a (1, 1) stand-in for the others); on a simulated rank
    (a mesh whose exchange moves nothing: the dry run) a shape-only one, since only its shape counts
    there (a 32k sequence over cp = 4 would otherwise build a 256 MiB host mask per simulated rank)."""
    if block.kind != "masked":
        return Tensor(np.zeros((1, 1), bool))
    if mesh is not None and not mesh.exchange.moves:
        rows, cols = block.rows[1] - block.rows[0], block.cols[1] - block.cols[0]
        return mesh.exchange.placeholder(Tensor(np.zeros((1, 1), bool)), (rows, cols))
    return Tensor(block_mask(q_positions, kv_positions, block))


class RingAttention(nn.Cell):
    """Attention of this rank's queries on every ring member's keys and values; see the module
    docstring. Built by :func:`ring_attention`.

    Args:
        spec: the :class:`RingSpec`.
    """

    def __init__(self, spec: RingSpec) -> None:
        super().__init__()
        self.mesh, self.dim, self.size, self.index = spec.mesh, spec.dim, spec.size, spec.index
        self.p2p = spec.rotate == "alltoall" and spec.size > 1
        self.next, self.previous = (spec.index + 1) % spec.size, (spec.index - 1) % spec.size
        self.scale, self.groups, self.has_bias = spec.scale, spec.groups, spec.has_bias
        q_pos = np.asarray(spec.q_positions)
        kv_pos = [np.asarray(p) for p in spec.kv_positions]
        # the ring's steps, then (index ``size``) the whole block of the gathered keys, members in order
        blocks = ring_blocks(q_pos, kv_pos, spec.index, spec.causal)
        gathered = np.concatenate(kv_pos)
        blocks += ring_blocks(q_pos, (gathered,), 0, spec.causal)
        kv_pos.append(gathered)
        self.steps = tuple((b.member, b.rows[0], b.rows[1], b.cols[0], b.cols[1], _KINDS[b.kind]) for b in blocks)
        self.masks = tuple(_mask_tensor(spec.mesh, q_pos, kv_pos[len(kv_pos) - 1 if i == spec.size else b.member], b)
                           for i, b in enumerate(blocks))

    # ------------------------------------------------------------------ pieces of one block
    def _operands(self, kv, bias, step: int, offset: int, head: int):
        """The float32 keys, values and bias of block ``step`` from ``kv`` (keys and values side by
        side on the last dim, the keys' ``head`` first; the block's member at ``offset`` of dim 2)."""
        member, r0, r1, c0, c1, kind = self.steps[step]
        part = _rows(kv, offset + c0, c1 - c0).astype(mstype.float32)
        k, v = _last(part, 0, head), _last(part, head, part.shape[3] - head)
        b = _last(bias, offset + c0, c1 - c0) if self.has_bias else None
        return k, v, b, (self.masks[step] if kind == _MASKED else None)

    def _forward_block(self, out, lse, q, kv, bias, step: int, offset: int):
        member, r0, r1, c0, c1, kind = self.steps[step]
        k, v, b, blocked = self._operands(kv, bias, step, offset, q.shape[3])
        o, l = block_forward(_rows(q, r0, r1 - r0), k, v, self.scale, b, blocked, self.groups)
        o, l = merge(_rows(out, r0, r1 - r0), _rows(lse, r0, r1 - r0), o, l)
        return _splice(out, r0, r1, o), _splice(lse, r0, r1, l)

    def _backward_block(self, q, kv, bias, do, lse, delta, step: int, offset: int, sk: int):
        """``(dq, dkv)`` of block ``step``: ``dq`` over every row of ``q``, ``dkv`` over the ``sk``
        keys of the block's member (keys' and values' gradients side by side)."""
        member, r0, r1, c0, c1, kind = self.steps[step]
        k, v, b, blocked = self._operands(kv, bias, step, offset, q.shape[3])
        rows = r1 - r0
        dq, dk, dv = block_backward(_rows(q, r0, rows), k, v, _rows(do, r0, rows), _rows(lse, r0, rows),
                                    _rows(delta, r0, rows), self.scale, b, blocked, self.groups)
        return pad_dim(dq, 2, r0, q.shape[2] - r1), pad_dim(ops.cat((dk, dv), 3), 2, c0, sk - c1)

    def _shift(self, x):
        """PyNative: ``x`` sent to the next member, the previous member's received (even places send
        first, odd ones receive first, so that no send waits on a send)."""
        if self.index % 2 == 0:
            comm.send(x, self.mesh, self.dim, dst=self.next)
            return comm.recv(x, self.mesh, self.dim, src=self.previous)
        got = comm.recv(x, self.mesh, self.dim, src=self.previous)
        comm.send(x, self.mesh, self.dim, dst=self.next)
        return got

    def __call__(self, *args):
        if running_eagerly():          # PyNative: an op-level recompute policy keeps none of its ops' outputs
            with one_autodiff_node():
                return super().__call__(*args)
        return super().__call__(*args)

    # ------------------------------------------------------------------ forward
    def construct(self, q, k, v, bias):
        if self.p2p and running_eagerly():
            out, lse = self._ring_forward(q, k, v, bias)
        else:
            out, lse = self._gathered_forward(q, k, v, bias)
        return out.astype(q.dtype), lse

    def _start(self, q, v):
        b, h, sq, _ = q.shape
        return ops.zeros((b, h, sq, v.shape[3]), mstype.float32), neg_inf_like((b, h, sq, 1))

    def _gathered_forward(self, q, k, v, bias):
        kv = ops.cat((k, v), 3)
        if self.size > 1:
            kv = _gather_forward(kv, self.mesh, self.dim, dim=2)
            if self.has_bias:
                bias = _gather_forward(ops.stop_gradient(bias), self.mesh, self.dim, dim=3)
        out, lse = self._start(q, v)
        return self._forward_block(out, lse, q.astype(mstype.float32), kv, bias, self.size, 0)

    def _ring_forward(self, q, k, v, bias):
        kv = ops.cat((k, v), 3)
        qf = q.astype(mstype.float32)
        out, lse = self._start(q, v)
        for step in range(self.size):
            if step > 0:
                kv = self._shift(kv)
                if self.has_bias:
                    bias = self._shift(bias)
            if self.steps[step][5] != _SKIP:
                out, lse = self._forward_block(out, lse, qf, kv, bias, step, 0)
        return out, lse

    # ------------------------------------------------------------------ backward
    def bprop(self, q, k, v, bias, out, dout):
        do = dout[0].astype(mstype.float32)
        lse = out[1]
        delta = (do * out[0].astype(mstype.float32)).sum(-1, keepdims=True)
        qf = q.astype(mstype.float32)
        if self.p2p and running_eagerly():
            dq, dkv = self._ring_backward(qf, k, v, bias, do, lse, delta)
        else:
            dq, dkv = self._gathered_backward(qf, k, v, bias, do, lse, delta)
        head = k.shape[3]
        dk, dv = _last(dkv, 0, head), _last(dkv, head, dkv.shape[3] - head)
        return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), ops.zeros_like(bias)

    def _gathered_backward(self, q, k, v, bias, do, lse, delta):
        kv = ops.cat((k, v), 3)
        if self.size > 1:
            kv = _gather_backward(kv, self.mesh, self.dim, dim=2)
            if self.has_bias:
                bias = _gather_backward(ops.stop_gradient(bias), self.mesh, self.dim, dim=3)
        dq, dkv = self._backward_block(q, kv, bias, do, lse, delta, self.size, 0, kv.shape[2])
        if self.size == 1:
            return dq, dkv
        return dq, _scatter_backward(dkv, self.mesh, self.dim, dim=2)

    def _ring_backward(self, q, k, v, bias, do, lse, delta):
        sk = k.shape[2]
        kv = ops.cat((k, v), 3)
        dq = ops.zeros(q.shape, mstype.float32)
        dkv = ops.zeros(k.shape[:3] + (k.shape[3] + v.shape[3],), mstype.float32)
        for step in range(self.size):
            if step > 0:
                kv, dkv = self._shift(kv), self._shift(dkv)
                if self.has_bias:
                    bias = self._shift(bias)
            if self.steps[step][5] != _SKIP:
                dq_b, dkv_b = self._backward_block(q, kv, bias, do, lse, delta, step, 0, sk)
                dq, dkv = dq + dq_b, dkv + dkv_b
        return dq, self._shift(dkv)          # after the last step each gradient goes home


@cell_per_call_site
def ring_attention(spec: RingSpec) -> RingAttention:
    """The :class:`RingAttention` of ``spec`` (one per spec; one per call site while MindSpore
    compiles a graph PyNative differentiates).

    Example::

        out, lse = ring_attention(spec)(q, k, v, no_bias())
    """
    return RingAttention(spec)
