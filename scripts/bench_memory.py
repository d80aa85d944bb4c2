"""Benchmark d: parameter memory per rank after tensor parallelism, and the peak RSS while
``parallelize_module`` runs, for the example Llama model on 2 and 4 CPU ranks.

Prints, on rank 0: parameter bytes of the unsharded model and of this rank's pieces, the
ratio for the sharded weights (1/tp when every sharded weight splits evenly) and for the
whole model (norm weights stay replicated), and how far the resident set size rose above
its level before the call (the peak, read from /proc after resetting it).

Usage: .venv/bin/python scripts/bench_memory.py [--ranks 2,4] [--dim 512] [--vocab 8192] [--layers 4]
"""
from __future__ import annotations

import argparse
from typing import Dict

import mindspore as ms

from hyper_parallel_ms.mesh import init_device_mesh
from hyper_parallel_ms.nn import parallelize_module, parameter_sharding
from hyper_parallel_ms.testing import run_on_ranks, shutdown_pools
from hyper_parallel_ms.testing._probes import reset_peak_rss, status_kb


def measure(dim: int, hidden: int, vocab: int, layers: int, heads: int) -> Dict[str, float]:
    import sys
    from pathlib import Path
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from examples.llama import Llama, LlamaConfig, tp_plan
    tp = ms.communication.get_group_size()
    mesh = init_device_mesh("cpu", (tp,), mesh_dim_names=("tp",))
    ms.set_seed(0)
    model = Llama(LlamaConfig(vocab=vocab, dim=dim, layers=layers, heads=heads, hidden=hidden, max_seq=64))
    before = {p.name: p.nbytes for p in model.trainable_params()}
    rss_before = reset_peak_rss()
    parallelize_module(model, mesh, tp_plan(sequence_parallel=True))
    peak_rise = (status_kb("VmHWM") - rss_before) * 1024
    after = {p.name: (p.nbytes, parameter_sharding(p)) for p in model.trainable_params()}
    sharded = [n for n, (_, s) in after.items() if s is not None and not s.spec.layout.is_replicated()]
    ratios = {after[n][0] / before[n] for n in sharded}
    return {"tp": tp, "total_before": sum(before.values()), "total_after": sum(b for b, _ in after.values()),
            "sharded_before": sum(before[n] for n in sharded), "sharded_after": sum(after[n][0] for n in sharded),
            "sharded_ratios": sorted(ratios), "peak_rise": peak_rise, "sharded_count": len(sharded),
            "count": len(after)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", default="2,4")
    parser.add_argument("--dim", type=int, default=512)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=8)
    args = parser.parse_args()
    mib = 2 ** 20
    for n in (int(r) for r in args.ranks.split(",")):
        r = run_on_ranks(measure, n, args.dim, args.hidden, args.vocab, args.layers, args.heads, timeout=900)[0]
        print(f"tp={r['tp']}: parameters {r['total_before'] / mib:.2f} MiB unsharded -> {r['total_after'] / mib:.2f} "
              f"MiB on rank 0 (ratio {r['total_after'] / r['total_before']:.4f}); the {r['sharded_count']} sharded of "
              f"{r['count']} parameters: {r['sharded_before'] / mib:.2f} -> {r['sharded_after'] / mib:.2f} MiB, each "
              f"piece / whole = {', '.join(f'{x:.4f}' for x in r['sharded_ratios'])} (1/tp = {1 / r['tp']:.4f}); "
              f"peak RSS rise during parallelize_module {r['peak_rise'] / mib:.1f} MiB "
              f"({r['peak_rise'] / r['total_before']:.2f} x the unsharded parameters)")
    shutdown_pools()


if __name__ == "__main__":
    import bench_memory               # the ranks import the case function by module name
    bench_memory.main()
