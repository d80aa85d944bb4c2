"""Small functions to run on every rank of a pool (harness checks and benchmarks).

Example::

    RankPool(2).run(rank_of_this_process)      # -> [0, 1]
"""
from __future__ import annotations

__all__ = ["rank_of_this_process", "all_reduce_once"]


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
