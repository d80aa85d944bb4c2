"""Broadcast with the SPMD backward, on either path.

Forward: every rank receives the source rank's tensor, natively (``ops.Broadcast``) or
composed (non-source ranks add zeros to an all-reduce sum, :func:`._tensor.slot_zeros`). Backward: the source
receives the sum of every rank's gradient, the others zero. MindSpore's own backward of
``ops.Broadcast`` passes each rank's gradient through, so both paths use this Cell's
``bprop``, which works in PyNative and inside ``ms.jit``. On non-source ranks the
backward all-reduce is tied to the (zero) result with ``ops.depend`` so that graph
compilation cannot drop it and leave the source's all-reduce without partners.

Example (group ``g``, source = group rank 0)::

    y = broadcast(x, 0, g, native=False)
"""
from __future__ import annotations


import mindspore as ms
from mindspore import nn, ops

from .._mindspore import cell_per_call_site, off_meta_device
from ._exact import place_over, sum_over
from ._tensor import slot_zeros

__all__ = ["broadcast"]


class _Broadcast(nn.Cell):
    """One broadcast configuration: (source group rank, group, path) seen from this rank."""

    def __init__(self, src: int, group, native: bool) -> None:
        super().__init__()
        self.is_src = group.rank == src
        self.group = group
        self.native = native
        self.prim = ops.Broadcast(group.ranks[src], group.name) if native else None
        # whether this rank sends, as a Parameter rather than a Python branch: every rank then
        # compiles the same graph (a constant zero buffer could be folded and its all-reduce
        # scheduled before the rank's other collectives, out of step with the source)
        # (on the process's device even when first built inside a meta-device block: the Cell is cached)
        with off_meta_device():
            self.sends = ms.Parameter(ms.Tensor(group.rank == src), name=f"hpms_broadcast_{group.name}_{src}_sends",
                                      requires_grad=False)

    def construct(self, x):
        if self.native:
            if x.dtype == ms.bool_:                      # HCCL moves bool as uint8
                return self.prim((x.astype(ms.uint8),))[0].astype(ms.bool_)
            return self.prim((x,))[0]
        if x.dtype == ms.bfloat16:           # no bfloat16 Select on CPU: chosen in float32, exactly
            chosen = ops.select(self.sends, x.astype(ms.float32), slot_zeros(x.shape, ms.float32))
            return place_over(chosen.astype(ms.bfloat16), self.group)
        return place_over(ops.select(self.sends, x, slot_zeros(x.shape, x.dtype)), self.group)

    def bprop(self, x, out, dout):
        total = sum_over(dout, self.group)
        if self.is_src:
            return (total,)
        return (ops.depend(ops.zeros(total.shape, total.dtype), total),)


@cell_per_call_site
def _cell(src: int, group, native: bool) -> _Broadcast:
    return _Broadcast(src, group, native)


def broadcast(x, src: int, group, native: bool):
    """Every rank receives the tensor of group rank ``src``."""
    return _cell(src, group, native)(x)
