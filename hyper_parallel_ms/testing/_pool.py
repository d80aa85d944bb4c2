"""RankPool: N MindSpore CPU ranks kept alive to run test functions.

A pool starts a MindSpore scheduler and ``world_size`` worker processes with the
environment msrun sets, so ``mindspore.communication.init()`` builds a real MCCL cluster
on this machine. ``run(fn, ...)`` sends a module-level function (by reference) to every
rank and returns each rank's result; a function of a script run as ``__main__`` works
too (the ranks import the script by its path, without running its ``__main__`` block).
A rank that raises, dies or does not answer in time fails the call with a :class:`RankFailure` naming the rank and showing its
traceback (for a hung rank, its Python stack); the pool is then torn down, because ranks
that disagree about the next collective would pair up wrongly in later tests.

Example::

    pool = RankPool(4)
    pool.run(my_module.check_all_reduce)        # -> [result of rank 0, ..., rank 3]
    pool.stop()
"""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from multiprocessing.connection import Connection, wait
from typing import Any, Callable, Dict, List, Optional, Tuple

from ._worker import HARNESS_FD_ENV, LAUNCH_BLOCKING_ENV, script_reference

__all__ = ["RankPool", "RankFailure", "DEFAULT_TIMEOUT"]

DEFAULT_TIMEOUT = float(os.environ.get("HPMS_TEST_TIMEOUT", "180"))
START_TIMEOUT = float(os.environ.get("HPMS_START_TIMEOUT", "120"))
# a rank process holding more than this after a run is restarted before the next one (compiled graphs
# and allocator pools of many tests add up: several GiB per rank over a whole suite)
MAX_RANK_RSS_MB = float(os.environ.get("HPMS_MAX_RANK_RSS_MB", "2500"))
FAILURE_GRACE = 3.0  # seconds the other ranks get to finish once one rank has failed
_PACKAGE_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


class RankFailure(AssertionError):
    """One or more ranks failed: raised, died, or did not answer in time.

    Example::

        with pytest.raises(RankFailure, match="rank 1"):
            run_on_ranks(my_module.fail_on_rank_1, 2)
    """


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _reference(fn: Callable) -> Tuple[str, str]:
    """(module, qualified name) by which the ranks find ``fn``; a function of the script run
    as ``__main__`` is named by the script's path (see :func:`._worker.script_reference`)."""
    module, qualname = getattr(fn, "__module__", None), getattr(fn, "__qualname__", "")
    if not module or "<locals>" in qualname or "<lambda>" in qualname:
        raise TypeError(f"{fn!r} cannot run on ranks: pass a function defined at module level "
                        "(ranks import it by module and name)")
    if module == "__main__":
        module = script_reference(sys.modules["__main__"], fn)
    return module, qualname


def _rss_mb(pid: int) -> float:
    """Resident memory of process ``pid`` in MiB (0 where ``/proc`` cannot tell)."""
    try:
        with open(f"/proc/{pid}/status") as status:
            for line in status:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024.0
    except OSError:
        pass
    return 0.0


def _tail(path: str, start: int = 0, limit: int = 6000) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(max(start, os.path.getsize(path) - limit))
            return f.read().decode(errors="replace")
    except OSError as exc:
        return f"(log {path} unreadable: {exc})"


class _Rank:
    """A worker process and its end of the socket."""

    def __init__(self, rank: int, proc: subprocess.Popen, conn: Connection, log: str) -> None:
        self.rank, self.proc, self.conn, self.log = rank, proc, conn, log


class RankPool:
    """``world_size`` CPU ranks plus a scheduler, started on first use.

    Args:
        world_size: number of ranks (1 to 8 is practical on a small machine).
        log_dir: where each process logs (``worker_K.log``, ``scheduler.log``); a fresh
            temporary folder by default.

    Example::

        with RankPool(2) as pool:
            assert pool.run(tests.helpers.my_rank) == [0, 1]
    """

    def __init__(self, world_size: int, *, log_dir: Optional[str] = None) -> None:
        if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
            raise ValueError(f"world_size must be a positive int, got {world_size!r}")
        self.world_size = world_size
        self.log_dir = log_dir
        self.start_seconds: Optional[float] = None
        self._ranks: List[_Rank] = []
        self._scheduler: Optional[subprocess.Popen] = None

    # ------------------------------------------------------------ lifecycle
    @property
    def alive(self) -> bool:
        """Whether the processes are started and none has exited."""
        procs = [r.proc for r in self._ranks] + ([self._scheduler] if self._scheduler else [])
        return bool(self._ranks) and all(p.poll() is None for p in procs)

    def start(self) -> "RankPool":
        """Start the scheduler and the workers; wait until every rank has initialized."""
        if self._ranks:
            return self
        began = time.perf_counter()
        log_dir = self.log_dir or tempfile.mkdtemp(prefix=f"hpms_ranks{self.world_size}_")
        os.makedirs(log_dir, exist_ok=True)
        self.log_dir = log_dir
        env = self._cluster_env(_free_port())
        sched_log = os.path.join(log_dir, "scheduler.log")
        self._scheduler = self._spawn("hyper_parallel_ms.testing._scheduler",
                                      dict(env, MS_ROLE="MS_SCHED"), sched_log)
        for rank in range(self.world_size):
            parent, child = socket.socketpair()
            log = os.path.join(log_dir, f"worker_{rank}.log")
            worker_env = dict(env, MS_ROLE="MS_WORKER", MS_NODE_ID=str(rank), RANK_ID=str(rank),
                              **{HARNESS_FD_ENV: str(child.fileno())})
            proc = self._spawn("hyper_parallel_ms.testing._worker", worker_env, log, pass_fds=(child.fileno(),))
            child.close()
            self._ranks.append(_Rank(rank, proc, Connection(parent.detach()), log))
        try:
            self._await_ready(START_TIMEOUT)
        except BaseException:
            self.stop()
            raise
        self.start_seconds = time.perf_counter() - began
        return self

    def stop(self) -> None:
        """Kill every process of the pool (ranks and scheduler)."""
        for r in self._ranks:
            try:
                r.conn.close()
            except OSError:
                pass
        procs = [r.proc for r in self._ranks] + ([self._scheduler] if self._scheduler else [])
        for p in procs:
            if p.poll() is None:
                try:
                    os.killpg(p.pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    p.kill()
        for p in procs:
            p.wait()
        self._ranks, self._scheduler = [], None

    def __enter__(self) -> "RankPool":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def _cluster_env(self, port: int) -> Dict[str, str]:
        env = dict(os.environ)
        path = env.get("PYTHONPATH")
        env.update(MS_WORKER_NUM=str(self.world_size), MS_SCHED_HOST="127.0.0.1", MS_SCHED_PORT=str(port),
                   MS_TOPO_TIMEOUT=str(int(START_TIMEOUT)),
                   PYTHONPATH=_PACKAGE_ROOT + (os.pathsep + path if path else ""),
                   OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1", MKL_NUM_THREADS="1")
        env.setdefault("GLOG_v", "3")
        if env.get(LAUNCH_BLOCKING_ENV, "1") == "1":
            # with launch_blocking (the worker's), compiled graphs run synchronously too: MindSpore's actor
            # threads then spin less, and the ranks of two pools sharing the cores run faster (measured on 2
            # cores: 10-15% less CPU time over the compiled and pipeline test files)
            env.setdefault("MS_SYNC_RUN", "1")
        env.pop("RANK_SIZE", None)
        return env

    @staticmethod
    def _spawn(module: str, env: Dict[str, str], log: str, pass_fds: Tuple[int, ...] = ()) -> subprocess.Popen:
        with open(log, "wb") as out:
            return subprocess.Popen([sys.executable, "-m", module], env=env, stdout=out, cwd=os.path.dirname(log),
                                    stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                    pass_fds=pass_fds, start_new_session=True)

    def _await_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        pending = {r.conn: r for r in self._ranks}
        problems: List[str] = []
        while pending and time.monotonic() < deadline:
            if self._scheduler is not None and self._scheduler.poll() is not None:
                problems.append(f"scheduler exited with code {self._scheduler.returncode}:\n"
                                f"{_tail(os.path.join(self.log_dir, 'scheduler.log'))}")
                break
            for conn in wait(list(pending), timeout=min(1.0, max(0.0, deadline - time.monotonic()))):
                r = pending.pop(conn)
                status, payload = self._receive(r)
                if status != "ready":
                    problems.append(f"rank {r.rank} failed to start:\n{payload}")
        problems += [f"rank {r.rank} did not initialize within {timeout:.0f} s:\n{_tail(r.log)}"
                     for r in pending.values()]
        if problems:
            raise RankFailure(f"could not start {self.world_size} ranks (logs in {self.log_dir}):\n"
                              + "\n".join(problems))

    @staticmethod
    def _receive(r: _Rank) -> Tuple[str, Any]:
        try:
            return r.conn.recv()
        except (EOFError, OSError):
            code = r.proc.wait()
            return "died", f"rank {r.rank} exited with code {code}; end of its log:\n{_tail(r.log)}"

    # ------------------------------------------------------------------ run
    def run(self, fn: Callable, *args: Any, timeout: Optional[float] = None, **kwargs: Any) -> List[Any]:
        """Run ``fn(*args, **kwargs)`` on every rank; return the results in rank order.

        Raises:
            RankFailure: a rank raised, died or did not answer within ``timeout`` seconds
                (default ``HPMS_TEST_TIMEOUT`` or 180). The pool is stopped afterwards.
        """
        module, qualname = _reference(fn)
        if not self.alive:
            self.stop()
            self.start()
        timeout = DEFAULT_TIMEOUT if timeout is None else float(timeout)
        task = ([os.path.abspath(p) for p in sys.path], module, qualname, args, kwargs)
        for r in self._ranks:
            r.conn.send(task)
        results: Dict[int, Any] = {}
        failures: Dict[int, str] = {}
        pending = {r.conn: r for r in self._ranks}
        deadline = time.monotonic() + timeout
        while pending:
            limit = deadline if not failures else min(deadline, time.monotonic() + FAILURE_GRACE)
            ready = wait(list(pending), timeout=max(0.0, limit - time.monotonic()))
            if not ready:
                break
            for conn in ready:
                r = pending.pop(conn)
                status, payload = self._receive(r)
                if status == "ok":
                    results[r.rank] = payload
                else:
                    failures[r.rank] = f"rank {r.rank} {'raised' if status == 'error' else 'died'}:\n{payload}"
        if pending:
            why = (f"no reply within {timeout:.1f} s" if not failures else
                   f"did not finish; stopped waiting {FAILURE_GRACE:.0f} s after rank {min(failures)} failed")
            for r in sorted(pending.values(), key=lambda r: r.rank):
                failures[r.rank] = f"rank {r.rank} hung: {why}; its stack:\n{self._stack_of(r)}"
        if failures:
            self.stop()
            raise RankFailure(f"{len(failures)} of {self.world_size} ranks failed in {module}.{qualname}:\n"
                              + "\n".join(failures[k] for k in sorted(failures)))
        if max(_rss_mb(r.proc.pid) for r in self._ranks) > MAX_RANK_RSS_MB:
            self.stop()                  # the next run starts fresh ranks
        return [results[k] for k in range(self.world_size)]

    @staticmethod
    def _stack_of(r: _Rank) -> str:
        size = os.path.getsize(r.log) if os.path.exists(r.log) else 0
        try:
            os.kill(r.proc.pid, signal.SIGUSR1)
        except ProcessLookupError:
            return f"(rank exited with code {r.proc.poll()})\n{_tail(r.log)}"
        time.sleep(0.5)
        return _tail(r.log, start=size) or "(no stack written)"
