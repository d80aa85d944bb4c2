"""Ops on DTensors: sharding propagation for MindSpore PyNative ops.

Importing this package installs the dispatcher as ``DTensor.__fallback__`` and registers
the rules in :mod:`._rules` (pointwise, matmul / linear, reductions, views, softmax). An op with no rule
raises ``NotImplementedError`` naming the op and the placements.

Example::

    import hyper_parallel_ms.ops          # (imported by hyper_parallel_ms)
    y = mint.nn.functional.linear(x_dt, w_dt, b_dt)      # a DTensor with the right placements

    @register_sharding("MyOp")
    def my_rule(schema: OpSchema) -> OutputSharding: ...
"""
from mindspore import ops as _ms_ops

from ..dtensor import DTensor
from . import _rules  # noqa: F401  (registers the rules)
from ._rules.indexing import GetItem, index_key
from ._dispatch import clear_cache, dispatch, strict_plain_tensors
from ._local_map import local_map
from ._registry import ShardingPropagator, propagator, register_sharding, registered_ops
from ._schema import OpSchema, OutputSharding, TensorArg

__all__ = ["register_sharding", "registered_ops", "OpSchema", "OutputSharding", "TensorArg", "dispatch",
           "strict_plain_tensors", "clear_cache", "local_map", "ShardingPropagator", "propagator"]


def _fallback(self, func, args=(), kwargs=None):
    return dispatch(func, args, kwargs or {})


def _getitem(self, index):
    return dispatch(GetItem, (self, index_key(index, len(self._dt_spec.shape))), {})


def _reflected(op):
    def method(self, other):
        return op(other, self)
    return method


# The hook MindSpore calls for ops on DTensors; and reflected operators, which Python tries
# first on a Tensor subclass, so that ``plain + dtensor`` reaches the dispatcher too.
DTensor.__fallback__ = _fallback
DTensor.__getitem__ = _getitem      # MindSpore's indexing does not always reach the hook
DTensor.__radd__ = _reflected(_ms_ops.add)
DTensor.__rsub__ = _reflected(_ms_ops.sub)
DTensor.__rmul__ = _reflected(_ms_ops.mul)
DTensor.__rtruediv__ = _reflected(_ms_ops.div)
DTensor.__rmatmul__ = _reflected(_ms_ops.matmul)
