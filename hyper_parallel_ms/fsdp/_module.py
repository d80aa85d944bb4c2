"""The methods a Cell sharded by ``fully_shard`` / ``hsdp`` gains (FSDP2's ``FSDPModule``), the
unit state they act on (:func:`fsdp_state`), and the checked setting of ``reshard_after_forward``
shared with the planner.

Example::

    fully_shard(model, mesh=mesh)
    fsdp_state(model).groups                   # the unit's FSDPParamGroup records
    model.set_requires_gradient_sync(False)    # an FSDPModule method
"""
from __future__ import annotations

import warnings
from typing import Any, Callable, List, Optional

from mindspore import Tensor, nn

from ._group import FSDPParamGroup
from ._mesh import post_forward_mesh
from ._reshard import RegatherOnBackward
from ._state import FSDPState, cast_keyword_inputs, eager_hooks

__all__ = ["STATE", "fsdp_state", "FSDPModule", "UnshardHandle", "register_fsdp_forward_method", "check_reshard",
           "set_reshard"]

STATE = "_hpms_fsdp_state"     # the attribute holding a unit's FSDPState


def fsdp_state(cell: nn.Cell) -> Optional[FSDPState]:
    """The :class:`FSDPState` a fully_shard / hsdp call left on ``cell`` (None: not sharded)."""
    return cell.__dict__.get(STATE)


class FSDPModule:
    """Methods of a Cell sharded by :func:`fully_shard` (its class becomes ``FSDP<Name>``).

    Example::

        fully_shard(model, mesh=mesh)
        model.set_requires_gradient_sync(False)    # micro-steps accumulate locally
        model.unshard(); model.reshard()
    """

    def _fsdp_states(self, recurse: bool = True) -> List[FSDPState]:
        cells = [c for _, c in self.cells_and_names()] if recurse else [self]
        return [state for state in map(fsdp_state, cells) if state is not None]

    def unshard(self, async_op: bool = False) -> Optional["UnshardHandle"]:
        """Gather this Cell's parameters now and keep them until :meth:`reshard`: forwards until then
        gather nothing (their backward still reduces the gradients). The Cell keeps holding its
        pieces (``trainable_params()`` and the optimizer see them); a forward reads the full values.
        ``async_op=True`` returns an :class:`UnshardHandle` (FSDP2); the gather has completed when
        this returns (collectives here are synchronous), so its ``wait()`` returns at once."""
        if not isinstance(async_op, bool):
            raise TypeError(f"async_op must be a bool, got {async_op!r}")
        self.__dict__[STATE].unshard()
        return UnshardHandle() if async_op else None

    def reshard(self) -> None:
        """Put this Cell's pieces back (frees the gathered parameters)."""
        self.__dict__[STATE].reshard()

    def _set_reduction_switch(self, name: str, value: bool, recurse: bool, field: str, off: str,
                              applies: Callable[[FSDPState], bool] = lambda state: True) -> None:
        """Set ``SyncState.<field>`` of this unit's states (and those below with ``recurse``); turning it
        off is refused where a compiled graph (which reduces every backward) holds a unit it applies to."""
        if not isinstance(value, bool):
            raise TypeError(f"{name} must be a bool, got {value!r}")
        states = self._fsdp_states(recurse)
        if not value and any(state.compiled and applies(state) for state in states):
            raise NotImplementedError(
                f"{type(self).__name__} was compiled by ms.jit / GRAPH_MODE, where every backward reduces the "
                f"gradients{off}")
        for state in states:
            setattr(state.sync, field, value)

    def set_requires_gradient_sync(self, requires_gradient_sync: bool, *, recurse: bool = True) -> None:
        """With ``False`` the backward accumulates unreduced gradients locally and sends nothing;
        the next backward with ``True`` reduces the sum once (gradient accumulation)."""
        self._set_reduction_switch(
            "requires_gradient_sync", requires_gradient_sync, recurse, "sync",
            ", so turning sync off would not take effect there: keep sync on and add up the returned gradients of "
            "the micro-steps (the same sum as one big batch)")

    def set_requires_all_reduce(self, requires_all_reduce: bool, *, recurse: bool = True) -> None:
        """HSDP (a 2-D mesh): with ``False`` the backward reduce-scatters over the shard dim but does not
        all-reduce over the replicas: this rank's part is added to a local accumulator and the gradient
        returned is zero; the next backward with ``True`` all-reduces the sum once (FSDP2's gradient
        accumulation across replicas). Without a replicate dim there is nothing to skip."""
        self._set_reduction_switch(
            "requires_all_reduce", requires_all_reduce, recurse, "all_reduce",
            " fully, so turning the all-reduce off would not take effect there: keep it on and add up the "
            "returned gradients of the micro-steps",
            applies=lambda state: any(g.replicate_dim is not None for g in state.groups))

    def set_gradient_divide_factor(self, factor: float) -> None:
        """Divide this unit's reduced gradients by ``factor`` instead of the number of data-parallel
        ranks (FSDP2: the gradients are summed over the ranks, then divided by ``factor``; ``1.0``:
        the sum). Set it before a graph gathering the unit is compiled."""
        if isinstance(factor, bool) or not isinstance(factor, (int, float)) or not factor > 0:
            raise ValueError(f"set_gradient_divide_factor takes a positive number, got {factor!r}")
        self._set_reduction_scaling("divide_factor", float(factor), "its divide factor", "the factor")

    def set_reduce_op_type(self, reduce_op_type: str) -> None:
        """HyperParallel's choice of this unit's gradient reduction over the data-parallel ranks:
        ``"avg"`` (the default: the mean) or ``"sum"`` (the sum: the loss carries the division, as
        MindFormers' ``disable_fsdp_gradient_division`` arranges). ``"sum"`` is
        ``set_gradient_divide_factor(1.0)``. Set it before a graph gathering the unit is compiled.

        Example::

            model.set_reduce_op_type("sum")
        """
        if reduce_op_type not in ("sum", "avg"):
            raise ValueError(f"set_reduce_op_type takes 'sum' or 'avg', got {reduce_op_type!r}")
        factor = 1.0 if reduce_op_type == "sum" else None
        self._set_reduction_scaling("divide_factor", factor, "its reduce op", "the reduce op type")

    def _set_reduction_scaling(self, field: str, value: Any, built_in: str, what: str) -> None:
        """Set ``SyncState.<field>`` of this unit and give its backward steps the new scale and reduce op;
        refused once a compiled graph holds the unit (``built_in``, ``what``: the error's words)."""
        state = self.__dict__[STATE]
        if state.compiled:
            raise NotImplementedError(
                f"{type(self).__name__} was compiled by ms.jit / GRAPH_MODE with {built_in} built in: set "
                f"{what} before the first compiled step")
        setattr(state.sync, field, value)
        for group in state.groups:
            group.rescale()

    def set_force_sum_reduction_for_comms(self, enable: bool) -> None:
        """FSDP2's: reduce this unit's gradients with sum collectives only, the division by the
        divide factor (default: the number of data-parallel ranks) applied after them; ``False``
        (the default) sends ``"avg"`` reductions. Set it before a graph gathering the unit is compiled.

        Example::

            model.set_force_sum_reduction_for_comms(True)
        """
        if not isinstance(enable, bool):
            raise TypeError(f"set_force_sum_reduction_for_comms takes a bool, got {enable!r}")
        self._set_reduction_scaling("force_sum", enable, "its reduce op", "force_sum_reduction_for_comms")

    def set_reduce_scatter_divide_factor(self, factor: float) -> None:
        """FSDP2's earlier name of :meth:`set_gradient_divide_factor` (deprecated there too)."""
        warnings.warn("set_reduce_scatter_divide_factor is deprecated; use set_gradient_divide_factor",
                      FutureWarning, stacklevel=2)
        self.set_gradient_divide_factor(factor)

    def set_all_reduce_hook(self, hook: Callable[[Tensor], Optional[Tensor]], *, stream: Any = None) -> None:
        """Call ``hook`` on this unit's reduced gradient in each backward that reduces it (FSDP2's):
        after the reduce-scatter, or after the all-reduce over replicas with HSDP, before the
        gradient reaches its parameters (one call per parameter group, on the group's flat gradient
        piece). ``hook(g)`` changes ``g`` in place and returns ``None``, or returns the new gradient
        (MindSpore's collectives mostly return their result). E.g. an all-reduce over a mesh dim
        fully_shard does not reduce. PyNative only: compiling a step over the unit is refused while
        a hook is set. ``hook=None`` removes it.

        Args:
            hook: ``hook(gradient) -> None | Tensor``, or ``None``.
            stream: FSDP2's stream to run the hook on; collectives here complete in order on the
                current stream, so any stream given is accepted and the hook runs there too. As in
                FSDP2, refused with HSDP (a replicate dim).

        Example::

            model.set_all_reduce_hook(lambda g: comm.all_reduce(g, mesh, "tp"))
        """
        if hook is not None and not callable(hook):
            raise TypeError(f"set_all_reduce_hook takes a callable hook(gradient) or None, got {hook!r}")
        state = self.__dict__[STATE]
        if stream is not None and any(g.replicate_dim is not None for g in state.groups):
            raise ValueError("set_all_reduce_hook: a stream cannot be given with HSDP (a replicate mesh dim), whose "
                             "all-reduce runs before the hook; leave stream=None")
        if hook is not None and state.compiled:
            raise NotImplementedError(
                f"{type(self).__name__} was compiled by ms.jit / GRAPH_MODE, whose graph does not call a Python "
                "hook; apply it to the gradients the compiled step returns")
        state.sync.all_reduce_hook = hook

    def set_post_optim_event(self, event: Any) -> None:
        """FSDP2's: an event recorded after the optimizer step (``mindspore.runtime.Event`` on Ascend),
        waited on once before this unit's next forward gathers (then dropped), so the gathers read
        the updated pieces. Without one, the gathers run after the optimizer's kernels in the order
        of the current stream.

        Args:
            event: an object with ``wait()`` (MindSpore's or PyTorch's Event).

        Example::

            event = ms.runtime.Event(); event.record()
            model.set_post_optim_event(event)
        """
        if not callable(getattr(event, "wait", None)):
            raise TypeError(f"set_post_optim_event takes an event with wait() (mindspore.runtime.Event), got "
                            f"{type(event).__name__}")
        self.__dict__[STATE].post_optim_event = event

    def set_unshard_in_backward(self, unshard_in_backward: bool) -> None:
        """FSDP2's hint that this unit's backward needs none of its gathered parameters (e.g. an
        embedding table). Here every unit's backward gathers a freed group again only when
        MindSpore's autodiff reads one of its values, so an embedding's backward gathers nothing
        whatever this flag; ``False`` adds a check: if the backward does read a value, it is gathered
        anyway (exact gradients) with a ``UserWarning`` naming the unit (FSDP2 would fail there).

        Args:
            unshard_in_backward: ``False``: the backward is expected to read no gathered value.

        Example::

            model.tok_embeddings.set_unshard_in_backward(False)
        """
        if not isinstance(unshard_in_backward, bool):
            raise TypeError(f"unshard_in_backward must be a bool, got {unshard_in_backward!r}")
        state = self.__dict__[STATE]
        state.unshard_in_backward = unshard_in_backward
        if state.saving is not None:
            state.saving.unshard_in_backward = unshard_in_backward

    def set_is_last_backward(self, is_last_backward: bool) -> None:
        """Whether the next backward is the last of the step (FSDP2 then waits for its pending
        gradient reductions). Every reduction here completes inside the backward, so no step
        waits on it; the flag is checked and kept (``is_last_backward``) for scripts written for FSDP2."""
        if not isinstance(is_last_backward, bool):
            raise TypeError(f"is_last_backward must be a bool, got {is_last_backward!r}")
        for state in self._fsdp_states(True):
            state.is_last_backward = is_last_backward

    def set_reshard_after_forward(self, reshard_after_forward: Any, *, recurse: bool = True) -> None:
        """``True``: PyNative frees the gathered parameters after the forward and gathers them again
        in the backward; an int ``k``: keeps ``1/k`` and gathers over ``k`` ranks in the backward;
        ``False``: kept until the backward (takes effect at the next forward; replaces the root's
        automatic ``False`` of ``reshard_after_forward=None``, as FSDP2)."""
        states = self._fsdp_states(recurse)
        for state in states:
            check_reshard(reshard_after_forward, state.groups, type(state.cell).__name__)
        for state in states:
            state.on_first_forward = None
            set_reshard(state, reshard_after_forward)

    def set_reshard_after_backward(self, reshard_after_backward: bool, *, recurse: bool = True) -> None:
        """``False``: after a backward without gradient sync the gathered parameters are kept and the
        next forward gathers nothing (gradient accumulation without collectives); they are dropped by
        the next forward with sync, :meth:`reshard` or :meth:`zero_accumulated_grads`. ``True`` (default):
        every forward gathers."""
        if not isinstance(reshard_after_backward, bool):
            raise TypeError(f"reshard_after_backward must be a bool, got {reshard_after_backward!r}")
        for state in self._fsdp_states(recurse):
            state.reshard_after_backward = reshard_after_backward
            if reshard_after_backward:
                state.reused = None

    def set_modules_to_forward_prefetch(self, modules: List["FSDPModule"]) -> None:
        """Gather ``modules``' parameters in this Cell's forward pre-hook, ahead of their own forward
        (FSDP2's explicit forward prefetch; a gather made ahead and then not used by its Cell's next
        forward is replaced by the next one). Collectives on MindSpore's CPU backend block the
        Python thread: this changes the order, not the time (see docs/fsdp.md, Memory, speed and compile time).

        Args:
            modules: Cells sharded by fully_shard / hsdp, each running after this one in every forward.
        """
        self.__dict__[STATE].forward_prefetch = [_unit_state(m, "set_modules_to_forward_prefetch")
                                                  for m in _cell_list(modules, "set_modules_to_forward_prefetch")]

    def set_modules_to_backward_prefetch(self, modules: List["FSDPModule"]) -> None:
        """In the backward, when this Cell gathers its freed parameters again, gather ``modules``'
        too (FSDP2's explicit backward prefetch; with ``reshard_after_forward=False`` nothing is
        gathered in the backward and this does nothing).

        Args:
            modules: Cells sharded by fully_shard / hsdp whose backward runs after this one's.
        """
        states = [_unit_state(m, "set_modules_to_backward_prefetch")
                  for m in _cell_list(modules, "set_modules_to_backward_prefetch")]
        saving = self.__dict__[STATE].saving
        if saving is not None:
            saving.ahead = [s.saving for s in states if s.saving is not None]

    def zero_accumulated_grads(self, *, recurse: bool = True) -> None:
        """Drop gradients accumulated by backward passes without sync."""
        for state in self._fsdp_states(recurse):
            state.clear_pending()


class UnshardHandle:
    """What ``unshard(async_op=True)`` returns (FSDP2's handle): :meth:`wait` returns once the
    parameters are gathered, which on this package's synchronous collectives is already so.

    Example::

        handle = model.unshard(async_op=True)
        handle.wait()
    """

    def wait(self) -> None:
        """Return when the gather has completed (it has, when ``unshard`` returned)."""
        return None


def _cell_list(modules: Any, what: str) -> list:
    if isinstance(modules, nn.Cell) or not isinstance(modules, (list, tuple)):
        raise TypeError(f"{what} takes a list of Cells sharded by fully_shard / hsdp, got {type(modules).__name__} "
                        "(wrap a single Cell in a list)")
    return list(modules)


def register_fsdp_forward_method(module: nn.Cell, method_name: str) -> None:
    """Make calls of ``module.<method_name>`` gather and free the unit's parameters as its forward does
    (FSDP2's ``register_fsdp_forward_method``: a ``generate`` or ``encode`` method called instead of the
    Cell itself). Without it such a call computes on the pieces (a shape error, or a wrong result where
    a piece happens to broadcast). PyNative.

    Args:
        module: a Cell sharded by ``fully_shard`` / ``hsdp``.
        method_name: the name of one of its methods.

    Example::

        register_fsdp_forward_method(model, "encode")
        model.encode(x)                 # the full parameters, as in model(x)
    """
    state = _unit_state(module, "register_fsdp_forward_method")
    method = getattr(type(module), method_name, None)
    if not callable(method):
        raise ValueError(f"register_fsdp_forward_method: {type(module).__name__} has no method {method_name!r}")
    pre, post = eager_hooks(state)
    cast_keywords = cast_keyword_inputs(state)

    def forward_method(*args, **kwargs):
        cast = pre(module, args)
        args = args if cast is None else cast
        if cast_keywords is not None:
            args, kwargs = cast_keywords(module, args, kwargs) or (args, kwargs)
        output = None
        try:
            output = method(module, *args, **kwargs)
        finally:
            changed = post(module, args, output)
        return output if changed is None else changed
    object.__setattr__(module, method_name, forward_method)


def _unit_state(module: Any, what: str) -> FSDPState:
    state = fsdp_state(module) if isinstance(module, nn.Cell) else None
    if state is None:
        raise ValueError(f"{what} takes Cells sharded by fully_shard / hsdp, got {type(module).__name__}")
    return state


def check_reshard(value: Any, groups: List[FSDPParamGroup] = (), unit: str = "") -> None:
    """Refuse a ``reshard_after_forward`` that is not a bool or an int dividing every sharded
    group's shard dim."""
    if isinstance(value, bool):
        return
    if not isinstance(value, int) or value < 1:
        raise ValueError(f"reshard_after_forward must be a bool or a positive int, got {value!r}")
    for group in groups:
        n = group.mesh.size(group.shard_dim)
        if group.sharded and value > 1 and n % value:
            raise ValueError(f"fully_shard({unit}): reshard_after_forward={value} must divide the {n} ranks of the "
                             f"shard dim of {group.mesh!r} (the ranks each gathers over in the backward); use a "
                             "divisor, True (all of them) or False")


def set_reshard(state: FSDPState, value: Any) -> None:
    """Apply a checked ``reshard_after_forward``: an int ``k`` gets each sharded group a post-forward
    mesh of ``k`` ranks (``k`` equal to the shard dim: as ``True``; ``1``: as ``False``, with a warning)."""
    if value is not True and value is not False and value == 1:
        warnings.warn("reshard_after_forward=1 (int) reshards to one rank, i.e. keeps the gathered parameters: "
                      "the same as False", UserWarning, stacklevel=3)
        value = False
    for group in state.groups:
        n = group.mesh.size(group.shard_dim)
        group.post_forward_mesh = None
        if value is not True and value is not False and group.sharded and 1 < value < n:
            group.post_forward_mesh = post_forward_mesh(group.mesh, value)
    earlier = state.saving
    state.reshard_after_forward = value
    state.saving = None if value is False else RegatherOnBackward(state.groups, value)
    if state.saving is not None:
        state.saving.name, state.saving.unshard_in_backward = type(state.cell).__name__, state.unshard_in_backward
        if earlier is not None:
            state.saving.ahead = earlier.ahead
