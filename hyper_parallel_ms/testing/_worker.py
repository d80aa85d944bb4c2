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
import importlib.util
import os
import signal
import sys
import time
import traceback
from multiprocessing.connection import Connection
from types import ModuleType
from typing import Any, Callable, Sequence, Tuple

HARNESS_FD_ENV = "HPMS_HARNESS_FD"
LAUNCH_BLOCKING_ENV = "HPMS_LAUNCH_BLOCKING"
DEVICE_ENV = "HPMS_TEST_DEVICE"      # CPU (default) or Ascend


SCRIPT_PREFIX = "script:"           # a module reference that is a script's path
SCRIPT_MODULE = "__hpms_script__"   # the name ranks import such a script under


def script_reference(main: ModuleType, fn: Callable) -> str:
    """How the ranks import the ``__main__`` module holding ``fn``: its module name when it
    was run with ``python -m``, else ``script:<absolute path>``.

    >>> import types
    >>> script = types.ModuleType("__main__"); script.__file__ = "/tmp/train.py"; script.__spec__ = None
    >>> script_reference(script, print)
    'script:/tmp/train.py'
    """
    spec = getattr(main, "__spec__", None)
    if spec is not None and spec.name and spec.name != "__main__":
        return spec.name
    path = getattr(main, "__file__", None)
    if not path:
        raise TypeError(f"{fn!r} was defined interactively (its __main__ has no file): ranks cannot import "
                        "it; put the function in a script or module")
    return SCRIPT_PREFIX + os.path.abspath(path)


def _import_script(path: str) -> ModuleType:
    """Import the script at ``path`` as module ``__hpms_script__`` (once per path): its
    ``if __name__ == "__main__"`` block does not run."""
    loaded = sys.modules.get(SCRIPT_MODULE)
    if loaded is not None and getattr(loaded, "__file__", None) == path:
        return loaded
    spec = importlib.util.spec_from_file_location(SCRIPT_MODULE, path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot import the script {path} on this rank")
    module = importlib.util.module_from_spec(spec)
    sys.modules[SCRIPT_MODULE] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[SCRIPT_MODULE]
        raise
    return module


def resolve(module: str, qualname: str) -> Callable:
    """Import ``module`` (or the script ``script:<path>``) and follow ``qualname``; unwrap a
    ``multi_rank`` test to its body."""
    obj: Any = _import_script(module[len(SCRIPT_PREFIX):]) if module.startswith(SCRIPT_PREFIX) \
        else importlib.import_module(module)
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


def _save_coverage() -> None:
    """Write this rank's line coverage so far when coverage.py measures it (the pool kills ranks,
    so data left for exit would be lost)."""
    coverage = sys.modules.get("coverage")
    current = coverage.Coverage.current() if coverage is not None else None
    if current is not None:
        current.save()


def _reset_between_tasks() -> None:
    _save_coverage()
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
