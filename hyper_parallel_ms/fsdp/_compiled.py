"""fully_shard inside ms.jit and GRAPH_MODE: parameters gathered where the Cell reads them.

The PyNative engine swaps gathered values into a Cell's parameter table in forward hooks;
a compiled graph cannot have its Parameters replaced by computed values that way. Here
each Cell holding a fully_shard parameter gets a subclass (:func:`gathering_class`) in
which the parameter's attribute is a property: in PyNative it returns what the table
holds (the piece, or the full value the hooks installed), and while MindSpore compiles it
returns the piece passed through a :class:`GatherParameter` / :class:`PassReplicated`
Cell, so the graph itself all-gathers each parameter where it is read and reduces its
gradient to the piece in the backward (reduce-scatter averaged over the shard dim, then
all-reduce averaged over the replicate dim). The table keeps the piece, so the optimizer,
``parameters_and_names`` and checkpoints see the same Parameters in every mode.

Differences from the PyNative engine, all decided by MindSpore's compiler: one all-gather
per parameter read (no per-Cell flat buffer or buckets); whether a gathered value stays
alive for the backward is the compiler's choice (``reshard_after_forward`` is not
applied). What cannot be compiled is refused while compiling, naming the fix: backward
passes without gradient sync (accumulate the returned, reduced gradients instead: their
sum equals the big batch's), and the input / output casts of a mixed-precision policy.

Example::

    fully_shard(model.layers[0], mesh=mesh); fully_shard(model, mesh=mesh)
    step = ms.jit(ms.value_and_grad(loss_fn, None, model.trainable_params()))
"""
from __future__ import annotations

from typing import Any, Dict, Optional, Sequence, Tuple

from mindspore import mint, nn, ops

from .. import comm
from .._mindspore import cell_subclass, run_in_python, running_eagerly
from ..comm._tensor import narrow, pad_dim
from ..layout import chunk_sizes

__all__ = ["GatherParameter", "PassReplicated", "gathering_class", "GATHER_PREFIX", "finish_gradient"]

GATHER_PREFIX = "_hpms_fsdp_gather_"
_CLASSES: Dict[Tuple[type, Tuple[str, ...]], type] = {}


def finish_gradient(g, like, mesh, replicate_dim: Optional[int], grad_scale: float):
    """The last steps of every reduced gradient: average over the replicas (HSDP), scale,
    cast to the piece's dtype."""
    if replicate_dim is not None:
        g = comm.all_reduce(g, mesh, replicate_dim, op="avg")
    if grad_scale != 1.0:
        g = g * grad_scale
    return g if g.dtype == like.dtype else g.astype(like.dtype)


@run_in_python
def _check_compiled(state) -> bool:
    """Run while MindSpore compiles a gathered parameter: refuse what a graph cannot do."""
    state.check_compilable()
    return True


class _CompiledParameter(nn.Cell):
    """Shared parts of the two compiled parameter Cells (the FSDPState is kept as a plain attribute)."""

    def __init__(self, state, mesh, replicate_dim: Optional[int], param_dtype: Any) -> None:
        super().__init__()
        object.__setattr__(self, "_hpms_state", state)
        self.mesh, self.replicate_dim, self.param_dtype = mesh, replicate_dim, param_dtype

    def _cast_in(self, x):
        return x if self.param_dtype is None or x.dtype == self.param_dtype else x.astype(self.param_dtype)

    def _cast_reduce(self, dout):
        dtype = self._hpms_state.sync.reduce_dtype
        return dout if dtype is None or dout.dtype == dtype else dout.astype(dtype)


class GatherParameter(_CompiledParameter):
    """Forward: the full parameter from this rank's dim-0 piece (``torch.chunk`` sizes over the
    shard dim). Backward: the gradient reduced to the piece (``"reduce_scatter"``; or
    ``"all_reduce"`` then this rank's rows, ZeRO-1).

    Example::

        full = GatherParameter(state, mesh, 0, None, (7, 8), None, "reduce_scatter")(piece)   # (7, 8)
    """

    def __init__(self, state, mesh, shard_dim: int, replicate_dim: Optional[int], shape: Sequence[int],
                 param_dtype: Any, reduce: str) -> None:
        super().__init__(state, mesh, replicate_dim, param_dtype)
        n = mesh.size(shard_dim)
        self.shard_dim, self.reduce = shard_dim, reduce
        self.sizes = chunk_sizes(shape[0], n)
        self.rows = self.sizes[0]                     # torch.chunk: the first piece is the longest
        self.rank = mesh.get_local_rank(shard_dim)
        self.local = self.sizes[self.rank]
        self.total, self.padded = int(shape[0]), self.rows * n

    def construct(self, piece):
        _check_compiled(self._hpms_state)
        x = self._cast_in(piece)
        if self.local != self.rows:
            x = pad_dim(x, 0, 0, self.rows - self.local)
        full = comm.all_gather(x, self.mesh, self.shard_dim, dim=0)
        return full if self.padded == self.total else mint.narrow(full, 0, 0, self.total)

    def bprop(self, piece, out, dout):
        g = self._cast_reduce(dout)
        if self.padded != self.total:
            g = pad_dim(g, 0, 0, self.padded - self.total)
        if self.reduce == "reduce_scatter":
            g = comm.reduce_scatter(g, self.mesh, self.shard_dim, dim=0, op="avg")
        else:
            g = narrow(comm.all_reduce(g, self.mesh, self.shard_dim, op="avg"), 0, self.rank * self.rows, self.rows)
        if self.local != self.rows:
            g = mint.narrow(g, 0, 0, self.local)
        return (finish_gradient(g, piece, self.mesh, self.replicate_dim, self._hpms_state.sync.grad_scale),)


class PassReplicated(_CompiledParameter):
    """A parameter kept whole: forward cast to ``param_dtype``; backward all-reduce averaged over
    the data-parallel dims."""

    def __init__(self, state, mesh, shard_dim: Optional[int], replicate_dim: Optional[int],
                 param_dtype: Any) -> None:
        super().__init__(state, mesh, replicate_dim, param_dtype)
        self.shard_dim = shard_dim

    def construct(self, piece):
        _check_compiled(self._hpms_state)
        return self._cast_in(piece)

    def bprop(self, piece, out, dout):
        g = self._cast_reduce(dout)
        if self.shard_dim is not None:
            g = comm.all_reduce(g, self.mesh, self.shard_dim, op="avg")
        return (finish_gradient(g, piece, self.mesh, self.replicate_dim, self._hpms_state.sync.grad_scale),)


def _gathered(attr: str) -> property:
    gather = GATHER_PREFIX + attr

    def read(self):
        value = self._params[attr]
        if running_eagerly():
            return value
        return getattr(self, gather)(value)
    read.__name__ = attr
    return property(read, doc=f"``{attr}``: the full parameter (gathered from this rank's piece when compiled)")


def gathering_class(base: type, attrs: Sequence[str]) -> type:
    """A subclass of the Cell class ``base`` in which each of ``attrs`` is read through a
    property (the instance holds a ``GATHER_PREFIX + attr`` Cell for each)."""
    key = (base, tuple(sorted(attrs)))
    if key not in _CLASSES:
        namespace = {a: _gathered(a) for a in key[1]}
        namespace.update(__module__=base.__module__, __qualname__=base.__qualname__, _hpms_gathered=key[1])
        _CLASSES[key] = cell_subclass(base.__name__, (base,), namespace)
    return _CLASSES[key]
