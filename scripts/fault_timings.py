"""Fault timings: how long a 2-rank CPU job takes to stop after one rank fails.

Three faults on rank 1, after a few all-reduces on a DeviceMesh: it raises (``raise``), it is
killed with SIGKILL (``kill``), or it hangs in ``time.sleep`` while rank 0 enters the next
all-reduce (``hang``); and three in a 2-stage pipeline step, while rank 0 waits in ``recv``:
rank 1's stage raises (``stage-raise``), rank 1 is killed (``stage-kill``) or its stage hangs
(``stage-hang``); the table is followed by what each rank ended with (its error, or the message
of the communication watchdog, ``HPMS_COMM_TIMEOUT``). Each fault runs twice: under ``msrun`` (seconds from the fault to
msrun's exit, to every worker having exited and to every process msrun started having
exited, and msrun's exit code) and under the test harness
(``hyper_parallel_ms.testing.run_on_ranks`` with a short timeout: seconds until it raises
``RankFailure`` and until every worker has exited). Prints one table; asserts nothing on time.
The environment is passed on to msrun, so MindSpore's timeouts can be compared: with
``MS_NODE_TIMEOUT=5`` (seconds) the scheduler gives up on a dead rank, and a rank waiting in a
CPU collective gives up on its peer, after about 5 s instead of about 30 s; the same limit then
fails a healthy job whose ranks reach a collective more than 5 s apart (scenario ``late``).
``--overhead`` instead times a point-to-point round trip on 2 ranks under the harness, with the
watchdog on and off (``HPMS_COMM_TIMEOUT=0``).

Example::

    PYTHONPATH=$PWD .venv/bin/python scripts/fault_timings.py --cap 180 --harness-timeout 20
    PYTHONPATH=$PWD .venv/bin/python scripts/fault_timings.py --scenarios stage-raise,stage-kill --harness-grace 90
    MS_NODE_TIMEOUT=5 PYTHONPATH=$PWD .venv/bin/python scripts/fault_timings.py --launchers msrun
    PYTHONPATH=$PWD .venv/bin/python scripts/fault_timings.py --overhead
"""
from __future__ import annotations

import argparse
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from typing import Dict, List, Optional, Set

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCENARIOS = ("raise", "kill", "hang")
STAGE_SCENARIOS = ("stage-raise", "stage-kill", "stage-hang")      # a pipeline stage fails mid-step
LATE_SECONDS = 10.0  # scenario "late" (no fault): rank 1 reaches the all-reduce this much later
POLL = 0.2  # seconds between process checks


# ---------------------------------------------------------------- on the ranks
def _write(out_dir: str, name: str, value: object) -> None:
    with open(os.path.join(out_dir, name), "w") as f:
        f.write(str(value))


def inject_fault(scenario: str, out_dir: str) -> float:
    """Three all-reduces on a (2,) mesh, then rank 1 faults and rank 0 enters a fourth one.

    ``late`` is not a fault: rank 1 joins the fourth all-reduce ``LATE_SECONDS`` late, to show
    whether a timeout setting fails a slow but healthy job."""
    import numpy as np
    import mindspore as ms
    from mindspore import communication
    from hyper_parallel_ms.comm import all_reduce
    from hyper_parallel_ms.mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("world",))
    rank = communication.get_rank()
    _write(out_dir, f"pid.{rank}", os.getpid())
    x = ms.Tensor(np.ones(8, np.float32))
    for _ in range(3):
        x = all_reduce(x, mesh, "world")
    x.asnumpy()
    if rank == 1:
        _write(out_dir, "fault", repr(time.time()))
        if scenario == "raise":
            raise RuntimeError("fault injected on rank 1")
        if scenario == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        if scenario == "late":
            time.sleep(LATE_SECONDS)
            return float(all_reduce(x, mesh, "world").asnumpy()[0])
        while True:
            time.sleep(3600)
    return float(all_reduce(x, mesh, "world").asnumpy()[0])


def inject_stage_fault(scenario: str, out_dir: str) -> float:
    """A 2-stage 1F1B pipeline (4 micro-batches): one good step, then rank 1's stage raises
    (``stage-raise``), is killed with SIGKILL (``stage-kill``) or hangs (``stage-hang``) in its
    second forward of the next step, while rank 0 waits in ``recv`` for a gradient. Each rank
    writes the first line of the error it ends with, and when (``error.<rank>``)."""
    import numpy as np
    import mindspore as ms
    from mindspore import communication, nn, ops
    from hyper_parallel_ms.mesh import init_device_mesh
    from hyper_parallel_ms.pipelining import PipelineStage, Schedule1F1B

    class Stage(nn.Cell):
        def __init__(self) -> None:
            super().__init__()
            self.dense = nn.Dense(8, 8)
            self.forwards, self.fault_at = 0, None

        def construct(self, x):
            self.forwards += 1
            if self.forwards == self.fault_at:
                _write(out_dir, "fault", repr(time.time()))
                if scenario == "stage-kill":
                    os.kill(os.getpid(), signal.SIGKILL)
                while scenario == "stage-hang":
                    time.sleep(3600)
                raise RuntimeError("fault injected in rank 1's stage forward")
            return ops.tanh(self.dense(x))

    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("pp",))
    rank = communication.get_rank()
    _write(out_dir, f"pid.{rank}", os.getpid())
    cell = Stage()
    cell.update_parameters_name(f"stage{rank}.")      # the stages' parameters have distinct names
    schedule = Schedule1F1B(PipelineStage(cell, rank, 2, mesh=mesh), 4, lambda out, y: ((out - y) ** 2).mean())
    x = ms.Tensor(np.ones((8, 8), np.float32))
    try:
        for step in range(2):
            if rank == 1 and step == 1:
                cell.fault_at = cell.forwards + 2
            schedule.step(*((x,) if rank == 0 else ()), target=x if rank == 1 else None)
    except BaseException as exc:
        _write(out_dir, f"error.{rank}", f"{time.time()!r} {type(exc).__name__}: {str(exc).splitlines()[0][:300]}")
        raise
    return 0.0


def _rank_main(scenario: str, out_dir: str) -> None:
    import mindspore as ms
    from mindspore import communication
    ms.set_device("CPU")
    communication.init()
    (inject_stage_fault if scenario.startswith("stage-") else inject_fault)(scenario, out_dir)


# ---------------------------------------------------------------- processes
def _alive(pid: int) -> bool:
    """True while ``pid`` runs (a zombie counts as exited)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def _descendants(root: int) -> Set[int]:
    children: Dict[int, List[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry))
    found, todo = set(), [root]
    while todo:
        for child in children.get(todo.pop(), []):
            if child not in found:
                found.add(child)
                todo.append(child)
    return found


def _read_float(path: str) -> Optional[float]:
    try:
        with open(path) as f:
            return float(f.read())
    except (OSError, ValueError):
        return None


def _worker_pids(out_dir: str) -> Set[int]:
    pids = set()
    for rank in range(2):
        value = _read_float(os.path.join(out_dir, f"pid.{rank}"))
        if value is not None:
            pids.add(int(value))
    return pids


def _note_exits(out_dir: str, exits: Dict[int, float], now: float) -> None:
    """Record in ``exits`` when each worker (by rank) was first seen gone."""
    for rank in range(2):
        pid = _read_float(os.path.join(out_dir, f"pid.{rank}"))
        if pid is not None and rank not in exits and not _alive(int(pid)):
            exits[rank] = now


def _watchdog_messages(out_dir: str) -> Dict[int, str]:
    """The communication watchdog's message of each rank, found in the logs under ``out_dir``."""
    found: Dict[int, str] = {}
    for folder, _, files in os.walk(out_dir):
        for name in files:
            try:
                with open(os.path.join(folder, name), errors="replace") as f:
                    text = f.read()
            except OSError:
                continue
            for match in re.finditer(r"\[hyper_parallel_ms watchdog\] rank (\d+): (.*?)(; ending this rank|$)", text,
                                     re.M):
                found.setdefault(int(match.group(1)), match.group(2))
    return found


def _rank_errors(out_dir: str, exits: Dict[int, float]) -> str:
    """What each rank ended with, seconds after the fault: its error (``error.<rank>``) or its
    watchdog's message (timed by the rank's exit)."""
    fault, found = _read_float(os.path.join(out_dir, "fault")), []
    watchdog = _watchdog_messages(out_dir)
    for rank in range(2):
        try:
            with open(os.path.join(out_dir, f"error.{rank}")) as f:
                when, message = f.read().split(" ", 1)
            found.append(f"rank {rank} at {_seconds(float(when), fault).strip()} s: {message}")
        except (OSError, ValueError):
            if rank in watchdog:
                found.append(f"rank {rank} exits at {_seconds(exits.get(rank), fault).strip()} s: watchdog: "
                             f"{watchdog[rank]}")
    return "; ".join(found) or "-"


def _seconds(end: Optional[float], start: Optional[float]) -> str:
    return "n/a" if end is None or start is None else f"{end - start:6.1f}"


# ---------------------------------------------------------------- under msrun
def time_msrun(scenario: str, port: int, cap: float, work: str) -> Dict[str, str]:
    """Launch the fault under msrun; follow msrun, its workers and every process it started."""
    out_dir = os.path.join(work, f"msrun_{scenario}")
    log_dir = os.path.join(out_dir, "logs")
    os.makedirs(log_dir)
    msrun = os.path.join(os.path.dirname(sys.executable), "msrun")
    msrun = msrun if os.path.exists(msrun) else shutil.which("msrun")
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
               PATH=os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", ""),
               GLOG_v=os.environ.get("GLOG_v", "3"), OMP_NUM_THREADS="1")
    cmd = [msrun, "--worker_num=2", "--local_worker_num=2", f"--master_port={port}", f"--log_dir={log_dir}",
           "--join=True", os.path.abspath(__file__), "--rank-job", scenario, "--out", out_dir]
    with open(os.path.join(out_dir, "msrun.log"), "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    started: Set[int] = set()
    exits: Dict[int, float] = {}
    msrun_end = workers_end = all_end = None
    deadline = time.time() + cap
    while time.time() < deadline:
        now = time.time()
        _note_exits(out_dir, exits, now)
        if proc.poll() is None:
            started |= _descendants(proc.pid)
        elif msrun_end is None:
            msrun_end = now
        workers = _worker_pids(out_dir)
        if workers_end is None and len(workers) == 2 and not any(_alive(p) for p in workers):
            workers_end = now
        if msrun_end is not None and not any(_alive(p) for p in started | workers):
            all_end = now
            break
        time.sleep(POLL)
    for pid in sorted(started | _worker_pids(out_dir)):  # past the cap: stop what this run started
        if _alive(pid):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    if proc.poll() is None:
        proc.kill()
    rc = proc.wait()
    fault = _read_float(os.path.join(out_dir, "fault"))
    over = f">{cap:.0f}s cap"
    return {"fault": scenario, "launcher": "msrun",
            "to launcher exit": _seconds(msrun_end, fault) if msrun_end else over,
            "to workers exited": _seconds(workers_end, fault) if workers_end else over,
            "to all exited": _seconds(all_end, fault) if all_end else over,
            "exit": f"rc={rc}" + (" (killed at cap)" if msrun_end is None else ""),
            "errors": _rank_errors(out_dir, exits), "logs": log_dir}


# ---------------------------------------------------------------- under the test harness
def time_harness(scenario: str, timeout: float, work: str) -> Dict[str, str]:
    """Run the fault with run_on_ranks; time RankFailure and the workers' exit."""
    from hyper_parallel_ms.testing import RankFailure, get_pool, run_on_ranks
    out_dir = os.path.join(work, f"harness_{scenario}")
    os.makedirs(out_dir)
    get_pool(2)  # started before the clock matters: the fault time is written by rank 1
    raised, outcome = None, "returned (no failure)"
    exits: Dict[int, float] = {}
    running = threading.Event()
    running.set()

    def follow() -> None:  # the workers' exits while run_on_ranks waits
        while running.is_set():
            _note_exits(out_dir, exits, time.time())
            time.sleep(POLL)
    threading.Thread(target=follow, daemon=True).start()
    try:
        job = inject_stage_fault if scenario.startswith("stage-") else inject_fault
        run_on_ranks(job, 2, scenario, out_dir, timeout=timeout)
    except RankFailure as exc:
        raised = time.time()
        _write(out_dir, "failure.txt", exc)
        outcome = "RankFailure: " + ", ".join(line.split(":")[0] for line in str(exc).splitlines()
                                              if line.startswith("rank ") and line.split(":")[0].split()[-1]
                                              in ("raised", "died", "hung"))
    running.clear()
    workers = _worker_pids(out_dir)
    workers_exited = all_exited = None
    end = time.time() + 60
    while time.time() < end and all_exited is None:  # the pool's scheduler and ranks are children of this process
        now = time.time()
        _note_exits(out_dir, exits, now)
        if workers_exited is None and not any(_alive(p) for p in workers):
            workers_exited = now
        if not any(_alive(p) for p in _descendants(os.getpid())):
            all_exited = now
        time.sleep(POLL)
    fault = _read_float(os.path.join(out_dir, "fault"))
    return {"fault": scenario, "launcher": f"run_on_ranks(timeout={timeout:.0f})",
            "to launcher exit": _seconds(raised, fault), "to workers exited": _seconds(workers_exited, fault),
            "to all exited": _seconds(all_exited, fault), "exit": outcome, "errors": _rank_errors(out_dir, exits),
            "logs": out_dir}


# ---------------------------------------------------------------- the watchdog's cost
def p2p_round_trips(count: int, blocks: int) -> Dict[str, List[float]]:
    """Seconds per point-to-point call (a send or a recv of 8 floats) over ``count`` round trips
    between 2 ranks, in ``blocks`` blocks counted by the watchdog alternating with as many not
    counted (the same processes: the machine's load changes less between them than between runs);
    and the seconds one round of the watchdog thread takes."""
    import numpy as np
    import mindspore as ms
    from hyper_parallel_ms import comm
    from hyper_parallel_ms.comm import _watchdog
    from hyper_parallel_ms.mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("pp",))
    me = mesh.get_local_rank()
    x = ms.Tensor(np.ones(8, np.float32))
    times: Dict[str, List[float]] = {"on": [], "off": []}
    dog = None
    for block in range(2 * blocks + 2):
        state = "on" if block % 2 == 0 else "off"
        if dog is not None:
            _watchdog._dogs[0] = dog if state == "on" else None      # pylint: disable=protected-access
        start = time.perf_counter()
        for _ in range(count):
            if me == 0:
                comm.send(x, mesh, "pp", dst=1)
                comm.recv(x, mesh, "pp", src=1)
            else:
                comm.recv(x, mesh, "pp", src=0)
                comm.send(x, mesh, "pp", dst=0)
        dog = dog or _watchdog._dogs[0]                              # pylint: disable=protected-access
        if block >= 2:                      # the first two are a warm-up
            times[state].append((time.perf_counter() - start) / (2 * count))
    _watchdog._dogs[0] = dog                                          # pylint: disable=protected-access
    start = time.perf_counter()
    for _ in range(100):
        dog._publish(time.time())                                     # pylint: disable=protected-access
        dog.check(time.time())
    times["round"] = [(time.perf_counter() - start) / 100]
    return times


def time_overhead(count: int, blocks: int = 30) -> None:
    """Print the time per p2p call with the watchdog counting and not (on one fresh pair of ranks):
    the median and fastest block of each, and the median difference of neighbouring blocks."""
    from hyper_parallel_ms.testing import RankPool
    with RankPool(2) as pool:
        times = pool.run(p2p_round_trips, count, blocks)[0]
    for state in ("off", "on"):
        runs = sorted(t * 1e6 for t in times[state])
        print(f"watchdog {state}: {runs[len(runs) // 2]:.1f} us per p2p call on rank 0 (median of {len(runs)} blocks "
              f"of {count} round trips, alternating; fastest {runs[0]:.1f} us)")
    diffs = sorted((on - off) * 1e6 for on, off in zip(times["on"], times["off"]))
    print(f"on - off, block by block: median {diffs[len(diffs) // 2]:+.1f} us per call "
          f"(quartiles {diffs[len(diffs) // 4]:+.1f}, {diffs[3 * len(diffs) // 4]:+.1f})")
    print(f"one round of the watchdog thread (every {0.25} s): {times['round'][0] * 1e6:.0f} us", flush=True)


def _print_table(rows: List[Dict[str, str]]) -> None:
    columns = ["fault", "launcher", "to launcher exit", "to workers exited", "to all exited", "exit"]
    widths = {c: max(len(c), *(len(r[c]) for r in rows)) for c in columns}
    print("seconds from the fault on rank 1 (wall clock; 'launcher exit' = msrun returns / run_on_ranks raises)")
    print("  ".join(c.ljust(widths[c]) for c in columns))
    for row in rows:
        print("  ".join(row[c].ljust(widths[c]) for c in columns))
    for row in rows:
        if row["errors"] != "-":
            print(f"{row['fault']} under {row['launcher']}: {row['errors']}")
    print("logs: " + ", ".join(r["logs"] for r in rows))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scenarios", default=",".join(SCENARIOS),
                        help=f"any of {', '.join(SCENARIOS)}, late (rank 1 {LATE_SECONDS:.0f} s late, no fault)")
    parser.add_argument("--launchers", default="msrun,harness")
    parser.add_argument("--port", type=int, default=8170, help="first msrun master port (one per scenario)")
    parser.add_argument("--cap", type=float, default=180.0, help="seconds after which an msrun run is killed")
    parser.add_argument("--harness-grace", type=float, default=None,
                        help="seconds the harness waits for the other ranks once one failed (default: its own, 3); "
                             "a long grace shows what the surviving ranks do by themselves")
    parser.add_argument("--harness-timeout", type=float,
                        default=float(os.environ.get("HPMS_TEST_TIMEOUT", "20")))
    parser.add_argument("--overhead", type=int, nargs="?", const=500, default=None, metavar="ROUND_TRIPS",
                        help="time p2p calls with the watchdog on and off instead (default 500 round trips)")
    parser.add_argument("--rank-job", choices=SCENARIOS + STAGE_SCENARIOS + ("late",), help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rank_job:
        _rank_main(args.rank_job, args.out)
        return 0
    if args.overhead is not None:
        time_overhead(args.overhead)
        return 0
    if args.harness_grace is not None:
        from hyper_parallel_ms.testing import _pool
        _pool.FAILURE_GRACE = args.harness_grace
    work = tempfile.mkdtemp(prefix="hpms_fault_timings_")
    rows = []
    launchers = args.launchers.split(",")
    for i, scenario in enumerate(args.scenarios.split(",")):
        if "msrun" in launchers:
            rows.append(time_msrun(scenario, args.port + i, args.cap, work))
            print(rows[-1], flush=True)
    for scenario in args.scenarios.split(","):
        if "harness" in launchers:
            rows.append(time_harness(scenario, args.harness_timeout, work))
            print(rows[-1], flush=True)
    _print_table(rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
