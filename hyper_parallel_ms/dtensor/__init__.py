"""DTensor on MindSpore Tensor: placements, redistribution, factories.

Example::

    from hyper_parallel_ms.dtensor import DTensor, distribute_tensor
    dt = distribute_tensor(x, mesh, [Shard(0), Replicate()])
    y = dt.redistribute(mesh, [Replicate(), Shard(1)]).full_tensor()
"""
from ._dtensor import DTensor
from ._factories import distribute_tensor, empty, full, manual_seed, ones, rand, randn, zeros
from ._grad import grad, parallelize_value_and_grad, value_and_grad
from ._skip import SkipDTensorDispatch
from ._spec import DTensorSpec
from ._visualize import sharding_table, visualize_sharding

__all__ = ["DTensor", "DTensorSpec", "distribute_tensor", "zeros", "ones", "empty", "full", "rand", "randn",
           "manual_seed", "visualize_sharding", "sharding_table", "grad", "value_and_grad",
           "parallelize_value_and_grad", "SkipDTensorDispatch"]
