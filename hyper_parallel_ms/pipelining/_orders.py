"""Per-rank compute orders (F / B / I / W only) of each schedule.

* :func:`gpipe`: every forward, then every backward (one stage per rank).
* :func:`one_f_one_b`: ``pp - rank - 1`` warm-up forwards, then one forward and one backward
  in turn, then the remaining backwards (PyTorch's and Megatron's 1F1B order).
* :func:`interleaved_1f1b`: several stages per rank in the looped placement; micro-batches go
  in rounds of about ``pp``, each round through the rank's stages in turn (backwards in reverse
  stage order); ``(v - 1) * round + 2 * (pp - 1 - rank)`` warm-up forwards, then 1F1B.
* :func:`looped_bfs`: several stages per rank in the looped placement, breadth first: every
  micro-batch through the rank's first stage, then its next; the backwards in reverse (last
  stage first, micro-batches from the last), as PyTorch's ``ScheduleLoopedBFS``.
* :func:`zbv`: the V placement with the backward split into input gradient (I) and weight
  gradient (W), ordered by a greedy list scheduler on unit-time actions: a rank runs a ready I
  first, else a ready F (the later stage first, at most ``2 pp`` forwards whose W is still
  pending), else a pending W, which fills what would be bubbles.

Pure Python. SEND / RECV are added by :mod:`._comms`.

Example:
    >>> one_f_one_b(pp=2, n_microbatches=3)[0]
    [0F0, 0F1, 0B0, 0F2, 0B1, 0B2]
    >>> one_f_one_b(pp=2, n_microbatches=3)[1]
    [1F0, 1B0, 1F1, 1B1, 1F2, 1B2]
"""
from __future__ import annotations

from typing import Dict, List, Tuple

from ._action import B, F, I, W, Action, ScheduleError
from ._data import makes, needs
from ._placement import stage_to_rank, stages_of_rank

__all__ = ["gpipe", "one_f_one_b", "interleaved_1f1b", "looped_bfs", "round_sizes", "zbv"]

Order = Dict[int, List[Action]]


def gpipe(pp: int, n_microbatches: int) -> Order:
    """All forwards, then all backwards, on each rank's one stage."""
    mbs = range(n_microbatches)
    return {r: [Action(r, F, m) for m in mbs] + [Action(r, B, m) for m in mbs] for r in range(pp)}


def _one_f_one_b(forwards: List[Action], backwards: List[Action], warmup: int) -> List[Action]:
    warmup = min(warmup, len(forwards))
    out = forwards[:warmup]
    for f, b in zip(forwards[warmup:], backwards):
        out += [f, b]
    return out + backwards[len(forwards) - warmup:]


def one_f_one_b(pp: int, n_microbatches: int) -> Order:
    """1F1B on one stage per rank."""
    mbs = range(n_microbatches)
    return {r: _one_f_one_b([Action(r, F, m) for m in mbs], [Action(r, B, m) for m in mbs], pp - 1 - r)
            for r in range(pp)}


def round_sizes(pp: int, n_microbatches: int) -> Tuple[int, ...]:
    """Micro-batches per round of the interleaved schedule: ``max(1, n // pp)`` rounds, as even as can be.

    >>> round_sizes(4, 8), round_sizes(4, 9), round_sizes(4, 3)
    ((4, 4), (5, 4), (3,))
    """
    rounds = max(1, n_microbatches // pp)
    base, extra = divmod(n_microbatches, rounds)
    return tuple(base + (i < extra) for i in range(rounds))


def interleaved_1f1b(pp: int, n_microbatches: int, stages_per_rank: int) -> Order:
    """Interleaved 1F1B with ``stages_per_rank`` looped stages per rank."""
    sizes = round_sizes(pp, n_microbatches)
    firsts = [sum(sizes[:k]) for k in range(len(sizes))]
    order: Order = {}
    for r in range(pp):
        local = [r + j * pp for j in range(stages_per_rank)]
        fwd = [Action(s, F, m) for first, size in zip(firsts, sizes) for s in local
               for m in range(first, first + size)]
        bwd = [Action(s, B, m) for first, size in zip(firsts, sizes) for s in reversed(local)
               for m in range(first, first + size)]
        order[r] = _one_f_one_b(fwd, bwd, (stages_per_rank - 1) * sizes[0] + 2 * (pp - 1 - r))
    return order


def looped_bfs(pp: int, n_microbatches: int, stages_per_rank: int) -> Order:
    """Breadth first over ``stages_per_rank`` looped stages per rank: all forwards of a stage, then of
    the next; the backwards from the last stage and the last micro-batch.

    >>> looped_bfs(pp=2, n_microbatches=2, stages_per_rank=2)[1]
    [1F0, 1F1, 3F0, 3F1, 3B1, 3B0, 1B1, 1B0]
    """
    mbs = range(n_microbatches)
    order: Order = {}
    for r in range(pp):
        local = [r + j * pp for j in range(stages_per_rank)]
        order[r] = ([Action(s, F, m) for s in local for m in mbs] +
                    [Action(s, B, m) for s in reversed(local) for m in reversed(mbs)])
    return order


def _ready(stages, kind, next_mb: Dict, n_microbatches: int, made: set, num_stages: int) -> List[Action]:
    """The next ``kind`` action of each of ``stages`` whose data exist; earliest micro-batch, then later stage, first."""
    acts = [Action(s, kind, next_mb[s, kind]) for s in stages if next_mb[s, kind] < n_microbatches]
    acts = [a for a in acts if all(d in made for d in needs(a, num_stages))]
    return sorted(acts, key=lambda a: (a.microbatch, -a.stage))


def zbv(pp: int, n_microbatches: int) -> Order:
    """Zero-bubble V order (see the module docstring), built by simulating unit-time steps."""
    num_stages = 2 * pp
    placement = stage_to_rank("v", pp, num_stages)
    local = {r: stages_of_rank(placement, r) for r in range(pp)}
    next_mb = {(s, k): 0 for s in range(num_stages) for k in (F, I)}
    pending_w: Dict[int, List[Action]] = {r: [] for r in range(pp)}
    in_flight = {r: 0 for r in range(pp)}     # forwards whose W has not run yet
    made: set = set()
    order: Order = {r: [] for r in range(pp)}
    left = 3 * num_stages * n_microbatches
    while left:
        chosen = []
        for r in range(pp):
            options = _ready(local[r], I, next_mb, n_microbatches, made, num_stages)
            if in_flight[r] < 2 * pp:
                options += _ready(local[r], F, next_mb, n_microbatches, made, num_stages)
            options += pending_w[r][:1]
            if options:
                chosen.append((r, options[0]))
        if not chosen:
            raise ScheduleError(f"the zero-bubble V order for {pp} ranks and {n_microbatches} micro-batches "
                                f"got stuck (no rank can run an action)")
        for r, action in chosen:
            order[r].append(action)
            made.update(makes(action))
            in_flight[r] += (action.kind is F) - (action.kind is W)
            if action.kind is W:
                pending_w[r].pop(0)
            else:
                next_mb[action.stage, action.kind] += 1
            if action.kind is I:
                pending_w[r].append(Action(action.stage, W, action.microbatch))
        left -= len(chosen)
    return order
