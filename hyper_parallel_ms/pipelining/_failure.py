"""How a pipeline step ends on every rank when an action fails on one: with the cause, none waiting.

1. The failing rank sends an abort (:class:`~._channel.Channel`), in place of its next message,
   to every peer it still owes one (its first pending SEND to that peer); a rank whose RECV
   receives an abort raises :class:`~._channel.PipelineAbort` there and does the same. Every
   rank waiting in ``recv`` on a failed rank, directly or through others, stops.
2. Each aborting rank then reads and drops what its peers sent it and it did not read (up to
   each peer's abort, or all its pending RECVs from a peer that owes it no more): on MindSpore's
   CPU backend a message left unread is taken as data by the next collective on the group.
3. Every step ends with one agreement over the pp mesh, failed or not (a small all-reduce:
   :func:`~hyper_parallel_ms.comm._agreement.failure_messages`): a rank that finished its list
   while another failed learns it there. The failed rank raises its own exception, the others a
   :class:`~._action.PipelineError` naming it, its action and its error.

A failed transfer (a peer gone: MindSpore's "Send failed" after its node timeout, about 30 s on
CPU) aborts with ``ABORT_LOST``, reads nothing more and skips the agreement, which a dead rank
would never join; ranks already waiting in the agreement then fail there after the same timeout.
Sends are assumed to return before their receive is posted (MindSpore's CPU backend buffers
them); a backend whose sends wait for the receiver could wait on a failed rank here.

Example::

    try:
        ...                                   # the action list, until action ``at`` raised ``error``
    except Exception as error:
        end_step(channel, plan, actions, at, error)      # raises on every rank
    end_step(channel, plan, actions, None, None)         # the agreement of a step that ran through
"""
from __future__ import annotations

from typing import Dict, Optional, Sequence, Set

from ..comm._agreement import failure_messages
from ._action import Action, PipelineError, TransferFailed
from ._channel import ABORT, ABORT_LOST, Channel, PipelineAbort
from ._plan import PipelinePlan

__all__ = ["end_step"]

_RESTART = ("every pp rank raises; messages may be left in flight between the ranks, so build the pipeline "
            "again in a new job (restart the ranks)")


def _peer(plan: PipelinePlan, action: Action) -> int:
    return plan.placement[action.peer_stage()]


def _tell_peers(channel: Channel, plan: PipelinePlan, pending: Sequence[Action], skip: Set[int], status: int,
                origin: int, failed: Action) -> None:
    """One abort to each peer of a pending SEND (its first), but those in ``skip``; best effort."""
    told = set(skip)
    for action in pending:
        if action.kind.is_send and _peer(plan, action) not in told:
            told.add(_peer(plan, action))
            try:
                channel.abort(_peer(plan, action), status, origin, failed)
            except Exception:  # noqa: BLE001  (that peer is gone too; the others still need theirs)
                pass


def _drain(channel: Channel, plan: PipelinePlan, pending: Sequence[Action], done: Set[int]) -> None:
    """Read what each peer (but those in ``done``, whose abort was read) sent for ``pending`` RECVs."""
    counts: Dict[int, int] = {}
    for action in pending:
        if action.kind.is_recv and _peer(plan, action) not in done:
            counts[_peer(plan, action)] = counts.get(_peer(plan, action), 0) + 1
    for peer, count in counts.items():
        channel.drain(peer, count)


def _agree(channel: Channel, message: Optional[str]) -> Dict[int, str]:
    try:
        return failure_messages(channel.mesh, message)
    except Exception as exc:  # noqa: BLE001
        raise PipelineError(f"the pp ranks could not agree on the outcome of the step (a rank may be gone): "
                            f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}; "
                            f"{_RESTART}") from exc


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return f"{type(error).__name__}: {text.splitlines()[0] if text else ''}"


def end_step(channel: Channel, plan: PipelinePlan, actions: Sequence[Action], at: Optional[int],
             error: Optional[BaseException]) -> None:
    """End a step on this rank: the agreement when ``error`` is ``None`` (raises if another rank
    failed), else the abort protocol of the module docstring for ``actions[at]`` (always raises)."""
    if error is None:
        failed = _agree(channel, None)
        if failed:
            raise PipelineError(_summary(failed))
        return
    action = actions[at]
    pending = actions[at + 1:]
    if isinstance(error, PipelineAbort):           # the abort of the peer of ``action`` was read there
        status, origin, failed_action, done = error.status, error.origin, error.action, {_peer(plan, action)}
    elif isinstance(error, TransferFailed):
        status, origin, failed_action, done = ABORT_LOST, channel.rank, action, {error.peer}
    else:            # a compute action, a SEND refused before sending, a RECV refusing a whole message
        status, origin, failed_action, done = ABORT, channel.rank, action, set()
        pending = actions[at:] if action.kind.is_send else pending
    lost = status == ABORT_LOST
    _tell_peers(channel, plan, pending, done if lost else set(), status, origin, failed_action)
    mine = origin == channel.rank
    if lost:
        if mine:
            raise error
        raise PipelineError(f"pipeline step failed: {error}; {_RESTART}") from error
    try:
        _drain(channel, plan, pending, done)
    except Exception as exc:  # noqa: BLE001
        raise PipelineError(f"pipeline step failed at {action} ({_first_line(error)}), and reading what the peers had "
                            f"sent failed: {_first_line(exc)}; {_RESTART}") from error
    failed = _agree(channel, f"{action}: {_first_line(error)}" if mine else None)
    if mine:
        raise error
    raise PipelineError(_summary(failed) if failed else f"pipeline step failed: {error}; {_RESTART}") from error


def _summary(failed: Dict[int, str]) -> str:
    where = "; ".join(f"pp rank {r} at {text}" for r, text in sorted(failed.items()))
    return f"pipeline step failed: {where}; {_RESTART}"
