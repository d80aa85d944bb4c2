"""Per-op dispatch overhead of DTensor ops, measured in one process (a one-rank mesh, so no
communication): DTensor op time vs plain op time for small tensors, and the absolute
microseconds the library adds beyond MindSpore's own fallback floor (entering and leaving
``NoFallbackGuard`` around one plain op).

Times are per call including execution; plain and DTensor calls are timed back to back in
each round and medians over the rounds are printed.

Usage: .venv/bin/python scripts/bench_dispatch.py [--size 8] [--iters 500] [--rounds 9]
"""
from __future__ import annotations

import argparse
import statistics
import time

import mindspore as ms
import numpy as np
from mindspore import Tensor, ops

from hyper_parallel_ms import Replicate, Shard, distribute_tensor, init_device_mesh
from hyper_parallel_ms._mindspore import no_hook


def _per_call(fn, iters: int) -> float:
    """Microseconds per call, including execution (the last result is read)."""
    began = time.perf_counter()
    for _ in range(iters):
        out = fn()
    Tensor.asnumpy(out)
    return (time.perf_counter() - began) / iters * 1e6


def _paired(plain, dist, iters: int, rounds: int):
    """Median plain time, median DTensor time and median per-round difference: the two are
    measured back to back in each round, so a slow moment of the machine hits both."""
    for fn in (plain, dist):
        _per_call(fn, 50)
    pairs = [(_per_call(plain, iters), _per_call(dist, iters)) for _ in range(rounds)]
    return (statistics.median(p for p, _ in pairs), statistics.median(d for _, d in pairs),
            statistics.median(d - p for p, d in pairs), min(d for _, d in pairs) - min(p for p, _ in pairs))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", type=int, default=8)
    parser.add_argument("--iters", type=int, default=500)
    parser.add_argument("--rounds", type=int, default=9)
    args = parser.parse_args()
    ms.set_device("CPU")
    mesh = init_device_mesh("cpu", (1,), mesh_dim_names=("tp",))
    a_np = np.random.default_rng(0).standard_normal((args.size, args.size)).astype(np.float32)
    a, b = ms.Tensor(a_np), ms.Tensor(a_np + 1)
    da, db = distribute_tensor(a, mesh, [Shard(0)]), distribute_tensor(b, mesh, [Replicate()])
    da2 = distribute_tensor(b, mesh, [Shard(0)])
    cases = [
        ("add", lambda: a + b, lambda: da + da2),
        ("mul scalar", lambda: a * 2.0, lambda: da * 2.0),
        ("relu", lambda: ops.relu(a), lambda: ops.relu(da)),
        ("matmul", lambda: ops.matmul(a, b), lambda: ops.matmul(da, db)),
        ("sum", lambda: a.sum(), lambda: da.sum()),
    ]

    def guarded_add():
        with no_hook():
            return a + b
    floor = _paired(lambda: a + b, guarded_add, args.iters, args.rounds)[3]
    print(f"tensor {args.size}x{args.size} float32, {args.rounds} rounds of {args.iters} calls; medians, and the "
          f"difference of the fastest rounds; MindSpore's guard floor (fastest rounds) {floor:.1f} us")
    print(f"{'op':<12}{'plain us':>10}{'DTensor us':>12}{'ratio':>8}{'added us':>10}{'added (min)':>13}"
          f"{'min - floor':>13}")
    for name, plain, dist in cases:
        t_plain, t_dist, added, added_min = _paired(plain, dist, args.iters, args.rounds)
        print(f"{name:<12}{t_plain:>10.1f}{t_dist:>12.1f}{t_dist / t_plain:>8.2f}{added:>10.1f}{added_min:>13.1f}"
              f"{added_min - floor:>13.1f}")
    print(f"the dispatcher's own Python work per call (cached decision, an op that returns at once, no MindSpore "
          f"fallback): {_dispatcher_only(da, args.iters * 10):.2f} us")


def _dispatcher_only(dt, iters: int) -> float:
    """Microseconds of ``dispatch`` itself: a relu rule, an op that returns a ready result."""
    from hyper_parallel_ms.ops import dispatch

    class _Ready:
        name = "ReLU"

        def __call__(self, x):
            return self.result

    ready = _Ready()
    ready.result = dt.to_local()
    dispatch(ready, (dt,), {})
    times = []
    for _ in range(5):
        began = time.perf_counter()
        for _ in range(iters):
            ready.result.__class__ = Tensor       # a fresh (plain) result each call, as an op returns
            dispatch(ready, (dt,), {})
        times.append((time.perf_counter() - began) / iters * 1e6)
    return min(times)


if __name__ == "__main__":
    main()
