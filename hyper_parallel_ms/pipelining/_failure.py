"""How a pipeline step ends on every rank when an action fails on one: with the cause, none waiting.

1. The failing rank sends an abort (:class:`~._channel.Channel`), in place of its next message,
   to every peer it still owes one (its list sends that peer more messages than the channel
   counted); a rank whose RECV receives an abort raises :class:`~._channel.PipelineAbort` there
   and does the same (back to its sender too, if it owes it). Every rank waiting in ``recv`` on a
   failed rank, directly or through others, stops.
2. Each aborting rank then reads and drops what its peers sent it and it did not read: from each
   peer whose abort it has not read, the messages its list reads from that peer beyond those
   counted, stopping at the peer's abort. On MindSpore's CPU backend a message left unread is
   taken as data by the next collective on the group.
3. Every step ends with one agreement over the pp mesh, failed or not (a small all-reduce:
   :func:`~hyper_parallel_ms.comm._agreement.failure_messages`): a rank that finished its list
   while another failed learns it there. The failed rank raises its own exception, the others a
   :class:`~._action.PipelineError` naming it, its action and its error.

A rank that hangs or dies sends no abort: the communication watchdog
(:mod:`hyper_parallel_ms.comm._watchdog`) ends every rank waiting for it (in a RECV, in the
agreement, or in a collective inside a stage), naming it and the call, at once for a dead rank
on the same host and after ``HPMS_COMM_TIMEOUT`` seconds (20 on CPU ranks) of silence for a hung one. A failed
transfer (MindSpore's "Send failed" after its node timeout, about 30 s on CPU, where the
watchdog is off or cannot see the peer) aborts with ``ABORT_LOST``, reads nothing more and skips
the agreement, which a dead rank would never join. Sends are assumed to return before their
receive is posted (MindSpore's CPU backend buffers them); a backend whose sends wait for the
receiver could wait on a failed rank here.

Example::

    try:
        ...                                   # the action list, until action ``at`` raised ``error``
    except Exception as error:
        end_step(channel, plan, actions, at, error)      # raises on every rank
    end_step(channel, plan, actions, None, None)         # the agreement of a step that ran through
"""
from __future__ import annotations

from collections import Counter
from typing import Dict, Optional, Sequence, Set

from ..comm._agreement import failure_messages
from ..comm._watchdog import note
from ._action import Action, PipelineError, TransferFailed
from ._channel import ABORT, ABORT_LOST, Channel, PipelineAbort
from ._plan import PipelinePlan

__all__ = ["end_step"]

_RESTART = ("every pp rank raises; messages may be left in flight between the ranks, so build the pipeline "
            "again in a new job (restart the ranks)")


def _per_peer(plan: PipelinePlan, actions: Sequence[Action], sends: bool) -> Counter:
    """How many messages this rank's list sends to (or reads from) each peer in a step."""
    return Counter(plan.placement[a.peer_stage()] for a in actions
                   if (a.kind.is_send if sends else a.kind.is_recv))


def _tell_peers(channel: Channel, plan: PipelinePlan, actions: Sequence[Action], skip: Set[int], status: int,
                origin: int, failed: Action) -> None:
    """One abort to each peer this rank still owes a message (but those in ``skip``); best effort."""
    for peer, count in _per_peer(plan, actions, sends=True).items():
        if count > channel.sent[peer] and peer not in skip:
            try:
                channel.abort(peer, status, origin, failed)
            except Exception:  # noqa: BLE001  (that peer is gone too; the others still need theirs)
                pass


def _drain(channel: Channel, plan: PipelinePlan, actions: Sequence[Action]) -> None:
    """Read what each peer sent this step and this rank did not read (up to the peer's abort)."""
    for peer, count in _per_peer(plan, actions, sends=False).items():
        if peer not in channel.aborted_by and count > channel.read[peer]:
            channel.drain(peer, count - channel.read[peer])


def _agree(channel: Channel, message: Optional[str]) -> Dict[int, str]:
    try:
        with note("the pipeline step's closing agreement, over the pp mesh"):
            return failure_messages(channel.mesh, message)
    except Exception as exc:  # noqa: BLE001
        raise PipelineError(f"the pp ranks could not agree on the outcome of the step (a rank may be gone): "
                            f"{_first_line(exc)}; {_RESTART}") from exc


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
    if isinstance(error, PipelineAbort):           # read where ``action`` waited
        status, origin, failed_action, skip = error.status, error.origin, error.action, set()
    elif isinstance(error, TransferFailed):
        status, origin, failed_action, skip = ABORT_LOST, channel.rank, action, {error.peer}
    else:            # a compute action, a SEND refused before sending, a RECV refusing a whole message
        status, origin, failed_action, skip = ABORT, channel.rank, action, set()
    _tell_peers(channel, plan, actions, skip, status, origin, failed_action)
    mine = origin == channel.rank
    if status == ABORT_LOST:
        if mine:
            raise error
        raise PipelineError(f"pipeline step failed: {error}; {_RESTART}") from error
    try:
        _drain(channel, plan, actions)
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
