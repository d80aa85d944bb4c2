"""The cost of drawing a sharded activation's dropout mask as the single device does: the
styled dropout Cell (``SequenceParallel`` on ``nn.Dropout``) places its piece in zeros of the
whole shape, drops the whole, and keeps its piece; a plain dropout on the piece is the local
draw it replaces (not the single device's mask). One process, no communication: the piece is
``1 / parts`` of a ``(batch, seq, dim)`` activation split along the sequence.

Forward and backward (``ms.grad``) are timed back to back in each round, for each number of
parts; medians of the ratio whole-draw / local-draw are printed, with the extra bytes the
whole draw holds while it runs (placed input, output and mask of the whole shape).

Usage: python scripts/bench_dropout.py [--batch 4] [--seq 512] [--dim 512] [--parts 2 4 8] [--rounds 7]
"""
from __future__ import annotations

import argparse
import statistics
import time

import mindspore as ms
import numpy as np
from mindspore import Tensor, nn

from hyper_parallel_ms.nn._dropout import sharded_dropout_class


def _seconds(fn, x, iters: int) -> float:
    began = time.perf_counter()
    for _ in range(iters):
        out = fn(x)
    Tensor.asnumpy(out)
    return (time.perf_counter() - began) / iters


def _cells(parts: int):
    ms.set_seed(0)
    local = nn.Dropout(p=0.1).set_train()
    whole = nn.Dropout(p=0.1).set_train()
    whole.__class__ = sharded_dropout_class(nn.Dropout)
    whole.hpms_dropout_dim, whole.hpms_dropout_parts, whole.hpms_dropout_index = 1, parts, parts // 2
    return local, whole


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--dim", type=int, default=512)
    parser.add_argument("--parts", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--iters", type=int, default=10)
    args = parser.parse_args()
    ms.set_device("CPU")
    print(f"activation ({args.batch}, {args.seq}, {args.dim}) float32, split along the sequence; "
          f"medians of {args.rounds} interleaved rounds")
    for parts in args.parts:
        x = Tensor(np.random.default_rng(0).standard_normal(
            (args.batch, args.seq // parts, args.dim)).astype(np.float32))
        local, whole = _cells(parts)
        runs = {"forward": (local, whole), "forward+backward": (ms.grad(local), ms.grad(whole))}
        for name, (plain, drawn) in runs.items():
            for fn in (plain, drawn):
                _seconds(fn, x, 2)
            ratios, plain_ms = [], []
            for _ in range(args.rounds):
                p, d = _seconds(plain, x, args.iters), _seconds(drawn, x, args.iters)
                ratios.append(d / p)
                plain_ms.append(p * 1e3)
            extra = 3 * 4 * args.batch * args.seq * args.dim / 2 ** 20
            print(f"parts={parts} {name:17s} local draw {statistics.median(plain_ms):7.2f} ms   whole draw x"
                  f"{statistics.median(ratios):.2f}   whole-shape buffers while it runs: {extra:.0f} MiB "
                  f"(the piece: {4 * x.size / 2 ** 20:.0f} MiB)")


if __name__ == "__main__":
    main()
