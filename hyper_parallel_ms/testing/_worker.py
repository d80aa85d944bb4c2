"""One rank of a :class:`~hyper_parallel_ms.testing.RankPool`.

Started by the pool as ``python -m hyper_parallel_ms.testing._worker`` with the cluster
environment msrun would set (``MS_ROLE=MS_WORKER``, ``MS_NODE_ID``, ``MS_WORKER_NUM``,
``MS_SCHED_HOST``, ``MS_SCHED_PORT``) and ``HPMS_HARNESS_FD``, the file descriptor of its
socket to the pool. It initializes MindSpore communication once, then runs tasks until
told to stop: a task names a function by module and qualified name, runs it, and sends
back ``("ok", result)`` or ``("error", traceback text)``.

Example (what the pool does)::

    HPMS_HARNESS_FD=5 MS_ROLE=MS_WORKER MS_NODE_ID=0 ... python -m hyper_parallel_ms.testing._worker
"""
from __future__ import annotations

import faulthandler
import importlib
import os
import signal
import sys
import time
import traceback
from multiprocessing.connection import Connection
from typing import Any, Callable, Sequence, Tuple

HARNESS_FD_ENV = "HPMS_HARNESS_FD"
LAUNCH_BLOCKING_ENV = "HPMS_LAUNCH_BLOCKING"
DEVICE_ENV = "HPMS_TEST_DEVICE"      # CPU (default) or Ascend


def resolve(module: str, qualname: str) -> Callable:
    """Import ``module`` and follow ``qualname``; unwrap a ``multi_rank`` test to its body."""
    obj: Any = importlib.import_module(module)
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return getattr(obj, "__hpms_rank_fn__", obj)


def _extend_path(paths: Sequence[str]) -> None:
    for p in reversed(list(paths)):
        if p not in sys.path:
            sys.path.insert(0, p)


def _init_mindspore() -> Tuple[int, int, float]:
    start = time.perf_counter()
    import mindspore as ms
    from mindspore import communication
    from mindspore.device_context.cpu import op_tuning

    device = os.environ.get(DEVICE_ENV, "CPU")
    if device == "CPU":
        ms.set_device("CPU")
        op_tuning.threads_num(1)
    else:
        ms.set_device(device, int(os.environ.get("MS_NODE_ID", "0")))
    if os.environ.get(LAUNCH_BLOCKING_ENV, "1") == "1":
        ms.runtime.launch_blocking()
    communication.init()
    return communication.get_rank(), communication.get_group_size(), time.perf_counter() - start


def _reset_between_tasks() -> None:
    import mindspore as ms
    if ms.get_context("mode") != ms.PYNATIVE_MODE:
        ms.set_context(mode=ms.PYNATIVE_MODE)


def _serve(conn: Connection) -> None:
    try:
        rank, size, seconds = _init_mindspore()
    except BaseException:  # report, then exit: the pool cannot use this rank
        conn.send(("error", traceback.format_exc()))
        return
    conn.send(("ready", (rank, size, seconds)))
    while True:
        try:
            task = conn.recv()
        except EOFError:
            return
        if task is None:
            return
        paths, module, qualname, args, kwargs = task
        try:
            _extend_path(paths)
            result = resolve(module, qualname)(*args, **kwargs)
            reply = ("ok", result)
        except BaseException:  # any failure of the test body is the test's result
            reply = ("error", traceback.format_exc())
        try:
            conn.send(reply)
        except Exception:  # the result could not be pickled: say so instead
            conn.send(("error", f"rank result {reply[1]!r} could not be sent back:\n{traceback.format_exc()}"))
        _reset_between_tasks()


def main() -> None:
    """Worker entry point."""
    faulthandler.register(signal.SIGUSR1, all_threads=False)
    conn = Connection(int(os.environ[HARNESS_FD_ENV]))
    try:
        _serve(conn)
    finally:
        conn.close()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)  # skip MindSpore's slow teardown; the pool stops the scheduler itself


if __name__ == "__main__":
    main()
