"""Benchmark a: one training step of the example Llama model with tensor parallelism on CPU
ranks, hyper_parallel_ms (PyNative and ms.jit) against the same model hand-written with local
shards and explicit ``ops.AllReduce`` calls (the floor), and against one process.

The ranks come from the test harness's RankPool (N worker processes, as msrun starts them).
Each case: 3 warm-up steps, then the median of ``--steps`` step times (loss, gradients and an
AdamWeightDecay update). Both implementations start from the same weights; their first-step
losses are printed as a check. The plan is tensor parallel without sequence parallel (the
hand-written model does the same Megatron-style all-reduces).

Usage: .venv/bin/python scripts/bench_tp_step.py [--ranks 2,4] [--steps 10] [--dim 256] ...
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import mindspore as ms  # noqa: E402
import numpy as np  # noqa: E402
from mindspore import nn, ops  # noqa: E402

from examples.llama import Llama, RMSNorm, cross_entropy, tp_plan  # noqa: E402
from examples.train_tp import TrainConfig, batch, model_config  # noqa: E402
from hyper_parallel_ms.mesh import init_device_mesh  # noqa: E402
from hyper_parallel_ms.nn import GradientReducer, parallelize_module  # noqa: E402
from hyper_parallel_ms.testing import run_on_ranks, shutdown_pools  # noqa: E402


# ----------------------------------------------------------------- the hand-written floor
class _CopyToTP(nn.Cell):
    """Megatron's f: identity forward, all-reduce of the gradient."""

    def __init__(self, group: str) -> None:
        super().__init__()
        self.all_reduce = ops.AllReduce(group=group)

    def construct(self, x):
        return x

    def bprop(self, x, out, dout):
        return (self.all_reduce(dout),)


class _ReduceFromTP(nn.Cell):
    """Megatron's g: all-reduce forward, identity backward."""

    def __init__(self, group: str) -> None:
        super().__init__()
        self.all_reduce = ops.AllReduce(group=group)

    def construct(self, x):
        return self.all_reduce(x)

    def bprop(self, x, out, dout):
        return (dout,)


class _GatherLastDim(nn.Cell):
    """Each rank's slice of the last dim placed in zeros and all-reduced; backward: the slice."""

    def __init__(self, group: str, offset: int, width: int, total: int) -> None:
        super().__init__()
        self.all_reduce = ops.AllReduce(group=group)
        self.offset, self.width, self.total = offset, width, total

    def construct(self, x):
        shape = x.shape[:-1]
        left = ops.zeros(shape + (self.offset,), x.dtype)
        right = ops.zeros(shape + (self.total - self.offset - self.width,), x.dtype)
        return self.all_reduce(ops.cat((left, x, right), -1))

    def bprop(self, x, out, dout):
        return (dout[..., self.offset:self.offset + self.width],)


def _local(dense_weight, dim: int, rank: int, tp: int):
    piece = np.split(dense_weight.asnumpy(), tp, axis=dim)[rank]
    return ms.Parameter(ms.Tensor(piece), name=dense_weight.name)


class _TPRegion(nn.Cell):
    """A Cell whose first layers are split by columns and last by rows: f before, g after."""

    def __init__(self, inner: nn.Cell, group: str) -> None:
        super().__init__()
        self.f, self.inner, self.g = _CopyToTP(group), inner, _ReduceFromTP(group)

    def construct(self, x):
        return self.g(self.inner(self.f(x)))


def _split_dense(dense: nn.Dense, dim: int, rank: int, tp: int) -> None:
    dense.weight = _local(dense.weight, dim, rank, tp)


class HandTPLlama(nn.Cell):
    """The example model split by hand (Megatron-LM style) from a full ``ref`` model."""

    def __init__(self, ref: Llama, group: str, rank: int, tp: int) -> None:
        super().__init__()
        vocab, dim = ref.tok_embeddings.embedding_table.shape
        self.rows = vocab // tp
        self.start = rank * self.rows
        self.table = _local(ref.tok_embeddings.embedding_table, 0, rank, tp)
        self.reduce = _ReduceFromTP(group)
        for layer in ref.layers:   # heads and MLP columns split; each block half between f and g
            attention, feed_forward = layer.attention, layer.feed_forward
            for dense, dim in ((attention.wq, 0), (attention.wk, 0), (attention.wv, 0), (attention.wo, 1),
                               (feed_forward.w1, 0), (feed_forward.w3, 0), (feed_forward.w2, 1)):
                _split_dense(dense, dim, rank, tp)
            layer.attention = _TPRegion(attention, group)
            layer.feed_forward = _TPRegion(feed_forward, group)
        self.layers = ref.layers
        self.norm: RMSNorm = ref.norm
        self.f = _CopyToTP(group)
        self.output = nn.Dense(1, 1, has_bias=False)
        self.output.weight = _local(ref.output.weight, 0, rank, tp)
        self.gather = _GatherLastDim(group, rank * (vocab // tp), vocab // tp, vocab)

    def construct(self, ids):
        local = ids - self.start
        outside = ops.logical_or(local < 0, local >= self.rows)
        found = ops.gather(self.table, ops.select(outside, ops.zeros_like(local), local), 0)
        h = self.reduce(found * ops.expand_dims(ops.logical_not(outside), -1).astype(found.dtype))
        for layer in self.layers:
            h = layer(h)
        return self.gather(self.output(self.f(self.norm(h))))


# ----------------------------------------------------------------- one case on every rank
class _Step(nn.Cell):
    def __init__(self, model, reducer) -> None:
        super().__init__()
        self.model = model
        self.optimizer = nn.AdamWeightDecay(model.trainable_params(), learning_rate=1e-3, weight_decay=0.01)
        self.reducer = reducer
        self.grad_fn = ms.value_and_grad(self._loss, None, self.optimizer.parameters)

    def _loss(self, ids, onehot):
        return cross_entropy(self.model(ids), onehot)

    def construct(self, ids, onehot):
        loss, grads = self.grad_fn(ids, onehot)
        self.optimizer(self.reducer(grads))
        return loss


class _Same(nn.Cell):
    def construct(self, grads):
        return grads


def run_case(cfg: TrainConfig, impl: str, mode: str, steps: int):
    """Median step seconds and the first loss for ``impl`` (single | hpms | hand) in ``mode``."""
    ms.set_seed(cfg.seed)
    ref = Llama(model_config(cfg))
    reducer = _Same()
    if impl == "hpms":
        mesh = init_device_mesh("cpu", (cfg.tp,), mesh_dim_names=("tp",))
        parallelize_module(ref, mesh, tp_plan(sequence_parallel=False))
        reducer = GradientReducer(ref.trainable_params())
        model = ref
    elif impl == "hand":
        mesh = init_device_mesh("cpu", (cfg.tp,), mesh_dim_names=("tp",))
        model = HandTPLlama(ref, mesh.get_group("tp"), mesh.get_coordinate()[0], cfg.tp)
    else:
        model = ref
    cell = _Step(model, reducer)
    step = ms.jit(cell.construct) if mode == "jit" else cell
    return time_steps(step, batch(cfg, 0), steps, warmup=2)


def time_steps(step, inputs: tuple, steps: int, warmup: int):
    """(median seconds per step, first loss): one step for the loss, ``warmup`` more, then
    ``steps`` timed ones (each waits for its loss)."""
    first = float(step(*inputs).asnumpy())
    for _ in range(warmup):
        step(*inputs).asnumpy()
    times = []
    for _ in range(steps):
        began = time.perf_counter()
        step(*inputs).asnumpy()
        times.append(time.perf_counter() - began)
    return statistics.median(times), first


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", default="2,4")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--vocab", type=int, default=512)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--batch", type=int, default=8)
    args = parser.parse_args()
    base = TrainConfig(dp=1, tp=1, dim=args.dim, hidden=args.hidden, vocab=args.vocab, layers=args.layers,
                       heads=args.heads, seq=args.seq, batch=args.batch)
    print(f"model: dim {args.dim}, hidden {args.hidden}, vocab {args.vocab}, layers {args.layers}, heads "
          f"{args.heads}; batch {args.batch} x seq {args.seq}; median of {args.steps} steps (ms)")
    results = {}
    for mode in ("pynative", "jit"):
        results[(1, "single", mode)] = run_on_ranks(run_case, 1, base, "single", mode, args.steps)[0]
    for n in (int(r) for r in args.ranks.split(",")):
        cfg = replace(base, tp=n)
        for impl in ("hand", "hpms"):
            for mode in ("pynative", "jit"):
                results[(n, impl, mode)] = run_on_ranks(run_case, n, cfg, impl, mode, args.steps, timeout=900)[0]
    shutdown_pools()
    print(f"{'ranks':>5} {'mode':<9}{'single':>9}{'hand':>9}{'hpms':>9}{'hpms/hand':>11}{'hpms/single':>13}"
          f"{'loss hand':>11}{'loss hpms':>11}")
    for n in (int(r) for r in args.ranks.split(",")):
        for mode in ("pynative", "jit"):
            single, _ = results[(1, "single", mode)]
            hand, hand_loss = results[(n, "hand", mode)]
            hpms, hpms_loss = results[(n, "hpms", mode)]
            print(f"{n:>5} {mode:<9}{single * 1e3:>9.1f}{hand * 1e3:>9.1f}{hpms * 1e3:>9.1f}{hpms / hand:>11.3f}"
                  f"{hpms / single:>13.2f}{hand_loss:>11.5f}{hpms_loss:>11.5f}")


if __name__ == "__main__":
    import bench_tp_step          # the ranks import the case functions by module name, not as __main__
    bench_tp_step.main()
