"""Benchmark: what the conversions' shape agreement costs a PyNative training step.

In PyNative every conversion that moves data or records a global shape first has the ranks of
its mesh agree on the global shape read from their pieces (one small all-reduce per mesh dim;
``redistribute/_local.agree_on_global_shape``). This script trains the example Llama with
tensor parallelism (with and without sequence parallelism) on CPU ranks and times steps with
the agreement and with it replaced by a no-op, in interleaved rounds within one run, and prints
the ratio and the agreements per step.

Usage: .venv/bin/python scripts/bench_shape_agreement.py [--ranks 2] [--rounds 4] [--steps 3]
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import mindspore as ms  # noqa: E402
from mindspore import nn  # noqa: E402

from examples.llama import Llama, cross_entropy, tp_plan  # noqa: E402
from examples.train_tp import TrainConfig, batch, model_config  # noqa: E402
from hyper_parallel_ms.mesh import init_device_mesh  # noqa: E402
from hyper_parallel_ms.nn import GradientReducer, parallelize_module  # noqa: E402
from hyper_parallel_ms.redistribute import _local  # noqa: E402
from hyper_parallel_ms.testing import run_on_ranks, shutdown_pools  # noqa: E402


def _skip_agreement(plan_id, local_shape, where=""):
    return True


def run(tp: int, sequence_parallel: bool, rounds: int, steps: int):
    """Per round: median step seconds with the agreement, then without; and agreements per step."""
    cfg = TrainConfig(tp=tp)
    ms.set_seed(cfg.seed)
    model = Llama(model_config(cfg))
    mesh = init_device_mesh("cpu", (tp,), mesh_dim_names=("tp",))
    parallelize_module(model, mesh, tp_plan(sequence_parallel=sequence_parallel))
    reducer = GradientReducer(model.trainable_params())
    optimizer = nn.AdamWeightDecay(model.trainable_params(), learning_rate=1e-3, weight_decay=0.01)
    grad_fn = ms.value_and_grad(lambda ids, onehot: cross_entropy(model(ids), onehot), None, optimizer.parameters)
    inputs = batch(cfg, 0)

    def step():
        loss, grads = grad_fn(*inputs)
        optimizer(reducer(grads))
        return float(loss.asnumpy())

    checked = _local.agree_on_global_shape
    calls = [0]

    def counting(plan_id, local_shape, where=""):
        calls[0] += 1
        return checked(plan_id, local_shape, where)
    _local.agree_on_global_shape = counting
    step()
    per_step = calls[0]
    results = []
    try:
        for _ in range(rounds):
            timed = {}
            for name, fn in (("with", checked), ("without", _skip_agreement)):
                _local.agree_on_global_shape = fn
                step()
                times = []
                for _ in range(steps):
                    began = time.perf_counter()
                    step()
                    times.append(time.perf_counter() - began)
                timed[name] = statistics.median(times)
            results.append(timed)
    finally:
        _local.agree_on_global_shape = checked
    return per_step, results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args()
    try:
        for sp in (False, True):
            per_step, rounds = run_on_ranks(run, args.ranks, args.ranks, sp, args.rounds, args.steps, timeout=1800)[0]
            with_ = statistics.median(r["with"] for r in rounds)
            without = statistics.median(r["without"] for r in rounds)
            print(f"tp={args.ranks} sequence_parallel={sp}: {per_step} agreements per step; step "
                  f"{with_ * 1e3:.1f} ms with, {without * 1e3:.1f} ms without: ratio {with_ / without:.3f}")
    finally:
        shutdown_pools()


if __name__ == "__main__":
    main()
