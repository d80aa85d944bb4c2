"""Shape-only runs (the cluster plan's simulation): a step run on shape-only data, with MindSpore's
execution and autodiff stood in for by the run (:func:`abstract_run`), and the MindSpore details
such a run needs.

>>> from mindspore import nn
>>> has_custom_bprop(nn.Dense(2, 2))
False
"""
from __future__ import annotations

import functools
from contextlib import contextmanager
from typing import Any, Callable, Iterator, List, Sequence, Tuple

import mindspore
import numpy as np  # noqa: F401  (doctests)
from mindspore import Tensor
from mindspore.common import dtype as _mstype

from ._active import ACTIVE_RUNS
from .hooks import tensor_hook
from .swaps import Swap, entry_points_swapped

__all__ = ["GRAD_ENTRY_POINTS", "has_custom_bprop", "numpy_dtype", "stride_free_view", "abstract_run",
           "reads_shape_only"]

# MindSpore's public functions that differentiate, by module: a shape-only run replaces them
GRAD_ENTRY_POINTS: Tuple[Tuple[Any, str], ...] = tuple(
    (owner, name) for owner in (mindspore, mindspore.ops) for name in ("value_and_grad", "grad") if hasattr(owner, name))


def has_custom_bprop(cell: Any) -> bool:
    """Whether ``cell`` defines ``bprop`` (MindSpore's ``Cell.has_bprop``, set at construction)."""
    return bool(getattr(cell, "has_bprop", False))


def numpy_dtype(dtype: Any) -> Any:
    """The numpy dtype of a MindSpore dtype (MindSpore's own conversion; the public one warns).

    >>> numpy_dtype(mindspore.float16)
    <class 'numpy.float16'>
    """
    return _mstype._dtype_to_nptype(dtype)  # pylint: disable=protected-access


def stride_free_view(t: Tensor, shape: Sequence[int]) -> Tensor:
    """A view of the one-element ``t`` with ``shape`` and every stride 0 (``ops.broadcast_to`` in
    PyNative is a view): it has the shape and occupies one element.

    >>> stride_free_view(Tensor(np.zeros((1,), np.float32)), (1 << 20, 1 << 20)).shape
    (1048576, 1048576)
    """
    shape = tuple(shape)
    return t.reshape(()) if not shape else mindspore.ops.broadcast_to(t, shape)


def reads_shape_only(args: Sequence[Any]) -> bool:
    """Whether ``args`` include shape-only data of the active shape-only run (a simulated rank's step,
    :func:`abstract_run`): code whose work depends on values (counts read to the host) takes a
    shape-level form there. ``False`` outside a simulation.

    >>> reads_shape_only((Tensor(np.ones(2, np.float32)),))
    False
    """
    return bool(ACTIVE_RUNS) and bool(ACTIVE_RUNS[-1].reads_abstract(tuple(args)))


@contextmanager
def abstract_run(run: Any) -> Iterator[None]:
    """Inside, a shape-only run ``run`` (:class:`hyper_parallel_ms.dryrun._autodiff.AbstractAutodiff`)
    stands in for MindSpore's execution and autodiff:

    - :func:`no_hook` is ``run.unhooking()`` (sets ``run.unhooked``): tensor hooks reached there
      compute shapes only (``run.infer``) for ops that read shape-only data
      (``run.reads_abstract(args)``) and run the others as on plain tensors; :func:`as_subclass`
      of a plain ``Tensor`` is ``run.plain_view(t)`` where that is not ``None``, and every other
      view made there is announced to ``run.viewed(t, view)``;
    - ``mindspore.value_and_grad`` / ``grad`` (and ``mindspore.ops``'s) are ``run.value_and_grad`` /
      ``run.grad``; :func:`taped_call`, :func:`tape_backward`, :func:`saved_tensors_hooks`,
      :func:`no_grad`, :func:`recompute_eagerly` and :func:`tensor_address` call ``run``'s methods of the
      same names;
    - every ``Cell`` call is ``run.cell_call(cell, call, args, kwargs)`` (``call`` runs it), and
      MindSpore's first-call initialisation of a Cell's parameters (``Cell._init_check``) only
      marks the Cell checked;
    - an op with a ``Parameter`` argument reaches ``run.parameter_op(func, args, kwargs)`` (a
      ``__fallback__`` on ``mindspore.Parameter``: the hook of every Parameter class);
    - ``Parameter.init_data`` (the materialisation of a deferred Parameter) calls
      ``run.refuse_initialisation(param)`` first, which raises.

    Example::

        with abstract_run(run):
            step()
    """
    def cell_call(original: Callable) -> Callable:
        @functools.wraps(original)
        def call(self, *args, **kwargs):
            return run.cell_call(self, lambda *a, **k: original(self, *a, **k), args, kwargs)
        return call

    def init_check(original: Callable) -> Callable:
        @functools.wraps(original)
        def checked(self):
            self._init_flag = True
        return checked

    def init_data(original: Callable) -> Callable:
        @functools.wraps(original)
        def refusing(self, *args, **kwargs):
            run.refuse_initialisation(self)
            return original(self, *args, **kwargs)
        return refusing

    swaps: List[Swap] = [(owner, name, lambda _, n=name: getattr(run, n)) for owner, name in GRAD_ENTRY_POINTS]
    swaps += [(mindspore.nn.Cell, "__call__", cell_call), (mindspore.nn.Cell, "_init_check", init_check),
              (mindspore.Parameter, "init_data", init_data),
              (mindspore.Parameter, "__fallback__", lambda _: tensor_hook(run.parameter_op))]
    ACTIVE_RUNS.append(run)
    try:
        with entry_points_swapped(swaps):
            yield
    finally:
        ACTIVE_RUNS.remove(run)
