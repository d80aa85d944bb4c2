"""``clip_grad_norm``: scale the gradients of a sharded model by its global gradient norm.

Example::

    reducer = GradientReducer(optimizer.parameters)
    loss, grads = grad_fn(x, y)
    grads, total = clip_grad_norm(reducer(grads), 1.0, parameters=optimizer.parameters)
    optimizer(grads)
"""
from __future__ import annotations

import math
import numbers
import weakref
from typing import Dict, Optional, Sequence, Tuple, Union

import mindspore as ms
import numpy as np
from mindspore import Tensor, ops

from .._mindspore import is_compiling, run_in_python, running_eagerly
from ..dtensor import DTensor
from ..pipelining._schedule_base import PipelineSchedule
from ._norm import TotalGradNorm, check_norm_type, parameter_list

__all__ = ["clip_grad_norm"]

# (ids of the parameters or the schedule, norm type) -> (weak references to them, TotalGradNorm): an
# entry goes when one of them is collected (the cache holds none of them), so an id reused by a new
# object never finds a stale norm
_NORMS: Dict[Tuple, Tuple[Tuple[weakref.ref, ...], TotalGradNorm]] = {}


def _cached_norm(owners: tuple, norm_type: float) -> TotalGradNorm:
    """The :class:`TotalGradNorm` of ``owners`` (the Parameters, or a pipeline schedule), built once."""
    key = (tuple(id(o) for o in owners), norm_type)
    known = _NORMS.get(key)
    if known is not None and all(ref() is o for ref, o in zip(known[0], owners)):
        return known[1]
    norm = TotalGradNorm(owners[0] if isinstance(owners[0], PipelineSchedule) else owners, norm_type=norm_type)

    def forget(_ref) -> None:
        if _NORMS.get(key, (None,))[0] is refs:
            del _NORMS[key]
    refs = tuple(weakref.ref(o, forget) for o in owners)
    _NORMS[key] = (refs, norm)
    return norm


@run_in_python
def _norm_of(parameters, norm_type, error_if_nonfinite: bool) -> TotalGradNorm:
    p = check_norm_type(norm_type)
    if isinstance(parameters, TotalGradNorm):
        if p != parameters.norm_type:
            raise ValueError(f"clip_grad_norm: norm_type={norm_type!r} but the TotalGradNorm passed as parameters "
                             f"was built with norm_type={parameters.norm_type}")
        norm = parameters
    else:
        parameters = parameter_list(parameters, "clip_grad_norm")
        norm = _cached_norm((parameters,) if isinstance(parameters, PipelineSchedule) else tuple(parameters), p)
    if error_if_nonfinite and is_compiling():
        raise NotImplementedError("clip_grad_norm(error_if_nonfinite=True) cannot raise from inside ms.jit: "
                                  "return total_norm from the compiled step and check it outside, or call "
                                  "clip_grad_norm in PyNative")
    return norm


_MAX_NORM = "max_norm must be a number >= 0 or a one-element Tensor"


@run_in_python
def _check_max_norm(max_norm) -> float:
    """A Python ``max_norm`` as a float (a constant inside ``ms.jit``: checked while compiling)."""
    if isinstance(max_norm, bool) or not isinstance(max_norm, numbers.Real):
        fix = f" (pass {float(max_norm)!r})" if isinstance(max_norm, str) and _is_number(max_norm) else ""
        raise TypeError(f"clip_grad_norm: {_MAX_NORM}, got {max_norm!r} ({type(max_norm).__name__}){fix}")
    if not max_norm >= 0:
        raise ValueError(f"clip_grad_norm: {_MAX_NORM}, got {max_norm!r} (a negative one would flip the gradients)")
    return float(max_norm)


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


@run_in_python
def _scalar_shape(shape: Tuple[int, ...]) -> Tuple[int, ...]:
    """``()`` for a Tensor ``max_norm`` of one element (its static shape: inside ``ms.jit`` checked while
    compiling, and the reshape to it depends on the check)."""
    if int(np.prod(shape)) != 1:
        raise ValueError(f"clip_grad_norm: {_MAX_NORM}, got a Tensor of shape {tuple(shape)}")
    return ()


def _check_max_norm_value(max_norm: Tensor) -> None:
    """PyNative: a Tensor ``max_norm``'s value (one device-to-host read)."""
    value = float(max_norm.asnumpy().reshape(()))
    if not value >= 0:
        raise ValueError(f"clip_grad_norm: {_MAX_NORM}, got Tensor({value}) (a negative one would flip the gradients)")


def _raise_if_nonfinite(total: Tensor, norm_type: float) -> None:
    value = float(total.asnumpy())
    if not math.isfinite(value):
        raise RuntimeError(f"clip_grad_norm: the total norm of order {norm_type} of the gradients is {value} "
                           "(non-finite) on every rank: clipping would turn every gradient into nan or 0. "
                           "Skip this step (all_finite), or pass error_if_nonfinite=False")


def _clip(grads, max_norm, norm: TotalGradNorm, nan_if_negative: bool = False):
    total = norm(grads)
    # PyTorch's coefficient: max_norm / (total + 1e-6), at most 1 (max_norm 0 zeroes the gradients)
    coef = ops.minimum(max_norm / (total + 1e-6), 1.0)
    if nan_if_negative:
        # compiled code cannot raise on a value: a negative (or NaN) max_norm makes every gradient NaN
        # (the next loss and all_finite show it) instead of flipping their signs
        coef = ops.where(max_norm >= 0, coef, float("nan"))
    out = ()
    for g in grads:
        out = out + ((g * coef).astype(g.dtype),)
    return out, total


def _clip_eager(grads, max_norm, norm: TotalGradNorm, norm_type, error_if_nonfinite: bool):
    """PyNative: DTensor gradients (Partial dims reduced first) clipped as their local pieces and
    returned as DTensors; the non-finite check."""
    specs = []
    local = []
    for g in grads:
        if isinstance(g, DTensor):
            if any(p.is_partial() for p in g.placements):
                g = g.reduce_partial()
            specs.append((g.device_mesh, g.placements, tuple(g.shape)))
            g = g.to_local()
        else:
            specs.append(None)
        local.append(g)
    out, total = _clip(tuple(local), max_norm, norm)
    if error_if_nonfinite:
        _raise_if_nonfinite(total, norm_type)
    out = tuple(g if spec is None else DTensor.from_local(g, spec[0], spec[1], shape=spec[2])
                for g, spec in zip(out, specs))
    return out, total


def clip_grad_norm(grads: Sequence[Tensor], max_norm: Union[float, Tensor], *,
                   parameters, norm_type: float = 2.0, error_if_nonfinite: bool = False,
                   foreach: Optional[bool] = None) -> Tuple[Tuple[Tensor, ...], Tensor]:
    """Clip gradients by the norm of the global gradient, as PyTorch's ``clip_grad_norm_`` does on one
    device: each gradient times ``min(max_norm / (total + 1e-6), 1)`` (``ops.clip_by_global_norm``'s
    ``max_norm / max(total, max_norm)`` but for the ``1e-6``; ``max_norm=0`` zeroes them).
    The total is the one-device norm: pieces summed over the mesh dims their parameter is split on,
    replicated gradients counted once (see :class:`TotalGradNorm`). Give it reduced gradients (after
    :class:`GradientReducer`, which sums SequenceParallel shares; fully_shard / hsdp pieces as
    returned): clip after the reduction, never before. PyNative and inside ``ms.jit``.

    Args:
        grads: this rank's gradients, a tuple aligned with ``parameters`` (DTensors too, in PyNative:
            Partial ones are reduced first). Each must have its parameter's local shape (refused
            otherwise, naming the first that differs; inside ``ms.jit`` while compiling).
        max_norm: the largest total norm kept: a number >= 0 or a one-element Tensor (a string, a
            bool, a negative number and a Tensor of more elements are refused). A Tensor's value is
            checked in PyNative (negative refused); inside ``ms.jit`` only its shape is (compiled code
            cannot raise on a value): there a negative one makes every gradient NaN instead of
            flipping their signs.
        parameters: the Parameters (``optimizer.parameters``, or the weights given to
            ``ms.value_and_grad``, e.g. ``model.trainable_params()``; one Parameter alone too); a
            pipeline schedule (every stage's gradients in the norm, ``grads`` aligned with
            ``schedule.parameters()``); or, inside ``ms.jit``, a :class:`TotalGradNorm` built from them
            outside (a compiled graph sees no sharding records). Its norm is built once per parameter
            tuple and kept while they live. A Cell or ``None`` is refused, naming what to pass.
        norm_type: ``2.0`` (default), any positive order, or ``float("inf")`` (``"inf"`` too; the
            Frobenius norm PyTorch users may write as ``"fro"`` is ``2.0``).
        error_if_nonfinite: raise ``RuntimeError`` on every rank when the total is nan or inf
            (PyNative only: inside ``ms.jit`` it raises at compile time, naming the fix).
        foreach: PyTorch's choice of kernels (``None`` / ``True`` / ``False``); accepted, the same
            result either way.

    Returns:
        ``(clipped_grads, total_norm)``: a tuple the optimizer takes, and the norm before clipping.

    Example::

        grads, total = clip_grad_norm(reducer(grads), 1.0, parameters=optimizer.parameters)
        optimizer(grads)
    """
    if foreach is not None and not isinstance(foreach, bool):
        raise TypeError(f"clip_grad_norm: foreach must be None or a bool, got {foreach!r}")
    if isinstance(max_norm, Tensor):
        max_norm = max_norm.astype(ms.float32).reshape(_scalar_shape(max_norm.shape))
    else:
        max_norm = _check_max_norm(max_norm)
    norm = _norm_of(parameters, norm_type, error_if_nonfinite)
    if running_eagerly():
        if isinstance(max_norm, Tensor):
            _check_max_norm_value(max_norm)
        return _clip_eager(grads, max_norm, norm, norm_type, error_if_nonfinite)
    return _clip(grads, max_norm, norm, isinstance(max_norm, Tensor))
