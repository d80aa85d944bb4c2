"""The two differentiable steps of a sharded group, as Cells with an explicit backward.

:class:`GatherPieces` all-gathers the flat pieces in the forward (in ``param_dtype``) and
reduces the gradient in its backward: reduce-scatter averaged over the shard mesh dim
(``"reduce_scatter"``, ZeRO-2/3) or all-reduce then keep this rank's slot
(``"all_reduce"``, ZeRO-1), then all-reduce averaged over the replicate dim (HSDP).
:class:`SyncReplicas` passes replicated parameters through and all-reduces their gradient
averaged over the data-parallel dims. Both read :class:`SyncState` when the backward
runs: with ``sync`` off they add the unreduced gradient to a local accumulator and send
nothing; the next synchronised backward reduces accumulator plus gradient once.

Example::

    state = SyncState()
    gather = GatherPieces(mesh, shard_dim=0, replicate_dim=None, state=state)
    full_flat = gather(flat_pieces)        # (n * L,): every rank's pieces
"""
from __future__ import annotations

from typing import Any, Optional

from mindspore import nn, ops

from .. import comm
from ..comm._tensor import narrow

__all__ = ["SyncState", "GatherPieces", "SyncReplicas"]


class SyncState:
    """Shared switches of one sharded Cell: gradient sync on/off, scale and reduce dtype."""

    def __init__(self, *, reduce_dtype: Any = None, grad_scale: float = 1.0) -> None:
        self.sync = True
        self.reduce_dtype = reduce_dtype
        self.grad_scale = grad_scale


class _Reducing(nn.Cell):
    """Shared backward bookkeeping: cast, accumulate while not syncing, scale."""

    def __init__(self, mesh, shard_dim: Optional[int], replicate_dim: Optional[int], state: SyncState,
                 param_dtype: Any) -> None:
        super().__init__()
        self.mesh, self.shard_dim, self.replicate_dim = mesh, shard_dim, replicate_dim
        self.state, self.param_dtype = state, param_dtype
        self.pending = None

    def _cast_in(self, x):
        return x if self.param_dtype is None or x.dtype == self.param_dtype else x.astype(self.param_dtype)

    def _gradient(self, dout):
        """The gradient to reduce now, or ``None`` while accumulating without sync."""
        g = dout if self.state.reduce_dtype is None else dout.astype(self.state.reduce_dtype)
        if self.pending is not None:
            g = self.pending + g
        if not self.state.sync:
            self.pending = g
            return None
        self.pending = None
        return g

    def _finish(self, g, like):
        if self.replicate_dim is not None:
            g = comm.all_reduce(g, self.mesh, self.replicate_dim, op="avg")
        if self.state.grad_scale != 1.0:
            g = g * self.state.grad_scale
        return g if g.dtype == like.dtype else g.astype(like.dtype)

    def clear(self) -> None:
        """Drop the accumulated, not yet reduced gradient."""
        self.pending = None


class GatherPieces(_Reducing):
    """Forward: all-gather flat pieces over the shard dim. Backward: reduce to the pieces."""

    def __init__(self, mesh, shard_dim: int, replicate_dim: Optional[int], state: SyncState, *,
                 param_dtype: Any = None, reduce: str = "reduce_scatter") -> None:
        super().__init__(mesh, shard_dim, replicate_dim, state, param_dtype)
        if reduce not in ("reduce_scatter", "all_reduce"):
            raise ValueError(f"reduce must be 'reduce_scatter' or 'all_reduce', got {reduce!r}")
        self.reduce = reduce
        self.rank = mesh.get_local_rank(shard_dim)

    def construct(self, x):
        return comm.all_gather(self._cast_in(x), self.mesh, self.shard_dim, dim=0)

    def bprop(self, x, out, dout):
        g = self._gradient(dout)
        if g is None:
            return (ops.zeros(x.shape, x.dtype),)
        if self.reduce == "reduce_scatter":
            g = comm.reduce_scatter(g, self.mesh, self.shard_dim, dim=0, op="avg")
        else:
            g = narrow(comm.all_reduce(g, self.mesh, self.shard_dim, op="avg"), 0, self.rank * x.shape[0],
                       x.shape[0])
        return (self._finish(g, x),)


class SyncReplicas(_Reducing):
    """Forward: identity (cast to ``param_dtype``). Backward: all-reduce averaged over the dp dims."""

    def construct(self, x):
        return self._cast_in(x)

    def bprop(self, x, out, dout):
        g = self._gradient(dout)
        if g is None:
            return (ops.zeros(x.shape, x.dtype),)
        if self.shard_dim is not None:
            g = comm.all_reduce(g, self.mesh, self.shard_dim, op="avg")
        return (self._finish(g, x),)
