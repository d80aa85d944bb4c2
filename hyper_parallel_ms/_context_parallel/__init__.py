"""Context parallelism: attention on sequence shards, forward and backward equal to one device.

Every layer but attention runs on its sequence shard unchanged; attention needs every key. The
engine (:mod:`._engine`: keys and values all-gathered or passed around a ring, partial results
merged by log-sum-exp, causal blocks trimmed to what the mask allows), the load balancer
(:mod:`._balance`), Ulysses and hybrid (:mod:`._dispatch`), and the faces: PyTorch's
``context_parallel`` / ``context_parallel_unshard`` / ``set_rotate_method`` (:mod:`._api`), reached
through :func:`hyper_parallel_ms.nn.functional.scaled_dot_product_attention`, and HyperParallel's
``ContextParallel`` / ``AsyncContextParallel`` styles (:mod:`._style`) and its DeepSeek sparse attention
boundary styles (:mod:`._dsa`, :mod:`._dsa_async`); all exported from
:mod:`hyper_parallel_ms.nn`.

Example::

    from hyper_parallel_ms.nn import context_parallel
    with context_parallel(mesh["cp"], buffers=[q, k, v], buffer_seq_dims=[2, 2, 2]):
        out = scaled_dot_product_attention(q, k, v, is_causal=True)
"""
from ._api import context_parallel, context_parallel_unshard
from ._dispatch import set_rotate_method
from ._dsa import (DSAIndexerContextParallel, DSAIndexerLossContextParallel, DSASequenceReplicateCache,
                   DSASparseAttentionContextParallel)
from ._dsa_async import (AsyncDSAIndexerContextParallel, AsyncDSAIndexerLossContextParallel,
                         AsyncDSASparseAttentionContextParallel)
from ._style import AsyncContextParallel, ContextParallel

_DSA_STYLES = ["DSAIndexerContextParallel", "DSASparseAttentionContextParallel", "DSAIndexerLossContextParallel",
              "DSASequenceReplicateCache", "AsyncDSAIndexerContextParallel", "AsyncDSASparseAttentionContextParallel",
              "AsyncDSAIndexerLossContextParallel"]
__all__ = ["context_parallel", "context_parallel_unshard", "set_rotate_method", "ContextParallel",
           "AsyncContextParallel", *_DSA_STYLES]
