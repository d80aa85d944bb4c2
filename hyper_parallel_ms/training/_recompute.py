"""Activation checkpointing: PyTorch's ``checkpoint_wrapper`` / ``apply_activation_checkpointing``
on MindSpore's recompute.

A wrapped Cell keeps no activations of its forward for the backward; the backward runs the
forward again. The Cell is wrapped in place (its class gains :class:`CheckpointWrapper`), so
parameter names and dotted paths stay what they were (PyTorch inserts
``_checkpoint_wrapped_module.`` in both): checkpoints, optimizers and plans applied after
wrapping keep working.

- PyNative: the whole call (forward hooks included, e.g. fully_shard's parameter gather) runs
  under ``mindspore.recompute(use_reentrant=False)``, which reads the Cell's parameters when it
  runs, so wrapping before or after ``parallelize_module`` / ``fully_shard`` (which replace
  parameters) is exact. ``Cell.recompute()`` is not used: it captures ``trainable_params()``
  once and gives silently zero gradients to a parameter replaced later.
- ``ms.jit`` / GRAPH_MODE: the Cell's ``construct`` is marked for MindSpore's graph recompute
  pass (measured: it duplicates the forward ops it needs into the backward). Selective policies
  are PyNative only (refused while compiling). Measured on MindSpore 2.10 CPU, the example Llama
  does not run compiled with checkpointed blocks in two layouts, both failing loudly before a
  step completes: sequence parallelism with the blocks checkpointed whole ("Graph cycle exists"
  while compiling; checkpoint ``attention`` and ``feed_forward`` instead), and fully_shard units
  ("Launch kernel failed: recompute_.../AllReduce", the recomputed gather; use PyNative). The
  tests' smaller models compile and match one device in both.
- Selective (``policy``): the outputs of the ops the policy names (by MindSpore primitive name;
  default :data:`SAVE_MATMUL_AND_COLLECTIVES`) are kept from the forward and handed back to the
  recompute, which runs every other op again (PyTorch's ``create_selective_checkpoint_contexts``).
  ``policy="attention_core"`` (:data:`ATTENTION_CORE`) is Korthikanti et al.'s selective
  recomputation: the matmul and collective outputs are kept except the attention scores (the
  outputs shaped like the forward's softmax output), so the ``s^2`` terms are recomputed.

Example::

    from hyper_parallel_ms.training import apply_activation_checkpointing, checkpoint_wrapper
    apply_activation_checkpointing(model, check_fn=lambda cell: isinstance(cell, Block))
    checkpoint_wrapper(model.head, policy="selective")
"""
from __future__ import annotations

import contextvars
import enum
import threading
from collections import defaultdict, deque
from contextlib import nullcontext
from typing import Any, Callable, Dict, List, Optional, Tuple

import mindspore as ms
from mindspore import Parameter, nn

from .._mindspore import (OP_INTERCEPTION, cell_subclass, discard_grad_recording, is_compiling, recompute_eagerly,
                          recompute_in_graph, refuse_while_compiling, run_in_python, running_eagerly)
from ..dtensor import DTensor
from ..fsdp._module import fsdp_state
from ..fsdp._param import is_piece
from ..nn._adapter import CellChanges, named_cells, own_parameters
from ._policies import (ATTENTION_CORE, SAVE_MATMUL_AND_COLLECTIVES, CheckpointStats, Policy,
                        _attention_core_contexts, _attention_core_keeps, _keep_fn, _selective_contexts,
                        create_selective_checkpoint_contexts, is_random_op)

__all__ = ["CheckpointWrapper", "CheckpointImpl", "checkpoint_wrapper", "apply_activation_checkpointing",
           "checkpoint_stats", "create_selective_checkpoint_contexts", "SAVE_MATMUL_AND_COLLECTIVES", "ATTENTION_CORE"]


class CheckpointImpl(enum.Enum):
    """PyTorch's choice of checkpoint implementation, accepted by :func:`checkpoint_wrapper`: both run
    MindSpore's recompute here (the backward runs the forward again, random state replayed).

    Args:
        value: a member's value, as any ``Enum`` takes it (use the members by name).

    >>> CheckpointImpl.NO_REENTRANT.name
    'NO_REENTRANT'
    """

    REENTRANT = enum.auto()
    NO_REENTRANT = enum.auto()

_STATE = "_hpms_checkpoint"
_RUNNING = threading.local()          # .cell: the checkpointed Cell whose forward runs now (nesting check)



class _State:
    def __init__(self, keep: Optional[Callable[[str], bool]], graph_error: str,
                 context_fn: Optional[Callable[[], Tuple[Any, Any]]] = None) -> None:
        self.keep = keep
        self.graph_error = graph_error
        self.context_fn = context_fn
        self.stats = CheckpointStats()


class Invocation:
    """One call of a checkpointed Cell: what the regions excluded from its recomputation produced
    in its forward (``outputs``: region id -> queue of outputs), handed to its recompute."""

    def __init__(self) -> None:
        self.outputs: Dict[int, deque] = defaultdict(deque)


# (the Invocation, whether its recompute runs) while a checkpointed Cell's forward or recompute runs
_PHASE: contextvars.ContextVar = contextvars.ContextVar("hpms_checkpoint_phase", default=None)


def checkpoint_phase() -> Optional[Tuple[Invocation, bool]]:
    """``(invocation, recomputing)`` inside a checkpointed Cell's forward (``recomputing`` False) or
    its recompute in the backward (True); ``None`` elsewhere (inside an excluded region too)."""
    return _PHASE.get()


class _Phase:
    def __init__(self, invocation: Optional[Invocation], recomputing: bool) -> None:
        self.value = None if invocation is None else (invocation, recomputing)
        self.token = None

    def __enter__(self):
        self.token = _PHASE.set(self.value)
        return self

    def __exit__(self, *exc):
        _PHASE.reset(self.token)
        return False


class _Stacked:
    """Context managers entered in order, left in reverse; ``keeps``: the policy's choice of op outputs
    (a selective policy's context's, which the dry run reads; ``None`` without one)."""

    def __init__(self, *contexts: Any) -> None:
        self.contexts, self.entered = contexts, []
        self.keeps = next((c.keeps for c in contexts if getattr(c, "keeps", None) is not None), None)

    def __enter__(self):
        for ctx in self.contexts:
            ctx.__enter__()
            self.entered.append(ctx)
        return self

    def __exit__(self, *exc):
        suppress = False
        while self.entered:
            ctx = self.entered.pop()
            if ctx.__exit__(*exc):
                suppress, exc = True, (None, None, None)
        return suppress


def _user_contexts(context_fn: Optional[Callable[[], Tuple[Any, Any]]]) -> Tuple[Any, Any]:
    if context_fn is None:
        return nullcontext(), nullcontext()
    pair = context_fn()
    if not (isinstance(pair, tuple) and len(pair) == 2 and
            all(hasattr(c, "__enter__") and hasattr(c, "__exit__") for c in pair)):
        raise TypeError(f"checkpoint_wrapper(context_fn=...): context_fn() must return (forward context manager, "
                        f"recompute context manager), got {pair!r}")
    return pair


def _refuse_dtensors(cell: nn.Cell, args: tuple) -> None:
    """Selective policies intercept ops with a global mode that sees DTensors as plain tensors."""
    found = [p.name for p in cell.get_parameters() if isinstance(p, DTensor)]
    if found or any(isinstance(a, DTensor) for a in args):
        what = f"the parameters {found}" if found else "its inputs"
        raise NotImplementedError(
            f"{type(cell).__name__}: a selective checkpoint policy cannot run on DTensors ({what}; shard_module / "
            "distribute_module): its op interception sees them as plain local tensors. Use policy=None (full "
            "recompute), or place the parameters with parallelize_module's styles")


def _outer_unit_pieces(cell: nn.Cell) -> List[str]:
    """Parameters under ``cell`` that a fully_shard / hsdp unit enclosing ``cell`` gathers around
    its own forward (no unit at or below ``cell`` holds them), so that a recompute of ``cell`` in
    the backward would not find them gathered: pieces, or (called inside that unit's forward) the
    gathered values it put in their place, which are no Parameters."""
    found: List[str] = []

    def walk(sub: nn.Cell, path: str) -> None:
        if fsdp_state(sub) is not None:       # a unit: it gathers what is under it
            return
        for name, p in own_parameters(sub).items():
            if not isinstance(p, Parameter) or is_piece(p):
                found.append(path + name)
        for child_name, child in sub.name_cells().items():
            walk(child, f"{path}{child_name}.")
    walk(cell, "")
    return found


def _refuse_outer_unit(cell: nn.Cell) -> None:
    names = _outer_unit_pieces(cell)
    if names:
        raise NotImplementedError(
            f"{type(cell).__name__} is checkpointed inside a fully_shard / hsdp unit that holds its parameters "
            f"({names[:3]}{' ...' if len(names) > 3 else ''}): the unit gathers them around its own forward, so the "
            "recompute in the backward would read the pieces (PyNative: a shape error; compiled, measured on the "
            "example Llama: losses a few percent off one device's). Checkpoint the unit itself (e.g. the block), "
            "or make the checkpointed Cell a unit of its own (fully_shard it before its parent)")


@run_in_python
def _refuse_outer_unit_in_graph(cell: nn.Cell) -> bool:
    if is_compiling():
        _refuse_outer_unit(cell)
    return True


class CheckpointWrapper:
    """The methods a Cell gains from :func:`checkpoint_wrapper` (``isinstance(cell, CheckpointWrapper)``
    tells a wrapped Cell). Its parameters, their names and its path are unchanged.

    Example::

        checkpoint_wrapper(block)
        isinstance(block, CheckpointWrapper)       # True
    """

    def __call__(self, *args, **kwargs):
        state: _State = self.__dict__[_STATE]
        if ms.get_context("mode") == ms.GRAPH_MODE:
            return self._hpms_checkpoint_call(*args, **kwargs)
        try:
            return self._hpms_checkpoint_eagerly(state, args, kwargs)
        except Exception:
            # under a gradient call, an error leaving its forward would leave MindSpore's executor
            # recording (later in-place updates of Parameters fail): drop the failed call's record
            discard_grad_recording()
            raise

    def _hpms_checkpoint_eagerly(self, state: "_State", args: tuple, kwargs: dict):
        """PyNative: the refusals, then the forward under MindSpore's non-reentrant recompute."""
        _refuse_outer_unit(self)
        context_fn = None
        if state.keep is _attention_core_keeps:
            _refuse_dtensors(self, args + tuple(kwargs.values()))
            context_fn = _attention_core_contexts(state.stats)
        elif state.keep is not None:
            _refuse_dtensors(self, args + tuple(kwargs.values()))
            context_fn = _selective_contexts(lambda name: is_random_op(name) or state.keep(name), state.stats)
        elif OP_INTERCEPTION:
            context_fn = _selective_contexts(is_random_op, state.stats)
        stats = state.stats
        inner = next((name for name, cell in self.cells_and_names() if cell is not self and
                      isinstance(cell, CheckpointWrapper)), None)
        if inner is not None:
            raise ValueError(f"{type(self).__name__} is checkpointed and holds the checkpointed '{inner}': nested "
                             "checkpoints would run its forward three times. Wrap either the outer Cell or its parts")
        outer = getattr(_RUNNING, "cell", None)
        if outer is not None:
            raise ValueError(f"{type(self).__name__} is checkpointed and runs inside the checkpointed "
                             f"{type(outer).__name__}: nested checkpoints would run its forward three times. "
                             "Wrap either the outer Cell or its parts")

        def forward(*inner_args, **inner_kwargs):
            stats.forwards += 1
            _RUNNING.cell = self
            try:
                return self._hpms_checkpoint_call(*inner_args, **inner_kwargs)
            finally:
                _RUNNING.cell = None

        def counted_context_fn():
            forward_ctx, recompute_ctx = context_fn() if context_fn is not None else (nullcontext(), nullcontext())
            user_forward, user_recompute = _user_contexts(state.context_fn)
            invocation = Invocation()
            return (_Stacked(_Phase(invocation, False), user_forward, forward_ctx),
                    _Stacked(_Phase(invocation, True), user_recompute, _Counting(recompute_ctx, stats)))
        return recompute_eagerly(forward, args, kwargs, counted_context_fn)

    def construct(self, *args, **kwargs):
        if running_eagerly():
            return self._hpms_checkpoint_construct(*args, **kwargs)
        refuse_while_compiling(self._hpms_checkpoint_graph_error)
        _refuse_outer_unit_in_graph(self)
        return recompute_in_graph(self._hpms_checkpoint_construct, *args, **kwargs)


class _Counting:
    """The recompute context, counting recomputations."""

    def __init__(self, inner: Any, stats: CheckpointStats) -> None:
        self.inner, self.stats = inner, stats

    def __enter__(self):
        self.stats.recomputes += 1
        return self.inner.__enter__()

    def __exit__(self, *exc):
        return self.inner.__exit__(*exc)


_CLASSES: Dict[Tuple[type, type], type] = {}


def wrapped_class(mixin: type, base: type, prefix: str) -> type:
    """The (cached) subclass of the Cell class ``base`` with ``mixin``'s methods, which reach the
    original ``__call__`` and ``construct`` as ``_hpms_<prefix>_call`` / ``_hpms_<prefix>_construct``
    (wrapping in place keeps the class name, parameter names and paths)."""
    key = (mixin, base)
    if key not in _CLASSES:
        _CLASSES[key] = cell_subclass(base.__name__, (mixin, base), {
            f"_hpms_{prefix}_call": base.__call__, f"_hpms_{prefix}_construct": base.construct,
            "__module__": base.__module__, "__qualname__": base.__qualname__})
    return _CLASSES[key]


def _check_not_nested(cell: nn.Cell) -> None:
    nested = [path or "<itself>" for path, sub in named_cells(cell).items() if isinstance(sub, CheckpointWrapper)]
    if nested:
        raise ValueError(f"checkpoint_wrapper({type(cell).__name__}): {nested} already checkpointed; nested "
                         "checkpoints would run the inner forward three times. Wrap either the Cell or its parts")


def checkpoint_wrapper(cell: nn.Cell, checkpoint_impl: CheckpointImpl = CheckpointImpl.NO_REENTRANT,
                       checkpoint_fn: Optional[Callable] = None, *, policy: Policy = None,
                       use_reentrant: Optional[bool] = None, preserve_rng_state: bool = True,
                       context_fn: Optional[Callable[[], Tuple[Any, Any]]] = None) -> nn.Cell:
    """Checkpoint ``cell``'s activations: its forward keeps nothing for the backward (or only the
    outputs ``policy`` names), and the backward runs it again. Wraps in place and returns ``cell``:
    parameter names and paths do not change, so a plan, a checkpoint or an optimizer made before or
    after wrapping sees the same names. Exact before or after ``parallelize_module`` / ``fully_shard``;
    under ``fully_shard`` with ``policy=None`` the recompute gathers the Cell's parameters again.

    Args:
        cell: the Cell to checkpoint (an ``nn.Cell`` with no checkpointed Cell under it).
        checkpoint_impl: PyTorch's :class:`CheckpointImpl`; both run MindSpore's recompute.
        checkpoint_fn: PyTorch's custom checkpoint function: not supported (``None`` only).
        policy: ``None`` or ``"full"``: recompute everything; ``"selective"``: keep the outputs of
            :data:`SAVE_MATMUL_AND_COLLECTIVES` and recompute the rest; :data:`ATTENTION_CORE`
            (``"attention_core"``, Korthikanti et al.'s selective recomputation, for an attention
            Cell or a block): as ``"selective"``, except that the outputs shaped like a softmax
            output of the forward (the attention scores and probabilities, the ``s^2`` terms) are
            recomputed too; or a collection of MindSpore primitive names / a callable
            ``op_name -> bool`` naming the ops to keep. Random ops' outputs (a dropout's) are kept
            by every policy (MindSpore's dropout kernels cannot draw the same mask again).
            Selective policies run in PyNative only (ms.jit / GRAPH_MODE refuse them while compiling).
        use_reentrant: PyTorch's keyword, either value: the recompute is the same.
        preserve_rng_state: PyTorch's keyword; the random state is always replayed (the recomputed
            dropout masks are the forward's, so the gradients are the forward's), whatever it says.
        context_fn: ``None``, or a callable returning ``(forward_ctx, recompute_ctx)``, two context
            managers: each call of the Cell enters the first around its forward and the second
            around its recompute in the backward (as ``mindspore.recompute(context_fn=)``), e.g. to
            skip one-time side effects in the recompute. PyNative only.

    Example::

        for block in model.layers:
            checkpoint_wrapper(block)
        parallelize_module(model, mesh, {"layers.*.up": ColwiseParallel()})   # same paths
    """
    if not isinstance(cell, nn.Cell):
        raise TypeError(f"checkpoint_wrapper needs an nn.Cell, got {type(cell).__name__}")
    if not isinstance(checkpoint_impl, CheckpointImpl):
        raise TypeError(f"checkpoint_impl must be a CheckpointImpl, got {checkpoint_impl!r}")
    if checkpoint_fn is not None:
        raise NotImplementedError("checkpoint_wrapper(checkpoint_fn=...): a custom checkpoint function is not "
                                  "supported; the wrapper recomputes through MindSpore (leave checkpoint_fn=None, "
                                  "choose what to keep with policy=)")
    for name, value in (("use_reentrant", use_reentrant), ("preserve_rng_state", preserve_rng_state)):
        if value is not None and not isinstance(value, bool):
            raise TypeError(f"{name} must be a bool, got {value!r}")
    if context_fn is not None and not callable(context_fn):
        raise TypeError(f"checkpoint_wrapper(context_fn=...) must be a callable returning two context managers, "
                        f"got {context_fn!r}")
    keep = _keep_fn(policy)
    _check_not_nested(cell)
    graph_error = "" if keep is None else (
        f"{type(cell).__name__}: a selective checkpoint policy ({policy!r}) chooses ops in PyNative; MindSpore's "
        "graph recompute has no per-op choice here. Use policy=None under ms.jit / GRAPH_MODE, or run in PyNative")
    if context_fn is not None and not graph_error:
        graph_error = (f"{type(cell).__name__}: checkpoint_wrapper(context_fn=...) enters its contexts in PyNative; "
                       "MindSpore's graph recompute runs none. Leave context_fn=None under ms.jit / GRAPH_MODE")
    with CellChanges() as changes:
        changes.set_attribute(cell, _STATE, _State(keep, graph_error, context_fn))
        changes.set_attribute(cell, "_hpms_checkpoint_graph_error", graph_error)
        changes.swap_class(cell, wrapped_class(CheckpointWrapper, type(cell), "checkpoint"))
    return cell


def checkpoint_stats(cell: nn.Cell) -> CheckpointStats:
    """The :class:`CheckpointStats` of a Cell wrapped by :func:`checkpoint_wrapper` (PyNative counts).

    Args:
        cell: a checkpointed Cell.

    Example::

        checkpoint_stats(block).forwards      # 2 per training step: forward and recompute
    """
    state = cell.__dict__.get(_STATE) if isinstance(cell, nn.Cell) else None
    if state is None:
        raise ValueError(f"{type(cell).__name__} is not checkpointed: wrap it with checkpoint_wrapper first")
    return state.stats


def apply_activation_checkpointing(model: nn.Cell, checkpoint_wrapper_fn: Callable[..., nn.Cell] = checkpoint_wrapper,
                                   check_fn: Callable[[nn.Cell], bool] = lambda _: True,
                                   auto_wrap_policy: Any = None, **wrapper_kwargs: Any) -> nn.Cell:
    """Wrap every Cell under ``model`` (``model`` itself excluded) for which ``check_fn`` is true,
    outermost first (a Cell under a wrapped one is not wrapped again); returns ``model``.

    Args:
        model: the root Cell (changed in place).
        checkpoint_wrapper_fn: the wrapper, ``fn(cell, **wrapper_kwargs)`` (default :func:`checkpoint_wrapper`).
        check_fn: ``cell -> bool``: which Cells to wrap (PyTorch's name), e.g. ``lambda c: isinstance(c, Block)``.
        auto_wrap_policy: PyTorch's other way to choose: a set of Cell classes (``ModuleWrapPolicy``'s
            argument) or a callable ``cell -> bool``; the Cells it and ``check_fn`` both accept are wrapped.
        wrapper_kwargs: passed to ``checkpoint_wrapper_fn`` (``policy="selective"``).

    Example::

        apply_activation_checkpointing(model, check_fn=lambda c: isinstance(c, Block), policy="selective")
    """
    if not isinstance(model, nn.Cell):
        raise TypeError(f"apply_activation_checkpointing needs an nn.Cell, got {type(model).__name__}")
    policy_fn = _wrap_policy(auto_wrap_policy)
    chosen: List[Tuple[str, nn.Cell]] = []
    for path, cell in named_cells(model).items():
        if path and check_fn(cell) and policy_fn(cell) and not any(path.startswith(p + ".") for p, _ in chosen):
            chosen.append((path, cell))
    wrapped = [p for p, c in named_cells(model).items() if isinstance(c, CheckpointWrapper)]
    for path, cell in chosen:
        outer = [p or "<root>" for p in wrapped if not p or path.startswith(p + ".")]
        if outer:
            raise ValueError(f"apply_activation_checkpointing: '{path}' is inside the checkpointed {outer}; "
                             "nested checkpoints would run its forward three times")
        _check_not_nested(cell)
    for _, cell in chosen:
        checkpoint_wrapper_fn(cell, **wrapper_kwargs)
    return model


def _wrap_policy(policy: Any) -> Callable[[nn.Cell], bool]:
    """``auto_wrap_policy`` as ``cell -> bool``: ``None`` every Cell, a set of Cell classes those
    classes, a callable itself."""
    if policy is None:
        return lambda _: True
    if isinstance(policy, (set, frozenset, tuple, list)) and all(isinstance(c, type) for c in policy):
        classes = tuple(policy)
        return lambda cell: isinstance(cell, classes)
    if callable(policy):
        return policy
    raise TypeError(f"auto_wrap_policy must be a set of Cell classes or a callable cell -> bool, got {policy!r}")

