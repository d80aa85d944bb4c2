"""Gradients as DTensors: ``grad`` and ``value_and_grad`` with the signatures of
``mindspore.grad`` / ``mindspore.value_and_grad``, and HyperParallel's
``parallelize_value_and_grad(fn, weights, sens=None)``. PyNative.

The gradient with respect to a DTensor input or a DTensor parameter (``Parameter`` built
from a DTensor, as ``shard_module`` makes) is a DTensor laid out like that tensor with
Partial placements read as Replicate; gradients of plain tensors stay plain.

Example::

    loss, (gx, gw) = value_and_grad(lambda x: (x @ w).sum(), 0, [w])(x_dt)
    gx.placements == x_dt.placements        # Shard(0) stays Shard(0)
"""
from __future__ import annotations

from typing import Any, Callable, Optional, Sequence, Tuple, Union

import mindspore as ms
from mindspore import Tensor

from .._mindspore import discard_grad_recording, is_compiling, run_in_python
from ..redistribute import gradient_layout
from ._dtensor import DTensor
from ._spec import DTensorSpec

__all__ = ["grad", "value_and_grad", "parallelize_value_and_grad"]

Positions = Union[None, int, Sequence[int]]


def laid_out_like(gradient, like):
    """``gradient`` (this rank's piece) as a DTensor laid out like ``like``'s gradient."""
    if not isinstance(like, DTensor) or not isinstance(gradient, Tensor):
        return gradient
    return laid_out_by_spec(gradient, like._dt_spec, like.local_shape)


def laid_out_by_spec(gradient: Tensor, spec: DTensorSpec, local_shape: Optional[Tuple[int, ...]] = None) -> DTensor:
    """``gradient`` (this rank's piece of the gradient of a tensor laid out by ``spec``) as a DTensor,
    Partial placements read as Replicate (the gradient a backward hands back is reduced).

    Example::

        grad = laid_out_by_spec(piece, parameter_spec(param))     # local_shape: computed from the spec
    """
    local = gradient.to_local() if isinstance(gradient, DTensor) else gradient
    expected = spec.local_shape() if local_shape is None else tuple(local_shape)
    if tuple(local.shape) != expected:
        raise RuntimeError(f"the gradient piece of shape {tuple(local.shape)} does not match the local shape "
                           f"{expected} of the tensor it belongs to (laid out as {spec})")
    return DTensor(local, spec.with_layout(gradient_layout(spec.layout)))


def _as_dtensors(grads, grad_position: Positions, weights, args: tuple):
    """The gradient structure of ``mindspore.grad`` with each piece laid out as a DTensor."""
    def inputs_part(g):
        if isinstance(grad_position, int):
            return laid_out_like(g, args[grad_position])
        if isinstance(g, Tensor):          # MindSpore gives a one-position tuple's gradient bare
            return laid_out_like(g, args[grad_position[0]])
        return tuple(laid_out_like(x, args[i]) for x, i in zip(g, grad_position))

    def weights_part(g):
        if isinstance(weights, ms.Parameter):
            return laid_out_like(g, weights)
        return tuple(laid_out_like(x, w) for x, w in zip(g, weights))

    if grad_position is None:
        return weights_part(grads)
    if weights is None:
        return inputs_part(grads)
    return inputs_part(grads[0]), weights_part(grads[1])


def grad(fn: Callable, grad_position: Positions = 0, weights=None, has_aux: bool = False) -> Callable:
    """``mindspore.grad`` returning DTensor gradients for DTensor inputs and parameters.

    Args:
        fn: the function to differentiate (DTensors and plain tensors as arguments).
        grad_position: which positional inputs get gradients (an int, a tuple, or ``None`` for none).
        weights: parameters to differentiate too (``net.trainable_params()``), or ``None``.
        has_aux: ``fn`` returns ``(output, aux)``; only ``output`` is differentiated.

    Example::

        gx = grad(lambda x: (x * x).sum())(x_dt)          # a DTensor laid out like x_dt
    """
    inner = ms.grad(fn, grad_position, weights, has_aux)

    def gradient(*args, **kwargs):
        out = _called(inner, args, kwargs)
        if has_aux:
            return _as_dtensors(out[0], grad_position, weights, args), out[1]
        return _as_dtensors(out, grad_position, weights, args)
    return gradient


def _called(inner: Callable, args: tuple, kwargs: dict):
    """``inner(*args, **kwargs)``; if it raises, MindSpore's record of the failed gradient call is
    dropped first (on 2.8 - 2.10 the executor otherwise stays recording and the next gradient call
    fails, e.g. "For LayerNormGrad, the index 7 is out of range")."""
    try:
        return inner(*args, **kwargs)
    except BaseException:
        discard_grad_recording()
        raise


def value_and_grad(fn: Callable, grad_position: Positions = 0, weights=None, has_aux: bool = False) -> Callable:
    """``mindspore.value_and_grad`` returning DTensor gradients for DTensor inputs and parameters.

    Args:
        fn, grad_position, weights, has_aux: as in :func:`grad`.

    Example::

        loss, grads = value_and_grad(loss_fn, None, net.trainable_params())(x)
    """
    inner = ms.value_and_grad(fn, grad_position, weights, has_aux)

    def value_and_gradient(*args, **kwargs):
        value, grads = _called(inner, args, kwargs)
        return value, _as_dtensors(grads, grad_position, weights, args)
    return value_and_gradient


def _sens_error(sens: Optional[Sequence[float]], seen: dict) -> Optional[str]:
    """Why ``sens`` does not fit the outputs ``fn`` returned, or None."""
    if seen["single"]:
        return None if sens is None else f"fn has one output, so sens must be None, got {sens!r}"
    if sens is None:
        return None
    if not isinstance(sens, (list, tuple)) or not all(isinstance(s, (int, float)) for s in sens):
        return f"sens must be None or a list / tuple of floats, one per output of fn, got {sens!r}"
    if len(sens) != seen["count"]:
        return f"fn returned {seen['count']} outputs but sens has {len(sens)} values"
    return None


def _sensitivities(sens: Optional[Sequence[float]], outputs: int) -> Tuple[float, ...]:
    """Each output's sensitivity (``sens`` already checked by :func:`_sens_error`)."""
    if sens is None:
        return (1.0,) + (0.0,) * (outputs - 1)
    return tuple(float(s) for s in sens)


@run_in_python
def _refuse_compiled() -> bool:
    """Raise while ms.jit / GRAPH_MODE compiles a call of a ``parallelize_value_and_grad`` function."""
    if is_compiling():
        raise RuntimeError(
            "parallelize_value_and_grad runs in PyNative only: it reads, in Python, what fn returned (one output or "
            "several, for sens) and lays gradients out as DTensors, neither of which a graph compiled by ms.jit / "
            "GRAPH_MODE can do (MindSpore would fail with \"The key single does not exist\"). Call it outside "
            "ms.jit, in PyNative; to compile a train step, place the parameters with parallelize_module (local "
            "pieces) and differentiate with ms.value_and_grad inside ms.jit")
    return True


def parallelize_value_and_grad(fn: Callable, weights, sens: Optional[Sequence[float]] = None) -> Callable:
    """HyperParallel's ``parallelize_value_and_grad``: ``(outputs, gradients of weights)``,
    the gradients as DTensors for DTensor parameters. With several outputs, ``sens`` gives
    each output's sensitivity (default: 1 for the first, 0 for the others), i.e. the
    gradient of ``sum(sens[i] * outputs[i].sum())``; with one output it must be None.
    PyNative: a call inside ``ms.jit`` / GRAPH_MODE raises at once (compile a step with
    ``parallelize_module`` and ``ms.value_and_grad`` instead).

    Args:
        fn: the function (or Cell) computing the outputs.
        weights: the parameters whose gradients are returned, in this order.
        sens: one float per output of ``fn`` (its weight in the differentiated sum), or ``None``.

    Example::

        loss, grads = parallelize_value_and_grad(net_with_loss, net.trainable_params())(x, y)
        optimizer(grads)
    """
    # What the last call of fn returned. sens is checked after the gradient call: an error raised
    # inside it leaves MindSpore 2.8 / 2.9's PyNative grad state broken for later ops.
    seen: dict = {}

    def objective(*args, **kwargs):
        out = fn(*args, **kwargs)
        outputs = (out,) if not isinstance(out, (list, tuple)) else tuple(out)
        seen.update(single=not isinstance(out, (list, tuple)), count=len(outputs))
        scales = (1.0,) + (0.0,) * (len(outputs) - 1) if _sens_error(sens, seen) else \
            _sensitivities(sens, len(outputs))
        total = None
        for s, o in zip(scales, outputs):
            if s:
                term = o.sum() if s == 1.0 else o.sum() * s
                total = term if total is None else total + term
        if total is None:  # every sensitivity 0: differentiate the first output (the error follows)
            seen["all_zero"] = True
            total = outputs[0].sum()
        return (total,) + outputs

    inner = value_and_grad(objective, None, weights, has_aux=True)

    def wrapper(*args, **kwargs) -> Any:
        _refuse_compiled()
        seen.clear()
        value, grads = inner(*args, **kwargs)
        error = _sens_error(sens, seen)
        if error is not None:
            raise TypeError(error)
        if seen.get("all_zero"):
            raise ValueError("every sensitivity in sens is 0: there is nothing to differentiate")
        return (value[1] if seen["single"] else tuple(value[1:])), grads
    return wrapper
