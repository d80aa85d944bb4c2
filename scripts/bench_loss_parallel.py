"""Peak memory of a cross-entropy loss step (loss and logits gradient) on class-sharded
logits, with and without ``loss_parallel``, at vocabulary 32,000 on 2 and 4 CPU ranks.

Without it the step gathers the logits (``full_tensor()``) and runs ``ops.cross_entropy``
on the whole ``(rows, vocab)`` tensor; with it the loss reads only this rank's piece.
Prints, per world size, rank 0's numbers: bytes of the logits the loss reads, bytes of
the largest logits-gradient tensor the step makes (the whole gradient before it is cut
back into pieces, or this rank's piece), and how far the resident set size rose above its
level before the step (the peak, read from /proc after resetting it; each mode runs once
to warm up first). One run, no repetition.

Usage: .venv/bin/python scripts/bench_loss_parallel.py [--ranks 2,4] [--rows 512] [--vocab 32000]
"""
from __future__ import annotations

import argparse
from typing import Dict

import mindspore as ms
import numpy as np
from mindspore import ops

from hyper_parallel_ms.dtensor import DTensor
from hyper_parallel_ms.mesh import init_device_mesh
from hyper_parallel_ms.nn import loss_parallel
from hyper_parallel_ms.placement import Shard
from hyper_parallel_ms.testing import run_on_ranks, shutdown_pools
from hyper_parallel_ms.testing._probes import reset_peak_rss, status_kb


def _step(local, target, mesh, shape, parallel: bool):
    def loss_of(piece):
        x = DTensor.from_local(piece, mesh, [Shard(1)], shape=shape)
        if parallel:
            with loss_parallel():
                return ops.cross_entropy(x, target).to_local()
        return ops.cross_entropy(x.full_tensor(), target)
    loss, grad = ms.value_and_grad(loss_of)(local)
    return float(loss.asnumpy()), grad.asnumpy()


def _case(rows: int, vocab: int, mesh):
    rng = np.random.default_rng(0)
    logits = rng.standard_normal((rows, vocab)).astype(np.float32)
    target = ms.Tensor(rng.integers(0, vocab, rows).astype(np.int32))
    step = -(-vocab // mesh.size(0))
    rank = mesh.get_local_rank(0)
    return logits, target, ms.Tensor(np.ascontiguousarray(logits[:, rank * step:(rank + 1) * step]))


def measure(rows: int, vocab: int, parallel: bool) -> Dict[str, float]:
    """One mode in fresh rank processes: a small step first (kernels, caches), then the
    peak RSS rise of the first full-size step, before the allocator holds its memory."""
    tp = ms.communication.get_group_size()
    mesh = init_device_mesh("cpu", (tp,), mesh_dim_names=("tp",))
    small_logits, small_target, small_local = _case(8, 4 * tp, mesh)
    _step(small_local, small_target, mesh, small_logits.shape, parallel)
    logits, target, local = _case(rows, vocab, mesh)
    before = reset_peak_rss()
    loss, grad = _step(local, target, mesh, logits.shape, parallel)
    return {"tp": tp, "peak_rise": (status_kb("VmHWM") - before) * 1024, "read_bytes": local.nbytes if parallel
            else logits.nbytes, "grad_bytes": grad.nbytes if parallel else logits.nbytes, "loss": loss}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", default="2,4")
    parser.add_argument("--rows", type=int, default=512)
    parser.add_argument("--vocab", type=int, default=32000)
    args = parser.parse_args()
    mib = 2 ** 20
    for n in (int(r) for r in args.ranks.split(",")):
        r = {}
        for parallel in (False, True):
            r[parallel] = run_on_ranks(measure, n, args.rows, args.vocab, parallel, timeout=900)[0]
            shutdown_pools()                  # each mode in fresh processes
        print(f"tp={n} rows={args.rows} vocab={args.vocab}: logits read by the loss "
              f"{r[False]['read_bytes'] / mib:.1f} MiB gathered -> {r[True]['read_bytes'] / mib:.1f} MiB with "
              f"loss_parallel; largest logits gradient {r[False]['grad_bytes'] / mib:.1f} -> "
              f"{r[True]['grad_bytes'] / mib:.1f} MiB; peak RSS rise of the step {r[False]['peak_rise'] / mib:.1f} -> "
              f"{r[True]['peak_rise'] / mib:.1f} MiB "
              f"(ratio {r[True]['peak_rise'] / max(r[False]['peak_rise'], 1):.2f});"
              f" |loss difference| {abs(r[True]['loss'] - r[False]['loss']):.2e}")

if __name__ == "__main__":
    import bench_loss_parallel        # the ranks import the case function by module name
    bench_loss_parallel.main()
