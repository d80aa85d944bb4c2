"""Empty local pieces: 5 rows on 4 ranks leave the last rank nothing, and several MindSpore CPU
kernels raise on empty inputs (``LayerNorm``, ``RmsNorm``, ``Tile``, ``MaxDim``, ``Argmax``)
or return uninitialised memory (``ReduceMax`` over an empty dim). A rank that raised would
leave the others waiting in their next collective, and garbage in a Partial(max) piece is a
wrong result.

So where a decision gives this rank an empty input piece, the op runs on inputs padded with
ones (each empty dim given size 1), and each output is then cut to its expected local shape;
an output that is not empty (a reduction over the empty dim) is filled with the identity of
its Partial: 0 for sum, -inf for max, +inf for min. Which ranks take this path is decided from
layouts and global shapes alone, before anything runs.

Padding appends ones to the piece, cutting narrows the result and filling selects from it, so
every output stays connected to the inputs: the backward of every rank then runs the same
collectives. (An output made afresh let MindSpore skip the backward of the redistribution that
produced the empty piece, and the other ranks waited for it: ``bmm`` on mesh (2, 2).)

Example::

    run_on_empty_pieces(op, args, {}, empty_positions, specs, local_shapes)
"""
from __future__ import annotations

from math import prod
from typing import Any, Callable, Sequence, Tuple

from mindspore import Tensor, mint, ops
from mindspore.common import dtype as mstype

from .._mindspore import plain_view

__all__ = ["run_on_empty_pieces", "partial_identity"]

_IDENTITY = {"sum": 0.0, "avg": 0.0, "max": float("-inf"), "min": float("inf")}


def partial_identity(spec) -> float:
    """The value a rank with nothing to reduce contributes to ``spec``'s Partial (0 if none)."""
    ops_ = {p.reduce_op for p in spec.layout.placements if p.is_partial()}
    if len(ops_) > 1:
        raise NotImplementedError(f"an empty piece of an output with several Partial kinds {ops_}")
    return _IDENTITY[next(iter(ops_))] if ops_ else 0.0


def _padded(arg: Any) -> Tensor:
    """``arg``'s local piece with each empty dim grown to 1 by appending ones. Appended, not
    made afresh: the result stays connected to the input, so the backward still reaches the
    collectives that produced the piece (a rank skipping them would leave the others waiting)."""
    local = plain_view(arg) if isinstance(arg, Tensor) else arg
    for dim, size in enumerate(local.shape):
        if size == 0:
            shape = list(local.shape)
            shape[dim] = 1
            local = ops.concat([local, ops.ones(tuple(shape), local.dtype)], dim)
    return local


def run_on_empty_pieces(call: Callable[[Sequence[Any]], Any], local_inputs: Sequence[Any],
                        empty_positions: Tuple[int, ...], specs, local_shapes):
    """``call(inputs)`` with the inputs at ``empty_positions`` padded; outputs cut or filled."""
    inputs = [_padded(a) if i in empty_positions else a for i, a in enumerate(local_inputs)]
    out = call(inputs)
    single = isinstance(out, Tensor)
    results = []
    for result, spec, shape in zip((out,) if single else out, specs, local_shapes):
        results.append(_cut(result, shape) if prod(shape) == 0 else _filled(result, partial_identity(spec)))
    return results[0] if single else type(out)(results)


def _cut(result: Tensor, shape: Tuple[int, ...]) -> Tensor:
    """``result`` narrowed to the empty ``shape`` (the backward of a slice to an empty tensor
    fails on CPU, that of ``narrow`` does not)."""
    for dim, size in enumerate(shape):
        if result.shape[dim] != size:
            result = mint.narrow(result, dim, 0, size)
    return result


def _filled(result: Tensor, value: float) -> Tensor:
    """``value`` everywhere, still connected to ``result`` (its gradient is zero) so that the
    backward of this rank reaches the same collectives as the others'."""
    everywhere = ops.ones(result.shape, mstype.bool_)
    return ops.select(everywhere, ops.zeros_like(result) + value, result)
