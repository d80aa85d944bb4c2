"""MindSpore optimizers stepping DTensor parameters with DTensor gradients.

MindSpore 2.10 compiles an optimizer's ``construct`` with ``ms.jit``, where a DTensor argument is
its local piece; the package refuses DTensors as compiled arguments (compiled code would compute on
pieces as if they were whole). An optimizer whose update is element-wise is the exception: given
gradients laid out exactly as its parameters, each rank updating its pieces from its gradient
pieces is the whole update. Optimizers reading norms or factored moments of a whole parameter
(``Lamb``, ``LARS``, ``AdaFactor``), subclasses with a ``construct`` of their own and parameter
groups with ``grad_centralization`` (a mean over each gradient's dims) stay refused
(:func:`reads_whole_parameters`, :func:`centralized_gradients`; plain Parameters holding pieces are
checked by ``nn._parameter.check_optimizer_step``).

Example::

    loss, grads = parallelize_value_and_grad(loss_fn, optimizer.parameters)(x)   # DTensor gradients
    optimizer(grads)                                                          # each rank steps its pieces
"""
from __future__ import annotations

from typing import Any, Callable, List, Tuple

from ._spec import spec_of

__all__ = ["elementwise_step_on_pieces", "reads_whole_parameters", "centralized_gradients"]

_ELEMENTWISE = ("SGD", "Momentum", "Adam", "AdamWeightDecay", "AdamOffload", "LazyAdam", "Adagrad", "Adadelta",
                "AdaMax", "RMSProp", "FTRL", "ProximalAdagrad", "ASGD", "Rprop")
_WHOLE_READING = ("AdaFactor", "Lamb", "LARS", "THOR")


def _elementwise_constructs() -> Tuple[Callable, ...]:
    from mindspore import nn
    return tuple(getattr(nn, name).construct for name in _ELEMENTWISE if hasattr(nn, name))


def reads_whole_parameters(optimizer: Any) -> bool:
    """Whether ``optimizer`` is one of MindSpore's optimizers whose update of a parameter reads all
    of it (``AdaFactor``'s factored moments and RMS, ``Lamb`` / ``LARS`` norms, ``THOR``), or a
    subclass of one.

    Args:
        optimizer: a MindSpore ``nn.Optimizer``.

    Example::

        reads_whole_parameters(nn.AdaFactor(params))      # True
    """
    from mindspore import nn
    return isinstance(optimizer, tuple(getattr(nn, name) for name in _WHOLE_READING if hasattr(nn, name)))


def centralized_gradients(optimizer: Any) -> List[int]:
    """Indices of ``optimizer``'s parameters whose groups set ``grad_centralization`` (MindSpore
    subtracts from each dim-0 row of a gradient of 2 or more dims its mean over the other dims).

    Args:
        optimizer: a MindSpore ``nn.Optimizer``.

    Example::

        centralized_gradients(nn.SGD([{"params": params, "grad_centralization": True}]))   # [0, 1, ...]
    """
    flags = getattr(optimizer, "grad_centralization_flags", None) if getattr(optimizer, "is_group", False) else None
    return [i for i, flag in enumerate(flags or ()) if flag]


def elementwise_step_on_pieces(fn: Callable, args: tuple) -> bool:
    """Whether a compiled call is an element-wise MindSpore optimizer's step given, for each of its
    parameters, a gradient of the same global shape and layout (DTensors or not, alike).

    Args:
        fn: the compiled function (the optimizer's ``construct``).
        args: its arguments, the optimizer first.

    Example::

        elementwise_step_on_pieces(type(opt).construct, (opt, grads))     # True for SGD on shard_module
    """
    from mindspore import nn
    if len(args) != 2 or not isinstance(args[0], nn.Optimizer) or not isinstance(args[1], tuple):
        return False
    optimizer, grads = args
    if type(optimizer).construct not in _elementwise_constructs() or centralized_gradients(optimizer):
        return False
    params = tuple(optimizer.parameters)
    if len(grads) != len(params):
        return False
    for g, p in zip(grads, params):
        g_spec, p_spec = spec_of(g), spec_of(p)
        if (g_spec is None) != (p_spec is None):
            return False
        if g_spec is not None and (g_spec.shape != p_spec.shape or g_spec.layout != p_spec.layout):
            return False
    return True
