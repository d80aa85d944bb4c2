"""The Cell side: parallel styles, ``parallelize_module``, ``distribute_module``,
``ShardingPlan`` + ``shard_module``, and gradient reduction for data parallelism.

Example::

    from hyper_parallel_ms.nn import ColwiseParallel, RowwiseParallel, parallelize_module
    parallelize_module(mlp, mesh["tp"], {"up": ColwiseParallel(), "down": RowwiseParallel()})
"""
from .._context_parallel import (AsyncContextParallel, AsyncDSAIndexerContextParallel,
                                AsyncDSAIndexerLossContextParallel, AsyncDSASparseAttentionContextParallel,
                                ContextParallel, DSAIndexerContextParallel, DSAIndexerLossContextParallel,
                                DSASequenceReplicateCache, DSASparseAttentionContextParallel, context_parallel,
                                context_parallel_unshard, set_rotate_method)
from .._deferred import init_empty_weights, init_on_device, no_init_parameters
from ._attention import MultiheadAttentionParallel
from ._distribute import ShardingPlan, distribute_module, shard_module
from ._gradients import GradientReducer
from ._loss_parallel import ParallelCrossEntropy, loss_parallel, parallel_cross_entropy
from ._parallelize import parallelize_module
from ._parameter import ParameterSharding, as_dtensor, parameter_sharding
from ._styles import (ColwiseParallel, ParallelStyle, PrepareModuleInput, PrepareModuleInputOutput,
                      PrepareModuleOutput, RowwiseParallel, SequenceParallel)

__all__ = ["ParallelStyle", "ColwiseParallel", "RowwiseParallel", "SequenceParallel", "MultiheadAttentionParallel",
           "PrepareModuleInput",
           "PrepareModuleOutput", "PrepareModuleInputOutput", "parallelize_module", "GradientReducer",
           "ParameterSharding", "parameter_sharding", "as_dtensor", "distribute_module", "ShardingPlan",
           "shard_module", "loss_parallel", "ParallelCrossEntropy", "parallel_cross_entropy",
           "no_init_parameters", "init_empty_weights", "init_on_device",
           "context_parallel", "context_parallel_unshard", "set_rotate_method", "ContextParallel",
           "AsyncContextParallel", "DSAIndexerContextParallel", "DSASparseAttentionContextParallel",
           "DSAIndexerLossContextParallel", "DSASequenceReplicateCache", "AsyncDSAIndexerContextParallel",
           "AsyncDSASparseAttentionContextParallel", "AsyncDSAIndexerLossContextParallel"]
from . import functional  # noqa: E402  (hyper_parallel_ms.nn.functional, PyTorch's torch.nn.functional)
