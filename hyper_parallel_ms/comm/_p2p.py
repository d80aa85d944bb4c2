"""Point-to-point: ``send`` a tensor to one rank along a mesh dimension, ``recv`` it there.

Both run in PyNative only and have no backward (a pipeline runtime sends gradients itself,
as actions of its schedule). Ranks are indices along ``mesh_dim``, as ``broadcast``'s ``src``.
``recv`` blocks until the data arrive; ``send`` may return before the matching ``recv`` is
posted (MindSpore's CPU backend buffers it) or wait for it: order the calls so that neither
can deadlock, as :mod:`hyper_parallel_ms.pipelining` orders its actions. bool travels as uint8
(MCCL refuses bool). Every call is counted by ``CommDebugMode`` (``recv`` with 0 bytes sent)
and goes through the mesh's exchange (:mod:`._exchange`). On a cluster each call is counted by
the communication watchdog (:mod:`._watchdog`): a ``recv`` whose sender hangs or dies ends the
rank with a message naming the sender. On a simulated mesh nothing is sent: ``send`` is
recorded and handed to the simulation's exchange, ``recv`` returns what the exchange gives (by
default zeros of ``x``'s shape and dtype).

Example (2 ranks on a 1-D mesh)::

    if mesh.get_local_rank() == 0:
        send(x, mesh, dst=1)
    else:
        y = recv(ms.ops.zeros((2, 3), ms.float32), mesh, src=0)   # shape and dtype of what arrives
"""
from __future__ import annotations

from math import prod

import mindspore as ms

from .._mindspore import is_compiling
from .debug import CommRecord, record

__all__ = ["send", "recv"]


def _peer(kind: str, x, mesh, mesh_dim, peer: int, what: str):
    """The group, after checking the call; records it in active CommDebugModes and counts it
    on the mesh's exchange (on a cluster, for the watchdog)."""
    if is_compiling():
        raise NotImplementedError(f"{kind} runs in PyNative only (MindSpore's point-to-point calls have no "
                                  "graph-mode kernel here); call it outside ms.jit / GRAPH_MODE")
    if not isinstance(x, ms.Tensor):
        raise TypeError(f"{kind} needs a MindSpore Tensor, got {type(x).__name__}")
    group = mesh.comm_group(mesh_dim)
    n = group.size
    if isinstance(peer, bool) or not isinstance(peer, int) or not 0 <= peer < n or peer == group.rank:
        raise ValueError(f"{kind} {what} must be the index of another rank along mesh dim {mesh_dim!r} "
                         f"(0..{n - 1}, this rank is {group.rank}), got {peer!r}")
    names = mesh.mesh_dim_names
    index = mesh.dim_index(mesh_dim)
    dim_name = names[index] if names else str(index)
    sent = prod(x.shape) * x.itemsize if kind == "send" else 0
    record(CommRecord(kind, dim_name, n, "native", sent, sent, tuple(x.shape),
                      str(x.dtype), group=group.ranks, peer=group.ranks[peer]))
    mesh.exchange.count(kind, group, dim_name, peer)
    return group


def send(x, mesh, mesh_dim=0, *, dst: int) -> None:
    """Send ``x`` to the rank at index ``dst`` along ``mesh_dim`` (PyNative only, no backward).

    ``send`` may return before the matching :func:`recv` is posted or wait for it: order the
    calls of the ranks so that neither can deadlock.

    Args:
        x: the MindSpore Tensor to send (bool travels as uint8).
        mesh: the :class:`DeviceMesh`.
        mesh_dim: the name or index of the mesh dim the two ranks share (default 0).
        dst: the index, along ``mesh_dim``, of the receiving rank (not this rank).

    Example::

        if mesh.get_local_rank() == 0:
            send(x, mesh, dst=1)                 # rank 1 calls recv(..., src=0)
    """
    group = _peer("send", x, mesh, mesh_dim, dst, "dst")
    mesh.exchange.send(x, group, dst)


def recv(x, mesh, mesh_dim=0, *, src: int):
    """The tensor the rank at index ``src`` along ``mesh_dim`` sends; ``x`` gives its shape and
    dtype. Blocks until the data arrive (PyNative only, no backward).

    Args:
        x: a MindSpore Tensor of the shape and dtype of what arrives (its values are not used).
        mesh: the :class:`DeviceMesh`.
        mesh_dim: the name or index of the mesh dim the two ranks share (default 0).
        src: the index, along ``mesh_dim``, of the sending rank (not this rank).

    Returns:
        A new tensor holding the data sent by ``src``.

    Example::

        if mesh.get_local_rank() == 1:
            y = recv(ms.ops.zeros((2, 3), ms.float32), mesh, src=0)   # what rank 0 sent
    """
    group = _peer("recv", x, mesh, mesh_dim, src, "src")
    return mesh.exchange.recv(x, group, src)
