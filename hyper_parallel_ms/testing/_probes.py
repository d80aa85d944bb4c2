"""Small functions to run on every rank of a pool (harness checks and benchmarks).

Example::

    RankPool(2).run(rank_of_this_process)      # -> [0, 1]
"""
from __future__ import annotations

__all__ = ["rank_of_this_process", "all_reduce_once", "status_kb", "reset_peak_rss"]


def rank_of_this_process() -> int:
    """This rank's global rank."""
    from mindspore import communication
    return communication.get_rank()


def all_reduce_once() -> float:
    """Sum of all ranks' global ranks, by one all-reduce of a 4-element float32 tensor."""
    import numpy as np
    from mindspore import Tensor, communication, ops
    x = Tensor(np.full((4,), float(communication.get_rank()), np.float32))
    return float(ops.AllReduce()(x).asnumpy()[0])


def status_kb(field: str) -> int:
    """A memory field of ``/proc/self/status`` in KiB (``VmRSS``, ``VmHWM`` = peak RSS; Linux)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise KeyError(f"{field} is not in /proc/self/status")


def reset_peak_rss() -> int:
    """Make the peak RSS (``VmHWM``) start again from the current RSS; returns that RSS in KiB."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return status_kb("VmRSS")
