"""The multi-rank harness: results per rank, and failures (raise, hang, death) reported with
the rank and its traceback within seconds, never hanging the suite."""
from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from hyper_parallel_ms.testing import RankFailure, RankPool, get_pool, run_on_ranks


def rank_and_size(offset=0):
    from mindspore import communication
    return communication.get_rank() + offset, communication.get_group_size()


def raise_on_rank_2():
    from mindspore import communication
    if communication.get_rank() == 2:
        raise ValueError("bad value on purpose")
    return "fine"


def hang_on_rank_1():
    from mindspore import communication
    if communication.get_rank() == 1:
        time.sleep(600)
    return "fine"


def die_on_rank_0():
    from mindspore import communication
    if communication.get_rank() == 0:
        os._exit(3)
    return "fine"


def unpicklable_result():
    return lambda: None


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_results_in_rank_order(world_size):
    assert run_on_ranks(rank_and_size, world_size, offset=10) == [(10 + r, world_size) for r in range(world_size)]


def test_rank_that_raises_is_reported():
    get_pool(4)
    began = time.perf_counter()
    with pytest.raises(RankFailure) as info:
        run_on_ranks(raise_on_rank_2, 4)
    elapsed = time.perf_counter() - began
    text = str(info.value)
    assert "1 of 4 ranks failed" in text and "rank 2 raised" in text
    assert "ValueError: bad value on purpose" in text and "raise_on_rank_2" in text
    assert elapsed < 10, elapsed
    # the pool was torn down and comes back for the next test
    assert run_on_ranks(rank_and_size, 4) == [(r, 4) for r in range(4)]


def test_rank_that_hangs_is_reported():
    get_pool(4)
    began = time.perf_counter()
    with pytest.raises(RankFailure) as info:
        run_on_ranks(hang_on_rank_1, 4, timeout=3)
    elapsed = time.perf_counter() - began
    text = str(info.value)
    assert "rank 1 hung: no reply within 3.0 s" in text
    assert "in hang_on_rank_1" in text          # the hung rank's Python stack
    assert "rank 0" not in text and "rank 2" not in text
    assert elapsed < 15, elapsed


def test_rank_that_dies_is_reported():
    get_pool(2)
    with pytest.raises(RankFailure, match="rank 0 died"):
        run_on_ranks(die_on_rank_0, 2, timeout=30)


def test_bad_tasks_are_refused_clearly():
    def local_function():
        return 1
    with pytest.raises(TypeError, match="defined at module level"):
        run_on_ranks(local_function, 2)
    with pytest.raises(RankFailure, match="could not be sent back"):
        run_on_ranks(unpicklable_result, 2)
    with pytest.raises(ValueError, match="positive int"):
        RankPool(0)


_SCRIPT = '''
from hyper_parallel_ms.testing import run_on_ranks


def case(offset):
    from mindspore import communication
    return communication.get_rank() + offset, __name__


if __name__ == "__main__":
    print("RESULT", run_on_ranks(case, 1, 10))
'''


def test_run_on_ranks_from_a_script_run_as_main(tmp_path):
    """A user's first script: the ranks import the script by path (not as __main__, so its
    main block does not run again there) and find the function."""
    script = tmp_path / "first_script.py"
    script.write_text(_SCRIPT)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, PYTHONPATH=root)
    done = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "RESULT [(10, '__hpms_script__')]" in done.stdout, done.stdout[-2000:]
