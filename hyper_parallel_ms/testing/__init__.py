"""Multi-rank testing on one machine: run a function on N MindSpore CPU ranks from pytest.

``run_on_ranks(fn, world_size)`` runs a module-level function on every rank of a pool that
stays alive between calls of the same world size, and returns each rank's result;
``multi_rank(world_size)`` turns a function into a pytest test that does so. A failing,
crashing or hanging rank fails the test with its rank number and traceback, and the pool
is restarted before the next test.

Example (in a test module)::

    from hyper_parallel_ms.testing import multi_rank

    @multi_rank(4)
    def test_world():
        from mindspore import communication
        assert communication.get_group_size() == 4
"""
from __future__ import annotations

import atexit
import functools
from typing import Any, Callable, Dict, List, Optional

from ._pool import RankFailure, RankPool
from ._twins import TWINS, cpu_twins
from .graph_counts import compiled_collectives, compiled_primitives

__all__ = ["RankPool", "RankFailure", "get_pool", "run_on_ranks", "multi_rank", "shutdown_pools",
           "compiled_collectives", "compiled_primitives", "cpu_twins", "TWINS"]

_POOLS: Dict[int, RankPool] = {}


def get_pool(world_size: int) -> RankPool:
    """The shared, started pool of ``world_size`` ranks (restarted if it failed).

    Args:
        world_size: the number of ranks (one process each).

    Example::

        pool = get_pool(2)
        pool.run(my_module.rank_of_me)         # [0, 1]
    """
    pool = _POOLS.get(world_size)
    if pool is None:
        pool = _POOLS[world_size] = RankPool(world_size)
        if len(_POOLS) == 1:
            atexit.register(shutdown_pools)
    if not pool.alive:
        pool.stop()
        pool.start()
    return pool


def run_on_ranks(fn: Callable, world_size: int, *args: Any, timeout: Optional[float] = None,
                 **kwargs: Any) -> List[Any]:
    """Run ``fn(*args, **kwargs)`` on ``world_size`` ranks; return results in rank order.

    Args:
        fn: a module-level function (each rank imports it by module and name).
        world_size: the number of ranks.
        args: positional arguments for ``fn`` (picklable).
        timeout: seconds each rank may take (default: ``HPMS_TEST_TIMEOUT``, 180).
        kwargs: keyword arguments for ``fn`` (picklable).

    Example::

        assert run_on_ranks(my_module.rank_of_me, 2) == [0, 1]
    """
    return get_pool(world_size).run(fn, *args, timeout=timeout, **kwargs)


def multi_rank(world_size: int, *, timeout: Optional[float] = None) -> Callable[[Callable], Callable]:
    """Decorate a module-level test so that pytest runs its body on ``world_size`` ranks.

    The test's arguments (from ``pytest.mark.parametrize``) are passed to every rank.

    Args:
        world_size: the number of ranks.
        timeout: seconds each rank may take (default: ``HPMS_TEST_TIMEOUT``, 180).

    Example::

        @pytest.mark.parametrize("n", [1, 2])
        @multi_rank(2)
        def test_something(n): ...
    """
    def decorate(fn: Callable) -> Callable:
        @functools.wraps(fn)
        def test(*args: Any, **kwargs: Any) -> None:
            run_on_ranks(test, world_size, *args, timeout=timeout, **kwargs)

        test.__hpms_rank_fn__ = fn
        return test
    return decorate


def shutdown_pools() -> None:
    """Stop every shared pool.

    Example::

        shutdown_pools()         # registered with atexit; call it to free the processes earlier
    """
    for pool in _POOLS.values():
        pool.stop()
    _POOLS.clear()


