"""Benchmark c: time per redistribution on 4 CPU ranks for float32 tensors of 1 MB (512 x 512)
and 16 MB (2048 x 2048), with the textbook bytes of each plan and the bandwidth they imply.
(``bench_redistribute_bytes.py`` compares the bytes with the textbook minimum for the whole
transition matrix.)

Transitions: every pair of R, P(sum), S(0), S(1) on mesh (4,), and on mesh (2, 2) every pair
that changes one mesh dim plus a sample changing both. Median of ``--repeats`` runs, rank 0.

Usage: .venv/bin/python scripts/bench_redistribute_time.py [--repeats 5] [--sizes 512,2048]
"""
from __future__ import annotations

import argparse
import itertools
import statistics
import time
from typing import List, Sequence, Tuple

import mindspore as ms
import numpy as np

from hyper_parallel_ms.dtensor import DTensor, distribute_tensor
from hyper_parallel_ms.layout import Layout
from hyper_parallel_ms.mesh import init_device_mesh
from hyper_parallel_ms.placement import Partial, Replicate, Shard
from hyper_parallel_ms.testing import run_on_ranks, shutdown_pools
from hyper_parallel_ms.testing.redistribute_bytes import plan_bytes


def _pairs(mesh_ndim: int) -> List[Tuple[tuple, tuple]]:
    options = [Replicate(), Partial(), Shard(0), Shard(1)]
    lists = list(itertools.product(options, repeat=mesh_ndim))
    pairs = [(a, b) for a in lists for b in lists if a != b]
    if mesh_ndim == 1:
        return pairs
    one = [(a, b) for a, b in pairs if sum(x != y for x, y in zip(a, b)) == 1]
    both = [(a, b) for a, b in pairs if sum(x != y for x, y in zip(a, b)) == 2][::7]
    return one + both


def time_transitions(mesh_shape: Sequence[int], side: int, repeats: int):
    """(src, dst, textbook bytes per rank, median seconds) for each transition, on this rank."""
    mesh = init_device_mesh("cpu", tuple(mesh_shape))
    shape = (side, side)
    full = ms.Tensor(np.random.default_rng(0).standard_normal(shape).astype(np.float32))
    rows = []
    for src, dst in _pairs(len(mesh_shape)):
        if any(p.is_partial() for p in src):
            piece = distribute_tensor(full, mesh, [Replicate() if p.is_partial() else p for p in src],
                                      src_data_rank=None)
            x = DTensor.from_local(piece.to_local(), mesh, src, shape=shape)
        else:
            x = distribute_tensor(full, mesh, src, src_data_rank=None)
        x.redistribute(mesh, dst).to_local().asnumpy()           # plan, compile, warm up
        times = []
        for _ in range(repeats):
            began = time.perf_counter()
            x.redistribute(mesh, dst).to_local().asnumpy()
            times.append(time.perf_counter() - began)
        src_layout = Layout(mesh.shape, src).normalized(2)
        dst_layout = Layout(mesh.shape, dst).normalized(2)
        rows.append((src, dst, plan_bytes(src_layout, dst_layout, shape), statistics.median(times)))
    return rows


def _fmt(placements) -> str:
    return ",".join(str(p) for p in placements)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--sizes", default="512,2048")
    args = parser.parse_args()
    for mesh_shape in ((4,), (2, 2)):
        for side in (int(s) for s in args.sizes.split(",")):
            rows = run_on_ranks(time_transitions, 4, mesh_shape, side, args.repeats, timeout=1800)[0]
            mb = side * side * 4 / 2 ** 20
            moving = [r for r in rows if r[2] > 0]
            print(f"mesh {mesh_shape}, float32 ({side}, {side}) = {mb:.0f} MB: {len(rows)} transitions, "
                  f"{len(moving)} with communication")
            times = [r[3] * 1e3 for r in moving]
            print(f"  ms per transition with communication: median {statistics.median(times):.2f}, min "
                  f"{min(times):.2f}, max {max(times):.2f}; local-only transitions: median "
                  f"{statistics.median([r[3] * 1e3 for r in rows if r[2] == 0] or [0]):.2f} ms")
            if len(mesh_shape) == 1:
                for src, dst, nbytes, seconds in rows:
                    rate = nbytes / seconds / 2 ** 20 if nbytes else 0.0
                    print(f"  {_fmt(src):>5} -> {_fmt(dst):<5} {seconds * 1e3:8.2f} ms  textbook "
                          f"{nbytes / 2 ** 20:6.2f} MB/rank  {rate:8.1f} MB/s")
    shutdown_pools()


if __name__ == "__main__":
    import bench_redistribute_time    # the ranks import the case function by module name
    bench_redistribute_time.main()
