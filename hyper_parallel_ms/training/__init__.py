"""Training-loop helpers for sharded models: the global gradient norm and its clipping, one
finite-gradient verdict for dynamic loss scaling, activation checkpointing and swapping (with
PyTorch's composable ``checkpoint(module)`` and ``offload_wrapper`` names), and PyTorch's
``loss.backward()`` / ``param.grad`` on MindSpore 2.10 (``enable_mindspore_backward_compat``).

Example::

    from hyper_parallel_ms.training import clip_grad_norm, all_finite
    grads, total = clip_grad_norm(reducer(grads), 1.0, parameters=optimizer.parameters)
"""
from ._backward import disable_mindspore_backward_compat, enable_mindspore_backward_compat
from ._recompute import (ATTENTION_CORE, SAVE_MATMUL_AND_COLLECTIVES, CheckpointImpl, CheckpointWrapper,
                          apply_activation_checkpointing, checkpoint_stats, checkpoint_wrapper,
                          create_selective_checkpoint_contexts)
from ._clip import clip_grad_norm
from ._composable import checkpoint, offload_wrapper
from ._exclude import CheckpointExcludeWrapper, ExcludeStats, checkpoint_exclude_wrapper, exclude_stats
from ._finite import all_finite
from ._norm import TotalGradNorm
from ._swap import SwapStats, SwapWrapper, swap_stats, swap_wrapper

__all__ = ["clip_grad_norm", "TotalGradNorm", "all_finite", "checkpoint_wrapper", "apply_activation_checkpointing",
           "CheckpointWrapper", "CheckpointImpl", "checkpoint_stats", "create_selective_checkpoint_contexts",
           "SAVE_MATMUL_AND_COLLECTIVES", "ATTENTION_CORE", "swap_wrapper", "SwapWrapper", "swap_stats", "SwapStats", "checkpoint",
           "offload_wrapper", "checkpoint_exclude_wrapper", "CheckpointExcludeWrapper", "exclude_stats", "ExcludeStats",
           "enable_mindspore_backward_compat", "disable_mindspore_backward_compat"]
