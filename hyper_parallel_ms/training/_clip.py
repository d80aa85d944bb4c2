"""``clip_grad_norm``: scale the gradients of a sharded model by its global gradient norm.

Example::

    reducer = GradientReducer(optimizer.parameters)
    loss, grads = grad_fn(x, y)
    grads, total = clip_grad_norm(reducer(grads), 1.0, parameters=optimizer.parameters)
    optimizer(grads)
"""
from __future__ import annotations

import math
import weakref
from typing import Dict, Optional, Sequence, Tuple, Union

from mindspore import Tensor, ops

from .._mindspore import is_compiling, run_in_python, running_eagerly
from ..dtensor import DTensor
from ..pipelining._schedule_base import PipelineSchedule
from ._norm import TotalGradNorm

__all__ = ["clip_grad_norm"]

# (ids of the parameters or the schedule, norm type) -> (weak references to them, TotalGradNorm): an
# entry goes when one of them is collected (the cache holds none of them), so an id reused by a new
# object never finds a stale norm
_NORMS: Dict[Tuple, Tuple[Tuple[weakref.ref, ...], TotalGradNorm]] = {}


def _cached_norm(owners: tuple, norm_type) -> TotalGradNorm:
    """The :class:`TotalGradNorm` of ``owners`` (the Parameters, or a pipeline schedule), built once."""
    key = (tuple(id(o) for o in owners), float(norm_type))
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
    if isinstance(parameters, TotalGradNorm):
        if float(norm_type) != parameters.norm_type:
            raise ValueError(f"clip_grad_norm: norm_type={norm_type!r} but the TotalGradNorm passed as parameters "
                             f"was built with norm_type={parameters.norm_type}")
        norm = parameters
    else:
        norm = _cached_norm((parameters,) if isinstance(parameters, PipelineSchedule) else tuple(parameters),
                            norm_type)
    if error_if_nonfinite and is_compiling():
        raise NotImplementedError("clip_grad_norm(error_if_nonfinite=True) cannot raise from inside ms.jit: "
                                  "return total_norm from the compiled step and check it outside, or call "
                                  "clip_grad_norm in PyNative")
    return norm


def _raise_if_nonfinite(total: Tensor, norm_type: float) -> None:
    value = float(total.asnumpy())
    if not math.isfinite(value):
        raise RuntimeError(f"clip_grad_norm: the total norm of order {norm_type} of the gradients is {value} "
                           "(non-finite) on every rank: clipping would turn every gradient into nan or 0. "
                           "Skip this step (all_finite), or pass error_if_nonfinite=False")


def _clip(grads, max_norm, norm: TotalGradNorm):
    total = norm(grads)
    # PyTorch's coefficient: max_norm / (total + 1e-6), at most 1 (max_norm 0 zeroes the gradients)
    coef = ops.minimum(max_norm / (total + 1e-6), 1.0)
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
            Partial ones are reduced first).
        max_norm: the largest total norm kept (a float or a scalar Tensor).
        parameters: the Parameters (``optimizer.parameters``); a pipeline schedule (every stage's
            gradients in the norm, ``grads`` aligned with ``schedule.parameters()``); or, inside
            ``ms.jit``, a :class:`TotalGradNorm` built from them outside (a compiled graph sees no
            sharding records). Its norm is built once per parameter tuple and kept while they live.
        norm_type: ``2.0`` (default), any positive order, or ``float("inf")``.
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
    if isinstance(max_norm, (int, float)) and not isinstance(max_norm, bool) and not max_norm >= 0:
        raise ValueError(f"clip_grad_norm: max_norm must be a number >= 0, got {max_norm!r} (a negative one would "
                         "flip the gradients)")
    if foreach is not None and not isinstance(foreach, bool):
        raise TypeError(f"clip_grad_norm: foreach must be None or a bool, got {foreach!r}")
    norm = _norm_of(parameters, norm_type, error_if_nonfinite)
    if running_eagerly():
        return _clip_eager(grads, max_norm, norm, norm_type, error_if_nonfinite)
    return _clip(grads, max_norm, norm)
