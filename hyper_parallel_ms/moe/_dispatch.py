"""Token dispatch and combine over an expert-parallel mesh dim (the moves of :class:`ExpertParallel`).

A rank holds tokens sorted by global expert and their counts ``(E,)``. Dispatch gathers every rank's
counts (one all-gather of ``E`` values), derives the split matrix (rows rank ``i`` sends to rank ``j``: its
tokens of ``j``'s ``E / ep`` experts), exchanges the tokens (:func:`~hyper_parallel_ms.comm.all_to_all_by_matrix`)
and reorders what arrives from source-major (rank, expert) blocks into expert-major blocks, so the local
experts see their tokens contiguous with their local counts. Combine undoes the reorder and sends every row
back where it came from. Both moves are differentiable (the backward of each exchange is the transposed one);
the counts make the shapes, so this runs in PyNative only. On a simulated rank (the dry run), where no count
is known, the counts come from the routing the simulation states (``simulate(..., routing=)``; the count
gather is still issued and recorded).

Example::

    dispatcher = TokenDispatcher(mesh, "ep", num_experts=4)
    y, local_counts, state = dispatcher.dispatch(x, counts)
    back = dispatcher.combine(experts(y, local_counts), state)
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import List, Sequence, Tuple

import mindspore as ms
import numpy as np
from mindspore import Tensor, ops

from .. import comm
from ..comm._tensor import narrow

__all__ = ["TokenDispatcher", "DispatchState"]


@dataclass(frozen=True)
class DispatchState:
    """What combine needs of one dispatch: the split matrix, the received blocks' sizes (source-major) and
    the expert-major order of those blocks; and every rank's tokens per expert (the same on every rank)."""

    matrix: Tuple[Tuple[int, ...], ...]
    blocks: Tuple[int, ...]
    order: Tuple[int, ...]
    counts: Tuple[Tuple[int, ...], ...] = ()


def _reorder(x, sizes: Sequence[int], order: Sequence[int]):
    """``x``'s row blocks of ``sizes`` concatenated in ``order`` (empty blocks skipped)."""
    if list(order) == sorted(order):
        return x
    starts = [sum(sizes[:k]) for k in range(len(sizes))]
    # narrow, not split: the backward of a split into views misplaces gradients on CPU (MindSpore 2.10)
    kept = [narrow(x, 0, starts[k], sizes[k]) for k in order if sizes[k]]
    if not kept:
        return x
    return kept[0] if len(kept) == 1 else ops.cat(kept, 0)


class TokenDispatcher:
    """Moves tokens sorted by global expert to the ranks holding their experts along ``mesh_dim`` and back
    (experts placed in order: rank ``j`` holds experts ``[j * E / ep, (j + 1) * E / ep)``).

    Args:
        mesh: the :class:`~hyper_parallel_ms.DeviceMesh`.
        mesh_dim: the expert-parallel mesh dim (name or index).
        num_experts: the global number of experts (a multiple of the ep ranks).

    Example::

        y, local_counts, state = TokenDispatcher(mesh, "ep", 4).dispatch(x, counts)
    """

    def __init__(self, mesh, mesh_dim, num_experts: int) -> None:
        self.mesh, self.mesh_dim, self.num_experts = mesh, mesh_dim, num_experts
        self.ranks = mesh.size(mesh_dim)
        self.local = num_experts // self.ranks
        self.me = mesh.get_local_rank(mesh_dim)

    def gathered_counts(self, counts) -> np.ndarray:
        """Every rank's tokens per expert, ``(ep, E)`` integers (one all-gather, exact in float32)."""
        if tuple(counts.shape) != (self.num_experts,):
            raise ValueError(f"expert parallelism: num_tokens_per_expert has shape {tuple(counts.shape)}, expected "
                             f"({self.num_experts},): the counts of every (global) expert, for tokens sorted by expert")
        every = comm.all_gather(counts.astype(ms.float32).reshape(1, -1), self.mesh, self.mesh_dim, dim=0)
        return np.rint(every.asnumpy()).astype(np.int64)

    def dispatch(self, x, counts) -> Tuple[Tensor, Tensor, DispatchState]:
        """(this rank's tokens of its experts, expert-major; their counts ``(E / ep,)`` int32; the state)."""
        n, local, me = self.ranks, self.local, self.me
        every = self.gathered_counts(counts)
        if not self.mesh.exchange.moves:
            # nothing moved, no count known: the exchange states them (the dry run's routing assumption,
            # hyper_parallel_ms.simulate(..., routing=)); the gather above was issued and recorded
            every = np.asarray(self.mesh.exchange.expert_counts(int(x.shape[0]), self.num_experts, n), dtype=np.int64)
        if int(every[me].sum()) != x.shape[0]:
            raise ValueError(f"expert parallelism: num_tokens_per_expert sums to {int(every[me].sum())}, but the "
                             f"input has {x.shape[0]} tokens")
        matrix = tuple(tuple(int(every[i, j * local:(j + 1) * local].sum()) for j in range(n)) for i in range(n))
        received = comm.all_to_all_by_matrix(x, matrix, self.mesh, self.mesh_dim)
        blocks = tuple(int(every[i, me * local + e]) for i in range(n) for e in range(local))
        order = tuple(i * local + e for e in range(local) for i in range(n))
        mine = Tensor(every[:, me * local:(me + 1) * local].sum(0).astype(np.int32))
        state = DispatchState(matrix, blocks, order, tuple(map(tuple, every.tolist())))
        return _reorder(received, blocks, order), mine, state

    def combine(self, y, state: DispatchState):
        """The experts' output rows back on the ranks (and in the order) they came from."""
        back: List[int] = [0] * len(state.order)
        for position, k in enumerate(state.order):
            back[k] = position
        y = _reorder(y, [state.blocks[k] for k in state.order], back)
        transposed = tuple(zip(*state.matrix))
        return comm.all_to_all_by_matrix(y, transposed, self.mesh, self.mesh_dim)
