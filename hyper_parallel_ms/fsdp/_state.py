"""FSDPState: what one fully_shard call keeps on its Cell, and its forward hooks.

The Cell's own parameters (those not already taken by a fully_shard call on a sub-Cell)
are split into groups; each group is one collective: a sharded group is flattened and
all-gathered by :class:`GatherPieces`, a replicated group passes through
:class:`SyncReplicas`. The pre-forward hook puts the gathered full values into the
Cells that hold the parameters, the post-forward hook puts the pieces back.

Example::

    state = FSDPState(cell, mesh, groups, sync_state, policy)
    state.register(changes)          # hooks and piece Parameters, undone if a later step fails
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, List, Optional, Sequence, Tuple

import mindspore as ms
from mindspore import Parameter, Tensor, nn

from .._mindspore import SAVED_TENSOR_HOOKS, recomputing, running_eagerly
from ..dtensor._spec import DTensorSpec
from ._chunks import Chunks
from ._flat import FlatLayout, concat_flat, split_flat
from ..nn._adapter import named_cells, put_parameter
from ._mesh import dp_mesh_dims
from ._dparams import as_placed
from ._pieces import DEFERRED
from ._policy import MixedPrecisionPolicy
from ._reshard import RegatherOnBackward
from ._sync import GatherPieces, SyncReplicas, SyncState

__all__ = ["Slot", "Group", "FSDPState", "eager_hooks"]


@dataclass
class Slot:
    """One parameter: where it is held (cell, attribute), its piece, its full shape (of this
    rank's local piece for a DTensor parameter), whether the piece is a dim-0 shard (else the
    whole parameter), its data-parallel mesh, the DTensor spec the gathered value is read
    with (``None``: a plain parameter, see :mod:`._dparams`) and its :class:`Chunks`."""

    holders: List[Tuple[nn.Cell, str]]
    piece: Parameter
    shape: Tuple[int, ...]
    sharded: bool = True
    mesh: Any = None
    placed: Optional[DTensorSpec] = None
    chunks: Optional[Chunks] = None      # where the dim-0 pieces lie (sharded slots)


class Group:
    """Parameters moved by one collective (sharded: all-gather; replicated: gradient all-reduce)."""

    def __init__(self, slots: Sequence[Slot], sharded: bool, mesh, sync: SyncState, param_dtype: Any,
                 reduce: str) -> None:
        self.slots, self.sharded = list(slots), sharded
        shard_dim, rep_dim = dp_mesh_dims(mesh)
        if sharded:
            self.flat = FlatLayout([s.chunks for s in self.slots])
            self.cell = GatherPieces(mesh, shard_dim, rep_dim, sync, param_dtype=param_dtype, reduce=reduce)
        else:
            self.flat = None
            self.cell = SyncReplicas(mesh, shard_dim if mesh.size(shard_dim) > 1 else None,
                                     rep_dim if rep_dim is not None and mesh.size(rep_dim) > 1 else None,
                                     sync, param_dtype)

    def gathered(self) -> Tuple[Any, list]:
        """The group's collective output (flat) and the full values cut from it."""
        pieces = [s.piece for s in self.slots]
        if self.sharded:
            flat = self.cell(self.flat.pack(pieces))
            return flat, self.flat.unpack(flat)
        shapes = [s.shape for s in self.slots]
        flat = self.cell(concat_flat(pieces, shapes))
        return flat, split_flat(flat, shapes)


_FLOATS = (ms.float16, ms.bfloat16, ms.float32, ms.float64)


def _cast_floats(values, dtype):
    if dtype is None:
        return values
    return tuple(v.astype(dtype) if isinstance(v, Tensor) and v.dtype in _FLOATS and v.dtype != dtype
                 else v for v in values)


class FSDPState:
    """The groups of one sharded Cell, its mixed-precision policy and its hooks."""

    def __init__(self, cell: nn.Cell, mesh, groups: Sequence[Group], sync: SyncState,
                 policy: MixedPrecisionPolicy, reshard_after_forward: Any) -> None:
        self.cell, self.mesh, self.groups, self.sync, self.policy = cell, mesh, list(groups), sync, policy
        self.reshard_after_forward = reshard_after_forward
        self.reshard_after_backward = True
        self.kept: Optional[list] = None       # values installed by unshard(), until reshard()
        self.deferred = True                   # until every piece is seen initialised
        self.checked = False                   # MindSpore's first-call checks of the Cells done
        self.compiled = False                  # a graph gathering this Cell's parameters was compiled
        self.saving: Optional[RegatherOnBackward] = None   # frees gathered values after the forward

    def _check_initialised(self, cell) -> None:
        waiting = [s.piece.name for s in self.slots if getattr(s.piece, DEFERRED, None) is not None]
        if waiting:
            raise RuntimeError(f"{type(cell).__name__} was built under no_init_parameters() and its parameters "
                               f"{waiting} are not initialised: call hyper_parallel_ms.init_parameters(model) "
                               "after fully_shard / hsdp and before the first forward")
        self.deferred = False

    @property
    def slots(self) -> List[Slot]:
        return [s for g in self.groups for s in g.slots]

    def _install(self, values: Sequence) -> None:
        for slot, value in zip(self.slots, values):
            value = as_placed(value, slot.placed)
            for holder, attr in slot.holders:
                put_parameter(holder, attr, value)

    def _restore(self) -> None:
        for slot in self.slots:
            for holder, attr in slot.holders:
                put_parameter(holder, attr, slot.piece)

    def gather(self) -> list:
        """The full values of every parameter of this Cell (one collective per group)."""
        return [v for g in self.groups for v in g.gathered()[1]]

    def _frees_after_forward(self) -> bool:
        # inside an activation checkpoint MindSpore keeps nothing and the recompute gathers again
        return (self.reshard_after_forward is not False and self.kept is None and SAVED_TENSOR_HOOKS
                and not recomputing())

    def _gather_for_forward(self) -> list:
        """:meth:`gather`; with ``reshard_after_forward`` the gathered values are kept for the
        backward as records and gathered again there (:mod:`._reshard`)."""
        if not self._frees_after_forward():
            return self.gather()
        if self.saving is None:
            self.saving = RegatherOnBackward(self.groups)
        self.saving.begin()
        try:
            gathered = [g.gathered() for g in self.groups]
        except BaseException:
            self.saving.end()
            raise
        self.saving.gathered([item if g.sharded else None for g, item in zip(self.groups, gathered)])
        return [v for _, values in gathered for v in values]

    def _first_call_checks(self) -> None:
        """Run MindSpore's first-call Cell checks (they walk the parameter tables and expect
        Parameters) while the pieces are in place."""
        for sub in named_cells(self.cell).values():
            if not getattr(sub, "_is_check_and_refresh", True):
                sub._self_check()
            if not getattr(sub, "_init_flag", True):
                sub._init_check()
        self.checked = True

    def check_compilable(self) -> None:
        """Called while ms.jit / GRAPH_MODE compiles a read of this Cell's parameters: refuse what
        a compiled graph cannot do (see :mod:`._compiled`), naming the fix."""
        name = type(self.cell).__name__
        if self.deferred:
            self._check_initialised(self.cell)
        if not self.sync.sync:
            raise NotImplementedError(
                f"{name}: gradient sync is off, but inside ms.jit / GRAPH_MODE every backward reduces the gradients "
                "(a compiled graph cannot keep unreduced ones between calls). Keep sync on and add up the returned "
                "gradients of the micro-steps (the same sum as one big batch), or run the micro-steps in PyNative")
        policy = self.policy
        if (policy.param_dtype is not None and policy.cast_forward_inputs) or policy.output_dtype is not None:
            raise NotImplementedError(
                f"{name}: the mixed-precision policy casts the Cell's inputs or outputs, which fully_shard does in "
                "PyNative forward hooks; inside ms.jit / GRAPH_MODE use MixedPrecisionPolicy(param_dtype=..., "
                "cast_forward_inputs=False) without output_dtype and cast inputs in the model, or run in PyNative")
        if self.kept is not None:
            raise RuntimeError(f"{name} holds gathered parameters from unshard(): call reshard() before compiling")
        placed = [s.piece.name for s in self.slots if s.placed is not None]
        if placed:
            raise NotImplementedError(
                f"{name}: the parameters {placed} are DTensors (shard_module / distribute_module), whose Cell computes "
                "through the DTensor dispatcher in PyNative only: run it in PyNative, or place the parameters with "
                "parallelize_module's styles to compile")
        self.compiled = True

    def pre_forward(self, cell, args):
        if self.deferred:
            self._check_initialised(cell)
        if not self.checked:
            self._first_call_checks()
        self._install(self._gather_for_forward())
        if self.policy.cast_forward_inputs and self.policy.param_dtype is not None:
            return _cast_floats(args, self.policy.param_dtype)
        return None

    def post_forward(self, cell, args, output):
        if self.saving is not None:
            self.saving.end()
        if self.kept is not None:
            self._install(self.kept)
        else:
            self._restore()
        dtype = self.policy.output_dtype
        if dtype is None:
            return None
        if isinstance(output, tuple):
            return _cast_floats(output, dtype)
        return _cast_floats((output,), dtype)[0]

    def unshard(self) -> None:
        self.kept = self.gather()
        self._install(self.kept)

    def reshard(self) -> None:
        self.kept = None
        self._restore()

    def clear_pending(self) -> None:
        for g in self.groups:
            g.cell.clear()


def eager_hooks(state: FSDPState):
    """``state``'s forward pre-hook and hook, doing nothing when MindSpore compiles them (inside a
    graph the parameters are gathered where they are read, :mod:`._compiled`)."""
    def pre(cell, args):
        if running_eagerly():
            return state.pre_forward(cell, args)
        return None

    def post(cell, args, output):
        if running_eagerly():
            return state.post_forward(cell, args, output)
        return None
    return pre, post
