"""Point-to-point kernels: ``dist_comm_isend_op(x, dst, group, tag)`` and ``dist_comm_irecv_op(buffer,
tag, src, group)`` (ranks in the group), the kernels behind ``mint.distributed.send`` / ``recv``,
return ``(tensor, handle)`` and run on CPU (MCCL, any group) where ``mint.distributed.send`` itself
fails (its own-rank check reads the group ``hccl_world_group``).

Example::

    p2p_send(x, 1, group_name)                  # on rank 0 of the group
    y = p2p_recv(ops.zeros_like(x), 0, group_name)   # on rank 1
"""
from __future__ import annotations

from typing import Callable, Tuple

from mindspore import Tensor

__all__ = ["p2p_send", "p2p_recv"]


def _p2p_kernels() -> Tuple[Callable, Callable]:
    """(isend, irecv) kernels; imported on first use so that a release without them fails here only."""
    from mindspore.ops.auto_generate.gen_ops_prim import dist_comm_irecv_op, dist_comm_isend_op
    return dist_comm_isend_op, dist_comm_irecv_op


def p2p_send(x: Tensor, dst: int, group: str) -> None:
    """Send ``x`` to rank ``dst`` of ``group``; returns when the kernel reports the send done."""
    _p2p_kernels()[0](x, dst, group, 0)[1].wait()


def p2p_recv(buffer: Tensor, src: int, group: str) -> Tensor:
    """Receive from rank ``src`` of ``group`` a tensor of ``buffer``'s shape and dtype (blocks until it arrives)."""
    out, handle = _p2p_kernels()[1](buffer, 0, src, group)
    handle.wait()
    return out
