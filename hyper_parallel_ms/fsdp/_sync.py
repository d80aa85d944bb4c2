"""The gradient side of fully_shard, shared by every backward (PyNative and compiled).

:func:`reduce_gradient` reduces a gathered gradient to this rank's part: reduce-scatter
averaged over the shard mesh dim (``"reduce_scatter"``, ZeRO-2/3) or all-reduce then keep
this rank's slot (``"all_reduce"``, ZeRO-1), or all-reduce (``"replicated"``: a parameter
kept whole), then all-reduce averaged over the replicate dim (HSDP). :class:`SyncState` holds
the switches every backward of a unit reads when it runs.

Example::

    state = SyncState()
    g = reduce_gradient(dout, piece, mesh, 0, None, state.grad_scale, "reduce_scatter")
"""
from __future__ import annotations

from typing import Any, Callable, Optional


from .. import comm
from ..comm._tensor import narrow, owned_copy

__all__ = ["SyncState", "cast_to", "reduce_gradient", "reduce_over_shard", "reduce_over_replicas"]


def cast_to(x, dtype: Any):
    """``x`` in ``dtype`` (``None``: unchanged).

    Args:
        x: a tensor.
        dtype: the dtype wanted, or ``None``.

    Example::

        cast_to(piece, ms.bfloat16)
    """
    return x if dtype is None or x.dtype == dtype else x.astype(dtype)


def reduce_over_shard(g, mesh, shard_dim: Optional[int], reduce: str, rows: int = 0, start: int = 0,
                      op: str = "avg"):
    """A full (or flat) gradient reduced (``op``: ``"avg"`` or ``"sum"``) over the shard mesh dim to this
    rank's part: ``"reduce_scatter"`` (dim 0), ``"all_reduce"`` (then this rank's ``rows`` rows from
    ``start``, ZeRO-1) or ``"replicated"`` (all-reduce, the whole gradient); ``shard_dim`` ``None``: unchanged.

    Example::

        g = reduce_over_shard(dout, mesh, 0, "reduce_scatter")
    """
    if shard_dim is None:
        return g
    if reduce == "reduce_scatter":
        return comm.reduce_scatter(g, mesh, shard_dim, dim=0, op=op)
    if reduce == "all_reduce":
        return narrow(comm.all_reduce(g, mesh, shard_dim, op=op), 0, start, rows)
    return comm.all_reduce(g, mesh, shard_dim, op=op)


def reduce_over_replicas(g, like, mesh, replicate_dim: Optional[int], grad_scale: float, op: str = "avg"):
    """This rank's part of a gradient (:func:`reduce_over_shard`) reduced (``op``) over the HSDP replicate
    dim (``None``: none), scaled by ``grad_scale`` and cast to ``like``'s dtype.

    Example::

        g = reduce_over_replicas(part, piece, mesh, 0, 1.0)
    """
    if replicate_dim is not None:
        g = comm.all_reduce(g, mesh, replicate_dim, op=op)
    if grad_scale != 1.0:
        g = g * grad_scale
    return g if g.dtype == like.dtype else g.astype(like.dtype)     # (``is None`` on a dtype fails in graphs)


def reduce_gradient(g, like, mesh, shard_dim: Optional[int], replicate_dim: Optional[int], grad_scale: float,
                    reduce: str, rows: int = 0, start: int = 0, op: str = "avg"):
    """A full (or flat) gradient reduced to this rank's part, as every backward of fully_shard does it,
    PyNative and compiled: :func:`reduce_over_shard`, then :func:`reduce_over_replicas`.

    Args:
        g: the gradient, in the reduce dtype.
        like: the tensor whose dtype the result takes (the piece).
        mesh: the data-parallel mesh.
        shard_dim: the mesh dim the parameter is sharded over (``None``: nothing to reduce there).
        replicate_dim: the HSDP replicate mesh dim (``None``: none).
        grad_scale: a factor applied after averaging.
        reduce: ``"reduce_scatter"``, ``"all_reduce"`` or ``"replicated"``.
        rows: with ``"all_reduce"``, the rows of this rank's slot.
        start: with ``"all_reduce"``, its first row (a plain int: compiled code cannot compute it from
            the mesh).
        op: ``"avg"`` (default) or ``"sum"`` (:attr:`SyncState.reduce_op`).

    Example::

        g = reduce_gradient(dout, piece, mesh, 0, None, 1.0, "reduce_scatter")
    """
    g = reduce_over_shard(g, mesh, shard_dim, reduce, rows, start, op)
    return reduce_over_replicas(g, like, mesh, replicate_dim, grad_scale, op)


class SyncState:
    """Shared switches of one sharded Cell: gradient sync on/off (off: backward passes add the
    unreduced gradient to a local accumulator and send nothing; the next synchronised one reduces
    the sum once), the HSDP all-reduce over replicas on/off (off: backward passes reduce-scatter
    and add their part to a local accumulator; the next one with it on all-reduces the sum once),
    scale, divide factor and reduce dtype.

    Example::

        SyncState(reduce_dtype=ms.float32).sync       # True
    """

    def __init__(self, *, reduce_dtype: Any = None, grad_scale: float = 1.0) -> None:
        self.sync = True
        self.all_reduce = True
        self.reduce_dtype = reduce_dtype
        self.grad_scale = grad_scale
        self.divide_factor: Optional[float] = None      # FSDP2's gradient divide factor (None: the mesh size)
        self.force_sum = False                          # FSDP2's force_sum_reduction_for_comms
        self.all_reduce_hook: Optional[Callable] = None  # FSDP2's: called on each reduced gradient (PyNative)

    def hooked(self, g):
        """``g`` (a reduced gradient) after the all-reduce hook: the hook's result, or ``g`` itself
        where the hook changed it in place and returned ``None`` (FSDP2's signature)."""
        if self.all_reduce_hook is None:
            return g
        # a tensor owning its memory: the reduced gradient may be a view, and MindSpore's CPU in-place
        # copy into a view with an offset does nothing (a warning) or fails on the storage's size
        g = owned_copy(g)
        out = self.all_reduce_hook(g)
        return g if out is None else out

    @property
    def reduce_op(self) -> str:
        """The op every reduction of the unit sends: ``"avg"``, or ``"sum"`` with :attr:`force_sum`
        (the division then comes from :meth:`scale_for`)."""
        return "sum" if self.force_sum else "avg"

    def scale_for(self, mesh) -> float:
        """The factor applied to gradients reduced over ``mesh`` with :attr:`reduce_op`: ``grad_scale``,
        divided by ``divide_factor`` (or the mesh size) after a sum, times ``mesh.size() / divide_factor``
        after an average."""
        if self.force_sum:
            return self.grad_scale / (mesh.size() if self.divide_factor is None else self.divide_factor)
        if self.divide_factor is None:
            return self.grad_scale
        return self.grad_scale * mesh.size() / self.divide_factor
