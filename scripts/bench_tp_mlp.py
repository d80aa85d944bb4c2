"""Benchmark b (MindSpore side): the tensor-parallel MLP step of ``bench_torch_tp.py`` with
hyper_parallel_ms (ColwiseParallel then RowwiseParallel; PyNative and ms.jit) against the same
MLP hand-written with local shards and explicit ``ops.AllReduce`` (Megatron f / g), on CPU ranks.

Usage: .venv/bin/python scripts/bench_tp_mlp.py [--ranks 2,4] [--dim 512] [--hidden 2048] [--steps 20]
"""
from __future__ import annotations

import argparse

import mindspore as ms
import numpy as np
from mindspore import nn, ops

from bench_tp_step import _CopyToTP, _ReduceFromTP, time_steps
from hyper_parallel_ms.mesh import init_device_mesh
from hyper_parallel_ms.nn import ColwiseParallel, RowwiseParallel, parallelize_module
from hyper_parallel_ms.testing import run_on_ranks, shutdown_pools


class MLP(nn.Cell):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.up = nn.Dense(dim, hidden)
        self.down = nn.Dense(hidden, dim)

    def construct(self, x):
        return self.down(ops.relu(self.up(x)))


class HandMLP(nn.Cell):
    """Local shards of ``ref`` (Dense stores (out, in)): up by rows, down by columns; bias once."""

    def __init__(self, ref: MLP, group: str, rank: int, world: int) -> None:
        super().__init__()
        self.f, self.g = _CopyToTP(group), _ReduceFromTP(group)
        self.up_w = ms.Parameter(ms.Tensor(np.split(ref.up.weight.asnumpy(), world, 0)[rank]), name="up_w")
        self.up_b = ms.Parameter(ms.Tensor(np.split(ref.up.bias.asnumpy(), world, 0)[rank]), name="up_b")
        self.down_w = ms.Parameter(ms.Tensor(np.split(ref.down.weight.asnumpy(), world, 1)[rank]), name="down_w")
        self.down_b = ms.Parameter(ms.Tensor(ref.down.bias.asnumpy()), name="down_b")
        self.matmul_t = ops.MatMul(transpose_b=True)      # as nn.Dense multiplies by its (out, in) weight

    def construct(self, x):
        h = ops.relu(self.matmul_t(self.f(x), self.up_w) + self.up_b)
        return self.g(self.matmul_t(h, self.down_w)) + self.down_b


class _Step(nn.Cell):
    def __init__(self, model) -> None:
        super().__init__()
        self.model = model
        self.optimizer = nn.AdamWeightDecay(model.trainable_params(), learning_rate=1e-3)
        self.grad_fn = ms.value_and_grad(self._loss, None, self.optimizer.parameters)

    def _loss(self, x):
        return (self.model(x) ** 2).mean()

    def construct(self, x):
        loss, grads = self.grad_fn(x)
        self.optimizer(grads)
        return loss


def run_case(impl: str, mode: str, dim: int, hidden: int, tokens: int, steps: int):
    ms.set_seed(0)
    ref = MLP(dim, hidden)
    mesh = init_device_mesh("cpu", (ms.communication.get_group_size(),), mesh_dim_names=("tp",))
    if impl == "hpms":
        model = parallelize_module(ref, mesh, {"up": ColwiseParallel(), "down": RowwiseParallel()})
    else:
        model = HandMLP(ref, mesh.get_group("tp"), mesh.get_coordinate()[0], mesh.size())
    cell = _Step(model)
    step = ms.jit(cell.construct) if mode == "jit" else cell
    x = ms.Tensor(np.random.default_rng(0).standard_normal((tokens, dim)).astype(np.float32))
    return time_steps(step, (x,), steps, warmup=1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", default="2,4")
    parser.add_argument("--dim", type=int, default=512)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--tokens", type=int, default=512)
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()
    for n in (int(r) for r in args.ranks.split(",")):
        for mode in ("pynative", "jit"):
            hand, hand_loss = run_on_ranks(run_case, n, "hand", mode, args.dim, args.hidden, args.tokens,
                                           args.steps, timeout=900)[0]
            hpms, hpms_loss = run_on_ranks(run_case, n, "hpms", mode, args.dim, args.hidden, args.tokens,
                                           args.steps, timeout=900)[0]
            print(f"mindspore {ms.__version__} ranks {n} {mode}: hand-written {hand * 1e3:.2f} ms, hyper_parallel_ms "
                  f"{hpms * 1e3:.2f} ms, hpms/hand {hpms / hand:.3f} (first losses {hand_loss:.6f} {hpms_loss:.6f})",
                  flush=True)
    shutdown_pools()


if __name__ == "__main__":
    import bench_tp_mlp           # the ranks import the case function by module name
    bench_tp_mlp.main()
