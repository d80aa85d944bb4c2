"""Benchmark: simulating a Llama-70B-shaped job on 1024 ranks in one process (time and memory).

The example Llama at the 70B shape (80 layers, dim 8192, ffn 28672, vocab 128256, seq 4096,
micro-batch 1) on a pp 8 x dp 16 x tp 8 mesh: fully_shard over dp, tensor and sequence
parallelism over tp, 1F1B over pp with 8 micro-batches; every rank's memory and the
communication of one step, with the cross-rank checks. Prints the wall time, how many ranks
were run, the peak resident memory of this process and the ratios to the targets (2 minutes,
8 GiB). The machine may be shared: timings are indicative.

Usage: python scripts/bench_plan.py [--pp 8 --dp 16 --tp 8 --microbatches 8]
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for name, default in (("pp", 8), ("dp", 16), ("tp", 8), ("microbatches", 8), ("seq", 4096)):
        parser.add_argument(f"--{name}", type=int, default=default)
    args = parser.parse_args()
    began = time.perf_counter()
    import mindspore as ms
    if ms.get_context("device_target") != "CPU":
        ms.set_device("CPU")
    from examples.plan_llama import PRESETS, llama_training
    from hyper_parallel_ms import simulate
    from hyper_parallel_ms.dryrun import ParallelDims, format_bytes
    imported = time.perf_counter()
    dims = ParallelDims(args.pp, args.dp, args.tp, True, args.microbatches, False, 1, args.seq)
    shape, names = dims.mesh
    report = simulate(llama_training(PRESETS["70B"], dims), mesh_shape=shape, mesh_dim_names=names)
    done = time.perf_counter()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    print(report.table())
    print(f"70B shape on {dims.ranks} ranks ({dims.describe()}): simulate {done - imported:.1f} s "
          f"({len(report.computed)} ranks run, {(done - imported) / len(report.computed):.1f} s each), "
          f"with imports {done - began:.1f} s; peak RSS {format_bytes(peak)}")
    print(f"ratio to the 2-minute target: {(done - began) / 120:.2f}; ratio to the 8 GiB target: {peak / 2 ** 33:.2f}")


if __name__ == "__main__":
    main()
