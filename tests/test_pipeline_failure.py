"""The end of a failed pipeline step (``pipelining._failure``), without processes: each rank is a
thread running its action list over in-memory queues (sends return at once, as on MindSpore's
CPU backend; a receive waits), one action fails, and every rank must end the step: the failed
one with its own error, every other one with a PipelineError naming it, no rank waiting, and no
message left unread (an unread message would be taken as data by the next collective). The
runtime's Channel runs the protocol, over queues instead of MindSpore's send / recv. Every
schedule, 2 to 4 ranks, as many and one more micro-batches as ranks, a failure at every action
of every rank (before it runs, so a failed RECV leaves its message unread).

A rank that hangs or dies sends no abort: on 2 CPU ranks (a pool of their own, with a 3 s
``HPMS_COMM_TIMEOUT``), the communication watchdog ends the rank waiting for it, naming it and
the call it waited in."""
from __future__ import annotations

import os
import queue
import re
import signal
import threading
import time
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


TIMEOUT = 3.0       # HPMS_COMM_TIMEOUT of the ranks below


def _stage_hangs_or_dies(fault: str, where: str) -> None:
    """Two 1F1B steps on 2 ranks (4 micro-batches); in the second, rank 1 hangs in its stage's
    forward of micro-batch 1 while rank 0 waits in a RECV for its gradient (``fault="hang"``), or
    is killed with SIGKILL as it enters the step's closing agreement, an all-reduce over the pp
    mesh that rank 0 waits in (``fault="kill"``). Rank 1 writes when to ``where``."""
    from hyper_parallel_ms.mesh import init_device_mesh
    from tests._pipeline_models import batch, make_schedule

    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("pp",))
    schedule, _ = make_schedule("1F1B", mesh, 4)
    runtime = schedule._runtime                      # pylint: disable=protected-access  (fault injection)
    forward, agreement, armed = runtime._forward, _failure.failure_messages, [False]

    def fault_now() -> None:
        with open(where, "w") as f:
            f.write(repr(time.time()))
        if fault == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(3600)

    def faulty_forward(s: int, m: int) -> None:
        if armed[0] and fault == "hang" and m == 1:
            fault_now()
        forward(s, m)

    def faulty_agreement(mesh_, message):
        if armed[0] and fault == "kill":
            fault_now()
        return agreement(mesh_, message)

    first = mesh.get_local_rank() == 0
    if not first:
        runtime._forward, _failure.failure_messages = faulty_forward, faulty_agreement
    for step in range(2):
        x, y = batch(step, 8)
        armed[0] = step == 1
        schedule.step(*((x,) if first else ()), target=None if first else y)


@pytest.mark.parametrize("fault", ["hang", "kill"])
def test_a_rank_that_hangs_or_dies_ends_the_rank_waiting_for_it_naming_it(fault, tmp_path, monkeypatch):
    """Rank 0 ends (exit code 124) within the timeout of rank 1 hanging, at once when it is
    killed, with a message naming rank 1 and the call it waited in (a pipeline RECV; the step's
    closing all-reduce). Without the watchdog rank 0 waited in MindSpore for 60 s (a RECV) or
    30 s (the all-reduce), and its error named neither."""
    from hyper_parallel_ms.testing import RankFailure, RankPool, _pool

    monkeypatch.setenv("HPMS_COMM_TIMEOUT", str(TIMEOUT))
    if fault == "hang":
        monkeypatch.setattr(_pool, "FAILURE_GRACE", 1.0)  # once rank 0 has ended, the hung rank 1 is not waited for
    where = str(tmp_path / "fault")
    with RankPool(2) as pool:
        with pytest.raises(RankFailure) as info:
            pool.run(_stage_hangs_or_dies, fault, where, timeout=120)
    ended = time.time()
    with open(where) as f:
        seconds = ended - float(f.read())
    text = str(info.value)
    message = text.split("[hyper_parallel_ms watchdog] rank 0: ", 1)[-1].split("\n", 1)[0]
    assert "rank 0 exited with code 124" in text and "watchdog" in text, text
    if fault == "hang":
        found = re.search(r"^rank 1 stopped answering: this rank waits for rank 1 in recv #\d+ from rank 1 over mesh "
                          r"dim 'pp' \[pipeline 0RECV_B1 of pp rank 0, from pp rank 1\]; rank 1 \(pid \d+, alive\) has "
                          r"issued no communication call for (\d+\.\d) s and has not reached that call; it is at "
                          r".*test_pipeline_failure.py:\d+ in fault_now", message)
        assert found and TIMEOUT <= float(found.group(1)) < TIMEOUT + 3, message
        assert "rank 1 hung" in text and seconds < TIMEOUT + 1.0 + 6, (seconds, text)
    else:
        assert re.search(r"^rank 1 is gone: this rank waits for rank 1 in all_reduce \(call #\d+ over mesh dim 'pp', "
                         r"ranks \[0, 1\]\) \[the pipeline step's closing agreement, over the pp mesh\], and its "
                         r"process \(pid \d+\) exited before it reached that call", message), message
        assert "rank 1 exited with code -9" in text and seconds < 6, (seconds, text)
