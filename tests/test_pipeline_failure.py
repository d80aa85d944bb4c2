"""The end of a failed pipeline step (``pipelining._failure``), without processes: each rank is a
thread running its action list over in-memory queues (sends return at once, as on MindSpore's
CPU backend; a receive waits), one action fails, and every rank must end the step: the failed
one with its own error, every other one with a PipelineError naming it, no rank waiting, and no
message left unread (an unread message would be taken as data by the next collective). The
runtime's Channel runs the protocol, over queues instead of MindSpore's send / recv. Every
schedule, 2 to 4 ranks, as many and one more micro-batches as ranks, a failure at every action
of every rank (before it runs, so a failed RECV leaves its message unread)."""
from __future__ import annotations

import queue
import threading
from typing import Dict, List, Optional

import pytest

from hyper_parallel_ms.pipelining import PipelineError, build_plan
from hyper_parallel_ms.pipelining import _failure
from hyper_parallel_ms.pipelining._channel import Channel

WAIT = 5.0      # seconds a receive waits before the test calls it a hang


class QueueChannel(Channel):
    """The runtime's Channel (headers, checks, counts, aborts, drains) over in-memory queues."""

    def __init__(self, rank: int, queues: Dict[tuple, "queue.Queue"]) -> None:  # pylint: disable=super-init-not-called
        self.rank, self.mesh, self.queues = rank, None, queues
        self.new_step()

    def _send(self, tensor, dst: int) -> None:
        self.queues[self.rank, dst].put(tensor)

    def _recv(self, like, src: int):
        try:
            got = self.queues[src, self.rank].get(timeout=WAIT)
        except queue.Empty:
            raise AssertionError(f"rank {self.rank} waits for rank {src}: a hang") from None
        assert tuple(got.shape) == tuple(like.shape) and got.dtype == like.dtype, (got.shape, like.shape)
        return got


def _run(plan, fail: Optional[tuple], monkeypatch) -> Dict[int, BaseException]:
    """Every rank's list on a thread; rank ``fail[0]`` raises at its action index ``fail[1]``."""
    pp = plan.pp
    queues = {(a, b): queue.Queue() for a in range(pp) for b in range(pp) if a != b}
    barrier = threading.Barrier(pp, timeout=WAIT)
    reported: Dict[int, str] = {}

    def agreement(mesh, message):                        # failure_messages on threads
        rank = threading.current_thread().rank
        if message is not None:
            reported[rank] = message
        barrier.wait()
        out = dict(reported)
        barrier.wait()
        return out
    monkeypatch.setattr(_failure, "failure_messages", agreement)
    outcome: Dict[int, BaseException] = {}

    def rank_main(rank: int) -> None:
        channel = QueueChannel(rank, queues)
        actions = plan.actions[rank]
        at, error = None, None
        try:
            for at, action in enumerate(actions):
                if fail == (rank, at):
                    raise RuntimeError(f"fault at {action}")
                peer = plan.placement[action.peer_stage()] if not action.kind.is_compute else None
                if action.kind.is_send:
                    channel.send(action, (), peer)
                elif action.kind.is_recv:
                    channel.recv(action, peer)
        except Exception as exc:  # noqa: BLE001
            error = exc
        try:
            _failure.end_step(channel, plan, actions, at, error)
        except Exception as exc:  # noqa: BLE001
            outcome[rank] = exc

    threads: List[threading.Thread] = []
    for rank in range(pp):
        thread = threading.Thread(target=rank_main, args=(rank,), daemon=True)
        thread.rank = rank
        threads.append(thread)
        thread.start()
    for thread in threads:
        thread.join(4 * WAIT)
        assert not thread.is_alive(), f"rank {thread.rank} never ended the step (fail={fail})"
    left = {k: q.qsize() for k, q in queues.items() if q.qsize()}
    assert not left, f"messages left unread (src, dst) -> count: {left} (fail={fail})"
    return outcome


CASES = [(name, pp, n) for name in ("GPipe", "1F1B", "Interleaved1F1B", "ZBVZeroBubble") for pp in (2, 3, 4)
         for n in (pp, pp + 1)]


@pytest.mark.parametrize("name, pp, n", CASES)
def test_a_failure_at_any_action_ends_the_step_on_every_rank_with_no_message_left(name, pp, n, monkeypatch):
    plan = build_plan(name, pp, n)
    assert _run(plan, None, monkeypatch) == {}                        # a step that runs through
    for rank in range(pp):
        for at, action in enumerate(plan.actions[rank]):
            outcome = _run(plan, (rank, at), monkeypatch)
            assert set(outcome) == set(range(pp)), (rank, action, outcome)
            assert isinstance(outcome[rank], RuntimeError) and str(outcome[rank]) == f"fault at {action}"
            for other in set(range(pp)) - {rank}:
                error = outcome[other]
                assert isinstance(error, PipelineError), (rank, action, other, error)
                assert f"pp rank {rank} at {action}: RuntimeError: fault at {action}" in str(error), str(error)
