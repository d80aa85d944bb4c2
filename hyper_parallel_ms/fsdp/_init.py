"""``init_parameters``: materialise a model built under ``mindspore.nn.utils.no_init_parameters()``.

A parameter's initialiser draws from MindSpore's random stream when it runs, so the values
equal the eager single-device ones when the parameters are initialised in definition order
from the same seed. Random streams cannot be cut, so for each sharded parameter this rank
runs its initialiser once, keeps its piece and drops the rest before the next parameter:
the peak is the pieces plus the largest single parameter, never the whole model.

Example::

    ms.set_seed(0)
    with no_init_parameters():
        model = Net()
    fully_shard(model, mesh=mesh)
    init_parameters(model)         # pieces equal to the slices of Net() built eagerly from seed 0
"""
from __future__ import annotations

import numpy as np
from mindspore import Tensor, nn
from mindspore.common import dtype as mstype

from ._pieces import DEFERRED, cut_piece

__all__ = ["init_parameters"]


def _initial_value(source) -> np.ndarray:
    """The value ``source``'s initialiser gives, as a numpy array that is freed after use (the
    initialiser fills it as ``Tensor.init_data`` would, without storing it in the Parameter)."""
    init = getattr(getattr(source, "init_mode", None), "init", None) if source.has_init else None
    if init is None:
        return source.asnumpy()
    full = np.zeros(tuple(source.shape), dtype=mstype._dtype_to_nptype(source.dtype))  # pylint: disable=protected-access
    init(full)
    return full


def init_parameters(module: nn.Cell) -> nn.Cell:
    """Initialise every deferred parameter of ``module`` in definition order; returns ``module``.

    Args:
        module: the Cell built under ``mindspore.nn.utils.no_init_parameters`` and sharded.

    Example::

        init_parameters(model)
    """
    if not isinstance(module, nn.Cell):
        raise TypeError(f"init_parameters needs an nn.Cell, got {type(module).__name__}")
    seen = set()
    for _, param in module.parameters_and_names():
        if id(param) in seen:
            continue
        seen.add(id(param))
        deferred = getattr(param, DEFERRED, None)
        if deferred is not None:
            source, mesh, sharded = deferred
            object.__setattr__(param, DEFERRED, None)
            full = _initial_value(source)
            param.set_data(Tensor(cut_piece(full, mesh, sharded), dtype=param.dtype))
            del full, source, deferred
        elif param.has_init:
            param.init_data()
    return module
