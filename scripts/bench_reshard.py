"""Benchmark: what ``reshard_after_forward`` changes in PyNative, on 2 CPU ranks.

A stack of ``--units`` fully_shard units (each one ``--dim`` x ``--dim`` fp32 Dense, a small
batch, so that parameters dominate the memory) runs one forward + backward step per fresh
rank process. Printed per setting (rank 0): the all-gathers and reduce-scatters of the step
(CommDebugMode), and the rise of the peak resident set size during the step (VmHWM reset just
before it; the first step, before MindSpore's allocator holds memory from an earlier one).
One unit's full parameter is ``dim * dim * 4`` bytes; with ``True`` a rank should hold about
one or two at a time, with ``False`` every unit's until the backward.

Usage: .venv/bin/python scripts/bench_reshard.py [--units 8] [--dim 1024]
"""
from __future__ import annotations

import argparse
from typing import Dict

import mindspore as ms
import numpy as np

from hyper_parallel_ms.testing import run_on_ranks, shutdown_pools
from hyper_parallel_ms.testing._probes import reset_peak_rss, status_kb


def measure(units: int, dim: int, reshard) -> Dict[str, float]:
    from mindspore import nn, ops
    from hyper_parallel_ms import fully_shard, init_device_mesh
    from hyper_parallel_ms.comm import CommDebugMode
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("dp",))
    ms.set_seed(0)
    model = nn.SequentialCell([nn.Dense(dim, dim, has_bias=False) for _ in range(units)])
    for block in model:
        fully_shard(block, mesh=mesh, reshard_after_forward=reshard)
    fully_shard(model, mesh=mesh, reshard_after_forward=reshard)
    x = ms.Tensor(np.random.default_rng(0).standard_normal((4, dim)).astype(np.float32))
    step = ms.value_and_grad(lambda v: ops.tanh(model(v)).sum(), None, model.trainable_params())
    base = reset_peak_rss()
    with CommDebugMode() as mode:
        loss, grads = step(x)
        grads[0].asnumpy()
    rise = (status_kb("VmHWM") - base) * 1024
    counts = mode.get_comm_counts()
    return {"rise": rise, "all_gather": counts.get("all_gather", 0), "reduce_scatter": counts.get("reduce_scatter", 0),
            "loss": float(loss.asnumpy())}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--units", type=int, default=8)
    parser.add_argument("--dim", type=int, default=1024)
    args = parser.parse_args()
    mib = 2 ** 20
    print(f"{args.units} units of {args.dim} x {args.dim} fp32: one full parameter {args.dim * args.dim * 4 / mib:.1f} MiB, "
          f"all of them {args.units * args.dim * args.dim * 4 / mib:.1f} MiB, a rank's pieces half of that")
    for reshard in (False, True):
        r = run_on_ranks(measure, 2, args.units, args.dim, reshard, timeout=600)
        shutdown_pools()                       # a fresh process per setting: no memory held from before
        rise = max(x["rise"] for x in r)
        print(f"reshard_after_forward={reshard}: all-gathers {r[0]['all_gather']}, reduce-scatters "
              f"{r[0]['reduce_scatter']} per step ({args.units} units + root); peak RSS rise of the step "
              f"(max over ranks) {rise / mib:.1f} MiB; loss {r[0]['loss']:.6f}")


if __name__ == "__main__":
    main()
