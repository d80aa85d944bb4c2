"""What one pipeline stage's backward costs in MindSpore PyNative, measured in one process.

Compares, for one stage (an MLP of blocks) and one micro-batch:

* ``tape B``: the runtime's full backward (forward recorded once, one ``run_backward`` for the
  input and the weights);
* ``tape I + W``: the zero-bubble split as the runtime runs it (``run_backward`` for the input
  keeping the tape, then for the weights);
* ``recompute``: HyperParallel's way, ``GradOperation(get_all, get_by_list, sens_param)`` that runs
  the forward again inside the backward (plus the forward already run in F).

Prints milliseconds (median of repeats) and forwards per micro-batch (construct calls).

Run: PYTHONPATH=. python scripts/bench_pipeline_backward.py [--width 512 --blocks 4 --batch 64]
"""
from __future__ import annotations

import argparse
import statistics
import time

import mindspore as ms
import numpy as np
from mindspore import nn, ops

from hyper_parallel_ms._mindspore import tape_backward, taped


class Block(nn.Cell):
    def __init__(self, width: int, calls: list):
        super().__init__()
        self.up, self.down, self.calls = nn.Dense(width, 4 * width), nn.Dense(4 * width, width), calls

    def construct(self, x):
        self.calls.append(1)
        return self.down(ops.tanh(self.up(x))) + x


def _median_ms(fn, repeats: int) -> float:
    """Median wall time of ``fn`` with the device queue drained (PyNative ops run asynchronously)."""
    fn()
    ms.runtime.synchronize()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        ms.runtime.synchronize()
        times.append(time.perf_counter() - start)
    return 1000 * statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--blocks", type=int, default=4)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=10)
    args = parser.parse_args()
    ms.set_device("CPU")
    calls: list = []
    stage = nn.SequentialCell([Block(args.width, calls) for _ in range(args.blocks)])
    params = stage.trainable_params()
    x = ms.Tensor(np.random.RandomState(0).randn(args.batch, args.width).astype(np.float32))
    sens = ms.Tensor(np.random.RandomState(1).randn(args.batch, args.width).astype(np.float32))

    def forward():
        with taped():
            inp = ops.stop_gradient(x)
            inp.requires_grad_()
            return inp, stage(inp)

    def tape_b():
        inp, out = forward()
        tape_backward([out], [sens], [inp] + params)

    def tape_iw():
        inp, out = forward()
        tape_backward([out], [sens], [inp], keep_graph=True)
        tape_backward([out], [sens], params)

    grad_op = ops.GradOperation(get_all=True, get_by_list=True, sens_param=True)
    weights = ms.ParameterTuple(params)

    def recompute():
        stage(x)                                  # the forward of F
        grad_op(stage, weights)(x, sens)          # the backward runs the forward again

    forward_ms = _median_ms(forward, args.repeats)
    rows = [("forward (recorded)", forward_ms, forward)]
    for name, fn in (("F + tape B", tape_b), ("F + tape I + W", tape_iw), ("F + recompute B", recompute)):
        rows.append((name, _median_ms(fn, args.repeats), fn))
    print(f"stage: {args.blocks} blocks of width {args.width}, micro-batch {args.batch}, fp32, CPU")
    print(f"{'':20s} {'ms':>8s} {'x forward':>10s} {'forwards':>9s}")
    for name, ms_, fn in rows:
        calls.clear()
        fn()
        print(f"{name:20s} {ms_:8.2f} {ms_ / forward_ms:10.2f} {len(calls) / args.blocks:9.0f}")


if __name__ == "__main__":
    main()
