"""What one pipeline stage's backward costs in MindSpore, PyNative and compiled, in one process.

Compares, for one stage (an MLP of blocks) and one micro-batch:

* ``tape B``: the runtime's full backward (forward recorded once, one ``run_backward`` for the
  input and the weights);
* ``tape I + W``: the zero-bubble split as the runtime runs it (PyNative: ``run_backward`` for the
  input keeping the record, then for the weights; compiled: one backward for both, since a
  compiled forward's backward graph answers one call);
* ``recompute``: HyperParallel's way, ``GradOperation(get_all, get_by_list, sens_param)`` that runs
  the forward again inside the backward (plus the forward already run in F);

each PyNative and with the stage forward under ``ms.jit`` (``PipelineStage(..., jit=True)``:
the backward is the compiled forward's compiled backward graph; the recompute row compiles the
``GradOperation`` call). Prints milliseconds (median of repeats, rows interleaved round by round)
and forwards per micro-batch, counted by a Parameter each block increments with ``assign_add``
(it counts graph runs too, where Python side effects do not run).

Run: PYTHONPATH=. python scripts/bench_pipeline_backward.py [--width 256 --blocks 4 --batch 64]
"""
from __future__ import annotations

import argparse
import statistics
import time
from typing import Callable, Dict, List

import mindspore as ms
import numpy as np
from mindspore import Parameter, nn, ops

from hyper_parallel_ms._mindspore import tape_backward, taped_call


class Block(nn.Cell):
    def __init__(self, width: int):
        super().__init__()
        self.up, self.down = nn.Dense(width, 4 * width), nn.Dense(4 * width, width)
        self.runs = Parameter(ms.Tensor(np.zeros(1, np.float32)), requires_grad=False)

    def construct(self, x):
        ops.assign_add(self.runs, ops.ones((1,), ms.float32))
        return self.down(ops.tanh(self.up(x))) + x


def _rows(stage: nn.Cell, x: ms.Tensor, sens: ms.Tensor, compiled: bool) -> Dict[str, Callable[[], None]]:
    params = stage.trainable_params()

    def run_stage(inp):
        return stage(inp)
    forward = ms.jit(run_stage) if compiled else run_stage
    grad_op = ops.GradOperation(get_all=True, get_by_list=True, sens_param=True)
    weights = ms.ParameterTuple(params)

    def stage_grads(inp, s):
        return grad_op(stage, weights)(inp, s)
    grads = ms.jit(stage_grads) if compiled else stage_grads

    def recorded():
        inp = ops.stop_gradient(x)
        inp.requires_grad_()
        return inp, taped_call(forward, inp)

    def tape_b():
        inp, out = recorded()
        tape_backward([out], [sens], [inp] + params)

    def tape_iw():
        inp, out = recorded()
        if compiled:                               # the runtime's compiled I: input and weights at once
            tape_backward([out], [sens], [inp] + params)
            return
        tape_backward([out], [sens], [inp], keep_graph=True)
        tape_backward([out], [sens], params)

    def recompute():
        forward(x)                                 # the forward of F
        grads(x, sens)                             # the backward runs the forward again

    kind = "jit" if compiled else "PyNative"
    return {f"{kind} forward (recorded)": recorded, f"{kind} F + tape B": tape_b,
            f"{kind} F + tape I + W": tape_iw, f"{kind} F + recompute B": recompute}


def _median_ms(times: List[float]) -> float:
    return 1000 * statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--blocks", type=int, default=4)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=10)
    args = parser.parse_args()
    ms.set_device("CPU")
    stage = nn.SequentialCell([Block(args.width) for _ in range(args.blocks)])
    x = ms.Tensor(np.random.RandomState(0).randn(args.batch, args.width).astype(np.float32))
    sens = ms.Tensor(np.random.RandomState(1).randn(args.batch, args.width).astype(np.float32))
    rows = {**_rows(stage, x, sens, compiled=False), **_rows(stage, x, sens, compiled=True)}

    def runs() -> float:
        return sum(float(block.runs.asnumpy()[0]) for block in stage)
    forwards = {}
    for name, fn in rows.items():                  # warm-up (compiles) and forward counts
        fn()
        ms.runtime.synchronize()
        before = runs()
        fn()
        forwards[name] = (runs() - before) / args.blocks
    times: Dict[str, List[float]] = {name: [] for name in rows}
    for _ in range(args.repeats):                   # interleaved rounds: load changes hit every row alike
        for name, fn in rows.items():
            start = time.perf_counter()
            fn()
            ms.runtime.synchronize()
            times[name].append(time.perf_counter() - start)
    print(f"stage: {args.blocks} blocks of width {args.width}, micro-batch {args.batch}, fp32, CPU, "
          f"median of {args.repeats}")
    print(f"{'':32s} {'ms':>8s} {'x its forward':>14s} {'forwards':>9s}")
    for name in rows:
        base = _median_ms(times[name.split()[0] + " forward (recorded)"])
        print(f"{name:32s} {_median_ms(times[name]):8.2f} {_median_ms(times[name]) / base:14.2f} "
              f"{forwards[name]:9.0f}")


if __name__ == "__main__":
    main()
