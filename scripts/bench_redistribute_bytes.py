"""Bytes moved by redistribution vs the textbook minimum, for every placement transition.

Starts 4 CPU ranks with the test harness and, on meshes (4,) and (2, 2), redistributes a
float32 (8, 8) tensor between every pair of placement lists (R, P(sum), S(0), S(1) per
mesh dim). Prints, over all pairs with communication: recorded / optimum (the textbook
bytes of the collectives issued over the cheapest textbook sequence), naive / optimum
(gathering to Replicate first), and wire / optimum (what CPU's composed collectives send).

Usage: .venv/bin/python scripts/bench_redistribute_bytes.py
"""
from __future__ import annotations

import statistics
import time

from hyper_parallel_ms.testing import run_on_ranks, shutdown_pools
from hyper_parallel_ms.testing.redistribute_bytes import measure_on


def _summary(name, rows):
    moving = [r for r in rows if r.optimum > 0]
    ratios = {
        "recorded/optimum": [r.recorded / r.optimum for r in moving],
        "naive/optimum": [r.naive / r.optimum for r in moving],
        "cpu wire/optimum": [r.wire / r.optimum for r in moving],
    }
    print(f"{name}: {len(rows)} transitions, {len(moving)} with communication, "
          f"{len(rows) - len(moving)} local only")
    for key, vals in ratios.items():
        print(f"  {key:<18} min {min(vals):6.3f}  mean {statistics.mean(vals):6.3f}  max {max(vals):6.3f}")
    worst = max(moving, key=lambda r: r.naive / r.optimum)
    print(f"  largest saving over the naive route: {worst.src} -> {worst.dst}: "
          f"{worst.naive:.0f} B vs {worst.optimum:.0f} B")


def main() -> None:
    began = time.perf_counter()
    for mesh_shape in [(4,), (2, 2)]:
        per_rank = run_on_ranks(measure_on, 4, "cpu", mesh_shape, (8, 8))
        _summary(f"mesh {mesh_shape}, tensor (8, 8) float32, rank 0", per_rank[0])
    print(f"({time.perf_counter() - began:.1f} s including the 4-rank start)")
    shutdown_pools()


if __name__ == "__main__":
    main()
