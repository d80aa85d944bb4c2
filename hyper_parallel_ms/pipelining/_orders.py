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
  gradient (W), ordered by a greedy list scheduler on unit-time actions (:func:`zero_bubble`):
  a rank runs a ready I first, else a ready F (the earlier micro-batch, then the later stage,
  first; at most ``v pp`` forwards whose W is still pending), else a pending W, which fills
  what would be bubbles.
* :func:`interleaved_zero_bubble`: the same scheduler on the looped placement with
  ``stages_per_rank`` stages per rank (PyTorch's ``ScheduleInterleavedZeroBubble``).
* :func:`dualpipev`: DeepSeek's DualPipeV on the V placement, in its eight phases (PyTorch's
  ``ScheduleDualPipeV``): warm-up forwards of the first stage, forwards of both, I / W / F of the
  second, then pairs "forward of one stage, full backward of the other" (overlapped on hardware
  that runs a forward and a backward at once; here one after the other), the backwards, and the
  weight gradients left. Needs at least ``2 pp`` micro-batches.

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

__all__ = ["gpipe", "one_f_one_b", "interleaved_1f1b", "looped_bfs", "round_sizes", "zero_bubble", "zbv",
           "interleaved_zero_bubble", "dualpipev"]

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


def zero_bubble(placement: Tuple[int, ...], pp: int, n_microbatches: int, in_flight_limit: int) -> Order:
    """The zero-bubble list scheduler (see the module docstring) over ``placement``, built by
    playing unit-time steps: at most ``in_flight_limit`` forwards per rank whose W is pending.

    >>> zero_bubble(stage_to_rank("v", 2, 4), 2, 1, 4)[1]
    [1F0, 2F0, 2I0, 1I0, 2W0, 1W0]
    """
    num_stages = len(placement)
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
            if in_flight[r] < in_flight_limit:
                options += _ready(local[r], F, next_mb, n_microbatches, made, num_stages)
            options += pending_w[r][:1]
            if options:
                chosen.append((r, options[0]))
        if not chosen:
            raise ScheduleError(f"the zero-bubble order for {pp} ranks, placement {placement} and {n_microbatches} "
                                f"micro-batches got stuck (no rank can run an action)")
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


def zbv(pp: int, n_microbatches: int) -> Order:
    """Zero-bubble V order: :func:`zero_bubble` on the V placement, at most ``2 pp`` forwards in flight."""
    return zero_bubble(stage_to_rank("v", pp, 2 * pp), pp, n_microbatches, 2 * pp)


def interleaved_zero_bubble(pp: int, n_microbatches: int, stages_per_rank: int) -> Order:
    """Interleaved zero-bubble order: :func:`zero_bubble` on the looped placement of
    ``stages_per_rank`` stages per rank, at most ``stages_per_rank * pp`` forwards in flight.

    >>> interleaved_zero_bubble(pp=2, n_microbatches=1, stages_per_rank=2)[0]
    [0F0, 2F0, 2I0, 2W0, 0I0, 0W0]
    """
    return zero_bubble(stage_to_rank("loop", pp, stages_per_rank * pp), pp, n_microbatches, stages_per_rank * pp)


class _DualPipeRank:
    """One rank's DualPipeV list as it is written: the next micro-batch of each (stage, kind) and
    the weight gradients whose input gradient ran (oldest first)."""

    def __init__(self) -> None:
        self.actions: List[Action] = []
        self.next: Dict[Tuple[int, str], int] = {}
        self.pending_w: List[Action] = []

    def add(self, stage: int, kind) -> None:
        """The next ``kind`` action of ``stage``: F, B (a full backward) or I (its W queued)."""
        key = (stage, "F" if kind is F else "B")          # B and I share the backward's count
        m = self.next.get(key, 0)
        self.next[key] = m + 1
        self.actions.append(Action(stage, kind, m))
        if kind is I:
            self.pending_w.append(Action(stage, W, m))

    def weight(self) -> None:
        """The oldest pending weight gradient, if any."""
        if self.pending_w:
            self.actions.append(self.pending_w.pop(0))


def dualpipev(pp: int, n_microbatches: int) -> Order:
    """DualPipeV (see the module docstring): rank ``r`` holds stage ``r`` (``first``) and
    ``2 pp - 1 - r`` (``second``); ``n_microbatches >= 2 pp``.

    >>> dualpipev(pp=2, n_microbatches=4)[1]
    [1F0, 2F0, 1F1, 2F1, 1F2, 2B0, 2F2, 1B0, 1F3, 2B1, 2F3, 1B1, 2B2, 1B2, 2I3, 1I3, 2W3, 1W3]
    """
    if n_microbatches < 2 * pp:
        raise ScheduleError(f"DualPipeV needs at least as many micro-batches as stages: got {n_microbatches} "
                            f"for {2 * pp} stages")
    placement = stage_to_rank("v", pp, 2 * pp)
    order: Order = {}
    for r in range(pp):
        first, second = stages_of_rank(placement, r)
        rank = _DualPipeRank()
        for _ in range(2 * (pp - r - 1)):                 # 1: forwards of the first stage
            rank.add(first, F)
        for _ in range(r + 1):                            # 2: forwards of both
            rank.add(first, F)
            rank.add(second, F)
        for _ in range(pp - r - 1):                       # 3: I / W / F of the second stage
            rank.add(second, I)
            rank.weight()
            rank.add(second, F)
        for _ in range(n_microbatches - 2 * pp + r + 1):  # 4: forward of one stage with backward of the other
            rank.add(first, F)
            rank.add(second, B)
            rank.add(second, F)
            rank.add(first, B)
        for _ in range(pp - r - 1):                       # 5: backward of the second, forward with backward
            rank.add(second, B)
            rank.add(second, F)
            rank.add(first, B)
        split = False                                     # 6: backwards of both, zero bubble from the middle on
        for i in range(r + 1):
            split = split or (i == (r + 1) // 2 and r % 2 == 1)
            rank.add(second, I if split else B)
            split = split or (i == (r + 1) // 2 and r % 2 == 0)
            rank.add(first, I if split else B)
        for _ in range(pp - r - 1):                       # 7: weight gradients with the first stage's backwards
            rank.weight()
            rank.add(first, I if split else B)
        for _ in range(r + 1):                            # 8: the weight gradients left
            rank.weight()
        order[r] = rank.actions
    return order
