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

__all__ = ["SyncState", "GatherPieces", "SyncReplicas", "cast_to", "reduce_gradient"]


def cast_to(x, dtype: Any):
    """``x`` in ``dtype`` (``None``: unchanged).

    Args:
        x: a tensor.
        dtype: the dtype wanted, or ``None``.

    Example::

        cast_to(piece, ms.bfloat16)
    """
    return x if dtype is None or x.dtype == dtype else x.astype(dtype)


def reduce_gradient(g, like, mesh, shard_dim: Optional[int], replicate_dim: Optional[int], grad_scale: float,
                    reduce: str, rows: int = 0):
    """A full (or flat) gradient reduced to this rank's part, as every backward of fully_shard does it,
    PyNative and compiled: over the shard dim ``"reduce_scatter"`` (dim 0), ``"all_reduce"`` (then
    this rank's ``rows`` rows, ZeRO-1) or ``"replicated"`` (all-reduce, the whole gradient), each
    averaged; then averaged over the replicas (HSDP), scaled, and cast to ``like``'s dtype.

    Args:
        g: the gradient, in the reduce dtype.
        like: the tensor whose dtype the result takes (the piece).
        mesh: the data-parallel mesh.
        shard_dim: the mesh dim the parameter is sharded over (``None``: nothing to reduce there).
        replicate_dim: the HSDP replicate mesh dim (``None``: none).
        grad_scale: a factor applied after averaging.
        reduce: ``"reduce_scatter"``, ``"all_reduce"`` or ``"replicated"``.
        rows: with ``"all_reduce"``, the rows of this rank's slot.

    Example::

        g = reduce_gradient(dout, piece, mesh, 0, None, 1.0, "reduce_scatter")
    """
    if shard_dim is not None:
        if reduce == "reduce_scatter":
            g = comm.reduce_scatter(g, mesh, shard_dim, dim=0, op="avg")
        elif reduce == "all_reduce":
            g = narrow(comm.all_reduce(g, mesh, shard_dim, op="avg"), 0, mesh.get_local_rank(shard_dim) * rows, rows)
        else:
            g = comm.all_reduce(g, mesh, shard_dim, op="avg")
    if replicate_dim is not None:
        g = comm.all_reduce(g, mesh, replicate_dim, op="avg")
    if grad_scale != 1.0:
        g = g * grad_scale
    return g if g.dtype == like.dtype else g.astype(like.dtype)     # (``is None`` on a dtype fails in graphs)


class SyncState:
    """Shared switches of one sharded Cell: gradient sync on/off, scale and reduce dtype."""

    def __init__(self, *, reduce_dtype: Any = None, grad_scale: float = 1.0) -> None:
        self.sync = True
        self.reduce_dtype = reduce_dtype
        self.grad_scale = grad_scale


class _Reducing(nn.Cell):
    """Shared backward of the PyNative Cells: cast, accumulate while not syncing, reduce."""

    def __init__(self, mesh, shard_dim: Optional[int], replicate_dim: Optional[int], state: SyncState,
                 param_dtype: Any, reduce: str) -> None:
        super().__init__()
        self.mesh, self.shard_dim, self.replicate_dim = mesh, shard_dim, replicate_dim
        self.state, self.param_dtype, self.reduce = state, param_dtype, reduce
        self.pending = None

    def bprop(self, x, out, dout):
        g = cast_to(dout, self.state.reduce_dtype)
        if self.pending is not None:
            g = self.pending + g
        if not self.state.sync:
            self.pending = g
            return (ops.zeros(x.shape, x.dtype),)
        self.pending = None
        return (reduce_gradient(g, x, self.mesh, self.shard_dim, self.replicate_dim, self.state.grad_scale,
                                self.reduce, x.shape[0]),)

    def clear(self) -> None:
        """Drop the accumulated, not yet reduced gradient."""
        self.pending = None


class GatherPieces(_Reducing):
    """Forward: all-gather flat pieces over the shard dim. Backward: reduce to the pieces."""

    def __init__(self, mesh, shard_dim: int, replicate_dim: Optional[int], state: SyncState, *,
                 param_dtype: Any = None, reduce: str = "reduce_scatter") -> None:
        if reduce not in ("reduce_scatter", "all_reduce"):
            raise ValueError(f"reduce must be 'reduce_scatter' or 'all_reduce', got {reduce!r}")
        super().__init__(mesh, shard_dim, replicate_dim, state, param_dtype, reduce)

    def construct(self, x):
        return comm.all_gather(cast_to(x, self.param_dtype), self.mesh, self.shard_dim, dim=0)


class SyncReplicas(_Reducing):
    """Forward: identity (cast to ``param_dtype``). Backward: all-reduce averaged over the dp dims."""

    def __init__(self, mesh, shard_dim: Optional[int], replicate_dim: Optional[int], state: SyncState,
                 param_dtype: Any) -> None:
        super().__init__(mesh, shard_dim, replicate_dim, state, param_dtype, "replicated")

    def construct(self, x):
        return cast_to(x, self.param_dtype)
