"""Activation swapping: HyperParallel's ``swap_wrapper`` on MindSpore's saved-tensor hooks.

A wrapped Cell's forward keeps host copies of the activations autodiff saves for the backward
(not of Parameters, which stay alive anyway), and the backward reads them back onto the device:
device memory traded for two copies per saved tensor, with no recompute. The Cell is wrapped in
place (its class gains :class:`SwapWrapper`), so parameter names and paths do not change.

- PyNative only (MindSpore's ``saved_tensors_hooks``); ms.jit / GRAPH_MODE refuse it while
  compiling. Not inside or around a checkpointed Cell (a recompute keeps nothing to swap).
- Copies are synchronous (``asnumpy`` to host, a new Tensor back). HyperParallel's asynchronous
  copies on a side stream and ``group_swap`` fusion are not built: ``group_swap=True`` raises.
- On MindSpore's CPU backend host and device are one memory: the swap is exact and counted
  (:func:`swap_stats`), and saves nothing there.

Example::

    from hyper_parallel_ms.training import swap_wrapper
    for block in model.layers:
        swap_wrapper(block, policy_fn=lambda t: t.nbytes >= 1 << 20)
"""
from __future__ import annotations

import weakref
from typing import Any, Callable, List, Optional

import mindspore as ms
import numpy as np
from mindspore import Parameter, Tensor, nn

from .._mindspore import SAVED_TENSOR_HOOKS, discard_grad_recording, refuse_while_compiling, saved_tensors_hooks
from ..nn._adapter import CellChanges, named_cells
from ._recompute import _RUNNING, CheckpointWrapper, wrapped_class

__all__ = ["SwapWrapper", "swap_wrapper", "swap_stats", "SwapStats"]

_STATE = "_hpms_swap"
_GRAPH_ERROR = ("{name} is wrapped by swap_wrapper, which moves saved activations with PyNative's saved-tensor "
                "hooks; MindSpore's graph autodiff has none. Run it in PyNative, or use checkpoint_wrapper "
                "(graph recompute) under ms.jit / GRAPH_MODE")


class SwapStats:
    """What a swapping Cell moved: ``tensors`` and ``bytes`` copied to host, ``restored`` read back
    (``prefetched`` of them read back ahead of their use, by a prefetch order).

    Example::

        swap_stats(block).bytes       # bytes kept on the host by the forwards so far
    """

    def __init__(self) -> None:
        self.tensors = self.bytes = self.restored = self.prefetched = 0

    def __repr__(self) -> str:
        return (f"SwapStats(tensors={self.tensors}, bytes={self.bytes}, restored={self.restored}, "
                f"prefetched={self.prefetched})")


class _HostCopy:
    """A saved tensor's host copy (bfloat16 travels as float32: numpy has no bfloat16)."""

    def __init__(self, t: Tensor) -> None:
        self.dtype = t.dtype
        wide = t.astype(ms.float32) if t.dtype == ms.bfloat16 else t
        self.array = np.array(wide.asnumpy(), copy=True)
        self.ahead: Optional[Tensor] = None      # read back ahead of its use (a prefetch)

    def restore(self) -> Tensor:
        if self.ahead is not None:
            t, self.ahead = self.ahead, None
            return t
        t = Tensor(self.array)
        return t.astype(self.dtype) if t.dtype != self.dtype else t


class _State:
    def __init__(self, policy_fn: Optional[Callable[[Tensor], bool]]) -> None:
        self.policy_fn = policy_fn
        self.stats = SwapStats()
        self.pending: List[weakref.ref] = []     # host copies not read back yet

    def prefetch(self) -> int:
        """Read back every host copy not read back yet (ahead of its use); how many."""
        count = 0
        for ref in self.pending:
            kept = ref()
            if kept is not None and kept.ahead is None:
                kept.ahead = kept.restore()
                count += 1
        self.pending = []
        self.stats.prefetched += count
        return count

    def pack(self, t: Any) -> Any:
        if type(t) is not Tensor or isinstance(t, Parameter) or (self.policy_fn is not None and not self.policy_fn(t)):
            return t
        self.stats.tensors += 1
        self.stats.bytes += t.nbytes
        kept = _HostCopy(t)
        self.pending = [ref for ref in self.pending if ref() is not None]
        self.pending.append(weakref.ref(kept))
        return kept

    def unpack(self, kept: Any) -> Any:
        if isinstance(kept, _HostCopy):
            self.stats.restored += 1
            return kept.restore()
        return kept


class SwapWrapper:
    """The methods a Cell gains from :func:`swap_wrapper` (``isinstance(cell, SwapWrapper)`` tells
    a wrapped Cell). Its parameters, their names and its path are unchanged.

    Example::

        swap_wrapper(block)
        isinstance(block, SwapWrapper)       # True
    """

    def __call__(self, *args, **kwargs):
        state: _State = self.__dict__[_STATE]
        outer = getattr(_RUNNING, "cell", None)
        if outer is not None:
            raise ValueError(f"{type(self).__name__} is swapped and runs inside the checkpointed {type(outer).__name__}, "
                             "whose forward keeps nothing to swap: wrap either the outer Cell or its parts")
        try:
            with saved_tensors_hooks(state.pack, state.unpack):
                return self._hpms_swap_call(*args, **kwargs)
        except Exception:
            discard_grad_recording()      # a failed forward under a gradient call leaves no record
            raise

    def construct(self, *args, **kwargs):
        refuse_while_compiling(self._hpms_swap_graph_error)      # raises only while MindSpore compiles it
        return self._hpms_swap_construct(*args, **kwargs)


def _check_placement(cell: nn.Cell) -> None:
    inside = [path or "<itself>" for path, sub in named_cells(cell).items()
              if isinstance(sub, (SwapWrapper, CheckpointWrapper))]
    if inside:
        raise ValueError(f"swap_wrapper({type(cell).__name__}): {inside} already swapped or checkpointed; wrap "
                         "each Cell once, with one of swap_wrapper and checkpoint_wrapper")


def swap_wrapper(module: nn.Cell, policy_fn: Optional[Callable[[Tensor], bool]] = None,
                 group_swap: bool = False) -> nn.Cell:
    """Keep host copies of the activations ``module``'s forward saves for the backward, read back in
    the backward (HyperParallel's ``swap_wrapper``). Wraps in place and returns ``module``;
    parameter names and paths do not change. PyNative only.

    Args:
        module: the Cell (no swapped or checkpointed Cell under it).
        policy_fn: ``tensor -> bool``: which saved tensors to swap (default: all but Parameters).
        group_swap: HyperParallel's fused group copies; not supported (``True`` raises).

    Example::

        swap_wrapper(model.layers[0].attention)
        swap_stats(model.layers[0].attention).tensors      # after a forward under a gradient call
    """
    if not isinstance(module, nn.Cell):
        raise TypeError(f"swap_wrapper needs an nn.Cell, got {type(module).__name__}")
    if policy_fn is not None and not callable(policy_fn):
        raise TypeError(f"swap_wrapper policy_fn must be a callable tensor -> bool, got {policy_fn!r}")
    if group_swap:
        raise ValueError("swap_wrapper(group_swap=True): fused group copies are not built here; each saved tensor "
                         "is copied on its own (group_swap=False)")
    if not SAVED_TENSOR_HOOKS:
        raise NotImplementedError(f"swap_wrapper needs mindspore.saved_tensors_hooks (MindSpore 2.9 and later); "
                                  f"MindSpore {ms.__version__} lacks it: use checkpoint_wrapper")
    _check_placement(module)
    with CellChanges() as changes:
        changes.set_attribute(module, _STATE, _State(policy_fn))
        changes.set_attribute(module, "_hpms_swap_graph_error", _GRAPH_ERROR.format(name=type(module).__name__))
        changes.swap_class(module, wrapped_class(SwapWrapper, type(module), "swap"))
    return module


def swap_stats(cell: nn.Cell) -> SwapStats:
    """The :class:`SwapStats` of a Cell wrapped by :func:`swap_wrapper`.

    Args:
        cell: a swapping Cell.

    Example::

        swap_stats(block).bytes
    """
    state = cell.__dict__.get(_STATE) if isinstance(cell, nn.Cell) else None
    if state is None:
        raise ValueError(f"{type(cell).__name__} is not swapped: wrap it with swap_wrapper first")
    return state.stats


def prefetch_swapped(cell: nn.Cell) -> int:
    """Read back now the host copies kept by the swapping Cells at or under ``cell`` that their
    backward has not used yet (the prefetch of a swap order); returns how many."""
    return sum(sub.__dict__[_STATE].prefetch() for sub in named_cells(cell).values() if isinstance(sub, SwapWrapper))


def swapped_cells(cell: nn.Cell) -> List[str]:
    """The paths of the swapping Cells at or under ``cell`` (``""``: ``cell`` itself)."""
    return [path for path, sub in named_cells(cell).items() if isinstance(sub, SwapWrapper)]
