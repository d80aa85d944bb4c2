"""The composed (CPU) all-to-alls in PyNative autodiff as one node that keeps nothing.

The composed all-to-all pads this rank's piece into a whole-size buffer, all-reduces it and cuts
its chunk out (:func:`._composed.all_to_all`). Differentiated op by op, MindSpore keeps the padded
buffer and the all-reduced one for the backward though neither is read there (measured, 2.10: four
whole-sequence buffers per Ulysses attention call, more than the cp=1 attention keeps). As a
custom-``bprop`` Cell run by :func:`call_keeping_nothing`, its backward is the inverse all-to-all of
the gradient through the public :func:`all_to_all` (or ``all_to_all_by_matrix`` with the split matrix
transposed, for the uneven exchange of ``all_to_all_single``), which also puts it on
:class:`CommDebugMode`'s record like the forward.

Example::

    y = LeanAllToAll(forward, inverse).move(x)     # keeps nothing; backward: inverse(dout)
"""
from __future__ import annotations

from typing import Callable, Tuple

import mindspore as ms
from mindspore import nn

from .._mindspore import call_keeping_nothing, is_compiling, recording_gradients, run_in_python
from .._mindspore._active import ACTIVE_RUNS
from ..layout import chunk_sizes

__all__ = ["LeanAllToAll", "applies", "chunked_evenly", "simulated"]

_FLOATS = (ms.float16, ms.float32, ms.bfloat16, ms.float64)


@run_in_python
def applies(dtype) -> bool:
    """Whether :meth:`LeanAllToAll.move` serves an exchange of ``dtype``: PyNative recording gradients (not
    compiling, not a shape-only dry run) and floating point (other dtypes have no gradient).

    >>> applies(ms.int32)
    False
    """
    return not is_compiling() and dtype in _FLOATS and not ACTIVE_RUNS and recording_gradients()


@run_in_python
def simulated(dtype, group_size: int, exchange) -> bool:
    """Whether an all-to-all of ``dtype`` over a group of ``group_size`` ranks runs on a simulated rank
    (``exchange`` moves nothing: the dry run) as :class:`LeanAllToAll` of a placeholder, whose backward
    issues the inverse exchange as the cluster's does (outside a graph, floating point).

    >>> simulated(ms.float32, 1, None)
    False
    """
    return group_size > 1 and dtype in _FLOATS and not exchange.moves and not is_compiling()


def chunked_evenly(sizes: Tuple[int, ...]) -> bool:
    """Whether pieces of ``sizes`` are ``torch.chunk``'s split of their sum (what an inverse
    :func:`all_to_all` cuts).

    >>> chunked_evenly((3, 3, 2)), chunked_evenly((2, 3))
    (True, False)
    """
    return tuple(sizes) == chunk_sizes(sum(sizes), len(sizes))


class LeanAllToAll(nn.Cell):
    """``forward`` as one autodiff node whose backward is ``inverse(dout)``; call through :meth:`move`.

    Args:
        forward: the all-to-all of a piece (the composed ops).
        inverse: the all-to-all taking the output's gradient back to the input's layout.

    Example::

        y = LeanAllToAll(forward, inverse).move(x)
    """

    def __init__(self, forward: Callable, inverse: Callable) -> None:
        super().__init__()
        self.forward, self.inverse = forward, inverse

    def construct(self, x):
        return self.forward(x)

    def bprop(self, x, out, dout):
        return (self.inverse(dout),)

    def move(self, x):
        """``forward(x)`` keeping neither ``x`` nor the result for the backward (:func:`call_keeping_nothing`)."""
        return call_keeping_nothing(self, x)
