"""Autodiff beyond ``ms.value_and_grad``: saved-tensor hooks, a PyNative tape differentiated later
(pipeline schedules), and recompute (activation checkpointing).

Contracts: inside ``mindspore.saved_tensors_hooks(pack, unpack)`` (2.10) PyNative autodiff passes
every tensor it keeps through ``pack`` (:func:`saved_tensors_hooks`); with the executor's grad flag
on, op results carry autodiff nodes and ``run_backward`` differentiates several kept forwards in any
order (:func:`taped_call`, :func:`tape_backward`); a failed gradient call leaves the executor
recording until ``clear_res()`` (:func:`discard_grad_recording`); ``mindspore.recompute(...,
use_reentrant=False, early_stop=False, context_fn=...)`` keeps nothing and runs the function again,
whole, in the backward (:func:`recompute_eagerly`), and compiles to graph recompute inside ``ms.jit``
(:func:`recompute_in_graph`).

Example::

    out = taped_call(stage_cell, x)
    grads = tape_backward((out,), (ones_like_out,), [x] + params)
"""
from __future__ import annotations

import inspect
import sys
import threading
from contextlib import contextmanager
from typing import Any, Callable, Iterator, List, Optional, Sequence, Tuple

import mindspore
import numpy as np
from mindspore import Tensor

from ._active import ACTIVE_RUNS
from .tensor_backward import recording_for_tensor_backward

__all__ = ["SAVED_TENSOR_HOOKS", "saved_tensors_hooks", "no_grad", "tensor_address", "taped", "taped_call",
           "tape_backward", "discard_grad_recording", "discard_tapes", "RECOMPUTE_CONTEXT_FN", "recompute_eagerly",
           "recomputing",
           "recompute_in_graph", "random_state", "set_random_state", "identity_with_gradient",
           "keeping_nothing", "call_keeping_nothing"]


SAVED_TENSOR_HOOKS = hasattr(mindspore, "saved_tensors_hooks") and hasattr(mindspore, "_no_grad")


def saved_tensors_hooks(pack: Callable[[Tensor], Any], unpack: Callable[[Any], Tensor]) -> Any:
    """A context in which autodiff keeps ``pack(t)`` for each tensor ``t`` it saves for the
    backward, and the backward reads ``unpack`` of it (PyNative).

    Args:
        pack: called with each saved tensor; returns what is kept.
        unpack: called with what ``pack`` returned, in the backward; returns the tensor.

    Example::

        with saved_tensors_hooks(lambda t: t, lambda t: t):
            loss = model(x)
    """
    if ACTIVE_RUNS:
        return ACTIVE_RUNS[-1].saved_tensors_hooks(pack, unpack)
    return mindspore.saved_tensors_hooks(pack, unpack)


def no_grad() -> Any:
    """A context in which PyNative ops are not recorded for autodiff."""
    if ACTIVE_RUNS:
        return ACTIVE_RUNS[-1].no_grad()
    return mindspore._no_grad()          # pylint: disable=protected-access


def tensor_address(t: Tensor) -> int:
    """The address of ``t``'s storage (views of one buffer at its start share it).

    >>> tensor_address(Tensor([1.0])) > 0
    True
    """
    if ACTIVE_RUNS:
        return ACTIVE_RUNS[-1].tensor_address(t)
    return t.data_ptr()


# ------------------------------------------------------------ autograd tape
@contextmanager
def taped() -> Iterator[None]:
    """Record the autodiff nodes of the PyNative ops run inside (the executor's grad flag),
    restoring the flag after; :func:`tape_backward` differentiates what was recorded."""
    from mindspore.common.api import _pynative_executor
    before = _pynative_executor.grad_flag()
    _pynative_executor.set_grad_flag(True)
    try:
        yield
    finally:
        _pynative_executor.set_grad_flag(before)


def taped_call(top: Callable, *args: Any) -> Any:
    """``top(*args)`` with its autodiff tape recorded as one top graph of the PyNative executor
    (as ``ms.grad`` records it), for :func:`tape_backward` to differentiate later. Cells with a
    custom ``bprop`` (the collectives' Cells, so tensor-parallel styles and fully_shard) need
    that top graph: under a bare :func:`taped` they fail with "The pointer[top_cell_] is null".
    Several such tapes may be kept and differentiated in any order.

    Example::

        out = taped_call(stage_cell, x)
        grads = tape_backward((out,), (ones_like_out,), [x] + params)
    """
    if ACTIVE_RUNS:
        return ACTIVE_RUNS[-1].taped_call(top, *args)
    from mindspore.common.api import _pynative_executor
    before = _pynative_executor.grad_flag()
    _pynative_executor.set_grad_flag(True)
    try:
        _pynative_executor.new_graph(top, *args)
        out = top(*args)
        _pynative_executor.end_graph(top, out, *args)
    finally:
        _pynative_executor.set_grad_flag(before)
    return out


def tape_backward(outputs: Sequence[Tensor], sens: Sequence[Tensor], inputs: Sequence[Tensor],
                  keep_graph: bool = False) -> Tuple[Optional[Tensor], ...]:
    """Gradients of ``inputs`` (``None`` where unreached) of ``sum(outputs * sens)`` from a
    forward recorded under :func:`taped`; ``keep_graph=True`` allows another call on it. No
    ``inputs`` (a pipeline stage without trainable parameters or input gradients): nothing to
    compute, ``()`` (MindSpore refuses a backward without inputs)."""
    if not inputs:
        return ()
    if ACTIVE_RUNS:
        return ACTIVE_RUNS[-1].tape_backward(outputs, sens, inputs, keep_graph)
    from mindspore._c_expression import run_backward
    grads = run_backward(tuple(outputs), tuple(sens), keep_graph, False, tuple(inputs), True,
                         accumulate_grad=False)
    return tuple(grads)


def recording_gradients() -> bool:
    """Whether PyNative ops now are recorded for a gradient call (``ms.grad`` / ``ms.value_and_grad``
    running their function).

    >>> recording_gradients()
    False
    """
    from mindspore.common.api import _pynative_executor
    return bool(_pynative_executor.grad_flag())


def discard_grad_recording() -> None:
    """Drop what the PyNative executor recorded for a gradient call whose forward is failing (an
    error about to leave it): otherwise the executor stays recording and later in-place updates of
    Parameters fail. Nothing happens when no gradient call is recording.

    Example::

        try:
            check(cell)
        except Exception:
            discard_grad_recording()
            raise
    """
    from mindspore.common.api import _pynative_executor
    if _pynative_executor.grad_flag():
        _pynative_executor.clear_res()


def discard_tapes() -> None:
    """Drop every record :func:`taped_call` keeps, and the half-recorded one a failed call leaves
    open (kept so that earlier records still differentiate): a caller that gives up all its
    records (a failed pipeline step) must, or the open record takes in every later op of the
    process and breaks the next recorded call.

    Example::

        try:
            out = taped_call(stage, x)
        except Exception:
            discard_tapes()
            raise
    """
    from mindspore.common.api import _pynative_executor
    _pynative_executor.clear_res()


# ------------------------------------------------------------ recompute (activation checkpointing)
_RECOMPUTE_ARGS = inspect.signature(mindspore.recompute).parameters
# non-reentrant recompute with a whole second forward and a context_fn: MindSpore 2.9 and later
RECOMPUTE_CONTEXT_FN: bool = all(k in _RECOMPUTE_ARGS for k in ("use_reentrant", "early_stop", "context_fn"))


def random_state() -> Tuple[Any, dict]:
    """MindSpore's random state: the default generator's state and the per-op seed counters that
    functional random ops (``ops.dropout``, ``ops.uniform``, ...) advance in Python at each call
    (``mindspore.common.seed._KERNEL_SEED``). A primitive kept by a Cell (``nn.Dropout``'s) also
    keeps a generator in its kernel, which this does not hold.

    Example::

        state = random_state(); ops.dropout(x); set_random_state(state); ops.dropout(x)   # same mask
    """
    seed = sys.modules["mindspore.common.seed"]   # the module (mindspore.common.seed is a function)
    return mindspore.get_rng_state(), dict(seed._KERNEL_SEED)


def set_random_state(state: Tuple[Any, dict]) -> None:
    """Put back a :func:`random_state`."""
    seed = sys.modules["mindspore.common.seed"]   # the module (mindspore.common.seed is a function)
    mindspore.set_rng_state(state[0])
    seed._KERNEL_SEED.clear()
    seed._KERNEL_SEED.update(state[1])


def recompute_eagerly(fn: Callable, args: tuple, kwargs: dict, context_fn: Optional[Callable] = None) -> Any:
    """``fn(*args, **kwargs)`` (PyNative) keeping none of the tensors it saves for the backward:
    the backward runs ``fn`` again, whole (``early_stop=False``: Cell hooks after the last saved
    tensor, such as fully_shard's reshard, run too). ``context_fn() -> (forward ctx, recompute ctx)``."""
    if not RECOMPUTE_CONTEXT_FN and not ACTIVE_RUNS:
        raise NotImplementedError(
            f"activation checkpointing needs mindspore.recompute(use_reentrant=False, early_stop=..., context_fn=...) "
            f"(MindSpore 2.9 and later); MindSpore {mindspore.__version__} lacks it: upgrade MindSpore")

    forward_rng = []
    record = RecomputeRecord()

    def flagged(*inner_args, **inner_kwargs):     # the forward and its recompute in the backward alike
        # the recompute draws seeds as the forward did and leaves the random state as it found it
        # (PyTorch's preserve_rng_state): random ops that take their seeds in Python advance it
        after = None
        replay = bool(forward_rng)             # the second call: the recompute in the backward
        if forward_rng:
            after = random_state()
            set_random_state(forward_rng[0])
        else:
            forward_rng.append(random_state())
        _RECOMPUTING.depth += 1
        _RECOMPUTING.replays += replay
        record.replaying, record.next = replay, 0
        _RECOMPUTING.records.append(record)
        try:
            return fn(*inner_args, **inner_kwargs)
        finally:
            _RECOMPUTING.records.pop()
            _RECOMPUTING.depth -= 1
            _RECOMPUTING.replays -= replay
            if after is not None:
                set_random_state(after)
    if ACTIVE_RUNS:
        return ACTIVE_RUNS[-1].recompute(flagged, args, kwargs, context_fn)
    return mindspore.recompute(flagged, *args, use_reentrant=False, early_stop=False, context_fn=context_fn, **kwargs)


class _Recomputing(threading.local):
    depth = 0
    replays = 0

    def __init__(self) -> None:
        self.records: List["RecomputeRecord"] = []


class RecomputeRecord:
    """Host values one checkpointed call keeps in its forward (:meth:`keep`) and reads back, in
    the same order, in its recompute (:meth:`take`): code run twice checks that the recompute saw
    what the forward saw (an expert-parallel dispatch's token counts)."""

    def __init__(self) -> None:
        self.values: List[Any] = []
        self.replaying, self.next = False, 0

    def keep(self, value: Any) -> None:
        """In the forward: remember ``value`` for the recompute."""
        self.values.append(value)

    def take(self) -> Any:
        """In the recompute: the forward's next kept value (``None`` when the forward kept no more)."""
        if self.next >= len(self.values):
            return None
        self.next += 1
        return self.values[self.next - 1]


_RECOMPUTING = _Recomputing()


def recomputing() -> bool:
    """Whether Python runs inside :func:`recompute_eagerly`'s function (its forward or its
    recompute in the backward): MindSpore keeps none of the tensors saved there, so code that
    would free them itself (fully_shard's reshard) has nothing to do.

    >>> recomputing()
    False
    """
    return _RECOMPUTING.depth > 0


def recompute_record() -> Optional[RecomputeRecord]:
    """The :class:`RecomputeRecord` of the innermost :func:`recompute_eagerly` call running now
    (its forward or its recompute: ``record.replaying`` tells), ``None`` outside one.

    >>> recompute_record() is None
    True
    """
    return _RECOMPUTING.records[-1] if _RECOMPUTING.records else None


def replaying() -> bool:
    """Whether Python runs :func:`recompute_eagerly`'s function for its recompute in the backward
    (not for the forward): state a forward updates in place (an MoE's token counters) is updated
    once, by the forward, not again by the recompute.

    >>> replaying()
    False
    """
    return _RECOMPUTING.replays > 0


def recompute_in_graph(method: Callable, *args: Any, **kwargs: Any) -> Any:
    """Inside ms.jit / GRAPH_MODE: ``method(*args)`` (a Cell's bound method) marked for MindSpore's
    graph recompute pass (its forward ops are computed again in the backward)."""
    return mindspore.recompute(method, *args, **kwargs)


# ------------------------------------------------ an identity whose backward keeps nothing
def identity_with_gradient(x: Tensor, backward: Callable[[Tensor], Tensor]) -> Tensor:
    """PyNative: ``x``'s value as a new tensor (``x - 0``, exact, signed zeros included), whose
    gradient reaches ``x`` as ``backward(dout)`` (a tensor hook), keeping no tensor for the
    backward. A Cell with a custom ``bprop`` keeps its input and its output whether its bprop
    reads them or not, and every op that keeps such a Cell's output for its own backward keeps a
    copy of it (measured, MindSpore 2.10: three q / k / v projections reading one converted input
    kept three copies; ``tests/test_activation_memory.py``). Floating-point ``x`` only.

    Args:
        x: the input (floating point).
        backward: the gradient of ``x`` from the gradient of the result (same shape).

    Example::

        y = identity_with_gradient(x, lambda d: all_reduce(d, mesh, 0))
    """
    if ACTIVE_RUNS:
        return ACTIVE_RUNS[-1].identity_with_gradient(x, backward)
    y = x - 0
    if recording_for_tensor_backward() and y._grad_node is None:
        return y        # loss.backward() records: nothing reaching x needs a gradient, nothing to hook
    y.register_hook(backward)
    return y


def _dropped(_t: Any) -> None:
    return None


def _empty(_packed: Any) -> Tensor:
    return Tensor(np.zeros((0,), np.float32))


@contextmanager
def keeping_nothing() -> Iterator[None]:
    """Inside (PyNative), autodiff keeps no tensor for the backward: a backward that reads one it
    saved gets an empty tensor. For a custom-``bprop`` Cell whose bprop reads neither its inputs
    nor its output, which MindSpore keeps all the same (measured, 2.10: a sequence-parallel
    gather's whole output; ``tests/test_activation_memory.py``); only such a Cell may run inside.
    Without ``mindspore.saved_tensors_hooks`` (before 2.9) the tensors are kept.

    Example::

        with keeping_nothing():
            y = redistribution_cell(x)      # its bprop reads only dout
    """
    if ACTIVE_RUNS:
        with ACTIVE_RUNS[-1].keeping_nothing():
            yield
    elif SAVED_TENSOR_HOOKS:
        with mindspore.saved_tensors_hooks(_dropped, _empty):
            yield
    else:
        yield


def call_keeping_nothing(cell: Callable[[Tensor], Tensor], x: Tensor) -> Tensor:
    """PyNative: ``cell(x)`` under :func:`keeping_nothing` (``cell``: a custom-``bprop`` Cell whose
    bprop reads only the gradient), returned as an op's result (``- 0``), which the ops that keep it
    for their own backward share rather than each copy (measured, 2.10: the three q / k / v
    projections reading one Cell result kept three copies; ``tests/test_activation_memory.py``).

    Example::

        y = call_keeping_nothing(redistribution_cell, x)
    """
    with keeping_nothing():
        y = cell(x)
    return y - 0
