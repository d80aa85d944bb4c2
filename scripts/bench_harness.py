"""Cost of the multi-rank test harness: starting a pool of N CPU ranks, and one call.

Prints, for world sizes 1, 2, 4 and 8: the time to start the scheduler and N ranks
(MindSpore import, communication init), the median time of a call that runs a trivial
function on every rank, and of a call running one all-reduce on every rank.

Usage: .venv/bin/python scripts/bench_harness.py [--sizes 1,2,4,8] [--calls 20]
"""
from __future__ import annotations

import argparse
import statistics
import time

from hyper_parallel_ms.testing import RankPool
from hyper_parallel_ms.testing._probes import all_reduce_once, rank_of_this_process


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="1,2,4,8")
    parser.add_argument("--calls", type=int, default=20)
    args = parser.parse_args()
    print(f"{'ranks':>5}  {'start (s)':>9}  {'trivial call (ms)':>17}  {'all-reduce call (ms)':>20}")
    for n in (int(s) for s in args.sizes.split(",")):
        with RankPool(n) as pool:
            timings = {}
            for fn in (rank_of_this_process, all_reduce_once):
                pool.run(fn)  # warm up
                samples = []
                for _ in range(args.calls):
                    began = time.perf_counter()
                    pool.run(fn)
                    samples.append(time.perf_counter() - began)
                timings[fn.__name__] = statistics.median(samples) * 1e3
            print(f"{n:>5}  {pool.start_seconds:>9.1f}  {timings['rank_of_this_process']:>17.1f}  "
                  f"{timings['all_reduce_once']:>20.1f}")


if __name__ == "__main__":
    main()
