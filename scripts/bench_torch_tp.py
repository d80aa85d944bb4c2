"""Benchmark b (PyTorch side): a tensor-parallel MLP training step in PyTorch 2.13 on CPU
(gloo, torchrun), ``torch.distributed.tensor.parallel`` (Colwise then Rowwise) against the
same MLP hand-written with local shards and explicit all-reduces. Run by
``scripts/bench_tp_mlp.sh`` in its own virtualenv; prints one line from rank 0.

Usage: torchrun --nproc_per_node 2 scripts/bench_torch_tp.py [--dim 512] [--hidden 2048] [--steps 20]
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module


class MLP(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.up = nn.Linear(dim, hidden)
        self.down = nn.Linear(hidden, dim)

    def forward(self, x):
        return self.down(torch.relu(self.up(x)))


class _CopyToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x

    @staticmethod
    def backward(ctx, grad):
        grad = grad.clone()
        dist.all_reduce(grad)
        return grad


class _ReduceFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        x = x.clone()
        dist.all_reduce(x)
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad


class HandMLP(nn.Module):
    """Local shards of ``ref``: up split by rows (output features), down by columns; bias once."""

    def __init__(self, ref: MLP, rank: int, world: int) -> None:
        super().__init__()
        self.up = nn.Linear(1, 1)
        self.up.weight = nn.Parameter(ref.up.weight.detach().chunk(world, 0)[rank].clone())
        self.up.bias = nn.Parameter(ref.up.bias.detach().chunk(world, 0)[rank].clone())
        self.down_weight = nn.Parameter(ref.down.weight.detach().chunk(world, 1)[rank].clone())
        self.down_bias = nn.Parameter(ref.down.bias.detach().clone())

    def forward(self, x):
        h = torch.relu(self.up(_CopyToTP.apply(x)))
        return _ReduceFromTP.apply(h @ self.down_weight.t()) + self.down_bias


def _time(model, x, steps: int):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

    def step():
        loss = (model(x) ** 2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss.item()
    first = step()
    step()
    times = []
    for _ in range(steps):
        began = time.perf_counter()
        step()
        times.append(time.perf_counter() - began)
    return statistics.median(times), first


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dim", type=int, default=512)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--tokens", type=int, default=512)
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(0)
    x = torch.randn(args.tokens, args.dim)
    ref = MLP(args.dim, args.hidden)
    hand = HandMLP(ref, rank, world)
    hand_s, hand_loss = _time(hand, x, args.steps)
    dtensor_model = parallelize_module(ref, mesh, {"up": ColwiseParallel(), "down": RowwiseParallel()})
    dt_s, dt_loss = _time(dtensor_model, x, args.steps)
    if rank == 0:
        print(f"torch {torch.__version__} ranks {world}: hand-written {hand_s * 1e3:.2f} ms, DTensor TP "
              f"{dt_s * 1e3:.2f} ms, DTensor/hand {dt_s / hand_s:.3f} (first losses {hand_loss:.6f} "
              f"{dt_loss:.6f})", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
