"""From per-rank compute orders to full action lists with SEND / RECV, deadlock-free when blocking.

:func:`add_comms` first times the compute orders with zero-cost, non-blocking transfers
(:func:`time_compute`): each action starts when its rank is free and its data exist anywhere.
Every datum that crosses ranks becomes one transfer, keyed by ``(time it is made, stage, kind,
micro-batch)``; both ranks place it by that key among their compute actions (a transfer goes
before a compute that starts at the same time).

Why blocking send / recv cannot deadlock on the result: on every rank the transfers appear in
the order of their keys, one total order shared by all ranks; a SEND follows the compute that
makes its datum (its key is that compute's end) and a RECV precedes the compute that reads it
(which starts no earlier than the key). Compute actions never wait, so the pending transfer
with the smallest key always finds both of its ranks at it.

A backward/forward pair (``paired``: the backwards of :mod:`._pairing`) is timed as one compute
action that starts once both halves' inputs exist and makes both halves' outputs when it ends, so
no transfer falls between its halves and the argument above holds for it as for any action.

Example:
    >>> from hyper_parallel_ms.pipelining._action import Action
    >>> order = {0: [Action.parse(a) for a in ("0F0", "0B0")], 1: [Action.parse(a) for a in ("1F0", "1B0")]}
    >>> add_comms(order, placement=(0, 1))
    {0: [0F0, 0SEND_F0, 0RECV_B0, 0B0], 1: [1RECV_F0, 1F0, 1B0, 1SEND_B0]}
"""
from __future__ import annotations

from typing import Dict, FrozenSet, List, Mapping, Optional, Sequence, Tuple

from ._action import B, F, I, RECV_B, RECV_F, SEND_B, SEND_F, Action, ActionKind, ScheduleError
from ._data import Datum, costs, describe, makes, needs
from ._pairing import pair_positions

__all__ = ["time_compute", "add_comms"]


def time_compute(order: Mapping[int, Sequence[Action]], placement: Sequence[int],
                 durations: Optional[Mapping[ActionKind, float]] = None,
                 paired: FrozenSet[Action] = frozenset()) -> Dict[Action, float]:
    """Start time of every compute action, transfers free and non-blocking (a parameter action listed
    twice on a rank, an UNSHARD after a RESHARD: the start of the later one).

    Raises ``ScheduleError`` naming each rank's waiting action when the orders wait in a cycle
    (or for data no action makes).

    Args:
        order: rank -> its compute actions (F, B, I, W; UNSHARD, RESHARD and REDUCE_GRAD too,
            which take no time by default), in order.
        placement: the rank of each stage, indexed by stage.
        durations: time units per kind (:func:`._data.costs`: compute 1 by default).
        paired: backwards run as one action with the forward after them (a pair's forward starts
            when its backward ends).

    Example:
        >>> from hyper_parallel_ms.pipelining._action import Action
        >>> order = {0: [Action.parse(a) for a in ("0F0", "0B0")], 1: [Action.parse(a) for a in ("1F0", "1B0")]}
        >>> time_compute(order, placement=(0, 1))
        {0F0: 0.0, 1F0: 1.0, 1B0: 2.0, 0B0: 3.0}
    """
    times, _ = _start_times(order, placement, durations, _pairs(order, paired))
    timed = [(action, t) for rank in order for action, t in zip(order[rank], times[rank])]
    return dict(sorted(timed, key=lambda item: item[1]))


def _pairs(order: Mapping[int, Sequence[Action]], paired: FrozenSet[Action]) -> Dict[int, Dict[int, Action]]:
    """Per rank, :func:`._pairing.pair_positions` of its order."""
    return {rank: pair_positions(actions, paired) for rank, actions in order.items()}


def _start_times(order: Mapping[int, Sequence[Action]], placement: Sequence[int],
                 durations: Optional[Mapping[ActionKind, float]], pairs: Mapping[int, Mapping[int, Action]]
                 ) -> Tuple[Dict[int, List[float]], Dict[int, List[float]]]:
    """:func:`time_compute`'s start times and the times each action's data are made, per rank in the
    order's positions (a pair's halves make theirs when the pair ends)."""
    num_stages = len(placement)
    cost = costs(durations)
    made: Dict[Datum, float] = {}
    starts: Dict[int, List[float]] = {r: [] for r in order}
    ends: Dict[int, List[float]] = {r: [] for r in order}
    pos = {r: 0 for r in order}
    clock = {r: 0.0 for r in order}
    moved = True
    while moved:
        moved = False
        for rank in sorted(order):
            while pos[rank] < len(order[rank]):
                unit = _unit(order[rank], pos[rank], pairs[rank])
                for action in unit:
                    if not (action.kind.is_compute or action.kind.is_fsdp):
                        raise ScheduleError(f"rank {rank}: {action} (step {pos[rank]}) is not a compute action; "
                                            f"compute orders hold F, B, I and W (and UNSHARD, RESHARD, "
                                            f"REDUCE_GRAD) only")
                wanted = [d for a in unit for d in needs(a, num_stages)]
                if any(d not in made for d in wanted):
                    break
                start = max([clock[rank]] + [made[d] for d in wanted])
                end = start + sum(cost[a.kind] for a in unit)
                for k, action in enumerate(unit):         # a pair's forward starts when its backward ends
                    starts[rank].append(start + (cost[unit[0].kind] if k else 0.0))
                    ends[rank].append(end)
                    made.update((d, end) for d in makes(action))
                clock[rank] = end
                pos[rank] += len(unit)
                moved = True
    stuck = [(r, order[r][pos[r]]) for r in sorted(order) if pos[r] < len(order[r])]
    if stuck:
        waits = "; ".join(f"rank {r} waits at {a} (step {pos[r]}) for "
                          + ", ".join(describe(d) for u in _unit(order[r], pos[r], pairs[r])
                                      for d in needs(u, num_stages) if d not in made)
                          for r, a in stuck)
        raise ScheduleError(f"the compute order cannot run, ranks wait for each other: {waits}")
    return starts, ends


def _unit(actions: Sequence[Action], step: int, pairs: Mapping[int, Action]) -> Tuple[Action, ...]:
    """The action at ``step``, with the forward after it when it is a paired backward."""
    return (actions[step], pairs[step]) if step in pairs else (actions[step],)


def _transfers(action: Action, placement: Sequence[int]) -> Tuple[Tuple[Action, Action], ...]:
    """The (SEND, RECV) pairs that carry what ``action`` makes to another rank."""
    s, kind, m = action
    if kind is F and s + 1 < len(placement) and placement[s + 1] != placement[s]:
        return ((Action(s, SEND_F, m), Action(s + 1, RECV_F, m)),)
    if kind in (B, I) and s > 0 and placement[s - 1] != placement[s]:
        return ((Action(s, SEND_B, m), Action(s - 1, RECV_B, m)),)
    return ()


def add_comms(order: Mapping[int, Sequence[Action]], placement: Sequence[int],
              durations: Optional[Mapping[ActionKind, float]] = None,
              paired: FrozenSet[Action] = frozenset()) -> Dict[int, List[Action]]:
    """Per-rank lists: the compute ``order`` with SEND / RECV placed as the module docstring says.

    Args:
        order: rank -> its compute actions (F, B, I, W, and the parameter actions), in order.
        placement: the rank of each stage, indexed by stage.
        durations: time units per kind used to order the transfers (:func:`._data.costs`).
        paired: backwards that run as one action with the forward after them (:mod:`._pairing`).

    Example:
        >>> from hyper_parallel_ms.pipelining._action import Action
        >>> order = {0: [Action.parse(a) for a in ("0F0", "0B0")], 1: [Action.parse(a) for a in ("1F0", "1B0")]}
        >>> add_comms(order, placement=(0, 1))[1]
        [1RECV_F0, 1F0, 1B0, 1SEND_B0]
    """
    pairs = _pairs(order, paired)
    starts, ends = _start_times(order, placement, durations, pairs)
    keyed: Dict[int, List[tuple]] = {r: [] for r in order}
    for rank, actions in order.items():
        for step, action in enumerate(actions):
            # a pair's forward sorts with its backward: nothing comes between them
            sort_at = starts[rank][step - 1] if step - 1 in pairs[rank] else starts[rank][step]
            keyed[rank].append((sort_at, 1, step, action))
            made = ends[rank][step]
            for send, recv in _transfers(action, placement):
                tie = (send.stage, send.kind.value, send.microbatch)
                keyed[rank].append((made, 0, tie, send))
                keyed[placement[recv.stage]].append((made, 0, tie, recv))
    return {r: [item[-1] for item in sorted(keyed[r], key=lambda k: k[:3])] for r in sorted(keyed)}
