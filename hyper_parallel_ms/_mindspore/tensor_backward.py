"""PyTorch's ``loss.backward()`` / ``param.grad`` on MindSpore builds without them (2.10).

MindSpore 2.10's PyNative executor already keeps a PyTorch-like autograd record of every op run
while its grad flag is set (each output's ``_grad_node``), and ``run_backward`` with
``accumulate_grad=True`` adds the gradients of the leaves into ``Parameter._grad``. What it lacks is
the public face, and one piece of plumbing: a Cell with a custom ``bprop`` (this library's
collectives, fully_shard's gathers, the ring attention) needs a top graph of the executor (as
``ms.grad`` opens one), and a forward run for a later ``loss.backward()`` has none ("The
pointer[top_cell_] is null"). :func:`enable_mindspore_backward_compat` supplies the three:

- the grad flag set, so forwards are recorded (PyTorch's grad mode; ``_no_grad`` turns it off
  for a block, as MindSpore's recompute and optimizers do);
- ``Tensor.backward(gradient=None, retain_graph=None, create_graph=False, inputs=None)`` and a
  ``grad`` property (read, assign, ``None`` to clear) on tensors and parameters;
- custom-``bprop`` Cells run as one autodiff node (MindSpore's ``_Function``: the Cell's
  ``construct`` forward, its ``bprop`` backward) wherever no top graph of the executor is open;
  inside ``ms.grad`` / ``value_and_grad`` they run as before.

The switch is per process and stays on (MindFormers' trainer enables it once) until
:func:`disable_mindspore_backward_compat`; a MindSpore with a ``Tensor.backward`` of its own (2.11)
is left as it is.

Example::

    enable_mindspore_backward_compat()
    loss = model(x).sum()
    loss.backward()
    grads = tuple(p.grad for p in model.trainable_params())      # None where no gradient reached
    optimizer(grads)
    for p in model.trainable_params():
        p.grad = None
"""
from __future__ import annotations

import inspect
import threading
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple, Union

from mindspore import Parameter, Tensor, nn, ops

__all__ = ["enable_mindspore_backward_compat", "disable_mindspore_backward_compat", "backward_compat_enabled",
           "top_graph_open", "recording_for_tensor_backward"]

_ATTR = "_hpms_backward_compat"      # set on mindspore.Tensor where this module installed its methods
GradView = Callable[[Tensor, Tensor], Tensor]    # (tensor, its accumulated gradient) -> what .grad returns


class _TopGraphDepth(threading.local):
    """How many top graphs of the PyNative executor (``ms.grad``'s, ``taped_call``'s) this thread
    is inside: counted by :func:`_counting_executor_methods`."""
    depth = 0


_TOP_GRAPHS = _TopGraphDepth()


def backward_compat_enabled() -> bool:
    """Whether :func:`enable_mindspore_backward_compat` installed ``Tensor.backward`` here."""
    return bool(getattr(Tensor, _ATTR, False))


def top_graph_open() -> bool:
    """Whether the current thread runs inside a top graph of the PyNative executor (``ms.grad``,
    ``value_and_grad``, a ``taped_call``): custom-``bprop`` Cells then record as MindSpore does."""
    return _TOP_GRAPHS.depth > 0


def recording_for_tensor_backward() -> bool:
    """Whether ops run now are recorded for ``Tensor.backward`` (the compatibility on, no top graph of
    the executor open): a tensor no leaf requiring a gradient reaches has no record then, and a hook
    on it is refused ("The tensor requires grad is false")."""
    return backward_compat_enabled() and not top_graph_open()


def _backward(self: Tensor, gradient: Optional[Tensor] = None, retain_graph: Optional[bool] = None,
              create_graph: bool = False, inputs: Union[None, Tensor, Sequence[Tensor]] = None) -> None:
    """PyTorch's ``Tensor.backward``: the gradients of ``sum(self * gradient)`` added into the
    ``grad`` of every leaf that requires one (``inputs``: only these)."""
    from mindspore._c_expression import run_backward
    if self._grad_node is None:
        raise RuntimeError(
            "backward: this tensor has no autodiff record (no op that needs a gradient produced it, or it was "
            "computed with the grad mode off: inside _no_grad, or after ms.grad / value_and_grad turned the "
            "PyNative grad flag off). Compute it after enable_mindspore_backward_compat(), outside _no_grad.")
    if gradient is None:
        if self.size != 1:
            raise RuntimeError(f"backward: grad can be implicitly created only for scalar outputs; this tensor has "
                               f"shape {tuple(self.shape)}: pass gradient=")
        gradient = ops.ones_like(self)
    elif not isinstance(gradient, Tensor):
        gradient = Tensor(gradient, self.dtype)
    if tuple(gradient.shape) != tuple(self.shape) and gradient.size == self.size:
        gradient = gradient.reshape(self.shape)
    keep = create_graph if retain_graph is None else bool(retain_graph)
    targets = () if inputs is None else ((inputs,) if isinstance(inputs, Tensor) else tuple(inputs))
    run_backward((self,), (gradient,), keep, bool(create_graph), targets, True, accumulate_grad=True)


def _get_grad(self: Tensor) -> Optional[Tensor]:
    """The accumulated gradient, as the ``grad_view`` given to :func:`enable_mindspore_backward_compat`
    presents it (a distributed parameter's as a DTensor)."""
    piece = self._grad
    view = _Installed.grad_view
    return piece if piece is None or view is None else view(self, piece)


def _set_grad(self: Tensor, value: Optional[Tensor]) -> None:
    """Replace the accumulated gradient (``None``: clear it); a distributed tensor takes its local piece."""
    if value is not None and not isinstance(value, Tensor):
        raise TypeError(f"grad must be a Tensor or None, got {type(value).__name__}")
    if value is not None and hasattr(value, "to_local"):
        value = value.to_local()
    local_shape = tuple(getattr(self, "local_shape", self.shape))
    if value is not None and tuple(value.shape) != local_shape:
        raise RuntimeError(f"assigned grad has shape {tuple(value.shape)}; the tensor's (local) shape is {local_shape}")
    self._grad = value


def _counting_executor_methods(executor: Any) -> Dict[str, Callable]:
    """The executor's ``new_graph`` / ``end_graph`` counting its top graphs per thread (so that a custom-
    ``bprop`` Cell knows whether MindSpore's own custom-bprop path can record it), and its ``grad``
    leaving the grad flag on where no top graph is open (MindSpore turns it off after a grad)."""
    new_graph, end_graph, grad = executor.new_graph, executor.end_graph, executor.grad

    def counted_new_graph(obj, *args, **kwargs):
        result = new_graph(obj, *args, **kwargs)
        _TOP_GRAPHS.depth += 1
        return result

    def counted_end_graph(obj, output, *args, **kwargs):
        _TOP_GRAPHS.depth = max(0, _TOP_GRAPHS.depth - 1)
        return end_graph(obj, output, *args, **kwargs)

    def recording_grad(*args, **kwargs):
        try:
            return grad(*args, **kwargs)
        finally:
            if not top_graph_open():
                executor.set_grad_flag(True)

    return {"new_graph": counted_new_graph, "end_graph": counted_end_graph, "grad": recording_grad}


def _custom_bprop_node():
    """MindSpore's ``_Function`` running a Cell's ``construct`` forward and its ``bprop`` backward
    (one autodiff node, recorded without a top graph). Built on first use: ``_Function``'s module
    is private to MindSpore."""
    from mindspore.common._grad_function import _Function

    class CellBprop(_Function):
        """``apply(cell, *args)``: ``cell.construct(*args)`` with ``cell.bprop`` as its backward."""

        @staticmethod
        def forward(ctx, cell, *args):
            out = cell.construct(*args)
            ctx.cell, ctx.args, ctx.out = cell, args, out
            return out

        @staticmethod
        def backward(ctx, *douts):
            outs = ctx.out if isinstance(ctx.out, (tuple, list)) else (ctx.out,)
            douts = tuple(ops.zeros_like(o) if d is None else d for o, d in zip(outs, douts))
            grads = ctx.cell.bprop(*ctx.args, ctx.out, douts if isinstance(ctx.out, (tuple, list)) else douts[0])
            grads = tuple(grads) if isinstance(grads, (tuple, list)) else (grads,)
            if len(grads) != len(ctx.args):
                raise RuntimeError(f"{type(ctx.cell).__name__}.bprop returned {len(grads)} gradients for "
                                   f"{len(ctx.args)} inputs")
            return (None,) + tuple(g if isinstance(a, Tensor) else None for a, g in zip(ctx.args, grads))

    return CellBprop


def _call_custom_bprop_anywhere(original):
    """``Cell._call_custom_bprop`` that records without a top graph too (see the module's text)."""
    node = []

    def call(self: nn.Cell, *args, **kwargs):
        if top_graph_open():
            return original(self, *args, **kwargs)
        if kwargs or self.construct.__defaults__ or self.construct.__kwdefaults__:
            bound = inspect.signature(self.construct).bind(*args, **kwargs)
            bound.apply_defaults()
            if bound.kwargs:
                raise TypeError(f"{type(self).__name__}: a custom-bprop Cell takes positional arguments only")
            args = bound.args
        if not node:
            node.append(_custom_bprop_node())
        return node[0].apply(self, *args)

    return call


def _pre_process_opening_top_graphs(original):
    """``Cell._call_pre_process`` that opens a top graph for a Cell that requires grad (``ms.grad`` on a
    Cell) where none is open, also while the grad flag is set (MindSpore opens one only when it is not)."""
    from mindspore.common.api import _pynative_executor

    def pre_process(self: nn.Cell, *args, **kwargs):
        if self.requires_grad and not top_graph_open() and _pynative_executor.grad_flag():
            _pynative_executor.set_grad_flag(False)
        return original(self, *args, **kwargs)

    return pre_process


class _Installed:
    """What :func:`enable_mindspore_backward_compat` replaced: ``(owner, name, original)`` triples
    (``original`` ``_ABSENT`` where the owner had no such attribute), the grad flag before, and how
    ``grad`` presents a gradient."""
    changes: List[Tuple[Any, str, Any]] = []
    grad_flag = False
    grad_view: Optional[GradView] = None


_ABSENT = object()


def _replace(owner: Any, name: str, value: Any) -> None:
    """``owner.name = value``, remembering what ``owner`` itself held under ``name`` (not what it
    inherits or its class gives it), so that :func:`disable_mindspore_backward_compat` restores it."""
    _Installed.changes.append((owner, name, vars(owner).get(name, _ABSENT)))
    setattr(owner, name, value)


def enable_mindspore_backward_compat(grad_view: Optional[GradView] = None) -> None:
    """Give this process PyTorch's ``loss.backward()`` and ``param.grad`` (see the module's text).
    Idempotent; nothing changes on a MindSpore with its own ``Tensor.backward``;
    :func:`disable_mindspore_backward_compat` undoes it. ``grad_view(tensor, gradient)``: what
    ``tensor.grad`` returns for the gradient accumulated (default: the gradient itself).

    Example::

        enable_mindspore_backward_compat()
        loss = net(x).sum(); loss.backward()
        net.weight.grad        # the accumulated gradient
    """
    from mindspore.common.api import _pynative_executor
    if backward_compat_enabled():
        _Installed.grad_view = grad_view
        _pynative_executor.set_grad_flag(True)
        return
    if hasattr(Tensor, "backward"):
        return
    _Installed.grad_flag = _pynative_executor.grad_flag()
    _Installed.grad_view = grad_view
    for name, method in _counting_executor_methods(_pynative_executor).items():
        _replace(_pynative_executor, name, method)
    _replace(nn.Cell, "_call_pre_process", _pre_process_opening_top_graphs(nn.Cell._call_pre_process))
    _replace(nn.Cell, "_call_custom_bprop", _call_custom_bprop_anywhere(nn.Cell._call_custom_bprop))
    grad = property(_get_grad, _set_grad, doc="The gradient accumulated by backward() (None: none yet).")
    for cls in (Tensor, Parameter):
        _replace(cls, "backward", _backward)
        _replace(cls, "grad", grad)
    _replace(Tensor, _ATTR, True)
    _pynative_executor.set_grad_flag(True)


def disable_mindspore_backward_compat() -> None:
    """Undo :func:`enable_mindspore_backward_compat` (a no-op where it is not enabled): MindSpore's
    methods back, the grad flag as it was before. Gradients already accumulated stay in
    ``Parameter._grad``.

    Example::

        enable_mindspore_backward_compat()
        try:
            train()
        finally:
            disable_mindspore_backward_compat()
    """
    from mindspore.common.api import _pynative_executor
    while _Installed.changes:
        owner, name, original = _Installed.changes.pop()
        if original is _ABSENT:
            delattr(owner, name)
        else:
            setattr(owner, name, original)
    _TOP_GRAPHS.depth = 0
    _Installed.grad_view = None
    _pynative_executor.set_grad_flag(_Installed.grad_flag)
