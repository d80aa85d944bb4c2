"""Regions excluded from recomputation inside a checkpointed Cell (HyperParallel's
``checkpoint_exclude_wrapper``).

Inside the forward of a Cell wrapped by :func:`~hyper_parallel_ms.training.checkpoint_wrapper`,
an excluded region (a Cell or any callable) runs once and keeps the tensors its backward needs
(the checkpoint's own hooks are set aside for it); its output is held for the checkpoint's
recompute, which gets the output back instead of running the region again. Outside a checkpoint
the region runs as it is. Worth it for a region that is costly to run again and cheap to keep,
or one with side effects that must happen once (a collective, a counter).

- PyNative only (the exclusion rides on the checkpoint's PyNative recompute); ms.jit /
  GRAPH_MODE refuse it while compiling.
- The region must not write its tensor inputs in place (its kept tensors would no longer be the
  forward's), and must return the same output structure each call.
- Selective checkpoint policies do not record the region's ops (nothing of it runs in the
  recompute).

Example::

    from hyper_parallel_ms.training import checkpoint_exclude_wrapper, checkpoint_wrapper
    checkpoint_exclude_wrapper(block.router)   # computed once, kept
    checkpoint_wrapper(block)                  # the rest of the block recomputed in the backward
"""
from __future__ import annotations

import functools
from typing import Any, Callable, Union

from mindspore import nn

from .._mindspore import discard_grad_recording, refuse_while_compiling, running_eagerly, saved_tensors_hooks
from ..nn._adapter import CellChanges
from ._policies import _EXCLUDING
from ._recompute import _PHASE, checkpoint_phase, wrapped_class

__all__ = ["CheckpointExcludeWrapper", "ExcludeStats", "checkpoint_exclude_wrapper", "exclude_stats"]

_STATE = "_hpms_exclude"
_GRAPH_ERROR = ("{name} is excluded from recomputation (checkpoint_exclude_wrapper), which works with the PyNative "
                "recompute of checkpoint_wrapper; MindSpore's graph recompute has no per-region exclusion. Run it in "
                "PyNative, or unwrap the region under ms.jit / GRAPH_MODE")


class ExcludeStats:
    """What an excluded region did: ``runs`` (runs inside a checkpoint's forward, its output kept),
    ``replays`` (its kept output handed to a recompute instead of running), ``plain`` (runs outside
    any checkpoint), ``kept_tensors`` / ``kept_bytes`` (tensors its runs inside a checkpoint kept
    for the backward).

    Example::

        stats = exclude_stats(block.router)
        stats.runs, stats.replays            # 1, 1 after one step of a checkpointed block
    """

    def __init__(self) -> None:
        self.runs = self.replays = self.plain = self.kept_tensors = self.kept_bytes = 0

    def __repr__(self) -> str:
        return (f"ExcludeStats(runs={self.runs}, replays={self.replays}, plain={self.plain}, "
                f"kept_tensors={self.kept_tensors}, kept_bytes={self.kept_bytes})")


class _State:
    def __init__(self) -> None:
        self.stats = ExcludeStats()

    def keep(self, t: Any) -> Any:
        self.stats.kept_tensors += 1
        self.stats.kept_bytes += getattr(t, "nbytes", 0)
        return t

    def run(self, key: int, fn: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
        phase = checkpoint_phase()
        if phase is None:
            self.stats.plain += 1
            return fn(*args, **kwargs)
        invocation, recomputing = phase
        if recomputing:
            queue = invocation.outputs.get(key)
            if not queue:
                raise RuntimeError(
                    "checkpoint_exclude_wrapper: the recompute called an excluded region more often than the forward "
                    "did; the checkpointed forward must call its excluded regions the same way each time")
            self.stats.replays += 1
            return queue.popleft()
        token = _PHASE.set(None)             # inside the region: no checkpoint (nested exclusions run as they are)
        _EXCLUDING.depth += 1
        try:
            with saved_tensors_hooks(self.keep, _unpack):   # kept: the checkpoint's own hooks set aside
                out = fn(*args, **kwargs)
        finally:
            _EXCLUDING.depth -= 1
            _PHASE.reset(token)
        self.stats.runs += 1
        invocation.outputs[key].append(out)
        return out


def _unpack(t: Any) -> Any:
    return t


class CheckpointExcludeWrapper:
    """The methods a Cell gains from :func:`checkpoint_exclude_wrapper` (``isinstance(cell,
    CheckpointExcludeWrapper)`` tells an excluded Cell); its parameters, names and path are unchanged.

    Example::

        checkpoint_exclude_wrapper(block.router)
        isinstance(block.router, CheckpointExcludeWrapper)     # True
    """

    def __call__(self, *args, **kwargs):
        state: _State = self.__dict__[_STATE]
        if not running_eagerly():
            return self._hpms_exclude_call(*args, **kwargs)
        try:
            return state.run(id(self), self._hpms_exclude_call, args, kwargs)
        except Exception:
            discard_grad_recording()
            raise

    def construct(self, *args, **kwargs):
        if not running_eagerly():
            refuse_while_compiling(self._hpms_exclude_graph_error)
        return self._hpms_exclude_construct(*args, **kwargs)


class _ExcludedCallable:
    """A callable (function, bound method, Primitive) excluded from recomputation."""

    def __init__(self, fn: Callable[..., Any]) -> None:
        functools.update_wrapper(self, fn, updated=())
        self._hpms_fn = fn
        self.__dict__[_STATE] = _State()

    def __call__(self, *args, **kwargs):
        try:
            return self.__dict__[_STATE].run(id(self), self._hpms_fn, args, kwargs)
        except Exception:
            discard_grad_recording()
            raise

    def __repr__(self) -> str:
        return f"checkpoint_exclude_wrapper({self._hpms_fn!r})"


def checkpoint_exclude_wrapper(module: Union[nn.Cell, Callable[..., Any]], *,
                               save_output: bool = True) -> Union[nn.Cell, Callable[..., Any]]:
    """Exclude ``module`` from the recomputation of the checkpointed Cell it runs in: it runs once
    in the checkpoint's forward and keeps what its backward needs; the recompute gets its output
    back instead of running it. Outside a checkpoint it runs as it is. A Cell is wrapped in place
    and returned (names and paths unchanged); another callable comes back wrapped.

    Args:
        module: an ``nn.Cell`` or a callable (function, bound method, Primitive) that a
            checkpointed Cell calls.
        save_output: HyperParallel's keyword: ``True`` only (the output is kept for the recompute).

    Example::

        block.attention.core = checkpoint_exclude_wrapper(block.attention.core)
        block.mlp.act = checkpoint_exclude_wrapper(block.mlp.act)      # a function attribute
        checkpoint_wrapper(block)
    """
    if save_output is not True:
        raise NotImplementedError("checkpoint_exclude_wrapper(save_output=False): the region's output is always kept "
                                  "for the recompute here; leave save_output=True")
    if isinstance(module, (CheckpointExcludeWrapper, _ExcludedCallable)):
        raise ValueError(f"checkpoint_exclude_wrapper: {module!r} is already excluded from recomputation")
    if isinstance(module, nn.Cell):
        with CellChanges() as changes:
            changes.set_attribute(module, _STATE, _State())
            changes.set_attribute(module, "_hpms_exclude_graph_error", _GRAPH_ERROR.format(name=type(module).__name__))
            changes.swap_class(module, wrapped_class(CheckpointExcludeWrapper, type(module), "exclude"))
        return module
    if not callable(module):
        raise TypeError(f"checkpoint_exclude_wrapper needs an nn.Cell or a callable, got {type(module).__name__}")
    return _ExcludedCallable(module)


def exclude_stats(region: Any) -> ExcludeStats:
    """The :class:`ExcludeStats` of a region wrapped by :func:`checkpoint_exclude_wrapper`.

    Args:
        region: what :func:`checkpoint_exclude_wrapper` returned.

    Example::

        exclude_stats(block.router).replays
    """
    state = getattr(region, "__dict__", {}).get(_STATE)
    if not isinstance(state, _State):
        raise ValueError(f"{region!r} is not excluded from recomputation: wrap it with checkpoint_exclude_wrapper "
                         "first")
    return state.stats
