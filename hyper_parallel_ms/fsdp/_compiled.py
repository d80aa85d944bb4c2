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

from mindspore import mint, nn

from .. import comm
from .._mindspore import cell_subclass, run_in_python, running_eagerly
from ..comm._tensor import pad_dim
from ._chunks import Chunks
from ._flat import padded_piece
from ._sync import cast_to, reduce_gradient

__all__ = ["GatherParameter", "PassReplicated", "gathering_class", "GATHER_PREFIX"]

GATHER_PREFIX = "_hpms_fsdp_gather_"
_CLASSES: Dict[Tuple[type, Tuple[str, ...]], type] = {}


@run_in_python
def _check_compiled(state) -> bool:
    """Run while MindSpore compiles a gathered parameter: refuse what a graph cannot do."""
    state.check_compilable()
    return True


class _CompiledParameter(nn.Cell):
    """Shared parts of the two compiled parameter Cells (the FSDPState is kept as a plain attribute);
    their backward is :func:`._sync.reduce_gradient`, as in PyNative."""

    def __init__(self, state, mesh, shard_dim: Optional[int], replicate_dim: Optional[int], param_dtype: Any,
                 reduce: str, rows: int = 0) -> None:
        super().__init__()
        object.__setattr__(self, "_hpms_state", state)
        self.mesh, self.shard_dim, self.replicate_dim = mesh, shard_dim, replicate_dim
        self.param_dtype, self.reduce, self.rows = param_dtype, reduce, rows

    def _reduced(self, g, piece):
        sync = self._hpms_state.sync
        return reduce_gradient(cast_to(g, sync.reduce_dtype), piece, self.mesh, self.shard_dim, self.replicate_dim,
                               sync.grad_scale, self.reduce, self.rows)


class GatherParameter(_CompiledParameter):
    """Forward: the full parameter from this rank's dim-0 piece (its :class:`Chunks`).
    Backward: the gradient reduced to the piece (``"reduce_scatter"``; or ``"all_reduce"``
    then this rank's rows, ZeRO-1).

    Example::

        full = GatherParameter(state, mesh, 0, None, Chunks((7, 8), 2, 0), None, "reduce_scatter")(piece)  # (7, 8)
    """

    def __init__(self, state, mesh, shard_dim: int, replicate_dim: Optional[int], chunks: Chunks,
                 param_dtype: Any, reduce: str) -> None:
        super().__init__(state, mesh, shard_dim, replicate_dim, param_dtype, reduce, chunks.rows)
        self.chunks = chunks

    def construct(self, piece):
        _check_compiled(self._hpms_state)
        full = comm.all_gather(padded_piece(cast_to(piece, self.param_dtype), self.chunks), self.mesh,
                               self.shard_dim, dim=0)
        chunks = self.chunks
        return full if chunks.padded == chunks.shape[0] else mint.narrow(full, 0, 0, chunks.shape[0])

    def bprop(self, piece, out, dout):
        chunks = self.chunks
        g = dout if chunks.padded == chunks.shape[0] else pad_dim(dout, 0, 0, chunks.padded - chunks.shape[0])
        g = self._reduced(g, piece)
        return (g if not chunks.padding else mint.narrow(g, 0, 0, chunks.local),)


class PassReplicated(_CompiledParameter):
    """A parameter kept whole: forward cast to ``param_dtype``; backward all-reduce averaged over
    the data-parallel dims."""

    def __init__(self, state, mesh, shard_dim: Optional[int], replicate_dim: Optional[int],
                 param_dtype: Any) -> None:
        super().__init__(state, mesh, shard_dim, replicate_dim, param_dtype, "replicated")

    def construct(self, piece):
        _check_compiled(self._hpms_state)
        return cast_to(piece, self.param_dtype)

    def bprop(self, piece, out, dout):
        return (self._reduced(dout, piece),)


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
