"""Backward/forward pairs: HyperParallel's ``OVERLAP_B_F`` steps in this library's plans.

With ``overlap_b_f=True`` an interleaved 1F1B plan marks, on every rank, each backward that its
compute order runs directly before a forward: in the 1F1B steady state ``B_i, F_(i+1)`` (the first
forward of that phase and the last backward stay alone, as HyperParallel's
``ScheduleInterleaved1F1B(overlap_b_f=True)`` pairs them). A pair may run at once, the forward on
one thread and the backward on another (:class:`~hyper_parallel_ms.pipelining.CommComputeOverlap`),
so the plan keeps it whole:

* :func:`backward_forward_pairs` finds the pairs of a compute order;
* the transfers are timed with each pair as one compute action (:mod:`._comms`): what either half
  receives is received before the backward, what either half sends leaves after the forward;
* the parameter actions of fully_shard stages (:mod:`._lowering`) gather both halves' stages before
  the backward and free or reduce nothing between them;
* :func:`check_pairs` refuses a plan whose marked backward is not directly followed by a forward
  its own rank can run without it.

Run one after the other (no callback), a pair computes what the unpaired plan computes, in the
same order on each rank. Pure Python.

Example:
    >>> from hyper_parallel_ms.pipelining._orders import interleaved_1f1b
    >>> order = interleaved_1f1b(pp=2, n_microbatches=2, stages_per_rank=2)
    >>> order[1], sorted(backward_forward_pairs(order)[1])
    ([1F0, 1F1, 3F0, 3B0, 3F1, 3B1, 1B0, 1B1], [3B0])
"""
from __future__ import annotations

from typing import Dict, FrozenSet, List, Mapping, Sequence, Tuple

from ._action import B, F, I, W, Action, ScheduleError
from ._data import describe, makes, needs

__all__ = ["backward_forward_pairs", "check_pairs", "pair_positions", "split_pairs"]


def backward_forward_pairs(order: Mapping[int, Sequence[Action]]) -> Dict[int, FrozenSet[Action]]:
    """Per rank, the backwards its compute order runs directly before a forward (each pairs with that forward).

    Args:
        order: rank -> its compute actions (F and B), in order.

    Example:
        >>> from hyper_parallel_ms.pipelining._orders import one_f_one_b
        >>> pairs = backward_forward_pairs(one_f_one_b(pp=2, n_microbatches=3))
        >>> {rank: sorted(backwards) for rank, backwards in pairs.items()}
        {0: [0B0], 1: [1B0, 1B1]}
    """
    return {rank: frozenset(a for a, nxt in zip(acts, acts[1:]) if a.kind is B and nxt.kind is F)
            for rank, acts in order.items()}


def split_pairs(order: Mapping[int, Sequence[Action]], paired: FrozenSet[Action]
                ) -> Tuple[Dict[int, List[Action]], FrozenSet[Action]]:
    """The compute ``order`` with each paired backward of a stage after the first split: ``I`` in the pair,
    ``W`` right after its forward; returns the new order and the new paired backwards.

    Args:
        order: rank -> its compute actions, in order.
        paired: the paired backwards (:func:`backward_forward_pairs`).

    Example:
        >>> order = {1: [Action.parse(a) for a in ("1F0", "1F1", "1B0", "1F2", "1B1", "1B2")]}
        >>> new, pairs = split_pairs(order, frozenset({Action.parse("1B0")}))
        >>> new[1], sorted(pairs)
        ([1F0, 1F1, 1I0, 1F2, 1W0, 1B1, 1B2], [1I0])
    """
    new: Dict[int, List[Action]] = {}
    pairs = set()
    for rank, acts in order.items():
        out: List[Action] = []
        weight = None
        for action in acts:
            if action in paired:             # a pair's backward: the input gradient, its W after the forward
                if action.stage > 0:
                    weight = Action(action.stage, W, action.microbatch)
                    action = Action(action.stage, I, action.microbatch)
                pairs.add(action)
                out.append(action)
                continue
            out.append(action)
            if weight is not None:           # the pair's forward: its weight gradient next
                out.append(weight)
                weight = None
        new[rank] = out
    return new, frozenset(pairs)


def pair_positions(actions: Sequence[Action], paired: FrozenSet[Action]) -> Dict[int, Action]:
    """The position of each paired backward in one rank's ``actions``, with the forward right after it
    (raises ``ScheduleError`` when none follows it).

    >>> pair_positions([Action.parse(a) for a in ("0F0", "0B0", "0F1")], frozenset({Action.parse("0B0")}))
    {1: 0F1}
    """
    out: Dict[int, Action] = {}
    for step, action in enumerate(actions):
        if action in paired:
            if step + 1 >= len(actions) or actions[step + 1].kind is not F:
                raise ScheduleError(f"{action} (step {step}) is paired with the forward after it, but none follows")
            out[step] = actions[step + 1]
    return out


def check_pairs(actions: Mapping[int, Sequence[Action]], paired: FrozenSet[Action], num_stages: int) -> None:
    """Refuse a marked backward that its rank's list does not follow directly by a forward, or whose
    forward needs what the backward makes (the two halves must be able to run at once).

    Args:
        actions: rank -> its actions, in order.
        paired: the marked backwards.
        num_stages: the number of stages.

    Example:
        >>> check_pairs({0: [Action.parse(a) for a in ("0B0", "0SEND_B0", "0F1")]}, frozenset({Action.parse("0B0")}), 1)
        Traceback (most recent call last):
        ...
        hyper_parallel_ms.pipelining._action.ScheduleError: rank 0: 0B0 (step 0) is paired with the forward after it, but 0SEND_B0 comes next; a pair's transfers go before or after it
    """
    found = set()
    for rank, acts in actions.items():
        for step, action in enumerate(acts):
            if action not in paired:
                continue
            found.add(action)
            where = f"rank {rank}: {action} (step {step})"
            if action.kind not in (B, I):
                raise ScheduleError(f"{where} is marked as the backward of a backward/forward pair; only B or I is")
            if step + 1 >= len(acts) or acts[step + 1].kind is not F:
                nxt = "the list ends" if step + 1 >= len(acts) else f"{acts[step + 1]} comes next"
                raise ScheduleError(f"{where} is paired with the forward after it, but {nxt}; a pair's transfers go "
                                    f"before or after it")
            shared = set(makes(action)) & set(needs(acts[step + 1], num_stages))
            if shared:
                raise ScheduleError(f"{where}: its forward {acts[step + 1]} needs "
                                    f"{describe(shared.pop())}, which the backward makes; the two cannot run at once")
    missing = set(paired) - found
    if missing:
        raise ScheduleError(f"the paired backwards {sorted(map(str, missing))} are in no rank's list")
