"""``clip_grad_norm``: scale the gradients of a sharded model by its global gradient norm.

Example::

    reducer = GradientReducer(optimizer.parameters)
    loss, grads = grad_fn(x, y)
    grads, total = clip_grad_norm(reducer(grads), 1.0, parameters=optimizer.parameters)
    optimizer(grads)
"""
from __future__ import annotations

import math
from typing import Sequence, Tuple, Union

from mindspore import Tensor, ops

from .._mindspore import is_compiling, run_in_python, running_eagerly
from ..dtensor import DTensor
from ._norm import TotalGradNorm

__all__ = ["clip_grad_norm"]

_NORMS = {}       # (ids of the parameters, norm type) -> (parameters, TotalGradNorm), filled on first use


@run_in_python
def _norm_of(parameters, norm_type, error_if_nonfinite: bool) -> TotalGradNorm:
    if isinstance(parameters, TotalGradNorm):
        if float(norm_type) != parameters.norm_type:
            raise ValueError(f"clip_grad_norm: norm_type={norm_type!r} but the TotalGradNorm passed as parameters "
                             f"was built with norm_type={parameters.norm_type}")
        norm = parameters
    else:
        parameters = tuple(parameters)
        key = (tuple(id(p) for p in parameters), float(norm_type))
        if key not in _NORMS:
            _NORMS[key] = (parameters, TotalGradNorm(parameters, norm_type=norm_type))   # holds them: ids stay theirs
        norm = _NORMS[key][1]
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
    bound = ops.maximum(total, max_norm)
    out = ()
    for g in grads:
        out = out + ((g * max_norm / bound).astype(g.dtype),)
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
        value = float(total.asnumpy())
        if not math.isfinite(value):
            raise RuntimeError(f"clip_grad_norm: the total norm of order {norm_type} of the gradients is {value} "
                               "(non-finite) on every rank: clipping would turn every gradient into nan or 0. "
                               "Skip this step (all_finite), or pass error_if_nonfinite=False")
    out = tuple(g if spec is None else DTensor.from_local(g, spec[0], spec[1], shape=spec[2])
                for g, spec in zip(out, specs))
    return out, total


def clip_grad_norm(grads: Sequence[Tensor], max_norm: Union[float, Tensor], *,
                   parameters, norm_type: float = 2.0,
                   error_if_nonfinite: bool = False) -> Tuple[Tuple[Tensor, ...], Tensor]:
    """Clip gradients by the norm of the global gradient, as ``ops.clip_by_global_norm`` (and PyTorch's
    ``clip_grad_norm_``) do on one device: each gradient times ``max_norm / max(total, max_norm)``.
    The total is the one-device norm: pieces summed over the mesh dims their parameter is split on,
    replicated gradients counted once (see :class:`TotalGradNorm`). Give it reduced gradients (after
    :class:`GradientReducer`, which sums SequenceParallel shares; fully_shard / hsdp pieces as
    returned): clip after the reduction, never before. PyNative and inside ``ms.jit``.

    Args:
        grads: this rank's gradients, a tuple aligned with ``parameters`` (DTensors too, in PyNative:
            Partial ones are reduced first).
        max_norm: the largest total norm kept (a float or a scalar Tensor).
        parameters: the Parameters (``optimizer.parameters``), or, inside ``ms.jit``, a
            :class:`TotalGradNorm` built from them outside (a compiled graph sees no sharding records).
        norm_type: ``2.0`` (default), any positive order, or ``float("inf")``.
        error_if_nonfinite: raise ``RuntimeError`` on every rank when the total is nan or inf
            (PyNative only: inside ``ms.jit`` it raises at compile time, naming the fix).

    Returns:
        ``(clipped_grads, total_norm)``: a tuple the optimizer takes, and the norm before clipping.

    Example::

        grads, total = clip_grad_norm(reducer(grads), 1.0, parameters=optimizer.parameters)
        optimizer(grads)
    """
    norm = _norm_of(parameters, norm_type, error_if_nonfinite)
    if running_eagerly():
        return _clip_eager(grads, max_norm, norm, norm_type, error_if_nonfinite)
    return _clip(grads, max_norm, norm)
