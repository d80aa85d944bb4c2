"""Benchmark: fully_shard on the example Llama model at 1, 2 and 4 CPU ranks.

Prints, per world size N (rank 0's figures): bytes per rank of parameters + gradients +
AdamWeightDecay state, unsharded and with fully_shard per block and at the root (ratio to
unsharded, against 1/N and against 1/N plus the largest gathered Cell, which is what a rank
holds at most while one Cell computes); the rise of the peak resident set size while the
model is built, sharded and initialised, eagerly and under ``no_init_parameters()`` with
``init_parameters``; and the median PyNative step time of fully_shard against plain data
parallelism (full replicas, gradients all-reduced by ``GradientReducer``) on the same
per-rank batch, as a ratio. MindSpore's own DistributedDataParallel is tried too: its
result or the reason it cannot run is printed.

With ``--rounds R`` it instead times, in R interleaved rounds (each round runs every variant
for ``--steps`` steps, so that load from other processes falls on all of them alike), fully_shard
with ``reshard_after_forward`` True and False, plain data parallelism with this package's
``GradientReducer`` and with MindSpore's ``nn.DistributedGradReducer``, and prints each variant's
median step time and its ratio to the faster plain data parallelism.

Usage: .venv/bin/python scripts/bench_fsdp.py [--ranks 1,2,4] [--dim 256] [--layers 4] [--vocab 4096] [--steps 5]
       [--rounds R]
"""
from __future__ import annotations

import argparse
import statistics
import time
from typing import Dict

import mindspore as ms
import numpy as np

from hyper_parallel_ms.testing import run_on_ranks, shutdown_pools
from hyper_parallel_ms.testing._probes import reset_peak_rss, status_kb


def _config(dim: int, layers: int, vocab: int):
    import sys
    from pathlib import Path
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from examples.llama import LlamaConfig
    return LlamaConfig(vocab=vocab, dim=dim, layers=layers, heads=4, hidden=4 * dim, max_seq=16)


def _sharded(config, mesh, deferred: bool):
    from examples.llama import Llama
    from hyper_parallel_ms import fully_shard, init_parameters, no_init_parameters
    ms.set_seed(0)
    if deferred:
        with no_init_parameters():
            model = Llama(config)
    else:
        model = Llama(config)
    for block in model.layers:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    if deferred:
        init_parameters(model)
    return model


def _step_time(model, grad_reduce, ids, onehot, steps: int) -> float:
    from mindspore import nn
    from examples.llama import cross_entropy
    params = model.trainable_params()
    opt = nn.AdamWeightDecay(params, learning_rate=1e-3)
    step = ms.value_and_grad(lambda i, o: cross_entropy(model(i), o), None, params)
    times = []
    for _ in range(steps + 1):
        began = time.perf_counter()
        _, grads = step(ids, onehot)
        opt(grad_reduce(grads))
        times.append(time.perf_counter() - began)
    return statistics.median(times[1:])


def _state_bytes(model) -> Dict[str, int]:
    from mindspore import nn
    params = model.trainable_params()
    opt = nn.AdamWeightDecay(params, learning_rate=1e-3)
    p = sum(x.nbytes for x in params)
    return {"params": p, "grads": p, "optimizer": sum(x.nbytes for x in opt.moments1) +
            sum(x.nbytes for x in opt.moments2)}


def measure_rss(dim: int, layers: int, vocab: int, deferred: bool) -> int:
    """Rise of the peak RSS while the model is built, sharded (and initialised): run first in a
    fresh rank process, so that no freed memory of earlier work hides the rise."""
    from mindspore import communication
    from hyper_parallel_ms.mesh import init_device_mesh
    mesh = init_device_mesh("cpu", (communication.get_group_size(),), mesh_dim_names=("dp",))
    config = _config(dim, layers, vocab)
    base = reset_peak_rss()
    _sharded(config, mesh, deferred=deferred)
    return (status_kb("VmHWM") - base) * 1024


def measure(dim: int, layers: int, vocab: int, steps: int) -> Dict[str, object]:
    from mindspore import communication
    from examples.llama import Llama
    from hyper_parallel_ms.mesh import init_device_mesh
    from hyper_parallel_ms.nn import GradientReducer
    n = communication.get_group_size()
    mesh = init_device_mesh("cpu", (n,), mesh_dim_names=("dp",))
    config = _config(dim, layers, vocab)
    out: Dict[str, object] = {"n": n}

    base = reset_peak_rss()
    ms.set_seed(0)
    full = Llama(config)
    out["full"] = _state_bytes(full)
    largest = max(sum(p.nbytes for p in block.trainable_params()) for block in full.layers)
    root_own = sum(p.nbytes for p in full.trainable_params()) - sum(
        p.nbytes for block in full.layers for p in block.trainable_params())
    out["largest_cell"] = max(largest, root_own)

    model = _sharded(config, mesh, deferred=True)
    out["sharded"] = _state_bytes(model)

    rows = 2
    rng = np.random.default_rng(0)
    ids = ms.Tensor(rng.integers(0, vocab, (rows, 16)).astype(np.int32))
    onehot = ms.Tensor(np.eye(vocab, dtype=np.float32)[rng.integers(0, vocab, (rows, 16))])
    out["t_fsdp"] = _step_time(model, lambda g: g, ids, onehot, steps)
    reducer = GradientReducer(full.trainable_params(), dp_mesh=mesh, dp_dim="dp")
    out["t_dp"] = _step_time(full, reducer, ids, onehot, steps)
    try:
        from mindspore.parallel.distributed import DistributedDataParallel
        ddp = DistributedDataParallel(Llama(config), bucket_cap_mb=None, average_in_collective=True)
        out["t_ddp"] = _step_time(ddp, lambda g: g, ids, onehot, steps)
    except Exception as err:      # reported, not hidden: the reason MindSpore's DDP cannot run here
        out["t_ddp"] = f"{type(err).__name__}: {str(err).splitlines()[0][:100]}"
    return out


def measure_interleaved(dim: int, layers: int, vocab: int, steps: int, rounds: int) -> Dict[str, object]:
    """Median step time of each variant over ``rounds`` interleaved rounds of ``steps`` steps."""
    from mindspore import communication, nn
    from examples.llama import Llama, cross_entropy
    from hyper_parallel_ms import fully_shard
    from hyper_parallel_ms.mesh import init_device_mesh
    from hyper_parallel_ms.nn import GradientReducer
    n = communication.get_group_size()
    mesh = init_device_mesh("cpu", (n,), mesh_dim_names=("dp",))
    config = _config(dim, layers, vocab)
    rng = np.random.default_rng(0)
    ids = ms.Tensor(rng.integers(0, vocab, (2, 16)).astype(np.int32))
    onehot = ms.Tensor(np.eye(vocab, dtype=np.float32)[rng.integers(0, vocab, (2, 16))])

    def variant(shard, reducer):
        ms.set_seed(0)
        model = Llama(config)
        if shard is not None:
            for block in model.layers:
                fully_shard(block, mesh=mesh, reshard_after_forward=shard)
            fully_shard(model, mesh=mesh, reshard_after_forward=shard)
        params = model.trainable_params()
        opt = nn.AdamWeightDecay(params, learning_rate=1e-3)
        step = ms.value_and_grad(lambda i, o: cross_entropy(model(i), o), None, params)
        reduce = reducer(params) if reducer is not None else (lambda g: g)
        return lambda: opt(reduce(step(ids, onehot)[1]))

    variants = {
        "fully_shard reshard=True": variant(True, None),
        "fully_shard reshard=False": variant(False, None),
        "DP GradientReducer": variant(None, lambda ps: GradientReducer(ps, dp_mesh=mesh, dp_dim="dp")),
        "DP nn.DistributedGradReducer": variant(None, lambda ps: nn.DistributedGradReducer(ps, mean=True, degree=n)),
    }
    times: Dict[str, list] = {k: [] for k in variants}
    for run in variants.values():
        run()                                           # warm-up: first-call checks, kernels
    for _ in range(rounds):
        for name, run in variants.items():
            for _ in range(steps):
                began = time.perf_counter()
                run()
                times[name].append(time.perf_counter() - began)
    return {"n": n, **{k: statistics.median(v) for k, v in times.items()}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", default="1,2,4")
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=0)
    args = parser.parse_args()
    mib = 1024 * 1024
    if args.rounds:
        try:
            for n in (int(s) for s in args.ranks.split(",")):
                r = run_on_ranks(measure_interleaved, n, args.dim, args.layers, args.vocab, args.steps, args.rounds,
                                 timeout=1800)[0]
                plain = min(r["DP GradientReducer"], r["DP nn.DistributedGradReducer"])
                print(f"N={n}, {args.rounds} interleaved rounds of {args.steps} steps (median step time, ratio to the "
                      "faster plain DP):")
                for name, t in r.items():
                    if name != "n":
                        print(f"      {name}: {t * 1e3:.1f} ms ({t / plain:.2f}x)")
        finally:
            shutdown_pools()
        return
    try:
        for n in (int(s) for s in args.ranks.split(",")):
            rss = {}
            for deferred in (False, True):
                shutdown_pools()
                rss[deferred] = max(run_on_ranks(measure_rss, n, args.dim, args.layers, args.vocab, deferred,
                                                 timeout=900))
            r = run_on_ranks(measure, n, args.dim, args.layers, args.vocab, args.steps, timeout=1800)[0]
            r["rss_eager"], r["rss_deferred"] = rss[False], rss[True]
            full, sharded = sum(r["full"].values()), sum(r["sharded"].values())
            print(f"N={n}: params+grads+AdamW state per rank {sharded / mib:.2f} MiB of {full / mib:.2f} MiB "
                  f"unsharded = {sharded / full:.3f} (1/N = {1 / n:.3f}); with the largest gathered Cell "
                  f"({r['largest_cell'] / mib:.2f} MiB) {(sharded + r['largest_cell']) / full:.3f}")
            print(f"      ({', '.join(f'{k} {v / mib:.2f}' for k, v in r['sharded'].items())} MiB)")
            print(f"      peak RSS rise building + sharding (max over ranks): eager {r['rss_eager'] / mib:.1f} MiB, deferred init "
                  f"{r['rss_deferred'] / mib:.1f} MiB")
            ddp = r["t_ddp"]
            ddp_text = f"{ddp * 1e3:.1f} ms" if isinstance(ddp, float) else f"not run ({ddp})"
            print(f"      step time: fully_shard {r['t_fsdp'] * 1e3:.1f} ms, plain DP {r['t_dp'] * 1e3:.1f} ms "
                  f"(ratio {r['t_fsdp'] / r['t_dp']:.2f}); MindSpore DistributedDataParallel: {ddp_text}")
    finally:
        shutdown_pools()


if __name__ == "__main__":
    import bench_fsdp                 # the ranks import the case function by module name
    bench_fsdp.main()
