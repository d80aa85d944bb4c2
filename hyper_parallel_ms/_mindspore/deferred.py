"""Deferred initialisation: MindSpore's initialisers, run where and when this package decides.

Contracts: eagerly, ``Parameter(initializer(...))`` runs the ``Initializer`` at once on a numpy
array; the random ones draw only from numpy's global generator, a fixed number of times for
MindSpore's own classes (:func:`initializer_draws`, :func:`draw_numpy_seed`). Under
``no_init_parameters()`` the Parameter keeps the initialiser Tensor as ``init_mode``
(:func:`pending_init`); Parameters are made through ``Parameter._get_parameter_new_args``
(:func:`deferred_creation_hooked`); :func:`initial_array` computes what ``init_data`` would and
:func:`fill_deferred` stores it as ``init_data`` does.

>>> p = deferred_parameter((4, 4), mindspore.float32, "w")
>>> pending_init(p) is not None
True
"""
from __future__ import annotations

import contextlib
import functools
from typing import Any, Callable, Dict, Iterator, Optional, Sequence

import mindspore
import numpy as np
from mindspore import Tensor
from mindspore.common import dtype as _mstype, initializer as _initializers

from ._release import ABSENT as _ABSENT
from .swaps import entry_points_swapped

__all__ = ["initializer_draws", "draw_numpy_seed", "pending_init", "initial_array", "fill_deferred",
           "deferred_creation_hooked", "deferred_parameter", "off_meta_device", "process_device_target", "is_meta",
           "meta_empty"]

# MindSpore's own initialisers whose every run draws a fixed number of times from numpy's global
# generator: ``_numpy_seed()`` (one ``np.random.randint``) seeds the C++ fill; the constant ones
# draw nothing. Others (Orthogonal, Sparse, a user's class) draw an amount that depends on the shape.
_NUMPY_DRAWS: Dict[type, int] = {
    **{getattr(_initializers, n): 0 for n in ("Zero", "One", "Constant", "Identity", "Dirac")},
    **{getattr(_initializers, n): 1 for n in ("Normal", "Uniform", "TruncatedNormal", "XavierNormal",
                                              "XavierUniform", "HeNormal", "HeUniform", "VarianceScaling")}}


def initializer_draws(init: Any) -> Optional[int]:
    """How many numpy draws one run of ``init`` makes (``None``: not known without running it)."""
    return _NUMPY_DRAWS.get(type(init))


def draw_numpy_seed() -> int:
    """The draw MindSpore's random initialisers make from numpy's global generator."""
    return _initializers._numpy_seed()  # pylint: disable=protected-access


def pending_init(tensor: Any) -> Optional[Tensor]:
    """The initialiser Tensor a not yet initialised ``Parameter`` (or initialiser Tensor) will
    run (``Parameter.init_mode``, whose ``init`` is the ``Initializer``), or ``None``."""
    if not isinstance(tensor, Tensor) or not tensor.has_init:
        return None
    pending = getattr(tensor, "init_mode", None) if isinstance(tensor, mindspore.Parameter) else tensor
    return pending if pending is not None and pending.has_init else None


def initial_array(init: Any, shape: Sequence[int], dtype: Any) -> np.ndarray:
    """What ``Tensor.init_data()`` computes for an ``Initializer``, as a numpy array, drawing
    from numpy's global generator exactly as it does (without a slice index)."""
    nptype = _mstype._dtype_to_nptype(dtype)  # pylint: disable=protected-access
    if isinstance(init, _initializers.Zero):
        return np.zeros(tuple(shape), dtype=nptype)
    data = np.ndarray(tuple(shape), dtype=nptype)
    init(data)
    return data


def fill_deferred(param: Any, values: np.ndarray) -> None:
    """Give a not yet initialised ``param`` ``values`` as ``init_data`` would (in place, its
    initialiser dropped), leaving the initialiser Tensor itself untouched (others may share it)."""
    param.set_data(Tensor(values, dtype=param.dtype))
    param.init_mode = None


def deferred_creation_hooked(record: Callable[[Tensor], None]) -> Iterator[None]:
    """Inside, ``record(init_tensor)`` runs at the moment MindSpore would have run an
    initialiser eagerly but defers it (``no_init_parameters()``): when a ``Parameter`` is made
    from it (``Parameter._get_parameter_new_args``) and when ``set_data`` hands one to a deferred
    Parameter (eagerly, ``set_data`` initialises it there)."""
    def new_args(original: Any) -> Any:
        def wrapped(data, *args, **kwargs):
            result = original.__func__(data, *args, **kwargs)
            if pending_init(data) is not None:
                record(data)
            return result
        return staticmethod(wrapped)

    def set_data(original: Callable) -> Callable:
        @functools.wraps(original)
        def wrapped(self, data, *args, **kwargs):
            result = original(self, data, *args, **kwargs)
            if pending_init(data) is not None and getattr(self, "init_mode", None) is data:
                record(data)
            return result
        return wrapped
    return entry_points_swapped([(mindspore.Parameter, "_get_parameter_new_args", new_args),
                                 (mindspore.Parameter, "set_data", set_data)])


def deferred_parameter(shape: Sequence[int], dtype: Any, name: str, requires_grad: bool = True) -> Any:
    """A ``Parameter`` of ``shape`` and ``dtype`` holding no data (deferred, as under
    ``no_init_parameters()``, with a zeros initialiser), whatever context it is made in: the
    class flag ``Parameter.init_param`` that MindSpore's ``no_init_parameters()`` sets is set
    for the call and put back.

    >>> p = deferred_parameter((1 << 20, 1 << 20), mindspore.float32, "huge")
    >>> p.has_init, p.shape
    (True, (1048576, 1048576))
    """
    before = vars(mindspore.Parameter).get("init_param", _ABSENT)
    mindspore.Parameter.init_param = False
    try:
        return mindspore.Parameter(_initializers.initializer("zeros", tuple(shape), dtype), name=name,
                                   requires_grad=requires_grad)
    finally:
        if before is _ABSENT:
            del mindspore.Parameter.init_param
        else:
            mindspore.Parameter.init_param = before


def process_device_target() -> str:
    """MindSpore's device target of this process (``"CPU"``, ``"Ascend"``), also inside a
    ``mindspore.DeviceCtx("meta")`` block, where ``get_context("device_target")`` says ``"meta"``:
    the device below the meta blocks on MindSpore's device stack.

    Contract: ``DeviceCtx.__enter__`` pushes the device it replaces, an object with a
    ``device_target``, onto ``mindspore.common.device._DEVICE_STACK`` (a thread-local stack).

    >>> process_device_target() in ("CPU", "Ascend", "GPU")
    True
    """
    target = mindspore.get_context("device_target")
    if target != "meta":
        return target
    from mindspore.common.device import _DEVICE_STACK
    for info in reversed(_DEVICE_STACK.get_stack()):
        if info.device_target != "meta":
            return info.device_target
    raise RuntimeError("the device target is 'meta' and no device is below it on MindSpore's device stack: "
                       "call mindspore.set_device(...) before entering mindspore.DeviceCtx('meta')")


def off_meta_device() -> Any:
    """A context in which tensors are made on the process's device target even inside a
    ``mindspore.DeviceCtx("meta")`` block (where models are built shape-only): the host-side
    agreements between ranks run their collectives there. A no-op outside meta blocks and where
    MindSpore has no ``DeviceCtx``.

    >>> with off_meta_device():
    ...     pass
    """
    device_ctx = getattr(mindspore, "DeviceCtx", None)
    if device_ctx is None or mindspore.get_context("device_target") != "meta":
        return contextlib.nullcontext()
    return device_ctx(process_device_target())


def is_meta(tensor: Any) -> bool:
    """Whether ``tensor`` lives on MindSpore's meta device (a shape and dtype, no storage), as
    Parameters made inside ``mindspore.DeviceCtx("meta")`` do.

    >>> is_meta(Tensor(np.zeros(2)))
    False
    """
    return getattr(tensor, "device", None) == "meta"


def meta_empty(shape: Sequence[int], dtype: Any) -> Tensor:
    """A tensor of ``shape`` and ``dtype`` on the meta device (no storage), wherever it is called.

    >>> is_meta(meta_empty((2, 3), mindspore.float32))
    True
    """
    with mindspore.DeviceCtx("meta"):
        return mindspore.mint.empty(tuple(int(d) for d in shape), dtype=dtype)
