"""The pure check of per-rank action lists, under blocking point-to-point semantics.

:func:`validate` runs every rank's list the way a runtime with *rendezvous* send / recv would
(a SEND waits until its peer stands at the matching RECV, and the other way round: the
strictest blocking semantics; lists that pass also run where sends return early, as MindSpore's
CPU ``send`` does) and refuses, naming the rank and the action:

* an action on a rank that does not hold its stage, a SEND / RECV between two stages of one
  rank, a stage or micro-batch out of range;
* an action listed twice, a missing forward or backward (each (stage, micro-batch) needs one
  F and either one B or one I and one W), a SEND without its RECV or the reverse;
* parameter actions out of order on a rank (:func:`check_fsdp`): an UNSHARD of a stage already
  gathered, a RESHARD of one not gathered, a compute action of a stage that has UNSHARD actions
  while it is not gathered, a stage left gathered at the end, a REDUCE_GRAD before the stage's
  last B or W or listed twice;
* a compute or SEND that runs before what it needs is on its rank (F before its input is
  received, B before its own F or before the output gradient arrives, W before its I);
* a deadlock: ranks that wait for each other, reported with the action each is blocked on;
* a backward/forward pair (``paired``) whose halves are not adjacent or could not run at once
  (:func:`._pairing.check_pairs`).

Compute actions take ``durations[kind]`` time units (1 by default), SEND / RECV none, the
parameter actions none unless given (:func:`._data.costs`); the returned :class:`Timeline`
gives each compute action's start time and the bubble fraction.

Example:
    >>> from hyper_parallel_ms.pipelining._action import Action
    >>> lists = {0: [Action.parse(a) for a in ("0F0", "0SEND_F0", "0RECV_B0", "0B0")],
    ...          1: [Action.parse(a) for a in ("1RECV_F0", "1F0", "1B0", "1SEND_B0")]}
    >>> validate(lists, placement=(0, 1), n_microbatches=1).bubble_fraction
    0.5
    >>> lists[1][2:] = lists[1][3:] + lists[1][2:3]      # send the gradient before computing it
    >>> validate(lists, placement=(0, 1), n_microbatches=1)
    Traceback (most recent call last):
    ...
    hyper_parallel_ms.pipelining._action.ScheduleError: rank 1: 1SEND_B0 (step 2) runs before the input gradient of stage 1, micro-batch 0 is on rank 1
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, FrozenSet, List, Mapping, Optional, Sequence, Set, Tuple

from ._action import B, F, I, REDUCE_GRAD, RESHARD, UNSHARD, W, Action, ActionKind, ScheduleError
from ._data import Datum, costs, describe, makes, needs
from ._pairing import check_pairs

__all__ = ["Timeline", "validate", "check_static", "check_fsdp"]

Durations = Optional[Mapping[ActionKind, float]]


@dataclass(frozen=True)
class Timeline:
    """When each compute action starts, and how busy each rank is, in one step played on a timeline.

    Args:
        starts: the start time of each compute action.
        busy: the compute time of each rank.
        makespan: when the last action ends.

    Example:
        >>> Timeline(starts={}, busy=(3.0, 2.0), makespan=4.0).bubble_fraction
        0.375
    """

    starts: Mapping[Action, float]
    busy: Tuple[float, ...]          # compute time per rank
    makespan: float

    @property
    def bubble_fraction(self) -> float:
        """Idle share of all ranks' time: ``1 - sum(busy) / (ranks * makespan)``."""
        return 1.0 - sum(self.busy) / (len(self.busy) * self.makespan) if self.makespan else 0.0


def _where(rank: int, step: int, action: Action) -> str:
    return f"rank {rank}: {action} (step {step})"


def check_static(actions: Mapping[int, Sequence[Action]], placement: Sequence[int],
                 n_microbatches: int) -> None:
    """Refuse misplaced, out-of-range, duplicated, missing or unmatched actions."""
    num_stages, pp = len(placement), max(placement) + 1
    if sorted(actions) != list(range(pp)):
        raise ScheduleError(f"the schedule must list actions for ranks 0..{pp - 1} (the placement "
                            f"{tuple(placement)} uses {pp} ranks), got ranks {sorted(actions)}")
    seen: Dict[Action, Tuple[int, int]] = {}
    for rank in range(pp):
        for step, action in enumerate(actions[rank]):
            if not isinstance(action, Action):
                raise ScheduleError(f"rank {rank}, step {step}: {action!r} is not an Action")
            s, kind, m = action
            if kind.is_fsdp != (m is None):
                raise ScheduleError(f"{_where(rank, step, action)} " + (
                    "names a micro-batch: UNSHARD, RESHARD and REDUCE_GRAD act on a stage's parameters, e.g. "
                    f"'{s}{kind.value}'" if kind.is_fsdp else "has no micro-batch"))
            if not (0 <= s < num_stages and (m is None or 0 <= m < n_microbatches)):
                raise ScheduleError(f"{_where(rank, step, action)} is out of range: {num_stages} stages, "
                                    f"{n_microbatches} micro-batches")
            if placement[s] != rank:
                raise ScheduleError(f"{_where(rank, step, action)} acts for stage {s}, which rank "
                                    f"{placement[s]} holds")
            if kind in (UNSHARD, RESHARD):          # a stage may be gathered again after a RESHARD
                continue
            if action in seen:
                raise ScheduleError(f"{_where(rank, step, action)} is listed twice (also at step "
                                    f"{seen[action][1]} of rank {seen[action][0]})")
            seen[action] = (rank, step)
            if kind.is_compute or kind.is_fsdp:
                continue
            peer = action.peer_stage()
            if not 0 <= peer < num_stages:
                raise ScheduleError(f"{_where(rank, step, action)} has no peer: stage {peer} does not exist")
            if placement[peer] == rank:
                raise ScheduleError(f"{_where(rank, step, action)} goes between stages {s} and {peer}, "
                                    f"both on rank {rank}: stages of one rank pass data without SEND/RECV")
    for action, (rank, step) in seen.items():
        if not (action.kind.is_compute or action.kind.is_fsdp) and action.matching() not in seen:
            raise ScheduleError(f"{_where(rank, step, action)} has no matching {action.matching()} on rank "
                                f"{placement[action.peer_stage()]}")
    for s in range(num_stages):
        for m in range(n_microbatches):
            has = {k for k in (F, B, I, W) if Action(s, k, m) in seen}
            missing = ({F} - has) or (({I, W} - has) if (I in has or W in has) else ({B} - has))
            if missing:
                what = " and ".join(str(Action(s, k, m)) for k in sorted(missing, key=lambda k: k.value))
                raise ScheduleError(f"rank {placement[s]} lacks {what}: every stage and micro-batch needs one "
                                    f"F and either one B or one I and one W")
            if B in has and I in has:
                raise ScheduleError(f"rank {placement[s]} lists both {Action(s, B, m)} and {Action(s, I, m)}: a "
                                    f"backward is either full (B) or split (I then W)")
    for rank in range(pp):
        check_fsdp(rank, actions[rank])


def check_fsdp(rank: int, actions: Sequence[Action]) -> None:
    """Refuse parameter actions out of order in one rank's list (see the module docstring).

    Args:
        rank: the rank (for the message).
        actions: its actions, in order.

    Example:
        >>> check_fsdp(0, [Action.parse(a) for a in ("0F0", "0UNSHARD", "0B0", "0RESHARD")])
        Traceback (most recent call last):
        ...
        hyper_parallel_ms.pipelining._action.ScheduleError: rank 0: 0F0 (step 0) runs while stage 0 is sharded: put 0UNSHARD before it
    """
    gathering = {a.stage for a in actions if a.kind in (UNSHARD, RESHARD)}
    last_weight = {a.stage: step for step, a in enumerate(actions) if a.kind in (B, W)}
    held: Dict[int, int] = {}          # stage -> the step of its UNSHARD
    for step, action in enumerate(actions):
        s, kind = action.stage, action.kind
        if kind is UNSHARD and s in held:
            raise ScheduleError(f"{_where(rank, step, action)} gathers stage {s} again: its UNSHARD at step "
                                f"{held[s]} has no RESHARD before")
        if kind is RESHARD and s not in held:
            raise ScheduleError(f"{_where(rank, step, action)} frees stage {s}, which no UNSHARD gathered")
        if kind.is_compute and s in gathering and s not in held:
            raise ScheduleError(f"{_where(rank, step, action)} runs while stage {s} is sharded: put "
                                f"{Action(s, UNSHARD)} before it")
        if kind is REDUCE_GRAD and last_weight.get(s, -1) > step:
            raise ScheduleError(f"{_where(rank, step, action)} runs before the last weight gradient of stage {s} "
                                f"({actions[last_weight[s]]} at step {last_weight[s]}); it reduces them all, once")
        if kind is UNSHARD:
            held[s] = step
        elif kind is RESHARD:
            del held[s]
    if held:
        left = ", ".join(str(Action(s, RESHARD)) for s in held)
        raise ScheduleError(f"rank {rank} leaves stage(s) {sorted(held)} gathered at the end of the step: add {left}")


def _deadlock(actions, pos: List[int]) -> ScheduleError:
    blocked = {r: actions[r][pos[r]] for r in actions if pos[r] < len(actions[r])}
    waits = {}
    lines = []
    for rank, action in sorted(blocked.items()):
        match = action.matching()
        peer = next(r for r in actions if match in actions[r])
        waits[rank] = peer
        at = f"at {blocked[peer]}" if peer in blocked else "finished"
        lines.append(f"rank {rank} is blocked on {action} (step {pos[rank]}) waiting for rank {peer} "
                     f"to reach {match} (rank {peer} is {at})")
    start = next(iter(sorted(waits)))
    path: List[int] = []
    while start not in path:
        path.append(start)
        start = waits.get(start, start)
    cycle = path[path.index(start):] + [start]
    return ScheduleError("deadlock under blocking send/recv, ranks waiting in a cycle "
                         f"{' -> '.join(map(str, cycle))}: " + "; ".join(lines))


def validate(actions: Mapping[int, Sequence[Action]], placement: Sequence[int], n_microbatches: int,
             durations: Durations = None, paired: FrozenSet[Action] = frozenset()) -> Timeline:
    """Check per-rank action lists (see the module docstring) and return their timeline.

    Args:
        actions: rank -> its actions, in order.
        placement: the rank of each stage, indexed by stage.
        n_microbatches: micro-batches per step.
        durations: time units per compute kind (1 for each by default); transfers take none.
        paired: backwards each run with the forward directly after them (:mod:`._pairing`).

    Example:
        >>> from hyper_parallel_ms.pipelining import build_plan
        >>> plan = build_plan("GPipe", pp=2, n_microbatches=2)
        >>> validate(dict(enumerate(plan.actions)), plan.placement, 2).makespan
        6.0
    """
    check_static(actions, placement, n_microbatches)
    check_pairs(actions, paired, len(placement))
    num_stages = len(placement)
    cost = costs(durations)
    ranks = sorted(actions)
    pos = [0] * len(ranks)
    clock = [0.0] * len(ranks)
    busy = [0.0] * len(ranks)
    have: List[Set[Datum]] = [set() for _ in ranks]
    starts: Dict[Action, float] = {}

    def ready(rank: int, action: Action) -> None:
        for datum in needs(action, num_stages):
            if datum not in have[rank]:
                raise ScheduleError(f"{_where(rank, pos[rank], action)} runs before {describe(datum)} "
                                    f"is on rank {rank}")

    def head(rank: int) -> Optional[Action]:
        return actions[rank][pos[rank]] if pos[rank] < len(actions[rank]) else None

    moved = True
    while moved:
        moved = False
        for rank in ranks:
            while (action := head(rank)) is not None:
                ready(rank, action)
                if action.kind.is_fsdp:             # on this rank alone: waits for nothing
                    clock[rank] += cost[action.kind]
                    pos[rank] += 1
                    moved = True
                    continue
                if action.kind.is_compute:
                    starts[action] = clock[rank]
                    clock[rank] += cost[action.kind]
                    busy[rank] += cost[action.kind]
                    have[rank].update(makes(action))
                    pos[rank] += 1
                    moved = True
                    continue
                peer = placement[action.peer_stage()]
                other = head(peer)
                if other != action.matching():
                    break
                ready(peer, other)
                clock[rank] = clock[peer] = max(clock[rank], clock[peer])
                for r, a in ((rank, action), (peer, other)):
                    have[r].update(makes(a))
                    pos[r] += 1
                moved = True
    if any(head(r) is not None for r in ranks):
        raise _deadlock(actions, pos)
    return Timeline(starts, tuple(busy), max(clock))
