"""Dropout on DTensors: ``Dropout`` (``ops.dropout``, ``nn.Dropout``) and ``FuncDropoutExt``
(``mint.nn.functional.dropout``, ``mint.nn.Dropout``).

The output keeps the input's placements (Partial values are reduced first: dropping parts
of a sum is not dropping the sum). Masks follow the placements, as with PyTorch's DTensor
random ops: ranks holding the same piece (replicas) draw the same mask, ranks holding
different pieces draw independent masks. Each rank's seed is the op's seed plus an offset
from its piece's index over the sharded mesh dims. An op called without a seed (MindSpore
passes 0, 0 when ``ms.set_seed`` was not called) gets one from a counter that every rank
advances in step, so that replicas still agree.

Example::

    y = ops.dropout(x_dt, p=0.1)     # x S(0): y S(0), independent masks per row block
"""
from __future__ import annotations

import itertools
from typing import Tuple

from mindspore import ops
from ..._mindspore import seeded_dropout as func_dropout_ext_op
from .._registry import register_sharding
from .._schema import OpSchema, OutputSharding, TensorArg
from ._common import whole_and_reduced

__all__ = ["dropout_rule", "piece_index"]

_SEED_STRIDE = 7919                        # keeps the seeds of different pieces apart
_UNSEEDED = itertools.count(1)             # seeds for unseeded calls, in step on every rank


def piece_index(layout, coord: Tuple[int, ...]) -> int:
    """Index of this rank's piece among the distinct pieces of ``layout`` (replicas share it)."""
    index = 0
    for axis, p in enumerate(layout.placements):
        if p.is_shard():
            index = index * layout.mesh_shape[axis] + coord[axis]
    return index


def _layout(schema: OpSchema):
    x = schema.args[0]
    return whole_and_reduced(x.layout, (), x.ndim)


@register_sharding("Dropout", ignored_args=(2, 3))
def dropout_rule(schema: OpSchema) -> OutputSharding:
    """``Dropout(x, keep_prob, seed0, seed1)``: output and mask, placed like ``x``."""
    layout, x = _layout(schema), schema.args[0]

    def local_fn(coord):
        offset = piece_index(layout, coord) * _SEED_STRIDE

        def dropout(local, keep_prob, seed0, seed1):
            if seed0 == 0 and seed1 == 0:
                seed0, seed1 = 0, next(_UNSEEDED)
            return ops.Dropout(keep_prob, seed0, (seed1 + offset) % 2 ** 31)(local)
        return dropout
    return OutputSharding((layout, None, None, None), ((layout, x.shape), (layout, x.shape)), local_fn=local_fn)


@register_sharding("FuncDropoutExt")
def dropout_ext_rule(schema: OpSchema) -> OutputSharding:
    """``FuncDropoutExt(x, p, training, inplace, seed, offset)`` (seed and offset are tensors
    drawn from MindSpore's default generator): the output, placed like ``x``."""
    layout, x = _layout(schema), schema.args[0]

    def local_fn(coord):
        shift = piece_index(layout, coord) * _SEED_STRIDE

        def dropout(local, p, training, inplace, seed, offset):
            return func_dropout_ext_op(local, p, training, inplace, seed + shift, offset)
        return dropout
    inputs = (layout,) + tuple(a.layout if isinstance(a, TensorArg) else None for a in schema.args[1:])
    return OutputSharding(inputs, ((layout, x.shape),), local_fn=local_fn)
