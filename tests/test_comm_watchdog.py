"""The communication watchdog's decisions, without processes: this rank's Watchdog and its peers'
boards live in a temporary folder; a peer is a Board this test bumps (its pid this process's, or
that of a child that has exited). Each round (``check``) either names the peer and the call this
rank waits in, or lets it wait. The end-to-end runs (a rank hanging or killed in a pipeline step,
the rank waiting for it ending) are in tests/test_pipeline_failure.py."""
from __future__ import annotations

import os
import subprocess
import threading
import time

import pytest

from hyper_parallel_ms.comm import _watchdog
from hyper_parallel_ms.comm._board import (COMPILING, ENDED, EXITED, OVERFLOW, PID, SLOTS, STARTED, STATE, WAITING_ON,
                                           Board, BoardView, key_hash)
from hyper_parallel_ms.comm._watchdog import Watchdog, comm_timeout, note

T = 5.0        # the watchdog's timeout in these tests (seconds of the fake clock)


def _dead_pid() -> int:
    child = subprocess.Popen(["true"])
    child.wait()
    return child.pid


@pytest.fixture
def job(tmp_path):
    """(this rank's Watchdog as rank 0, a function making rank r's board)."""
    dog = Watchdog(0, T, str(tmp_path), local_job=True)
    return dog, lambda rank: Board.create(os.path.join(str(tmp_path), f"rank{rank}"))


def _bump(board: Board, key: str, times: int = 1) -> None:
    for _ in range(times):
        board.bump(board.slot(key_hash(key)))


def test_a_peer_behind_and_silent_for_the_timeout_is_named_with_the_call(job):
    dog, board = job
    peer = board(1)
    dog.arrive("all_reduce", "g01", (0, 1), None, "tp")
    now = time.time()
    assert dog.check(now) is None and dog.check(now + T - 0.1) is None          # waiting, not yet too long
    assert BoardView.read(dog.board.path)[WAITING_ON] == 1                      # published for the others
    message = dog.check(now + T + 0.1)
    assert message.startswith("rank 1 stopped answering: this rank waits for rank 1 in all_reduce (call #1 over "
                              "mesh dim 'tp', ranks [0, 1]); rank 1 (pid "), message
    assert f"(pid {os.getpid()}, alive) has issued no communication call for {T + 0.1:.1f} s" in message
    _bump(peer, "c:g01")                                                        # it joins: nobody is behind
    assert dog.check(now + 3 * T) is None and BoardView.read(dog.board.path)[WAITING_ON] == -1

    # a point-to-point recv, inside a pipeline action: the sender's sends are what it waits for
    with note("pipeline 0RECV_B1 of pp rank 0, from pp rank 1"):
        dog.arrive("recv", "g01", (0, 1), 1, "pp")
    _bump(peer, "r:g01:0>1", 5)                       # receiving from rank 0 is not sending to it
    assert dog.check(now + 4 * T) is None
    assert dog.check(now + 5.5 * T) == (
        f"rank 1 stopped answering: this rank waits for rank 1 in recv #1 from rank 1 over mesh dim 'pp' "
        f"[pipeline 0RECV_B1 of pp rank 0, from pp rank 1]; rank 1 (pid {os.getpid()}, alive) has issued no "
        f"communication call for {1.5 * T:.1f} s and has not reached that call")
    _bump(peer, "s:g01:1>0")
    assert dog.check(now + 10 * T) is None


def test_a_peer_that_progresses_or_compiles_is_waited_for(job):
    dog, board = job
    peer = board(1)
    dog.arrive("broadcast", "g01", (0, 1), None, "dp")
    now = time.time()
    assert dog.check(now) is None
    _bump(peer, "c:other")                     # busy with other calls: its silence starts again
    assert dog.check(now + T + 1) is None and dog.check(now + 2 * T) is None
    peer.q[STATE] = COMPILING                  # compiling a graph: never silent meanwhile
    assert dog.check(now + 10 * T) is None and dog.check(now + 20 * T) is None
    peer.q[STATE] = 0
    assert dog.check(now + 21 * T) is None
    assert "has issued no communication call for 5.5 s" in dog.check(now + 22.1 * T)


def test_a_peer_that_is_gone_is_named_at_once(job):
    dog, board = job
    peer = board(1)
    dog.arrive("send", "g01", (0, 1), 1, "pp")               # a message it has not read
    now = time.time()
    assert dog.check(now) is None                            # a send waits for nobody alive
    peer.q[PID] = _dead_pid()
    assert dog.check(now) == (f"rank 1 is gone: this rank's send #1 to rank 1 over mesh dim 'pp' has not been read, "
                              f"and its process (pid {peer.q[PID]}) exited before it read that message")
    peer.q[STATE] = EXITED                                   # it exited normally, done with this rank
    assert dog.check(now) is None
    peer.q[STATE] = 0
    _bump(peer, "r:g01:0>1")                                 # it had read everything: its exit is not this rank's
    assert dog.check(now) is None
    dog.arrive("all_reduce", "g01", (0, 1), None, "pp")
    peer.set_text(True, "rank 2 stopped answering: ...")     # it was ended by its own watchdog
    peer.q[STATE] = ENDED
    assert dog.check(now) == (
        f"rank 1 is gone: this rank waits for rank 1 in all_reduce (call #1 over mesh dim 'pp', ranks [0, 1]), and "
        f"its process (pid {peer.q[PID]}) exited before it reached that call (rank 1's watchdog had ended it: "
        "rank 2 stopped answering: ...)")


def test_a_peer_killed_after_its_calls_ends_a_rank_blocked_in_mindspore(job):
    """With MindSpore's asynchronous launch a call is counted when issued: a killed sender's last
    send may never have gone out though its count matches."""
    dog, board = job
    peer = board(1)
    dog.arrive("recv", "g01", (0, 1), 1, "pp")
    _bump(peer, "s:g01:1>0")
    peer.q[PID] = _dead_pid()
    now = time.time()
    dog._spot = (("a place in MindSpore",), now - 1.9)       # pylint: disable=protected-access
    assert dog.check(now) is None                            # not blocked long enough
    dog._spot = (("a place in MindSpore",), now - 2.5)       # pylint: disable=protected-access
    assert dog.check(now) == (f"rank 1 is gone: its process (pid {peer.q[PID]}) ended without a normal exit (killed "
                              f"or crashed), and this rank has been blocked in MindSpore for 2.5 s (its last call with "
                              f"rank 1: recv #1 from rank 1 over mesh dim 'pp')")
    peer.q[STATE] = EXITED                                   # it exited normally: done with this rank
    assert dog.check(now) is None
    dog._spot = (None, now - 10)                             # pylint: disable=protected-access
    peer.q[STATE] = 0
    assert dog.check(now) is None                            # this rank is not blocked in MindSpore
    dog._exited()                                            # pylint: disable=protected-access  (atexit)
    assert BoardView.read(dog.board.path)[STATE] == EXITED


def test_a_chain_of_waiting_ranks_names_its_end_and_a_cycle_names_every_rank(job):
    dog, board = job
    one, two = board(1), board(2)
    dog.arrive("recv", "g01", (0, 1), 1, "pp")
    one.q[WAITING_ON] = 2                                    # rank 1 waits for rank 2, which is silent
    now = time.time()
    assert dog.check(now) is None
    _bump(one, "c:somewhere")                  # rank 1 still makes calls: not stuck (yet), its silence starts again
    assert dog.check(now + T - 1) is None and dog.check(now + 2 * T - 1.5) is None
    assert dog.check(now + 2 * T) == (
        f"rank 2 stopped answering: this rank waits for rank 1 in recv #1 from rank 1 over mesh dim 'pp', and "
        f"rank 1 waits for rank 2; rank 2 (pid {os.getpid()}, alive) has issued no communication call for "
        f"{T + 1:.1f} s and has not reached that call")
    two.q[PID] = _dead_pid()
    assert dog.check(now + T + 1).startswith("rank 2 is gone: this rank waits for rank 1 in recv #1 from rank 1 "
                                              "over mesh dim 'pp', and rank 1 waits for rank 2, and its process")
    one.q[WAITING_ON] = 0                                    # rank 1 waits for this rank: a deadlock
    assert dog.check(now) is None
    assert dog.check(now + T) == (
        "ranks 0, 1 wait for each other: this rank waits for rank 1 in recv #1 from rank 1 over mesh dim 'pp', and "
        "rank 1 waits for this rank; none has issued a communication call for 5.0 s. The ranks issue different "
        "calls (a collective or send / recv that another rank does not issue, or issues in another order)")


def test_ranks_without_a_board_here(job, tmp_path):
    dog, board = job
    dog.arrive("all_gather", "g012", (0, 1, 2), None, "dp")
    _bump(board(1), "c:g012")
    now = time.time()
    assert dog.check(now) is None
    # rank 2 never made a call (on a one-host job): named after the timeout
    assert dog.check(now + T) == ("rank 2 stopped answering: this rank waits for rank 2 in all_gather (call #1 over "
                                  "mesh dim 'dp', ranks [0, 1, 2]), and rank 2 has issued no communication call of "
                                  "the library in 5.0 s (none since it started)")
    stale = board(2)                       # a board left by a past job (registered before this process started)
    stale.q[STARTED] = 0
    stale.q[PID] = _dead_pid()
    assert "rank 2 stopped answering" in dog.check(now + 2 * T)
    dog.local_job = False                  # ranks on other hosts: their boards are not seen from here
    assert dog.check(now + 3 * T) is None


def test_keys_past_the_boards_room_are_counted_apart_and_never_compared(job):
    dog, board = job
    peer = board(1)
    for g in range(SLOTS + 4):
        dog.arrive("all_reduce", f"g{g}", (0, 1), None, "dp")
    for g in range(SLOTS - 1):
        _bump(peer, f"c:g{g}")
    view = BoardView.read(dog.board.path)
    assert view.count(key_hash(f"c:g{SLOTS - 2}")) == 1 and view.count(key_hash(f"c:g{SLOTS - 1}")) == 0
    assert view.count(OVERFLOW) == 5                       # the 5 keys past the room, in the shared last slot
    now = time.time()
    assert dog.check(now) is None and dog.check(now + 2 * T) is None


def test_the_watchdog_thread_publishes_where_the_calls_come_from_and_compiling(job):
    dog, _ = job
    inside, release = threading.Event(), threading.Event()
    # a function compiled as if it were MindSpore's graph compiler (its file and name), calling back
    fake = {}
    exec(compile("def compile(wait):\n    wait()\n", f"{os.sep}x{os.sep}mindspore{os.sep}graph{os.sep}api.py",
                 "exec"), fake)

    def user_code(compiling: bool) -> None:
        def wait():
            inside.set()
            release.wait(10)
        fake["compile"](wait) if compiling else wait()

    for compiling in (False, True):
        inside.clear()
        release.clear()
        worker = threading.Thread(target=user_code, args=(compiling,))
        worker.start()
        inside.wait(10)
        dog.caller = worker.ident
        dog._publish(time.time())          # pylint: disable=protected-access  (one round of the thread)
        view = BoardView.read(dog.board.path)
        release.set()
        worker.join()
        assert view[STATE] == (COMPILING if compiling else 0)
        assert view.text().startswith(f"{__file__}:") and " in wait" in view.text(), view.text()


def test_the_timeout_setting(monkeypatch):
    for raw, seconds in (("", 20.0), ("7.5", 7.5), ("0", 0.0), ("off", 0.0)):
        monkeypatch.setenv("HPMS_COMM_TIMEOUT", raw)
        assert comm_timeout() == seconds
    # on NPUs the default is HCCL's execution timeout, so a rank working alone for minutes is not ended
    monkeypatch.setenv("HPMS_COMM_TIMEOUT", "")
    monkeypatch.delenv("HCCL_EXEC_TIMEOUT", raising=False)
    assert comm_timeout("npu") == 1836.0
    monkeypatch.setenv("HCCL_EXEC_TIMEOUT", "600")
    assert comm_timeout("npu") == 600.0 and comm_timeout("cpu") == 20.0
    monkeypatch.setenv("HPMS_COMM_TIMEOUT", "45")
    assert comm_timeout("npu") == 45.0
    for raw in ("-1", "soon", "inf", "nan"):
        monkeypatch.setenv("HPMS_COMM_TIMEOUT", raw)
        with pytest.raises(ValueError, match=f"HPMS_COMM_TIMEOUT must be a number of seconds >= 0 \\(0 turns the "
                                             f"watchdog off\\), got '{raw}'"):
            comm_timeout()
    # off, or outside a job (no scheduler address): no watchdog, no board, no thread
    monkeypatch.setattr(_watchdog, "_dogs", [])
    monkeypatch.setenv("HPMS_COMM_TIMEOUT", "0")
    assert _watchdog._watchdog(0) is None and _watchdog._dogs == [None]   # pylint: disable=protected-access
    monkeypatch.setattr(_watchdog, "_dogs", [])
    monkeypatch.setenv("HPMS_COMM_TIMEOUT", "5")
    monkeypatch.delenv("MS_SCHED_PORT", raising=False)
    assert _watchdog._watchdog(0) is None                                # pylint: disable=protected-access
