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

Example::

    run_on_empty_pieces(op, args, {}, empty_positions, specs, local_shapes)
"""
from __future__ import annotations

from math import prod
from typing import Any, Callable, Sequence, Tuple

from mindspore import Tensor, ops

from ..dtensor._dtensor import _local_view

__all__ = ["run_on_empty_pieces", "partial_identity"]

_IDENTITY = {"sum": 0.0, "avg": 0.0, "max": float("-inf"), "min": float("inf")}


def partial_identity(spec) -> float:
    """The value a rank with nothing to reduce contributes to ``spec``'s Partial (0 if none)."""
    ops_ = {p.reduce_op for p in spec.layout.placements if p.is_partial()}
    if len(ops_) > 1:
        raise NotImplementedError(f"an empty piece of an output with several Partial kinds {ops_}")
    return _IDENTITY[next(iter(ops_))] if ops_ else 0.0


def _padded(arg: Any) -> Tensor:
    local = _local_view(arg) if isinstance(arg, Tensor) else arg
    return ops.ones(tuple(max(1, s) for s in local.shape), local.dtype)


def run_on_empty_pieces(call: Callable[[Sequence[Any]], Any], local_inputs: Sequence[Any],
                        empty_positions: Tuple[int, ...], specs, local_shapes):
    """``call(inputs)`` with the inputs at ``empty_positions`` padded; outputs cut or filled."""
    inputs = [_padded(a) if i in empty_positions else a for i, a in enumerate(local_inputs)]
    out = call(inputs)
    single = isinstance(out, Tensor)
    results = []
    for result, spec, shape in zip((out,) if single else out, specs, local_shapes):
        if prod(shape) == 0:
            result = result[tuple(slice(0, s) for s in shape)] if len(shape) else result
        else:
            result = ops.zeros_like(result) + partial_identity(spec)
        results.append(result)
    return results[0] if single else type(out)(results)
