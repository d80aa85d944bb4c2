"""A schedule lowered to checked per-rank action lists: :class:`PipelinePlan` and :func:`build_plan`.

=====================  ===========  ==============  =============================================
schedule               placement    stages / rank   micro-batches
=====================  ===========  ==============  =============================================
``GPipe``              loop         1               any
``1F1B``               loop         1               at least ``pp`` (PyTorch refuses fewer too)
``Interleaved1F1B``    loop         1 or more       any (rounds of ``max(1, n // pp)``, as even
                                                    as can be; PyTorch wants them equal)
``LoopedBFS``          loop         1 or more       any
``ZBVZeroBubble``      V            2               any
``InterleavedZero      loop         1 or more       any
Bubble``
``DualPipeV``          V            2               at least ``2 pp`` (as PyTorch)
=====================  ===========  ==============  =============================================

The looped schedules hold 2 stages per rank unless told otherwise; with one stage per rank they
run their one-stage forms, as PyTorch's: interleaved 1F1B is 1F1B with ``2 (pp - 1 - rank)``
warm-up forwards, looped BFS is GPipe (the backwards from the last micro-batch), interleaved zero
bubble the zero-bubble order of one stage per rank (each backward split into I and W).

A plan is validated when it is made (:func:`._validate.validate`), so a runtime can execute
``plan.actions[rank]`` in order with blocking send / recv.

Example:
    >>> plan = build_plan("1F1B", pp=2, n_microbatches=2)
    >>> print(plan.table())
            rank 0    rank 1
    step 0  0F0       1RECV_F0
    step 1  0SEND_F0  1F0
    step 2  0F1       1RECV_F1
    step 3  0SEND_F1  1B0
    step 4  0RECV_B0  1SEND_B0
    step 5  0B0       1F1
    step 6  0RECV_B1  1B1
    step 7  0B1       1SEND_B1
    >>> round(plan.bubble_fraction(), 6)       # (pp - 1) / (n + pp - 1) with unit-time actions
    0.333333
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Dict, FrozenSet, List, Mapping, Optional, Sequence, Tuple

from ._action import B, F, W, Action, ActionKind, ScheduleError
from ._comms import add_comms
from ._lowering import lower_fsdp
from ._pairing import backward_forward_pairs, split_pairs
from ._orders import dualpipev, gpipe, interleaved_1f1b, interleaved_zero_bubble, looped_bfs, one_f_one_b, zbv
from ._placement import stage_to_rank, stages_of_rank
from ._validate import Timeline, validate

__all__ = ["SCHEDULES", "PipelinePlan", "build_plan", "format_table"]


@dataclass(frozen=True)
class _Spec:
    placement: str
    stages_per_rank: Optional[int]          # None: any number >= 1 (default 2)
    needs_a_microbatch_per_stage: bool
    order: Callable[[int, int, int], Dict[int, List[Action]]]


SCHEDULES: Mapping[str, _Spec] = {
    "GPipe": _Spec("loop", 1, False, lambda pp, n, v: gpipe(pp, n)),
    "1F1B": _Spec("loop", 1, True, lambda pp, n, v: one_f_one_b(pp, n)),
    "Interleaved1F1B": _Spec("loop", None, False, interleaved_1f1b),
    "LoopedBFS": _Spec("loop", None, False, looped_bfs),
    "ZBVZeroBubble": _Spec("v", 2, False, lambda pp, n, v: zbv(pp, n)),
    "InterleavedZeroBubble": _Spec("loop", None, False, interleaved_zero_bubble),
    "DualPipeV": _Spec("v", 2, True, lambda pp, n, v: dualpipev(pp, n)),
}


def format_table(actions: Sequence[Sequence[object]], row: str = "step") -> str:
    """Rows of steps (or time slots), one column per rank; ``None`` prints as blank.

    Args:
        actions: one sequence per rank (actions, or anything printable; ``None`` for a blank).
        row: the label of a row (``"step"``, or ``"t"`` for time slots).

    Example:
        >>> print(format_table([["0F0", None], ["1F0"]], row="t"))
             rank 0  rank 1
        t 0  0F0     1F0
        t 1
    """
    n_rows = max((len(a) for a in actions), default=0)
    cells = [[f"{row} {i}" for i in range(n_rows)]]
    cells += [[("" if a is None else str(a)) for a in acts] + [""] * (n_rows - len(acts)) for acts in actions]
    heads = [""] + [f"rank {r}" for r in range(len(actions))]
    widths = [max([len(h)] + [len(c) for c in col]) for h, col in zip(heads, cells)]
    lines = ["  ".join(h.ljust(w) for h, w in zip(heads, widths))]
    lines += ["  ".join(col[i].ljust(w) for col, w in zip(cells, widths)) for i in range(n_rows)]
    return "\n".join(line.rstrip() for line in lines)


@dataclass(frozen=True)
class PipelinePlan:
    """Checked per-rank action lists of one pipeline step (``actions[rank]``, run in order);
    :func:`build_plan` makes them, and a plan is validated when it is made.

    Args:
        schedule: the schedule's name (a key of ``SCHEDULES``).
        n_microbatches: micro-batches per step.
        placement: the rank of each stage, indexed by stage.
        actions: per rank, its actions in order.
        paired: the backwards that run with the forward directly after them (HyperParallel's
            ``OVERLAP_B_F`` steps, :mod:`._pairing`); none by default.

    Example:
        >>> plan = build_plan("GPipe", pp=2, n_microbatches=2)
        >>> plan.stages_of(1), plan.actions[1][:2]
        ((1,), (1RECV_F0, 1F0))
    """

    schedule: str
    n_microbatches: int
    placement: Tuple[int, ...]                 # rank of each stage
    actions: Tuple[Tuple[Action, ...], ...]    # per rank
    paired: FrozenSet[Action] = frozenset()
    _unit: Timeline = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_unit", validate(dict(enumerate(self.actions)), self.placement,
                                                   self.n_microbatches, paired=self.paired))

    @property
    def pp(self) -> int:
        """The number of pipeline ranks."""
        return len(self.actions)

    @property
    def num_stages(self) -> int:
        """The number of stages."""
        return len(self.placement)

    def stages_of(self, rank: int) -> Tuple[int, ...]:
        """The stages ``rank`` holds."""
        return stages_of_rank(self.placement, rank)

    def timeline(self, durations: Optional[Mapping[ActionKind, float]] = None) -> Timeline:
        """Start times under blocking send / recv, compute actions ``durations[kind]`` long (default 1)."""
        if durations is None:
            return self._unit
        return validate(dict(enumerate(self.actions)), self.placement, self.n_microbatches, durations, self.paired)

    def bubble_fraction(self, durations: Optional[Mapping[ActionKind, float]] = None) -> float:
        """Idle share of the ranks' time in one step (unit-time actions by default)."""
        return self.timeline(durations).bubble_fraction

    def peak_activations(self) -> Tuple[int, ...]:
        """Per rank, the most forward states held at once (F run, its B or W not yet), in (stage, micro-batch)
        units. A pair of :attr:`paired` may run at once: its forward's state counts before its backward frees one.

        >>> build_plan("1F1B", pp=4, n_microbatches=8).peak_activations()
        (4, 3, 2, 1)
        >>> build_plan("Interleaved1F1B", pp=2, n_microbatches=4, overlap_b_f=True).peak_activations()
        (6, 4)
        """
        peaks = []
        for acts in self.actions:
            held = peak = 0
            for a in acts:
                if a in self.paired:              # both halves at once: the forward's state before the release
                    peak = max(peak, held + 1)
                held += (a.kind is F) - (a.kind in (B, W))
                peak = max(peak, held)
            peaks.append(peak)
        return tuple(peaks)

    def table(self, *, timed: bool = False) -> str:
        """Per-rank lists side by side; ``timed=True``: compute actions by unit time slot, blanks are bubbles."""
        if not timed:
            return format_table(self.actions)
        starts = self.timeline().starts
        slots: List[List[Optional[Action]]] = [[None] * int(max(starts.values()) + 1) for _ in self.actions]
        for action, t in starts.items():
            slots[self.placement[action.stage]][int(t)] = action
        return format_table(slots, row="t")

    def __str__(self) -> str:
        return (f"{self.schedule}: {self.pp} ranks, {self.num_stages} stages, {self.n_microbatches} "
                f"micro-batches\n{self.table()}")


def build_plan(schedule: str, pp: int, n_microbatches: int, *, stages_per_rank: Optional[int] = None,
               fsdp: bool = False, max_active_stages: int = 3, overlap_b_f: bool = False,
               dxdw_split: bool = False) -> PipelinePlan:
    """Lower ``schedule`` (a name of :data:`SCHEDULES`) for ``pp`` ranks; raises ``ScheduleError`` when it cannot run.

    Args:
        schedule: ``"GPipe"``, ``"1F1B"``, ``"Interleaved1F1B"``, ``"LoopedBFS"``, ``"ZBVZeroBubble"``,
            ``"InterleavedZeroBubble"`` or ``"DualPipeV"``.
        pp: the number of pipeline ranks.
        n_microbatches: micro-batches per step.
        stages_per_rank: stages each rank holds (the schedule's own by default; any number, 2 by default, for
            ``Interleaved1F1B``, ``LoopedBFS`` and ``InterleavedZeroBubble``).
        fsdp: lower for fully_shard stages: UNSHARD / RESHARD around each stage's compute actions
            and REDUCE_GRAD after its last weight gradient (:mod:`._lowering`), as the schedules do
            when a stage holds Cells sharded by ``fully_shard`` / ``hsdp``.
        max_active_stages: with ``fsdp``, the most stages a rank holds gathered at once.
        overlap_b_f: ``Interleaved1F1B`` only: pair each backward that a rank runs directly before a
            forward with that forward (HyperParallel's ``OVERLAP_B_F`` steps, :mod:`._pairing`); the
            pairs are :attr:`PipelinePlan.paired`, and no transfer comes between a pair's halves.
        dxdw_split: with ``overlap_b_f``: a pair's backward is its input gradient (I), its weight
            gradient (W) runs right after the pair's transfers (HyperParallel's ``enable_dxdw_split``;
            the first stage's backwards stay whole).

    Example:
        >>> build_plan("Interleaved1F1B", pp=2, n_microbatches=4, stages_per_rank=2).placement
        (0, 1, 0, 1)
        >>> build_plan("GPipe", pp=2, n_microbatches=1, fsdp=True).actions[1]
        (1UNSHARD, 1RECV_F0, 1F0, 1B0, 1SEND_B0, 1REDUCE_GRAD, 1RESHARD)
        >>> sorted(build_plan("Interleaved1F1B", pp=2, n_microbatches=2, overlap_b_f=True).paired)
        [3B0]
    """
    if schedule not in SCHEDULES:
        raise ScheduleError(f"unknown schedule {schedule!r}; expected one of {sorted(SCHEDULES)}")
    spec = SCHEDULES[schedule]
    if isinstance(n_microbatches, bool) or not isinstance(n_microbatches, int) or n_microbatches < 1:
        raise ScheduleError(f"n_microbatches must be a positive int, got {n_microbatches!r}")
    v = spec.stages_per_rank if stages_per_rank is None else stages_per_rank
    v = 2 if v is None else v
    if isinstance(v, bool) or not isinstance(v, int) or v < 1 or spec.stages_per_rank not in (None, v):
        want = spec.stages_per_rank or "1 or more"
        raise ScheduleError(f"{schedule} runs {want} stage(s) per rank, got stages_per_rank={v!r}")
    placement = stage_to_rank(spec.placement, pp, v * pp)
    if spec.needs_a_microbatch_per_stage and n_microbatches < len(placement):
        raise ScheduleError(f"{schedule} needs at least as many micro-batches as stages: got {n_microbatches} "
                            f"micro-batches for {len(placement)} stages; use n_microbatches >= {len(placement)} "
                            f"or GPipe")
    for name, flag in (("fsdp", fsdp), ("overlap_b_f", overlap_b_f), ("dxdw_split", dxdw_split)):
        if not isinstance(flag, bool):
            raise ScheduleError(f"build_plan {name} must be True or False, got {flag!r}")
    if dxdw_split and not overlap_b_f:
        raise ScheduleError("dxdw_split=True splits the backward of each backward/forward pair: it needs "
                            "overlap_b_f=True")
    if overlap_b_f and schedule != "Interleaved1F1B":
        raise ScheduleError(f"overlap_b_f=True pairs the steady-state backwards and forwards of Interleaved1F1B "
                            f"(HyperParallel's OVERLAP_B_F), not of {schedule}; use Interleaved1F1B or "
                            f"overlap_b_f=False")
    order = spec.order(pp, n_microbatches, v)
    paired: FrozenSet[Action] = frozenset()
    if overlap_b_f:
        paired = frozenset().union(*backward_forward_pairs(order).values())
        if dxdw_split:
            order, paired = split_pairs(order, paired)
    if fsdp:
        order = lower_fsdp(order, n_microbatches, max_active_stages, paired)
    lists = add_comms(order, placement, paired=paired)
    return PipelinePlan(schedule, n_microbatches, placement, tuple(tuple(lists[r]) for r in range(pp)), paired)
