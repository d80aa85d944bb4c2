"""Token-choice top-k routing: each token picks its ``top_k`` experts by router score.

Ties are broken deterministically, toward the lower expert index (the selection compares values only,
so the kernels' own tie rules never decide it), and the same tokens route the same way on one device
and on any number of expert-parallel ranks.

Example::

    router = TokenChoiceTopKRouter(dim=16, num_experts=4, top_k=2)
    scores, experts, counts = router(tokens)          # (T, 2), (T, 2) int32, (4,) int32
"""
from __future__ import annotations

from typing import Optional, Tuple

import mindspore as ms
from mindspore import nn, ops

__all__ = ["TokenChoiceTopKRouter", "top_k_lowest_first"]

SCORE_FUNCS = ("softmax", "sigmoid")


def _check_positive_int(value, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{what} must be a positive int, got {value!r}")
    return value


def top_k_lowest_first(values, k: int):
    """The indices ``(T, k)`` (int32) of the ``k`` largest entries of each row of ``values`` ``(T, E)``, largest
    first, a tie going to the lower index: ``k`` rounds of (row maximum, lowest index holding it, masked out).

    >>> import numpy as np
    >>> top_k_lowest_first(ms.Tensor(np.array([[1., 3., 3., 0.]], np.float32)), 2).asnumpy().tolist()
    [[1, 2]]
    """
    num = values.shape[-1]
    positions = ops.arange(num).astype(ms.float32)
    chosen = []
    current = values.astype(ms.float32)
    for _ in range(k):
        best = ops.amax(current, -1, keepdims=True)
        index = ops.amin(ops.where(current == best, positions, float(num)), -1)       # the lowest index holding it
        chosen.append(index)
        current = ops.where(positions == index.expand_dims(-1), float("-inf"), current)
    return ops.stack(chosen, -1).astype(ms.int32)


class TokenChoiceTopKRouter(nn.Cell):
    """Route each token to ``top_k`` of ``num_experts`` experts (as torchtitan's router).

    ``gate`` (``nn.Dense(dim, num_experts, has_bias=False)``) scores the tokens; ``score_func`` turns the
    scores into probabilities in float32; an ``expert_bias`` (aux-loss-free balancing) shifts the selection
    only, the returned scores come from the unbiased probabilities.

    Args:
        dim: the token's feature size.
        num_experts: the number of experts.
        top_k: the experts each token is routed to.
        score_func: ``"softmax"`` (over the experts) or ``"sigmoid"`` (each expert on its own).
        route_norm: divide each token's top-k scores by their sum.
        route_scale: multiply the scores by this factor.

    Returns (from ``construct(x, expert_bias=None)`` on ``x`` of shape ``(T, dim)``): the scores ``(T, top_k)``
    (float32), the expert indices ``(T, top_k)`` (int32, best first), the tokens per expert ``(num_experts,)``
    (int32).

    Example::

        scores, experts, counts = TokenChoiceTopKRouter(16, 4, 2)(x)
    """

    def __init__(self, dim: int, num_experts: int, top_k: int, score_func: str = "softmax", route_norm: bool = False,
                 route_scale: float = 1.0) -> None:
        super().__init__()
        _check_positive_int(dim, "dim")
        _check_positive_int(num_experts, "num_experts")
        _check_positive_int(top_k, "top_k")
        if top_k > num_experts:
            raise ValueError(f"top_k must be at most num_experts ({num_experts}), got {top_k}")
        if score_func not in SCORE_FUNCS:
            raise ValueError(f"score_func must be one of {SCORE_FUNCS}, got {score_func!r}")
        if not isinstance(route_norm, bool):
            raise TypeError(f"route_norm must be True or False, got {route_norm!r}")
        if isinstance(route_scale, bool) or not isinstance(route_scale, (int, float)):
            raise TypeError(f"route_scale must be a number, got {route_scale!r}")
        self.gate = nn.Dense(dim, num_experts, has_bias=False)
        self.num_experts, self.top_k = num_experts, top_k
        self.score_func, self.route_norm, self.route_scale = score_func, route_norm, float(route_scale)

    def probabilities(self, x):
        """The router's probabilities ``(T, num_experts)`` (float32) for tokens ``x`` ``(T, dim)``."""
        logits = self.gate(x).astype(ms.float32)
        return ops.sigmoid(logits) if self.score_func == "sigmoid" else ops.softmax(logits, -1)

    def construct(self, x, expert_bias: Optional[ms.Tensor] = None) -> Tuple[ms.Tensor, ms.Tensor, ms.Tensor]:
        probs = self.probabilities(x)
        ranked = ops.stop_gradient(probs if expert_bias is None else probs + expert_bias)
        experts = top_k_lowest_first(ranked, self.top_k)
        picked = (experts.expand_dims(-1) == ops.arange(self.num_experts).astype(ms.int32)).astype(ms.float32)
        scores = (probs.expand_dims(1) * picked).sum(-1)                        # (T, k): exact, one term each
        if self.route_norm:
            scores = scores / (scores.sum(-1, keepdims=True) + 1e-20)
        scores = scores * self.route_scale
        counts = picked.sum((0, 1)).astype(ms.int32)
        return scores, experts, counts
