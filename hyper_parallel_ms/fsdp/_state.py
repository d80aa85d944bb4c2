"""FSDPState: what one fully_shard / hsdp call keeps on its Cell (the unit), and the PyNative
driver: its forward hooks.

The unit's parameters are :class:`._param.FSDPParam` records in :class:`._group.FSDPParamGroup`
groups. The pre-forward hook gathers each group (one collective) and puts the full values into
the Cells holding the parameters; the post-forward hook puts the pieces back. Compiled code
does not run these hooks: there the parameters are gathered where they are read (:mod:`._compiled`).

Between the forward and the backward (``reshard_after_forward``): ``False`` keeps the gathered
values on the autodiff tape; ``True`` frees them and gathers again in the backward; an int ``k``
keeps ``1/k`` of them and gathers over groups of ``k`` ranks in the backward (:mod:`._reshard`).
After a backward without gradient sync, ``reshard_after_backward=False`` keeps the gathered
values for the next forward, which then gathers nothing (gradient accumulation without collectives).

Example::

    state = fsdp_state(block)
    state.groups[0].gathered()          # (flat buffer, full values), PyNative
"""
from __future__ import annotations

import copy
import threading
from typing import Any, Callable, Dict, List, Optional, Sequence, Set, Tuple

from mindspore import Tensor, nn

from .._mindspore import SAVED_TENSOR_HOOKS, recomputing, recording_gradients, run_first_call_checks, running_eagerly
from ..nn._adapter import held_parameter, put_parameter
from ._dparams import as_placed
from ._group import FSDPParamGroup
from ._param import FSDPParam
from ._policy import FLOATS, MixedPrecisionPolicy
from ._reshard import RegatherOnBackward
from ._sync import SyncState

__all__ = ["FSDPState", "eager_hooks", "cast_keyword_inputs", "pieces_check"]



class _Forwards(threading.local):
    def __init__(self) -> None:
        self.running: List["FSDPState"] = []    # units whose PyNative forward round is open, outermost first


_FORWARDS = _Forwards()


class _Backwards:
    count = 0          # PyNative backward passes through any unit's gather (rounds older than one are stale)


_BACKWARDS = _Backwards()


def _cast_floats(values, dtype):
    """``values`` (a tuple) with each floating Tensor cast to ``dtype``, inside nested tuples,
    named tuples, lists and dicts too, each keeping its type (FSDP2's input cast)."""
    if dtype is None:
        return values

    def cast(v):
        if isinstance(v, Tensor):
            return v.astype(dtype) if v.dtype in FLOATS and v.dtype != dtype else v
        if isinstance(v, tuple) and hasattr(v, "_fields"):
            return type(v)(*(cast(item) for item in v))
        if isinstance(v, (tuple, list)):
            return type(v)(cast(item) for item in v)
        if isinstance(v, dict):
            out = copy.copy(v)          # the mapping's own type (OrderedDict, defaultdict, ...)
            for k, item in v.items():
                out[k] = cast(item)
            return out
        return v
    return tuple(cast(v) for v in values)


class FSDPState:
    """The groups of one unit, its policies and its PyNative forward hooks.

    Args:
        cell: the unit (the Cell fully_shard / hsdp was applied to; the first of them for a list).
        mesh: the data-parallel mesh it was given.
        sync: the :class:`SyncState` its backward passes read.
        policy: the :class:`MixedPrecisionPolicy`.
        reshard_after_forward: ``True``, ``False`` or the int ``k`` (see the module docstring).

    Example::

        state = FSDPState(block, mesh, SyncState(), MixedPrecisionPolicy(), True)
    """

    def __init__(self, cell: nn.Cell, mesh, sync: SyncState, policy: MixedPrecisionPolicy,
                 reshard_after_forward: Any) -> None:
        self.cell, self.mesh, self.sync, self.policy = cell, mesh, sync, policy
        self.cells: List[nn.Cell] = [cell]      # every Cell of the unit (``fully_shard([m1, m2])``)
        self.running: Set[int] = set()          # Cells of the unit whose forward this round has not ended
        self.depth: Dict[int, int] = {}          # per Cell: its forwards (and forward methods) now running
        self._round: Optional[list] = None      # the full values gathered for this round
        self._round_mark: Tuple[int, bool] = (0, False)    # backward count and gradient recording then
        self._enclosing: Optional["FSDPState"] = None      # the unit whose forward encloses the round's start
        self.inside: List["FSDPState"] = []                # units whose rounds began inside this one's
        self._slot_cache: Dict[int, List[Tuple[int, int]]] = {}
        self.groups: List[FSDPParamGroup] = []
        self.reshard_after_forward = reshard_after_forward
        self.reshard_after_backward = True
        # HyperParallel's convention for DTensor parameters (set by its fully_shard under the alias):
        # the gradient of a Replicate mesh dim's local value is a share, summed over that dim
        self.replicated_grads_partial = False
        self.is_last_backward = True           # FSDP2's flag (set_is_last_backward); reductions never wait here
        self.kept: Optional[list] = None       # per group (flat, values) gathered by unshard(), until resharded
        self.pinned = False                    # kept across backward passes too (a pipeline's UNSHARD)
        self.reused: Optional[list] = None     # per group (flat, values) kept after a backward without sync
        self.deferred = True                   # until every piece is seen initialised
        self.checked = False                   # MindSpore's first-call checks of the Cells done
        self.compiled = False                  # a graph gathering this Cell's parameters was compiled
        self.saving: Optional[RegatherOnBackward] = None   # frees gathered values after the forward (if resharding)
        self.prefetched: Optional[list] = None   # gathered ahead by another unit's forward (forward prefetch)
        self.forward_prefetch: List["FSDPState"] = []     # units this one gathers ahead of their forward
        self.post_optim_event: Any = None    # FSDP2's: waited on once before the next forward's gathers
        self.unshard_in_backward = True          # FSDP2's hint (set_unshard_in_backward): checked, see _reshard
        # called once, at the first forward, with whether no other unit's forward encloses it (the root)
        self.on_first_forward: Optional[Callable[["FSDPState", bool], None]] = None

    @property
    def params(self) -> List[FSDPParam]:
        return [p for g in self.groups for p in g.params]

    def _check_initialised(self) -> None:
        waiting = [p.name for p in self.params if p.deferred is not None]
        if waiting:
            raise RuntimeError(f"{type(self.cell).__name__} was built under no_init_parameters() and its parameters "
                               f"{waiting} are not initialised: call hyper_parallel_ms.init_parameters(model) "
                               "after fully_shard / hsdp and before the first forward")
        self.deferred = False

    def _slots(self, cell: Optional[nn.Cell] = None) -> List[Tuple[int, int]]:
        """(record index, holder index) of every use of the unit's parameters inside ``cell`` (one
        Cell of the unit; ``None``: all of them). Indices only: MindSpore's compiler reads this object
        (:meth:`check_compilable`) and fails on Cells inside its containers."""
        key = -1 if cell is None or len(self.cells) == 1 else self.cells.index(cell)
        if key not in self._slot_cache:
            inside = None if key < 0 else {id(c) for _, c in cell.cells_and_names()}
            self._slot_cache[key] = [(i, j) for i, param in enumerate(self.params)
                                     for j, (holder, _) in enumerate(param.holders)
                                     if inside is None or id(holder) in inside]
        return self._slot_cache[key]

    def _install(self, values: Sequence, cell: Optional[nn.Cell] = None) -> None:
        params = self.params
        for i, j in self._slots(cell):
            holder, attr = params[i].holders[j]
            put_parameter(holder, attr, as_placed(values[i], params[i].placed, self.replicated_grads_partial))

    def _restore(self, cell: Optional[nn.Cell] = None) -> None:
        params = self.params
        for i, j in self._slots(cell):
            holder, attr = params[i].holders[j]
            put_parameter(holder, attr, params[i].piece)

    def _frees_after_forward(self) -> bool:
        # inside an activation checkpoint MindSpore keeps nothing and the recompute gathers again
        return self.saving is not None and self.kept is None and SAVED_TENSOR_HOOKS and not recomputing()

    def _gather_for_forward(self) -> list:
        """The full values for this forward: gathered ahead by another unit (:meth:`prefetch`), or now."""
        if self.prefetched is not None:
            (values, freeing), self.prefetched = self.prefetched, None
            if freeing:
                self.saving.resume()
            return values
        return self._gather()[0]

    def prefetch(self) -> None:
        """Gather this unit's parameters now, for its next forward (another unit's forward pre-hook
        calls it: FSDP2's ``set_modules_to_forward_prefetch``); a gather made ahead and not used is
        replaced."""
        if self.kept is None:
            self.prefetched = self._gather()
            if self.prefetched[1]:
                self.saving.pause()

    def _gather(self) -> Tuple[list, bool]:
        """One gather per group, and whether the unit's saved-tensor hooks now free what it
        gathered. After a backward without sync and with ``reshard_after_backward=False`` the
        values gathered then are used again (no collective), until a forward with sync. With
        ``reshard_after_forward`` the gathered values are kept for the backward as records and
        gathered again there (:mod:`._reshard`)."""
        keep = not self.sync.sync and not self.reshard_after_backward
        earlier = self.kept if self.kept is not None else self.reused
        freeing = earlier is None and not keep and self._frees_after_forward()
        if earlier is not None:
            gathered = [g.gathered(reuse=flat) for g, (flat, _) in zip(self.groups, earlier)]
        elif not freeing:
            gathered = [g.gathered() for g in self.groups]
        else:
            self.saving.begin()
            try:
                gathered = [g.gathered(owned=True) for g in self.groups]
            except BaseException:
                self.saving.end()
                raise
            self.saving.gathered([item if g.sharded else None for g, item in zip(self.groups, gathered)])
        self.reused = gathered if keep else None
        return [v for _, values in gathered for v in values], freeing

    def read_outside_forward(self, group: FSDPParamGroup, index: int, held: Any) -> Any:
        """PyNative: a read of parameter ``index`` of ``group`` that finds its piece while another
        unit's forward runs (a tied head reading an embedding unit's table, a Cell of
        ``fully_shard([m1, m2])`` reading the other's weight) gets the full value, gathered now as
        this unit's forward gathers it (its backward reduces that gradient to the piece as well);
        outside every forward (inspection, initialisation) the piece itself, what the Cell holds.

        Example::

            logits = ops.matmul(h, self.wte.embedding_table.T)    # the root's forward; wte its own unit
        """
        record = group.params[index]
        if held is not record.piece or not _FORWARDS.running:
            return held
        value = group.gathered()[1][index]
        return as_placed(value, record.placed, self.replicated_grads_partial)

    def check_compilable(self) -> None:
        """Called while ms.jit / GRAPH_MODE compiles a read of this Cell's parameters: refuse what
        a compiled graph cannot do (see :mod:`._compiled`), naming the fix."""
        name = type(self.cell).__name__
        if self.deferred:
            self._check_initialised()
        if not self.sync.sync:
            raise NotImplementedError(
                f"{name}: gradient sync is off, but inside ms.jit / GRAPH_MODE every backward reduces the gradients "
                "(a compiled graph cannot keep unreduced ones between calls). Keep sync on and add up the returned "
                "gradients of the micro-steps (the same sum as one big batch), or run the micro-steps in PyNative")
        if not self.sync.all_reduce and any(g.replicate_dim is not None for g in self.groups):
            raise NotImplementedError(
                f"{name}: the all-reduce over replicas is off (set_requires_all_reduce(False)), but inside ms.jit / "
                "GRAPH_MODE every backward reduces the gradients fully (a compiled graph cannot keep partial ones "
                "between calls). Keep it on and add up the returned gradients of the micro-steps, or run the "
                "micro-steps in PyNative")
        policy = self.policy
        if (policy.param_dtype is not None and policy.cast_forward_inputs) or policy.output_dtype is not None:
            raise NotImplementedError(
                f"{name}: the mixed-precision policy casts the Cell's inputs or outputs, which fully_shard does in "
                "PyNative forward hooks; inside ms.jit / GRAPH_MODE use MixedPrecisionPolicy(param_dtype=..., "
                "cast_forward_inputs=False) without output_dtype and cast inputs in the model, or run in PyNative")
        if self.sync.all_reduce_hook is not None:
            raise NotImplementedError(
                f"{name}: an all-reduce hook is set (set_all_reduce_hook), which runs as Python on each reduced "
                "gradient in PyNative; a compiled graph does not call it. Apply the hook's collective to the "
                "gradients the compiled step returns, or run the step in PyNative")
        if self.kept is not None:
            raise RuntimeError(f"{name} holds gathered parameters from unshard(): call reshard() before compiling")
        placed = [p.name for p in self.params if p.placed is not None]
        if placed:
            raise NotImplementedError(
                f"{name}: the parameters {placed} are DTensors (shard_module / distribute_module), whose Cell computes "
                "through the DTensor dispatcher in PyNative only: run it in PyNative, or place the parameters with "
                "parallelize_module's styles to compile")
        self.compiled = True

    def pre_forward(self, cell, args):
        """The forward pre-hook of each Cell of the unit: the first Cell of a round gathers, the
        others of the same round (``fully_shard([m1, m2])``) take the values gathered then; each
        Cell holds the full values only during its own forward. A call made inside one of the Cell's
        own forwards (the forward calling a registered ``encode``, a ``generate`` calling the forward)
        uses the values in place: gathering and freeing there would leave the outer call the pieces."""
        nested = self.depth.get(id(cell), 0) if any(u is self for u in _FORWARDS.running) else 0
        self.depth[id(cell)] = nested + 1
        if nested:
            return self._cast_inputs(args)
        try:
            return self._enter(cell, args)
        except BaseException:
            self.depth.pop(id(cell), None)
            raise

    def _cast_inputs(self, args):
        if self.policy.cast_forward_inputs and self.policy.param_dtype is not None:
            return _cast_floats(args, self.policy.param_dtype)
        return None

    def _enter(self, cell, args):
        if self.running and not self._round_continues(cell):
            self._end_round()
        if self.running:
            if self.saving is not None:
                self.saving.resume()
        else:
            self._begin_round()
        self._install(self._round, cell)
        return self._cast_inputs(args)

    def _round_continues(self, cell) -> bool:
        """Whether ``cell``'s forward belongs to the open round: it has not run in it, the forward
        enclosing the round's start (another unit's) is still running, and no backward or change of
        gradient recording came since (the round's values are then this forward's)."""
        enclosing = self._enclosing
        return (id(cell) in self.running and enclosing is not None and any(u is enclosing for u in _FORWARDS.running)
                and self._round_mark == _round_mark())

    def _begin_round(self) -> None:
        if self.on_first_forward is not None:
            decide, self.on_first_forward = self.on_first_forward, None
            decide(self, not _FORWARDS.running)
        if self.deferred:
            self._check_initialised()
        if not self.checked:
            for cell in self.cells:
                run_first_call_checks(cell)      # while the pieces are in place
            self.checked = True
        if self.post_optim_event is not None:
            event, self.post_optim_event = self.post_optim_event, None
            event.wait()
        self._round, self._round_mark = self._gather_for_forward(), _round_mark()
        for other in self.forward_prefetch:
            other.prefetch()
        self.running = {id(c) for c in self.cells}
        self._enclosing = _FORWARDS.running[-1] if _FORWARDS.running else None
        if self._enclosing is not None:
            self._enclosing.inside.append(self)
        _FORWARDS.running.append(self)

    def _end_round(self) -> None:
        self.running, self._round = set(), None
        if self.kept is not None and self.reshard_after_forward is not False:
            self.kept = None     # FSDP2's post-forward reshard: the next forward gathers (sees an optimizer step)
        _FORWARDS.running[:] = [u for u in _FORWARDS.running if u is not self]
        inside, self.inside = self.inside, []
        for unit in inside:           # rounds begun inside this forward that did not reach every Cell
            if unit.running:
                unit._end_round()
        if self.saving is not None:
            self.saving.end()

    def post_forward(self, cell, args, output):
        """The forward hook of each Cell of the unit (run when the forward raises too): the Cell gets
        its pieces back; the last Cell of a round ends it. The end of a nested call (see
        :meth:`pre_forward`) leaves the values in place."""
        nested = self.depth.pop(id(cell), 1) - 1
        if nested:
            self.depth[id(cell)] = nested
            return self._cast_output(output)
        self._restore(cell)
        self.running.discard(id(cell))
        if self.running and self._enclosing is not None:
            if self.saving is not None:
                self.saving.pause()    # other Cells' forwards run until the unit's next Cell
        else:
            self._end_round()          # every Cell ran, or no enclosing forward could continue the round
        return self._cast_output(output)

    def _cast_output(self, output):
        dtype = self.policy.output_dtype
        if dtype is None:
            return None
        return _cast_floats((output,), dtype)[0]

    def note_backward(self) -> None:
        """A backward pass reached one of this unit's gathers (called by it): open rounds are stale,
        and values kept by :meth:`unshard` are dropped (FSDP2's post-backward reshard)."""
        _BACKWARDS.count += 1
        if self.reshard_after_backward and not self.pinned:
            self.kept = None

    def unshard(self, through_backward: bool = False) -> None:
        """Gather every group now; the next forwards use these buffers (no collective) until the
        unit reshards as FSDP2's: after a forward with ``reshard_after_forward`` (True or an int),
        after a backward with ``reshard_after_backward`` (not with ``through_backward``: a
        pipeline's UNSHARD, whose micro-batches all read them), or at :meth:`reshard`."""
        self.kept = [g.gathered() for g in self.groups]
        self.pinned = through_backward

    def reduce_pending(self) -> List[Tuple[Any, Any]]:
        """The gradients that backward passes without sync accumulated, reduced now (one collective
        per group, as the next synchronised backward would), each with its piece Parameter: a
        pipeline's REDUCE_GRAD. Nothing for a group where nothing accumulated."""
        out: List[Tuple[Any, Any]] = []
        for group in self.groups:
            grads = group.gather.reduce_pending()
            if grads is not None:
                out += list(zip(group.pieces(), grads))
        return out

    def reshard(self) -> None:
        if self.running:
            self._end_round()
        self.drop_gathered()
        self._restore()

    def drop_gathered(self) -> None:
        """Forget values gathered ahead of a forward (:meth:`unshard`, kept between micro-steps,
        prefetched): the pieces changed (a load), the next forward gathers again."""
        self.kept, self.reused, self.prefetched = None, None, None
        self.pinned = False

    def clear_pending(self) -> None:
        if self.running:
            self._end_round()
        self.reused = None
        for g in self.groups:
            g.clear()


def _round_mark() -> Tuple[int, bool]:
    return _BACKWARDS.count, recording_gradients()


def cast_keyword_inputs(state: FSDPState) -> Optional[Callable]:
    """A forward pre-hook (with keyword arguments) casting the floating Tensors among a unit's
    keyword inputs to its ``param_dtype`` (FSDP2's ``cast_forward_inputs`` casts both; the positional
    ones are cast by :meth:`FSDPState.pre_forward`). Compiled code calls forward pre-hooks without
    keyword arguments (``kwargs`` then ``None``): nothing to do there. ``None`` where the unit's
    policy casts no inputs."""
    policy = state.policy
    if not policy.cast_forward_inputs or policy.param_dtype is None:
        return None

    def pre(cell, args, kwargs=None):
        if not running_eagerly() or not kwargs:
            return None
        names = list(kwargs)
        return args, dict(zip(names, _cast_floats([kwargs[k] for k in names], policy.param_dtype)))
    return pre


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


def pieces_check(unit: str, slots: Sequence[Tuple[str, FSDPParam]]) -> Callable:
    """A forward pre-hook for a Cell inside a unit holding pieces of the unit's sharded parameters
    (``slots``: attribute, record): called while it holds a piece (outside every forward of the unit)
    it would compute on this rank's rows only, so it raises, naming the fix. FSDP2 raises there too
    (its sharded parameters are DTensors). Nothing while MindSpore compiles (a graph gathers each read).
    """
    def check(cell) -> None:
        for attr, record in slots:
            if held_parameter(cell, attr) is record.piece:
                raise RuntimeError(
                    f"{type(cell).__name__} was called outside the forward of fully_shard({unit}), which holds its "
                    f"parameter {attr!r}: it holds this rank's piece {tuple(record.piece.shape)} of the whole "
                    f"{tuple(record.shape)} and would compute on it. Call it from {unit}'s forward, register the "
                    f"{unit} method that calls it with register_fsdp_forward_method, or make it a unit of its own "
                    f"(fully_shard it before {unit})")

    def pre(cell, args):
        if running_eagerly():
            check(cell)
        return None
    return pre
