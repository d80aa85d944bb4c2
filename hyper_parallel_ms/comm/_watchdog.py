"""The communication watchdog: a rank waiting for a peer that hangs or died ends, naming it.

Every communication call of the library that runs on a real cluster in PyNative is counted on
this rank's board (:mod:`._board`) before it is issued: collectives per group, ``send`` and
``recv`` per direction of a rank pair. A daemon thread, started at the first call, wakes every
0.25 s (and at once when a peer process on this host exits), publishes where this rank's main
thread is (and whether it compiles a graph), and compares the counts: a peer is *behind* when it
has issued fewer calls of a key this rank waits on (it has not entered the collective this rank
entered, or not sent the message this rank's ``recv`` reads). This rank then ends (a message
naming the peer and the call on stderr, then ``os._exit(124)``, so that msrun or the test
harness stops the job) when a peer it is behind on

- is gone (its process on this host has exited): at once;
- has issued no communication call at all for ``HPMS_COMM_TIMEOUT`` seconds (default 20 on CPU
  ranks, HCCL's execution timeout on NPUs: :func:`default_timeout`) while
  this rank waited for it, and was not compiling a graph meanwhile (a peer waiting for a third
  rank is followed to that rank; ranks waiting for each other are named together).

A peer that is gone without a normal exit (killed or crashed) also ends this rank once it has
been blocked inside MindSpore for 2 s, though no count shows it waiting: with MindSpore's
asynchronous launch a call is counted when issued, and a killed sender may have issued a send
that never went out.

The counts work whether or not the call blocks in Python (MindSpore's asynchronous launch
returns at once and waits at the next synchronisation), and a rank that is merely slow between
its calls is not ended before the timeout. ``HPMS_COMM_TIMEOUT=0`` turns the watchdog off. Not
seen: collectives inside compiled graphs and the backward of collectives (issued by MindSpore,
not counted, on every rank alike), and peers on other hosts (their boards are local files):
there, MindSpore's own timeouts (``MS_NODE_TIMEOUT``) still end the job.

Example::

    arrive("all_reduce", group, "dp")                  # before issuing the collective over mesh dim "dp"
    with note("pipeline 0RECV_B1 from pp rank 1"):    # named in a message about the calls inside
        ...
"""
from __future__ import annotations

import atexit
import os
import select
import sys
import sysconfig
import threading
import time
import warnings
from typing import Dict, List, Optional, Tuple

from ._board import (COMPILING, ENDED, EXITED, HEARTBEAT, PID, PROGRESS, RUNNING, STARTED, STATE, WAITING_ON, Board,
                     BoardView, job_dir, key_hash, process_start_ns, sweep)

__all__ = ["arrive", "note", "comm_timeout", "default_timeout", "set_comm_timeout", "Watchdog", "TIMEOUT_ENV",
           "EXIT_CODE"]

TIMEOUT_ENV = "HPMS_COMM_TIMEOUT"
DEFAULT_TIMEOUT = 20.0     # seconds on CPU ranks: every rank ends within 30 s of a peer hanging, with room to spare
HCCL_DEFAULT_TIMEOUT = 1836.0   # seconds: HCCL's execution timeout when HCCL_EXEC_TIMEOUT is not set
EXIT_CODE = 124            # as coreutils' ``timeout``
POLL = 0.25                # seconds between rounds
_RING = 16                 # labels kept per key (the calls a rank may be ahead of a peer)
_STALE_NS = 2_000_000_000  # a board registered this long before this process started is a past job's
_LOCAL_HOSTS = ("127.0.0.1", "localhost", "::1")
_SEP = os.sep
_MINDSPORE = f"{_SEP}mindspore{_SEP}"
_GRAPH = f"{_SEP}mindspore{_SEP}graph{_SEP}"
_COMPILE_NAMES = frozenset({"compile", "compile_frontend", "_compile", "compile_and_run"})
_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + _SEP
_CALLS = (_PACKAGE + "comm" + _SEP, _PACKAGE + "_mindspore" + _SEP)   # where this package calls MindSpore's kernels
_STUCK = 2.0               # seconds blocked in MindSpore after which a peer gone uncleanly ends this rank
_STDLIB = sysconfig.get_paths()["stdlib"] + _SEP          # "where" names the caller of a stdlib wait
_RESTART = ("ending this rank (exit code {code}) so that the job stops; HPMS_COMM_TIMEOUT={timeout:g} s "
            "(raise it to wait longer, 0 turns the watchdog off)")


def default_timeout(device: str) -> float:
    """The silence after which a waiting rank ends when ``HPMS_COMM_TIMEOUT`` is not set: 20 s on
    CPU ranks (MindSpore's own MCCL timeout ends them after about 30 s anyway), HCCL's execution
    timeout on NPUs (``HCCL_EXEC_TIMEOUT``, 1836 s when unset), so that a healthy rank working alone
    between collectives (an evaluation, a checkpoint written by one rank) is never ended there.
    Dead peers end a waiting rank at once on both.

    >>> default_timeout("cpu")
    20.0
    """
    if device != "npu":
        return DEFAULT_TIMEOUT
    try:
        return float(os.environ.get("HCCL_EXEC_TIMEOUT", "") or HCCL_DEFAULT_TIMEOUT)
    except ValueError:
        return HCCL_DEFAULT_TIMEOUT


def set_comm_timeout(seconds: Optional[float]) -> None:
    """Use ``seconds`` of a peer's silence (``init_process_group(timeout=...)``) in place of
    ``HPMS_COMM_TIMEOUT`` and the default, for this process, a watchdog already running included;
    ``None`` goes back to them.

    >>> set_comm_timeout(45.0); comm_timeout()
    45.0
    >>> set_comm_timeout(None)
    """
    if seconds is not None:
        if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or not 0 < seconds < float("inf"):
            raise ValueError(f"the communication timeout must be a positive number of seconds, got {seconds!r}")
        seconds = float(seconds)
    _chosen[:] = [] if seconds is None else [seconds]
    if _dogs and _dogs[0] is not None:
        _dogs[0].timeout = seconds if seconds is not None else comm_timeout(_dogs[0].device)


_chosen: List[float] = []     # [seconds] given by set_comm_timeout, else []


def comm_timeout(device: str = "cpu") -> float:
    """``HPMS_COMM_TIMEOUT`` in seconds (default :func:`default_timeout` of ``device``; ``0`` or
    ``off``: no watchdog), or what :func:`set_comm_timeout` chose."""
    if _chosen:
        return _chosen[0]
    raw = os.environ.get(TIMEOUT_ENV, "").strip().lower()
    if raw in ("", "default"):
        return default_timeout(device)
    if raw in ("off", "none", "false"):
        return 0.0
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not value >= 0 or value == float("inf"):
        raise ValueError(f"{TIMEOUT_ENV} must be a number of seconds >= 0 (0 turns the watchdog off), got "
                         f"{os.environ[TIMEOUT_ENV]!r}")
    return value


class _Key:
    """One counted stream of calls: a collective group, or one direction of a point-to-point pair."""
    __slots__ = ("kind", "group", "ranks", "peers", "slot", "theirs", "waits", "labels", "last")

    def __init__(self, kind: str, group: str, ranks: Tuple[int, ...], peers: Tuple[int, ...], slot: int,
                 theirs: int, waits: bool) -> None:
        self.kind, self.group, self.ranks, self.peers = kind, group, ranks, peers
        self.slot, self.theirs, self.waits = slot, theirs, waits
        self.labels: List[Optional[tuple]] = [None] * _RING
        self.last = 0                   # this rank's PROGRESS at its latest call of the key


_notes: List[str] = []         # what the calls being issued belong to (innermost last): see note()


class note:  # pylint: disable=invalid-name  (used as a function: ``with note(...)``)
    """Name what the calls issued inside belong to (e.g. a pipeline action) in watchdog messages.

    Example::

        with note("pipeline 0RECV_B1 from pp rank 1"):
            channel.recv(...)
    """
    __slots__ = ("text",)

    def __init__(self, text: str) -> None:
        self.text = text

    def __enter__(self) -> None:
        _notes.append(self.text)

    def __exit__(self, *exc) -> None:
        _notes.pop()


class Watchdog:
    """This rank's board and watchdog thread (see the module docstring).

    Args:
        rank: this process's global rank.
        timeout: seconds of silence of a peer this rank waits for before it ends.
        folder: the job's boards folder (:func:`._board.job_dir`).
        local_job: every rank runs on this host (a missing board means a rank that made no call yet).

    Example::

        dog = Watchdog(0, 20.0, job_dir(), True)
        dog.arrive("all_reduce", "hccl_world_group", (0, 1), None, "dp")
        dog.check(time.time())           # None, or the message this rank would end with
    """

    def __init__(self, rank: int, timeout: float, folder: str, local_job: bool, device: str = "cpu") -> None:
        self.rank, self.timeout, self.folder, self.local_job = rank, timeout, folder, local_job
        self.device = device
        self.board = Board.create(self._path(rank))
        self.keys: Dict[tuple, _Key] = {}
        self.caller: Optional[int] = None      # the thread that issues the calls (sampled for "where")
        self._start_ns = process_start_ns() or time.time_ns()
        self._views: Dict[int, Optional[BoardView]] = {}
        self._quiet: Dict[tuple, Tuple[tuple, float]] = {}   # chain -> (its state, since when unchanged)
        self._pidfds: Dict[int, int] = {}
        self._spot: Tuple[Optional[tuple], float] = (None, 0.0)   # (the caller's place inside MindSpore, since when)
        self._thread: Optional[threading.Thread] = None

    def _path(self, rank: int) -> str:
        return os.path.join(self.folder, f"rank{rank}")

    # ------------------------------------------------------------------ the calls (main thread)
    def arrive(self, kind: str, group: str, ranks: Tuple[int, ...], peer: Optional[int], dim: str) -> None:
        """Count one call about to be issued: a collective ``kind`` over ``group`` (global ``ranks``),
        or ``send`` / ``recv`` to / from global rank ``peer``, over the mesh dim named ``dim``."""
        key = self.keys.get((kind if peer is not None else "c", group, peer))
        if key is None:
            key = self._new_key(kind, group, ranks, peer)
        n = self.board.bump(key.slot)
        key.labels[n % _RING] = (kind, dim, _notes[-1] if _notes else None)
        key.last = self.board.q[PROGRESS]

    def _new_key(self, kind: str, group: str, ranks: Tuple[int, ...], peer: Optional[int]) -> _Key:
        me = self.rank
        if peer is None:
            name = theirs = f"c:{group}"
            peers, waits = tuple(r for r in ranks if r != me), True
        else:       # the receiver compares with the sender's sends, the sender with the receiver's receives
            src, dst = (me, peer) if kind == "send" else (peer, me)
            name, theirs = f"{kind[0]}:{group}:{src}>{dst}", f"{'r' if kind == 'send' else 's'}:{group}:{src}>{dst}"
            peers, waits = (peer,), kind == "recv"       # a send waits only for a receiver that is gone
        slot = self.board.slot(key_hash(name))
        if slot is None:              # the board is full: counted, never compared (MindSpore's timeouts apply)
            slot, peers = self.board.overflow(), ()
        key = _Key(kind if peer is not None else "collective", group, tuple(ranks), peers, slot, key_hash(theirs),
                   waits)
        self.keys[(kind if peer is not None else "c", group, peer)] = key
        return key

    def start(self) -> "Watchdog":
        """Start the watchdog thread, watching the calling thread (the one that issues the calls)."""
        self.caller = threading.get_ident()
        self._thread = threading.Thread(target=self._run, name="hpms-comm-watchdog", daemon=True)
        self._thread.start()
        atexit.register(self._exited)
        return self

    def _exited(self) -> None:
        """A normal exit (the interpreter's, or an exception's): peers that are done with this rank go on."""
        if self.board.q[STATE] != ENDED:
            self.board.q[STATE] = EXITED

    # ------------------------------------------------------------------ a round (watchdog thread)
    def check(self, now: float) -> Optional[str]:
        """One round: the message this rank must end with, or ``None`` (see the module docstring)."""
        self._views = {}
        behind: Dict[int, Tuple[_Key, int]] = {}     # peer -> (key, the first call of it the peer has not issued)
        owed: Dict[int, Tuple[_Key, int]] = {}       # peer -> (send key, the first message it has not read)
        for key in list(self.keys.values()):
            mine = self.board.q[key.slot]
            for peer in key.peers:
                view = self._view(peer)
                if view is None and not self.local_job:
                    continue                       # a rank on another host: not seen from here
                theirs = view.count(key.theirs) if view is not None else 0
                found = behind if key.waits else owed
                if theirs < mine and (peer not in found or theirs + 1 < found[peer][1]):
                    found[peer] = (key, theirs + 1)
        self.board.q[WAITING_ON] = min(behind) if behind else -1
        for peer, (key, n) in sorted(owed.items()):     # unread, by a rank killed or crashed (not one done with it)
            view = self._views.get(peer)
            if peer not in behind and view is not None and view[STATE] != EXITED and self._gone(view):
                return self._gone_message(key, n, [peer], peer, view)
        watched = set()
        for peer, (key, n) in sorted(behind.items()):
            chain, cycle = self._chain(peer)
            watched.add(tuple(chain))
            for rank in chain:
                view = self._views.get(rank)
                if view is not None and self._gone(view):
                    return self._gone_message(key, n, chain, rank, view)
            state = tuple((v[PROGRESS], v[STATE] == COMPILING) if v is not None else None
                          for v in (self._views.get(r) for r in chain))
            seen = self._quiet.get(tuple(chain))
            if seen is None or seen[0] != state or any(s is not None and s[1] for s in state):
                self._quiet[tuple(chain)] = (state, now)
            elif now - seen[1] >= self.timeout:
                return self._silent_message(key, n, chain, cycle, now - seen[1])
        for stale in set(self._quiet) - watched:
            del self._quiet[stale]
        stuck = now - self._spot[1] if self._spot[0] is not None else 0.0
        if stuck >= _STUCK:
            for rank, view in sorted(self._views.items()):
                if view is not None and view[STATE] != EXITED and self._gone(view):
                    return self._lost_message(rank, view, stuck)
        return None

    def _view(self, rank: int) -> Optional[BoardView]:
        if rank not in self._views:
            view = BoardView.read(self._path(rank))
            self._views[rank] = None if view is not None and view[STARTED] < self._start_ns - _STALE_NS else view
        return self._views[rank]

    def _chain(self, peer: int) -> Tuple[List[int], bool]:
        """``peer``, the rank it waits for, and so on (its published ``WAITING_ON``); whether it
        loops back (ranks waiting for each other)."""
        chain = [peer]
        while True:
            view = self._view(chain[-1])
            nxt = view[WAITING_ON] if view is not None else -1
            if nxt < 0:
                return chain, False
            if nxt == self.rank or nxt in chain:
                return chain, True
            chain.append(nxt)

    @staticmethod
    def _gone(view: BoardView) -> bool:
        return not view.alive()

    # ------------------------------------------------------------------ messages
    def _call(self, key: _Key, n: int) -> str:
        label = key.labels[n % _RING] if self.board.q[key.slot] - n < _RING else None
        kind, dim, context = label or (key.kind, None, None)
        over = f"mesh dim {dim!r}" if dim is not None else f"group {key.group!r}"
        if key.kind in ("recv", "send"):
            text = f"{key.kind} #{n} {'from' if key.kind == 'recv' else 'to'} rank {key.peers[0]} over {over}"
        else:
            text = f"{kind} (call #{n} over {over}, ranks {list(key.ranks)})"
        return text + (f" [{context}]" if context else "")

    def _waits(self, key: _Key, n: int, chain: List[int]) -> str:
        if key.kind == "send":
            return f"this rank's {self._call(key, n)} has not been read"
        text = f"this rank waits for rank {chain[0]} in {self._call(key, n)}"
        for a, b in zip(chain, chain[1:]):
            text += f", and rank {a} waits for rank {b}"
        return text

    def _where(self, view: Optional[BoardView]) -> str:
        where = view.text() if view is not None else ""
        return f"; it is at {where}" if where else ""

    def _gone_message(self, key: _Key, n: int, chain: List[int], rank: int, view: BoardView) -> str:
        before = ""
        if rank == chain[0]:
            before = " before it read that message" if key.kind == "send" else " before it reached that call"
        ended = view.text(message=True) if view[STATE] == ENDED else ""
        why = f" (rank {rank}'s watchdog had ended it: {ended})" if ended else ""
        return (f"rank {rank} is gone: {self._waits(key, n, chain)}, and its process (pid {view[PID]}) "
                f"exited{before}{why}")

    def _lost_message(self, rank: int, view: BoardView, stuck: float) -> str:
        key = max((k for k in list(self.keys.values()) if rank in k.peers), key=lambda k: k.last)
        here = self._where(BoardView.read(self.board.path))
        return (f"rank {rank} is gone: its process (pid {view[PID]}) ended without a normal exit (killed or crashed), "
                f"and this rank has been blocked in MindSpore for {stuck:.1f} s{here} (its last call with rank "
                f"{rank}: {self._call(key, self.board.q[key.slot])})")

    def _silent_message(self, key: _Key, n: int, chain: List[int], cycle: bool, seconds: float) -> str:
        if cycle:
            ranks = ", ".join(str(r) for r in [self.rank] + chain)
            return (f"ranks {ranks} wait for each other: {self._waits(key, n, chain)}, and rank {chain[-1]} "
                    f"waits for this rank; none has issued a communication call for {seconds:.1f} s. The ranks "
                    "issue different calls (a collective or send / recv that another rank does not issue, or "
                    "issues in another order)")
        root = chain[-1]
        view = self._views.get(root)
        if view is None:
            return (f"rank {root} stopped answering: {self._waits(key, n, chain)}, and rank {root} has issued no "
                    f"communication call of the library in {seconds:.1f} s (none since it started)")
        return (f"rank {root} stopped answering: {self._waits(key, n, chain)}; rank {root} (pid {view[PID]}, "
                f"alive) has issued no communication call for {seconds:.1f} s and has not reached that "
                f"call{self._where(view)}")

    # ------------------------------------------------------------------ the thread
    def _run(self) -> None:
        poller = select.poll()
        while True:
            try:
                for fd, _ in poller.poll(int(POLL * 1000)):
                    poller.unregister(fd)           # a peer exited: the round below tells whether it matters
                now = time.time()
                self._publish(now)
                message = self.check(now)
                if message is not None:
                    self._end(message)
                self._watch_exits(poller)
            except Exception as exc:  # noqa: BLE001  (the watchdog must never break training: say so and stop)
                os.write(2, f"[hyper_parallel_ms watchdog] rank {self.rank}: watchdog stopped: {exc!r}\n".encode())
                return

    def _publish(self, now: float) -> None:
        """Heartbeat, whether the calling thread compiles a graph, and where it is (its innermost
        frame outside MindSpore and Python's library; inside this package, also the frame it was
        called from outside it)."""
        q = self.board.q
        q[HEARTBEAT] = int(now * 1e9)
        frame = sys._current_frames().get(self.caller)    # pylint: disable=protected-access
        compiling, where, outside = False, "", ""
        top = frame
        inside = top is not None and (_MINDSPORE in top.f_code.co_filename
                                      or top.f_code.co_filename.startswith(_CALLS))
        spot = (id(top.f_code), top.f_lineno) if inside else None
        if spot is None or spot != self._spot[0]:
            self._spot = (spot, now)
        while frame is not None:
            path = frame.f_code.co_filename
            if _MINDSPORE in path:
                compiling = compiling or (_GRAPH in path and (frame.f_code.co_name in _COMPILE_NAMES
                                                              or f"{_GRAPH}_parse" in path))
            elif not path.startswith(_STDLIB) and not path.startswith("<"):
                place = f"{path}:{frame.f_lineno} in {frame.f_code.co_name}"
                where = where or place
                if not outside and not path.startswith(_PACKAGE):
                    outside = place
            frame = frame.f_back
        if q[STATE] not in (ENDED, EXITED):
            q[STATE] = COMPILING if compiling else RUNNING
        self.board.set_text(False, where if outside in ("", where) else f"{where} (called from {outside})")

    def _watch_exits(self, poller) -> None:
        """Be woken at once when a peer on this host exits (Linux pidfds)."""
        if not hasattr(os, "pidfd_open"):
            return
        for rank, view in self._views.items():
            if view is not None and rank not in self._pidfds and view.same_host:
                try:
                    fd = os.pidfd_open(view[PID])
                except OSError:
                    continue
                self._pidfds[rank] = fd
                poller.register(fd, select.POLLIN)

    def _end(self, message: str) -> None:
        self.board.set_text(True, message)
        text = (f"[hyper_parallel_ms watchdog] rank {self.rank}: {message}; "
                + _RESTART.format(code=EXIT_CODE, timeout=self.timeout) + "\n")
        self.board.q[STATE] = ENDED
        try:
            sys.stdout.flush()
        except Exception:  # noqa: BLE001
            pass
        os.write(2, text.encode(errors="replace"))
        os._exit(EXIT_CODE)


_dogs: List[Optional[Watchdog]] = []    # [] before the first call; then [this process's watchdog or None]


def _watchdog(rank: int) -> Optional[Watchdog]:
    """This process's watchdog, made on first use (``None``: turned off, or no job folder)."""
    if not _dogs:
        from .._cluster import device_type
        device = device_type()
        timeout, folder, dog = comm_timeout(device), job_dir(), None
        if timeout > 0 and folder:
            try:
                sweep(folder)
                dog = Watchdog(rank, timeout, folder, os.environ.get("MS_SCHED_HOST", "") in _LOCAL_HOSTS,
                               device).start()
            except OSError as exc:
                warnings.warn(f"the communication watchdog is off: its board in {folder} could not be made "
                              f"({exc}); set HPMS_WATCHDOG_DIR to a writable folder", RuntimeWarning, stacklevel=3)
        _dogs.append(dog)
    return _dogs[0]


def arrive(kind: str, group, dim: str, peer: Optional[int] = None) -> None:
    """Count a call on this rank's board before it is issued: a collective ``kind`` over the
    :class:`~hyper_parallel_ms._cluster.CommGroup` ``group``, or ``"send"`` / ``"recv"`` with the
    group index ``peer``; ``dim`` is the mesh dim's name. Starts the watchdog on first use."""
    dog = _dogs[0] if _dogs else _watchdog(group.ranks[group.rank])
    if dog is not None:
        dog.arrive(kind, group.name, group.ranks, None if peer is None else group.ranks[peer], dim)
