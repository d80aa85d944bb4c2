"""Benchmark the planner on a 70B-shaped job in one process: one 1024-rank layout, or a search over
every layout of N devices (time and memory).

Default: the example Llama at the 70B shape (80 layers, dim 8192, ffn 28672, vocab 128256, seq 4096,
micro-batch 1) on a pp 8 x dp 16 x tp 8 mesh: fully_shard over dp, tensor and sequence parallelism
over tp, 1F1B over pp with 8 micro-batches; every rank's memory and the communication of one step,
with the cross-rank checks. Prints the wall time, how many ranks were run, the peak resident memory
of this process and the ratio to the target (1 minute).

``--search --devices 1024``: ``hyper_parallel_ms.dryrun.search`` over every layout of 1024 devices
(as ``scripts/plan_cluster.py --search`` runs it), each layout's line printed as it is priced with
the seconds elapsed; then the total and the ratio to the target (5 minutes).

The machine may be shared: timings are indicative (the CPU seconds of this process are printed too).

Usage::

    python scripts/bench_plan.py [--model 70B] [--pp 8 --dp 16 --tp 8 --microbatches 8]
    python scripts/bench_plan.py --model Llama-3-70B --search --devices 1024 [--device-memory 64GiB]
"""
from __future__ import annotations

import argparse
import resource
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


def _cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _search(args, config, began: float) -> None:
    from examples.plan_llama import builder
    from hyper_parallel_ms.dryrun import Cluster, format_bytes, search
    cluster = Cluster(device_memory=args.device_memory)

    def progress(c) -> None:
        print(f"{time.perf_counter() - began:7.1f} s  {c.dims.describe():<36} peak {format_bytes(c.max_bytes):>11} "
              f"{'fits' if c.fits else 'too big':<8} {c.tokens_per_second:>10.0f} tokens/s {c.problem[:60]}",
              flush=True)
    start = time.perf_counter()
    ranked = search(builder(config), devices=args.devices, layers=config.layers, cluster=cluster, seq=args.seq,
                    progress=progress, workers=args.workers)
    done = time.perf_counter()
    fitting = [c for c in ranked if c.fits]
    best = f"; fastest that fits: {fitting[0].dims.describe()}" if fitting else ""
    print(f"{args.model}: search over {len(ranked)} layouts of {args.devices} devices: {done - start:.1f} s "
          f"({(done - start) / max(len(ranked), 1):.2f} s a layout, {args.workers} worker(s)), with imports "
          f"{done - began:.1f} s, CPU {_cpu_seconds():.1f} s (this process; workers apart); {len(fitting)} fit in {format_bytes(args.device_memory)}{best}")
    print(f"ratio to the 5-minute target: {(done - began) / 300:.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="70B")
    for name, default in (("pp", 8), ("dp", 16), ("tp", 8), ("microbatches", 8), ("seq", 4096), ("devices", 1024)):
        parser.add_argument(f"--{name}", type=int, default=default)
    parser.add_argument("--search", action="store_true", help="search every layout of --devices")
    parser.add_argument("--device-memory", type=int, default=64 * 2 ** 30, help="bytes (--search)")
    parser.add_argument("--workers", type=int, default=1, help="processes that simulate (--search)")
    args = parser.parse_args()
    began = time.perf_counter()
    import mindspore as ms
    if ms.get_context("device_target") != "CPU":
        ms.set_device("CPU")
    from examples.plan_llama import PRESETS, llama_training
    from hyper_parallel_ms import simulate
    from hyper_parallel_ms.dryrun import ParallelDims, format_bytes
    config = PRESETS[args.model]
    if args.search:
        _search(args, config, began)
        return
    imported = time.perf_counter()
    dims = ParallelDims(args.pp, args.dp, args.tp, True, args.microbatches, False, 1, args.seq)
    shape, names = dims.mesh
    report = simulate(llama_training(config, dims), mesh_shape=shape, mesh_dim_names=names)
    done = time.perf_counter()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    print(report.table())
    print(f"{args.model} shape on {dims.ranks} ranks ({dims.describe()}): simulate {done - imported:.1f} s "
          f"({len(report.computed)} ranks run, {(done - imported) / len(report.computed):.1f} s each), "
          f"with imports {done - began:.1f} s, CPU {_cpu_seconds():.1f} s; peak RSS {format_bytes(peak)}")
    print(f"ratio to the 1-minute target: {(done - began) / 60:.2f}")


if __name__ == "__main__":
    main()
