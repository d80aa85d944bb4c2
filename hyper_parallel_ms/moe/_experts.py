"""SwiGLU experts: one dense feed-forward (:class:`FeedForward`, the shared experts) and ``E`` experts with
stacked weights run on tokens sorted by expert (:class:`GroupedExperts`).

:func:`grouped_swiglu` picks the computation by device and mode: on Ascend, MindSpore's grouped matmul
(``gmm``); on CPU in PyNative a loop over the experts on their rows (the counts read once); compiled on CPU
(``ms.jit``, where the counts are data) every expert on every row, each row keeping its own expert's result
(the same values, static shapes). On a simulated rank (shape-only tensors, :func:`hyper_parallel_ms.simulate`)
the rows go through one matmul per weight: the grouped matmul's shapes and FLOPs, no counts read.

Example::

    experts = GroupedExperts(dim=16, hidden_dim=32, num_experts=4)
    y = experts(x_sorted_by_expert, ms.Tensor([3, 0, 2, 1], ms.int32))
"""
from __future__ import annotations

import mindspore as ms
from mindspore import Parameter, nn, ops
from mindspore.common.initializer import TruncatedNormal, initializer

from .._cluster import device_target
from .._mindspore import reads_shape_only, run_in_python, running_eagerly
from ._router import _check_positive_int

__all__ = ["FeedForward", "GroupedExperts", "grouped_swiglu"]


class FeedForward(nn.Cell):
    """The SwiGLU feed-forward ``w2(silu(w1(x)) * w3(x))`` with bias-free ``nn.Dense`` layers (a dense layer,
    or the shared experts of a :class:`~hyper_parallel_ms.moe.MoE`; ColwiseParallel on ``w1`` / ``w3`` and
    RowwiseParallel on ``w2`` split it over tensor-parallel ranks).

    Args:
        dim: the input and output features.
        hidden_dim: the hidden features.

    Example::

        y = FeedForward(16, 32)(x)
    """

    def __init__(self, dim: int, hidden_dim: int) -> None:
        super().__init__()
        _check_positive_int(dim, "dim")
        _check_positive_int(hidden_dim, "hidden_dim")
        self.w1 = nn.Dense(dim, hidden_dim, has_bias=False)
        self.w2 = nn.Dense(hidden_dim, dim, has_bias=False)
        self.w3 = nn.Dense(dim, hidden_dim, has_bias=False)

    def construct(self, x):
        return self.w2(ops.silu(self.w1(x)) * self.w3(x))


def _swiglu(x, w1, w2, w3):
    """One expert: ``x (M, dim)``, ``w1 / w3 (hidden, dim)``, ``w2 (dim, hidden)``."""
    return ops.matmul(ops.silu(ops.matmul(x, w1.T)) * ops.matmul(x, w3.T), w2.T)


def _first(w):
    """Expert 0's weight of the stacked ``w`` (``narrow``: indexing a Parameter without data fails)."""
    return ops.narrow(w, 0, 0, 1).reshape(tuple(w.shape[1:]))


@run_in_python
def _path() -> str:
    if device_target() == "Ascend":
        return "grouped"
    return "loop" if running_eagerly() else "masked"


def _grouped(x, w1, w2, w3, counts):
    from mindspore.ops.function.math_func import gmm       # Ascend's grouped matmul (an experimental API)
    sizes = counts.astype(ms.int64)

    def mm(a, w):
        return gmm([a], [ops.transpose(w, (0, 2, 1))], group_list=sizes, group_list_type=1)[0]
    return mm(ops.silu(mm(x, w1)) * mm(x, w3), w2)


def _looped(x, w1, w2, w3, counts):
    sizes = [int(c) for c in counts.asnumpy().tolist()]
    if sum(sizes) != x.shape[0]:
        raise ValueError(f"GroupedExperts: num_tokens_per_expert {sizes} sum to {sum(sizes)}, but x has "
                         f"{x.shape[0]} rows (tokens sorted by expert, every token counted once)")
    outs, start = [], 0
    for e, size in enumerate(sizes):
        if size:
            outs.append(_swiglu(x[start:start + size], w1[e], w2[e], w3[e]))
        start += size
    if not outs:
        return x                                    # no token: the empty (0, dim) input is the output
    return outs[0] if len(outs) == 1 else ops.cat(outs, 0)


def _masked(x, w1, w2, w3, counts):
    ends = ops.cumsum(counts.astype(ms.int32), 0)
    rows = ops.arange(x.shape[0]).astype(ms.int32).expand_dims(-1)
    expert_of = (rows >= ends.expand_dims(0)).astype(ms.int32).sum(-1)           # (M,): the row's expert
    out = ops.zeros(x.shape, x.dtype)
    for e in range(w1.shape[0]):
        out = ops.where((expert_of == e).expand_dims(-1), _swiglu(x, w1[e], w2[e], w3[e]), out)
    return out


def grouped_swiglu(x, w1, w2, w3, num_tokens_per_expert):
    """Each expert's SwiGLU on its rows of ``x`` (sorted by expert, ``num_tokens_per_expert[e]`` rows each).

    Args:
        x: ``(M, dim)`` tokens sorted by expert.
        w1: ``(E, hidden, dim)``.
        w2: ``(E, dim, hidden)``.
        w3: ``(E, hidden, dim)``.
        num_tokens_per_expert: ``(E,)`` integer tensor summing to ``M``.

    Example::

        y = grouped_swiglu(x, w1, w2, w3, ms.Tensor([2, 1], ms.int32))
    """
    if reads_shape_only((x,)):                      # the grouped matmul's shapes: every row through one expert's
        return _swiglu(x, _first(w1), _first(w2), _first(w3))
    path = _path()
    if path == "grouped":
        return _grouped(x, w1, w2, w3, num_tokens_per_expert)
    if path == "loop":
        return _looped(x, w1, w2, w3, num_tokens_per_expert)
    return _masked(x, w1, w2, w3, num_tokens_per_expert)


class GroupedExperts(nn.Cell):
    """``num_experts`` SwiGLU experts with stacked weights ``w1 (E, hidden, dim)``, ``w2 (E, dim, hidden)``,
    ``w3 (E, hidden, dim)``; ``construct(x, num_tokens_per_expert)`` runs each on its rows of ``x`` (tokens
    sorted by expert). :class:`~hyper_parallel_ms.moe.ExpertParallel` places ``E / ep`` experts on each rank.

    Args:
        dim: the token's features.
        hidden_dim: each expert's hidden features.
        num_experts: the number of experts.

    Example::

        y = GroupedExperts(16, 32, 4)(x_sorted, ms.Tensor([3, 0, 2, 1], ms.int32))
    """

    def __init__(self, dim: int, hidden_dim: int, num_experts: int) -> None:
        super().__init__()
        for value, what in ((dim, "dim"), (hidden_dim, "hidden_dim"), (num_experts, "num_experts")):
            _check_positive_int(value, what)
        self.w1 = Parameter(initializer(TruncatedNormal(0.02), (num_experts, hidden_dim, dim), ms.float32), name="w1")
        self.w2 = Parameter(initializer(TruncatedNormal(0.02), (num_experts, dim, hidden_dim), ms.float32), name="w2")
        self.w3 = Parameter(initializer(TruncatedNormal(0.02), (num_experts, hidden_dim, dim), ms.float32), name="w3")

    def construct(self, x, num_tokens_per_expert):
        return grouped_swiglu(x, self.w1, self.w2, self.w3, num_tokens_per_expert)
