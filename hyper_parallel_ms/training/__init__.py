"""Training-loop helpers for sharded models: the global gradient norm and its clipping, one
finite-gradient verdict for dynamic loss scaling.

Example::

    from hyper_parallel_ms.training import clip_grad_norm, all_finite
    grads, total = clip_grad_norm(reducer(grads), 1.0, parameters=optimizer.parameters)
"""
from ._clip import clip_grad_norm
from ._finite import all_finite
from ._norm import TotalGradNorm

__all__ = ["clip_grad_norm", "TotalGradNorm", "all_finite"]
