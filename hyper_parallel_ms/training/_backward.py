"""PyTorch's ``loss.backward()`` and ``param.grad`` on MindSpore 2.10, with a sharded parameter's
gradient read as a DTensor laid out like the parameter (HyperParallel's
``enable_mindspore_backward_compat``, which MindFormers' trainer calls): see docs/backward.md.

Example::

    enable_mindspore_backward_compat()
    loss = model(x).sum()
    loss.backward()                      # every rank: its pieces' gradients, reduced as by ms.grad
    model.fc1.weight.grad.placements     # (Shard(dim=0),) for a column-parallel weight
"""
from __future__ import annotations

from mindspore import Tensor

from .._mindspore import tensor_backward
from .._mindspore.tensor_backward import disable_mindspore_backward_compat
from ..dtensor._grad import laid_out_by_spec
from ..nn._parameter import parameter_spec

__all__ = ["enable_mindspore_backward_compat", "disable_mindspore_backward_compat"]


def _laid_out_gradient(param: Tensor, gradient: Tensor) -> Tensor:
    """``param.grad``: the accumulated piece, as a DTensor where ``param`` is sharded or placed."""
    spec = parameter_spec(param)
    return gradient if spec is None else laid_out_by_spec(gradient, spec)


def enable_mindspore_backward_compat() -> None:
    """Give this process ``loss.backward(gradient=None, retain_graph=None, create_graph=False,
    inputs=None)`` and a ``grad`` attribute on tensors and parameters (read, assign, ``None`` to
    clear), as PyTorch and MindSpore 2.11 have them: forwards are recorded from now on (the PyNative
    grad flag stays set), ``backward`` adds the gradients into the leaves' ``grad``; a parameter
    sharded by this library's styles, ``shard_module`` or ``fully_shard`` reads its gradient as a
    DTensor laid out like it. ``ms.grad`` / ``value_and_grad`` keep working and leave ``grad``
    alone. Idempotent; a MindSpore with its own ``Tensor.backward`` is left as it is.

    Example::

        enable_mindspore_backward_compat()
        loss = model(x).sum(); loss.backward()
        optimizer(tuple(p.grad for p in model.trainable_params()))
    """
    tensor_backward.enable_mindspore_backward_compat(grad_view=_laid_out_gradient)

