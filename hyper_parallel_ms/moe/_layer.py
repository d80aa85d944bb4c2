"""The mixture-of-experts layer: route, sort the tokens by expert, run the experts, weigh and sum back.

Dropless: every token reaches its ``top_k`` experts, however many go to one expert. Tokens are sorted by
(expert, token position) with distinct integer keys, so the order inside an expert is the tokens' order
(deterministic on every device). The router's counts feed the experts and accumulate in
``tokens_per_expert`` (for aux-loss-free balancing, :func:`~hyper_parallel_ms.moe.update_expert_bias`),
once per forward: under activation checkpointing the recompute in the backward adds nothing (PyNative;
MindSpore's graph recompute does not repeat the in-place add).

Example::

    moe = MoE(dim=16, hidden_dim=32, num_experts=4, top_k=2, num_shared_experts=1)
    y = moe(x)                                   # x: (batch, seq, 16) or (tokens, 16)
"""
from __future__ import annotations

from typing import Optional

import mindspore as ms
import numpy as np
from mindspore import Parameter, Tensor, nn, ops

from .._mindspore import replaying, running_eagerly
from ._experts import FeedForward, GroupedExperts
from ._router import TokenChoiceTopKRouter, _check_positive_int

__all__ = ["MoE", "auxiliary_loss"]


def _check_coeff(value, what: str) -> Optional[float]:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ValueError(f"{what} must be None or a positive number, got {value!r}")
    return float(value)


class _WithAuxiliaryGradient(nn.Cell):
    """``x`` unchanged; the backward also sends a gradient of one into ``aux`` (a loss added to the model's
    loss without being returned, as Megatron-LM's auxiliary-loss scaler does)."""

    def construct(self, x, aux):
        return x

    def bprop(self, x, aux, out, dout):
        return dout, ops.ones_like(aux)


def auxiliary_loss(probs, counts, top_k: int, coeff: float):
    """The classic load-balancing loss ``coeff * E * sum_e f_e * P_e`` (Switch Transformer): ``f_e`` the share of
    the ``T * top_k`` routed slots that expert ``e`` got (no gradient), ``P_e`` its mean router probability.

    Args:
        probs: ``(T, E)`` router probabilities.
        counts: ``(E,)`` tokens per expert.
        top_k: the experts per token.
        coeff: the loss's weight.

    Example::

        loss = auxiliary_loss(probs, counts, top_k=2, coeff=1e-2)
    """
    tokens, experts = probs.shape
    share = ops.stop_gradient(counts.astype(ms.float32)) / float(max(tokens * top_k, 1))
    return coeff * experts * (share * probs.mean(0)).sum()


class MoE(nn.Cell):
    """A dropless mixture-of-experts layer (as torchtitan's ``MoE``): a :class:`TokenChoiceTopKRouter`
    (``router``), :class:`GroupedExperts` (``experts``) and optional shared experts (``shared_experts``, one
    :class:`FeedForward` of ``hidden_dim * num_shared_experts``) that every token goes through.

    Args:
        dim: the token's features.
        hidden_dim: each expert's hidden features.
        num_experts: the number of routed experts.
        top_k: the experts each token is routed to.
        num_shared_experts: shared experts (0: none).
        score_func: the router's ``"softmax"`` or ``"sigmoid"``.
        route_norm: normalise each token's top-k scores to sum to one.
        route_scale: the router's score factor.
        load_balance_coeff: aux-loss-free balancing (DeepSeek-V3): the step of the non-trainable
            ``expert_bias`` that :func:`~hyper_parallel_ms.moe.update_expert_bias` moves after each
            optimizer step (``None``: no bias).
        aux_loss_coeff: the classic auxiliary loss's weight (``None``: none); its gradient joins the
            backward of the layer's output (the loss itself is not added to what the model returns).
        score_before_experts: weigh a token by its score before the experts (torchtitan's default) rather
            than their output.

    Example::

        moe = MoE(16, 32, num_experts=4, top_k=2, num_shared_experts=1, load_balance_coeff=1e-3)
        y = moe(x)
    """

    def __init__(self, dim: int, hidden_dim: int, num_experts: int, top_k: int, *, num_shared_experts: int = 0,
                 score_func: str = "softmax", route_norm: bool = False, route_scale: float = 1.0,
                 load_balance_coeff: Optional[float] = None, aux_loss_coeff: Optional[float] = None,
                 score_before_experts: bool = True) -> None:
        super().__init__()
        if isinstance(num_shared_experts, bool) or not isinstance(num_shared_experts, int) or num_shared_experts < 0:
            raise ValueError(f"num_shared_experts must be a non-negative int, got {num_shared_experts!r}")
        if not isinstance(score_before_experts, bool):
            raise TypeError(f"score_before_experts must be True or False, got {score_before_experts!r}")
        self.router = TokenChoiceTopKRouter(dim, num_experts, top_k, score_func, route_norm, route_scale)
        self.experts = GroupedExperts(dim, hidden_dim, num_experts)
        self.shared_experts = FeedForward(dim, hidden_dim * num_shared_experts) if num_shared_experts else None
        self.dim, self.num_experts, self.top_k = dim, num_experts, top_k
        self.load_balance_coeff = _check_coeff(load_balance_coeff, "load_balance_coeff")
        self.aux_loss_coeff = _check_coeff(aux_loss_coeff, "aux_loss_coeff")
        self.score_before_experts = score_before_experts
        zeros = Tensor(np.zeros(num_experts, np.float32))
        self.expert_bias = Parameter(zeros.copy(), name="expert_bias", requires_grad=False) \
            if self.load_balance_coeff is not None else None
        self.tokens_per_expert = Parameter(zeros.copy(), name="tokens_per_expert", requires_grad=False)
        self.with_aux = _WithAuxiliaryGradient() if self.aux_loss_coeff is not None else None

    def construct(self, x):
        shape = x.shape
        tokens = x.reshape(-1, self.dim)
        scores, experts, counts = self.router(tokens, self.expert_bias)
        increment = counts.astype(ms.float32)
        if running_eagerly():       # activation checkpointing's recompute counts nothing (the same ops, times 0)
            increment = increment * (0.0 if replaying() else 1.0)
        ops.assign_add(self.tokens_per_expert, increment)
        slots = experts.shape[0] * self.top_k
        keys = experts.reshape(-1) * slots + ops.arange(slots).astype(ms.int32)        # distinct: a stable order
        _, order = ops.sort(keys.astype(ms.float32) if slots * self.num_experts < 2 ** 24 else keys)
        routed = ops.gather(tokens, order // self.top_k, 0)
        weights = ops.gather(scores.reshape(-1), order, 0).expand_dims(-1)
        if self.score_before_experts:
            routed = (routed.astype(ms.float32) * weights).astype(tokens.dtype)
        out = self.experts(routed, counts)
        if not self.score_before_experts:
            out = (out.astype(ms.float32) * weights).astype(tokens.dtype)
        _, back = ops.sort(order.astype(ms.float32) if slots < 2 ** 24 else order)  # slot -> its place in order
        out = ops.gather(out, back, 0).reshape(-1, self.top_k, self.dim).sum(1)
        if self.shared_experts is not None:
            out = out + self.shared_experts(tokens)
        if self.with_aux is not None:
            probs = self.router.probabilities(tokens)
            out = self.with_aux(out, auxiliary_loss(probs, counts, self.top_k, self.aux_loss_coeff))
        return out.reshape(shape)
