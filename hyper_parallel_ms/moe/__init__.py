"""Mixture of experts: the building blocks (router, stacked experts, the dropless MoE layer), aux-loss-free
load balancing, and the parallel styles for experts (expert, expert x tensor, tensor parallelism).

Example::

    from hyper_parallel_ms.moe import MoE, ExpertParallel, update_expert_bias
    moe = MoE(dim=16, hidden_dim=32, num_experts=4, top_k=2, num_shared_experts=1)
    parallelize_module(moe, mesh["ep"], {"experts": ExpertParallel()})
"""
from ._balance import update_expert_bias
from ._dispatch import TokenDispatcher
from ._experts import FeedForward, GroupedExperts, grouped_swiglu
from ._layer import MoE, auxiliary_loss
from ._router import TokenChoiceTopKRouter
from ._styles import ExpertParallel, ExpertTensorParallel, TensorParallel

__all__ = ["MoE", "TokenChoiceTopKRouter", "GroupedExperts", "FeedForward", "grouped_swiglu", "auxiliary_loss",
           "update_expert_bias", "ExpertParallel", "ExpertTensorParallel", "TensorParallel", "TokenDispatcher"]
