"""Sharding rules, one module per op family; importing this package registers them all.

Example::

    from hyper_parallel_ms.ops import registered_ops
    "MatMulExt" in registered_ops()
"""
# registration by import (each module's rules register themselves by decorator)
from . import attention, concat, expand, indexing, matmul, nn_ops, pointwise, random, reduction, scan, view  # noqa: F401,E501
