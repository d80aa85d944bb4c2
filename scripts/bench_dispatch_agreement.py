"""Cost of the dispatcher's agreement on a decision's first run (``ops/_agreement.py``).

Where local shapes differ between ranks (uneven or empty pieces), the first run of each op
decision ends with one all-reduce of failure flags over all the mesh's ranks, so that a wrong rule fails
on every rank. Prints, on rank 0, the mean time of: a first run where every rank's pieces are
alike (no agreement), a first run with uneven pieces (with the agreement), the agreement
alone, and a cached run; and the agreement's share of an uneven first run. Meshes (2,) and
(2, 2); ``ops.neg`` on a new (rows, 8) shape per decision. One run, no repetition.

Usage: .venv/bin/python scripts/bench_dispatch_agreement.py [--decisions 40]
"""
from __future__ import annotations

import argparse
import time
from typing import Dict, Tuple

import mindspore as ms
import numpy as np
from mindspore import ops

from hyper_parallel_ms.dtensor import distribute_tensor
from hyper_parallel_ms.mesh import init_device_mesh
from hyper_parallel_ms.ops._agreement import failed_coordinates
from hyper_parallel_ms.placement import Shard
from hyper_parallel_ms.testing import run_on_ranks, shutdown_pools


def _first_runs(mesh, rows, placements) -> float:
    xs = [distribute_tensor(ms.Tensor(np.ones((r, 8), np.float32)), mesh, placements, src_data_rank=None)
          for r in rows]
    start = time.perf_counter()
    for x in xs:
        ops.neg(x).to_local().asnumpy()
    return (time.perf_counter() - start) / len(xs)


def measure(mesh_shape: Tuple[int, ...], decisions: int) -> Dict[str, float]:
    mesh = init_device_mesh("cpu", mesh_shape, mesh_dim_names=tuple(f"d{i}" for i in range(len(mesh_shape))))
    placements = [Shard(0)] * len(mesh_shape)
    parts = mesh.size()
    _first_runs(mesh, [parts * 1000 + 1], placements)                   # warm up kernels and groups
    alike = _first_runs(mesh, [parts * (k + 1) for k in range(decisions)], placements)
    uneven = _first_runs(mesh, [parts * (k + 1) + 1 for k in range(decisions)], placements)
    start = time.perf_counter()
    for _ in range(decisions):
        failed_coordinates(mesh, False)
    agree = (time.perf_counter() - start) / decisions
    cached = _first_runs(mesh, [parts * (k + 1) + 1 for k in range(decisions)], placements)
    return {"alike": alike, "uneven": uneven, "agree": agree, "cached": cached}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--decisions", type=int, default=40)
    args = parser.parse_args()
    try:
        for mesh_shape in ((2,), (2, 2)):
            t = run_on_ranks(measure, int(np.prod(mesh_shape)), mesh_shape, args.decisions)[0]
            print(f"mesh {mesh_shape}: first run, pieces alike {t['alike'] * 1e3:.2f} ms; uneven (with agreement) "
                  f"{t['uneven'] * 1e3:.2f} ms; agreement alone {t['agree'] * 1e3:.2f} ms "
                  f"({t['agree'] / t['uneven']:.2f} of the uneven first run); cached run {t['cached'] * 1e3:.2f} ms")
    finally:
        shutdown_pools()


if __name__ == "__main__":
    main()
