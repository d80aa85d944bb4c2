"""Benchmark: compile time of a tensor-parallel transformer's gradient step, on CPU ranks.

The transformer of ``tests/test_parallel_styles.py`` (``--layers`` blocks of attention and MLP,
dim 8) under ``ms.jit(ms.value_and_grad(loss))``; each plan in a fresh process of ranks (nothing
compiled before), timing the first call (the compile and one step) on rank 0 and printing the
loss, equal for every plan:

- ``none``: no parallel style (the plain model on every rank);
- ``tp``: Colwise q / k / v / up, Rowwise o / down;
- ``sp``: the two norms of every block ``SequenceParallel`` only;
- ``full``: the whole plan of the tests (Llama's: sequence parallel between the blocks).

Usage: .venv/bin/python scripts/bench_compile.py [--ranks 2] [--layers 1,4] [--plans none,tp,sp,full]
"""
from __future__ import annotations

import argparse
import time
from typing import Tuple

from hyper_parallel_ms.testing import run_on_ranks, shutdown_pools


def _plan(kind: str, mesh) -> dict:
    from hyper_parallel_ms.nn import ColwiseParallel, RowwiseParallel, SequenceParallel
    from tests.test_parallel_styles import transformer_plan
    if kind == "full":
        return transformer_plan(mesh)
    if kind == "tp":
        return {"layers.*": {"attn.[qkv]": ColwiseParallel(), "attn.o": RowwiseParallel(),
                             "mlp.up": ColwiseParallel(), "mlp.down": RowwiseParallel()}}
    if kind == "sp":
        return {"layers.*": {"attn_norm": SequenceParallel(), "mlp_norm": SequenceParallel()}}
    raise ValueError(f"unknown plan {kind!r}")


def measure(kind: str, layers: int) -> Tuple[float, float]:
    """(seconds of the first call of the compiled gradient step, its loss)."""
    import mindspore as ms
    from mindspore import communication
    from hyper_parallel_ms.mesh import init_device_mesh
    from hyper_parallel_ms.nn import parallelize_module
    from tests.test_parallel_styles import Transformer, _nll, _tokens
    mesh = init_device_mesh("cpu", (communication.get_group_size(),), mesh_dim_names=("tp",))
    ms.set_seed(0)
    model = Transformer(layers=layers)
    if kind != "none":
        parallelize_module(model, mesh, _plan(kind, mesh))

    def loss(ids, onehot):
        return _nll(model, ids, onehot)
    step = ms.jit(ms.value_and_grad(loss, None, model.trainable_params()))
    ids, onehot = _tokens(0, 1, 0)
    began = time.perf_counter()
    value, _ = step(ids, onehot)
    value = float(value.asnumpy())
    return time.perf_counter() - began, value


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--layers", default="1,4")
    parser.add_argument("--plans", default="none,tp,sp,full")
    args = parser.parse_args()
    print(f"{args.ranks} ranks: first call of the jit gradient step (compile + one step), fresh ranks each")
    try:
        for layers in (int(n) for n in args.layers.split(",")):
            for kind in args.plans.split(","):
                shutdown_pools()
                seconds, loss = run_on_ranks(measure, args.ranks, kind, layers, timeout=1800)[0]
                print(f"    {layers} blocks {kind:<5} {seconds:6.1f} s  loss {loss:.6f}")
    finally:
        shutdown_pools()


if __name__ == "__main__":
    import bench_compile              # the ranks import the case functions by module name
    bench_compile.main()
