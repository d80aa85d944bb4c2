"""Lowering a compute order onto fully_shard stages: UNSHARD / RESHARD / REDUCE_GRAD actions.

A stage whose Cells are sharded by ``fully_shard`` (or ``hsdp``) holds parameter pieces. The
lowered order says when its parameters are gathered and when its gradients are reduced, once
per step instead of once per micro-batch (PyTorch's ``_PipelineScheduleRuntime`` lowers its
schedules the same way):

* :func:`add_unshard_reshard`: before each compute action, the next ``max_active_stages``
  distinct stages of the rank's remaining compute actions are the ones to hold gathered: a
  held stage no longer among them gets ``RESHARD`` (its pieces back), a stage among them not yet
  held gets ``UNSHARD`` (one all-gather per sharded Cell); what is held at the end is resharded.
  With up to ``max_active_stages`` stages per rank, each stage is gathered once per step.
* :func:`add_reduce_grad`: ``REDUCE_GRAD`` right after the ``n_microbatches``-th weight-gradient
  action (B or W) of each stage: its backwards accumulate unreduced gradients, and this action
  reduces their sum (one reduce-scatter per sharded Cell and step).

A backward/forward pair (:mod:`._pairing`) stays whole: the stages of both halves are gathered
before the backward, and a RESHARD or REDUCE_GRAD the backward would be followed by comes after the
forward.

The parameter actions take no time in the plan's timelines (unless given a duration) and
move no data between ranks; :func:`._validate.validate` checks their order on each rank.
Pure Python.

Example:
    >>> from hyper_parallel_ms.pipelining._action import Action
    >>> order = {0: [Action.parse(a) for a in ("0F0", "0F1", "0B0", "0B1")]}
    >>> lower_fsdp(order, n_microbatches=2)[0]
    [0UNSHARD, 0F0, 0F1, 0B0, 0B1, 0REDUCE_GRAD, 0RESHARD]
"""
from __future__ import annotations

from typing import Dict, FrozenSet, List, Mapping, Sequence

from ._action import B, RESHARD, REDUCE_GRAD, UNSHARD, W, Action, ScheduleError
from ._pairing import pair_positions

__all__ = ["add_unshard_reshard", "add_reduce_grad", "lower_fsdp"]


def _next_stages(actions: Sequence[Action], count: int) -> List[int]:
    """The first ``count`` distinct stages of ``actions``, in order."""
    stages: List[int] = []
    for action in actions:
        if action.stage not in stages:
            stages.append(action.stage)
            if len(stages) == count:
                break
    return stages


def add_unshard_reshard(actions: Sequence[Action], max_active_stages: int = 3,
                        paired: FrozenSet[Action] = frozenset()) -> List[Action]:
    """One rank's compute actions with UNSHARD / RESHARD added (see the module docstring).

    Args:
        actions: the rank's compute actions (F, B, I, W), in order.
        max_active_stages: the most stages held gathered at once (PyTorch's default, 3).
        paired: backwards paired with the forward after them (nothing is added between the two).

    Example:
        >>> from hyper_parallel_ms.pipelining._action import Action
        >>> acts = [Action.parse(a) for a in ("0F0", "2F0", "2B0", "0B0")]
        >>> add_unshard_reshard(acts, max_active_stages=1)
        [0UNSHARD, 0F0, 0RESHARD, 2UNSHARD, 2F0, 2B0, 2RESHARD, 0UNSHARD, 0B0, 0RESHARD]
    """
    if isinstance(max_active_stages, bool) or not isinstance(max_active_stages, int) or max_active_stages < 1:
        raise ValueError(f"max_active_stages must be a positive int, got {max_active_stages!r}")
    out: List[Action] = []
    held: List[int] = []
    pairs = pair_positions(actions, paired)
    for i, action in enumerate(actions):
        if i - 1 in pairs:                          # a pair's forward: gathered with its backward
            out.append(action)
            continue
        wanted = _next_stages(actions[i:], max_active_stages)
        if i in pairs and pairs[i].stage not in wanted:
            raise ScheduleError(f"{action} and {pairs[i]} run as a pair, which needs both stages gathered at "
                                f"once; use max_active_stages >= 2 (got {max_active_stages})")
        for stage in [s for s in held if s not in wanted]:
            out.append(Action(stage, RESHARD))
            held.remove(stage)
        for stage in wanted:
            if stage not in held:
                out.append(Action(stage, UNSHARD))
                held.append(stage)
        out.append(action)
    return out + [Action(stage, RESHARD) for stage in held]


def add_reduce_grad(actions: Sequence[Action], n_microbatches: int,
                    paired: FrozenSet[Action] = frozenset()) -> List[Action]:
    """``actions`` with ``REDUCE_GRAD`` of each stage right after its ``n_microbatches``-th B or W
    (after the forward a paired backward runs with).

    Args:
        actions: one rank's actions, in order.
        n_microbatches: micro-batches per step.
        paired: backwards paired with the forward after them.

    Example:
        >>> from hyper_parallel_ms.pipelining._action import Action
        >>> add_reduce_grad([Action.parse(a) for a in ("1I0", "1I1", "1W0", "1W1")], 2)
        [1I0, 1I1, 1W0, 1W1, 1REDUCE_GRAD]
    """
    counts: Dict[int, int] = {}
    out: List[Action] = []
    waiting: List[Action] = []          # REDUCE_GRAD due after a pair's forward
    for action in actions:
        out.append(action)
        if action.kind in (B, W):
            counts[action.stage] = counts.get(action.stage, 0) + 1
            if counts[action.stage] == n_microbatches:
                (waiting if action in paired else out).append(Action(action.stage, REDUCE_GRAD))
                continue
        if action not in paired:
            out.extend(waiting)
            waiting.clear()
    return out + waiting


def lower_fsdp(order: Mapping[int, Sequence[Action]], n_microbatches: int,
               max_active_stages: int = 3, paired: FrozenSet[Action] = frozenset()) -> Dict[int, List[Action]]:
    """Every rank's compute order with :func:`add_unshard_reshard`, then :func:`add_reduce_grad`.

    Args:
        order: rank -> its compute actions (F, B, I, W), in order.
        n_microbatches: micro-batches per step.
        max_active_stages: as :func:`add_unshard_reshard`.
        paired: backwards paired with the forward after them (:mod:`._pairing`).

    Example:
        >>> from hyper_parallel_ms.pipelining._orders import gpipe
        >>> lower_fsdp(gpipe(pp=2, n_microbatches=1), 1)[1]
        [1UNSHARD, 1F0, 1B0, 1REDUCE_GRAD, 1RESHARD]
    """
    return {rank: add_reduce_grad(add_unshard_reshard(actions, max_active_stages, paired), n_microbatches, paired)
            for rank, actions in order.items()}
