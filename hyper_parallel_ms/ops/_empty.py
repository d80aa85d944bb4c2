"""Empty local pieces: 5 rows on 4 ranks leave the last rank nothing, and several MindSpore CPU
kernels raise on empty inputs (``LayerNorm``, ``RmsNorm``, ``Tile``, ``MaxDim``, ``Argmax``)
or return uninitialised memory (``ReduceMax`` over an empty dim). A rank that raised would
leave the others waiting in their next collective, and garbage in a Partial(max) piece is a
wrong result.

So where a decision gives this rank an empty input piece, the op runs on inputs padded with
ones (each empty dim given size 1), and each output is then cut to its expected local shape;
an output that is not empty (a reduction over the empty dim) is filled with the identity of
its Partial in the output's dtype: 0 for sum, the lowest value for max (-inf, an integer
type's minimum, False), the highest for min. An output that is not empty and not Partial
does not depend on the piece's values (``x.new_ones(size)``) and is kept as computed. Which
ranks take this path is decided from layouts and global shapes alone, before anything runs.

Padding appends ones to the piece, cutting narrows the result and filling selects from it, so
every output stays connected to the inputs: the backward of every rank then runs the same
collectives. (An output made afresh let MindSpore skip the backward of the redistribution that
produced the empty piece, and the other ranks waited for it: ``bmm`` on mesh (2, 2).)

Example::

    run_on_empty_pieces(op, args, {}, empty_positions, specs, local_shapes)
"""
from __future__ import annotations

from math import prod
from typing import Any, Callable, Optional, Sequence, Tuple

import numpy as np

from mindspore import Tensor, mint, ops
from mindspore.common import dtype as mstype

from .._mindspore import plain_view

__all__ = ["run_on_empty_pieces", "partial_identity", "zero_padded"]

_IDENTITY = {"sum": 0.0, "avg": 0.0, "max": float("-inf"), "min": float("inf")}


def partial_identity(spec) -> Optional[float]:
    """The value a rank with nothing to reduce contributes to ``spec``'s Partial (None if the
    output is not Partial: nothing to fill)."""
    ops_ = {p.reduce_op for p in spec.layout.placements if p.is_partial()}
    if len(ops_) > 1:
        raise NotImplementedError(f"an empty piece of an output with several Partial kinds {ops_}")
    return _IDENTITY[next(iter(ops_))] if ops_ else None


def _in_dtype(value: float, dtype) -> Any:
    """``value`` (0 or +-inf) as a fill of ``dtype``: an integer type's extremes for +-inf, bool's
    False / True (a float fill would turn the piece into float32 on this rank alone, and its
    all-reduce would no longer pair with the other ranks' integer one)."""
    if dtype == mstype.bool_:
        return value > 0
    if dtype in mstype.int_type or dtype in mstype.uint_type:
        if value in (float("inf"), float("-inf")):
            info = np.iinfo(str(dtype).lower())
            return int(info.max if value > 0 else info.min)
        return int(value)
    return value


def _grown(local: Tensor, dims: Sequence[int], make: Callable) -> Tensor:
    """``local`` with each of ``dims`` that is empty grown to 1 by appending ``make(shape, dtype)``.
    Appended, not made afresh: the result stays connected to the input, so the backward still
    reaches the collectives that produced the piece (a rank skipping them would leave the
    others waiting)."""
    for dim in dims:
        if local.shape[dim] == 0:
            shape = list(local.shape)
            shape[dim] = 1
            local = ops.concat([local, make(tuple(shape), local.dtype)], dim)
    return local


def _padded(arg: Any) -> Tensor:
    """``arg``'s local piece with each empty dim grown to 1 by appending ones."""
    local = plain_view(arg) if isinstance(arg, Tensor) else arg
    return _grown(local, range(local.ndim), ops.ones)


def zero_padded(local: Tensor, dims: Sequence[int]) -> Tensor:
    """``local`` with each of ``dims`` that is empty grown to one row of zeros: a sum over those
    dims is then 0 (MindSpore's CPU ``ReduceSum`` / ``SumExt`` of an empty tensor return
    uninitialised memory)."""
    return _grown(local, dims, ops.zeros)


def run_on_empty_pieces(call: Callable[[Sequence[Any]], Any], local_inputs: Sequence[Any],
                        empty_positions: Tuple[int, ...], specs, local_shapes):
    """``call(inputs)`` with the inputs at ``empty_positions`` padded; outputs cut or filled."""
    inputs = [_padded(a) if i in empty_positions else a for i, a in enumerate(local_inputs)]
    out = call(inputs)
    single = isinstance(out, Tensor)
    results = []
    for result, spec, shape in zip((out,) if single else out, specs, local_shapes):
        if prod(shape) == 0:
            results.append(_cut(result, shape))
        else:
            identity = partial_identity(spec)
            results.append(result if identity is None else _filled(result, identity))
    return results[0] if single else type(out)(results)


def _cut(result: Tensor, shape: Tuple[int, ...]) -> Tensor:
    """``result`` narrowed to the empty ``shape`` (the backward of a slice to an empty tensor
    fails on CPU, that of ``narrow`` does not)."""
    for dim, size in enumerate(shape):
        if result.shape[dim] != size:
            result = mint.narrow(result, dim, 0, size)
    return result


def _filled(result: Tensor, value: float) -> Tensor:
    """``value`` everywhere in ``result``'s dtype, still connected to ``result`` (its gradient is
    zero) so that the backward of this rank reaches the same collectives as the others'."""
    everywhere = ops.ones(result.shape, mstype.bool_)
    return ops.select(everywhere, ops.fill(result.dtype, result.shape, _in_dtype(value, result.dtype)), result)
