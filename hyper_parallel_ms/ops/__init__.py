"""Ops on DTensors: sharding propagation for MindSpore PyNative ops.

``DTensor``'s tensor hook calls the dispatcher, importing this package on the first op;
importing it registers the rules in :mod:`._rules` (pointwise, matmul / linear, reductions,
views, softmax). An op with no rule raises ``NotImplementedError`` naming the op and the
placements.

Example::

    y = mint.nn.functional.linear(x_dt, w_dt, b_dt)      # a DTensor with the right placements

    @register_sharding("MyOp")
    def my_rule(schema: OpSchema) -> OutputSharding: ...
"""
from . import _rules  # noqa: F401  (registers the rules)
from ._rules.indexing import GetItem, index_key
from ._dispatch import clear_cache, dispatch, strict_plain_tensors
from ._local_map import custom_shard, local_map
from ._registry import ShardingPropagator, propagator, register_sharding, registered_ops
from ._schema import OpSchema, OutputSharding, TensorArg

__all__ = ["register_sharding", "registered_ops", "OpSchema", "OutputSharding", "TensorArg", "dispatch",
           "strict_plain_tensors", "clear_cache", "local_map", "custom_shard", "ShardingPropagator",
           "propagator"]

