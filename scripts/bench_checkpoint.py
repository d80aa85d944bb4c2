"""Benchmark: checkpoint save and load throughput (GB/s) of a 1 GB model against writing and
reading the same bytes with the ``safetensors`` package in one process, in one run.

The model is ``--tensors`` fp32 Parameters of ``--rows`` x 4096 (16 x 4096 x 4096 = 1 GiB by
default). Cases, each timed once after one warm-up of the same size:

* safetensors ``save_file`` of the numpy arrays, with and without an fsync of the file
  (hyper_parallel_ms fsyncs every file before it commits, so the fsync'd figure is the fair one);
* ``checkpoint.save`` in this process (``no_dist``: one data file, CRC-32 of every chunk,
  metadata, atomic commit by rename);
* safetensors ``load_file`` (into numpy arrays) against ``checkpoint.load`` into the model's
  Parameters in place (reads, CRC-32 checks, copies into the Parameters, waited for);
* the CRC-32 of the same bytes alone (what a save and a load spend beyond the copies).

The cases run interleaved ``--repeat`` times (after one warm-up round) and each reports its
fastest run, so that a busy machine disturbs every case alike.

Files go to ``--dir`` (default: a fresh temporary directory, removed afterwards). Every save
writes new files (the previous ones are removed and the page cache flushed before it, outside
the timing); reads follow the writes, so both readers find the data in the page cache alike.

Usage: .venv/bin/python scripts/bench_checkpoint.py [--tensors 16] [--rows 4096] [--repeat 3] [--dir /tmp/x]
"""
from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import mindspore as ms  # noqa: E402
import numpy as np  # noqa: E402
from mindspore import Parameter  # noqa: E402

from hyper_parallel_ms import checkpoint  # noqa: E402
from hyper_parallel_ms.checkpoint._commit import fsync_path  # noqa: E402
from hyper_parallel_ms.checkpoint._safetensors import crc32  # noqa: E402


def _timed(fn) -> float:
    began = time.perf_counter()
    fn()
    return time.perf_counter() - began


def main(argv) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tensors", type=int, default=16)
    parser.add_argument("--rows", type=int, default=4096)
    parser.add_argument("--dir", default=None)
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args(argv)
    from safetensors.numpy import load_file, save_file

    rng = np.random.default_rng(0)
    arrays = {f"layers.{i}.weight": rng.standard_normal((args.rows, 4096), dtype=np.float32)
              for i in range(args.tensors)}
    params = {k: Parameter(ms.Tensor(a), name=k) for k, a in arrays.items()}
    gigabytes = sum(a.nbytes for a in arrays.values()) / 1e9
    base = args.dir or tempfile.mkdtemp(prefix="hpms_bench_ckpt_")
    os.makedirs(base, exist_ok=True)
    st_path = os.path.join(base, "plain.safetensors")
    ck_path = os.path.join(base, "ckpt")

    def st_save():
        save_file(arrays, st_path)

    def st_save_fsync():
        save_file(arrays, st_path)
        fsync_path(st_path)

    def ck_save():
        checkpoint.save({"model": params}, checkpoint_id=ck_path, no_dist=True)

    def st_load():
        load_file(st_path)

    def ck_load():
        checkpoint.load({"model": params}, checkpoint_id=ck_path, no_dist=True)
        for p in params.values():                                  # wait for the (asynchronous) copies
            p.asnumpy()

    def crc_only():
        for a in arrays.values():
            crc32(a)

    def fresh(path):
        """Writers create new files (as a save of a new step does): nothing to overwrite."""
        if os.path.isdir(path):
            shutil.rmtree(path)
        elif os.path.exists(path):
            os.remove(path)
        os.sync()

    try:
        cases = (("safetensors save_file", st_save, st_path), ("safetensors save_file + fsync", st_save_fsync, st_path),
                 ("checkpoint.save", ck_save, ck_path), ("safetensors load_file", st_load, None),
                 ("checkpoint.load", ck_load, None), ("CRC-32 of the same bytes (part of both)", crc_only, None))
        times = {name: float("inf") for name, _, _ in cases}
        for round_ in range(args.repeat + 1):                      # round 0 warms up (allocations, page cache)
            for name, fn, writes in cases:
                if writes:
                    fresh(writes)
                seconds = _timed(fn)
                if round_:
                    times[name] = min(times[name], seconds)
        for k, a in arrays.items():                                # the load filled the Parameters exactly
            assert np.array_equal(params[k].asnumpy(), a), k
    finally:
        if args.dir is None:
            shutil.rmtree(base, ignore_errors=True)
    print(f"model: {args.tensors} fp32 tensors of {args.rows} x 4096 = {gigabytes:.3f} GB, files in {base}")
    for name, seconds in times.items():
        print(f"  {name:40s} {seconds:7.3f} s  {gigabytes / seconds:6.2f} GB/s")
    save_ratio = times["safetensors save_file + fsync"] / times["checkpoint.save"]
    save_ratio_nosync = times["safetensors save_file"] / times["checkpoint.save"]
    load_ratio = times["safetensors load_file"] / times["checkpoint.load"]
    print(f"save throughput ratio checkpoint / safetensors: {save_ratio:.2f}x against save_file + fsync, "
          f"{save_ratio_nosync:.2f}x against save_file without fsync (target >= 0.8x)")
    print(f"load throughput ratio checkpoint / safetensors: {load_ratio:.2f}x (target >= 0.8x)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
