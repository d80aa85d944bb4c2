"""Activation checkpointing on the example Llama, 2 CPU ranks, PyNative: peak memory and step time
without checkpointing, with full and with selective checkpointing of every block, under tensor
parallelism (the example's sequence-parallel plan) and under fully_shard (each block, then the root).

Per configuration, on fresh ranks (MindSpore's memory pool keeps what a step allocated, so a
second step in the same process would show no rise): the rise of the resident set size over the
first training step (its peak, /proc VmHWM, max over ranks), the median time of the following
steps, the forwards of one block per step and the collectives per step (CommDebugMode; under
selective checkpointing it records the gather called again in the recompute, whose collective
kernel is not run: ``replayed`` counts those). With ``--graph`` it also counts, per rank 0's
compiled gradient graph under ms.jit, the MatMul / BatchMatMul / AllReduce / Softmax nodes with and
without full checkpointing (MindSpore's graph recompute pass duplicates the forward ops it recomputes).

Usage: .venv/bin/python scripts/bench_activation_checkpoint.py [--dim 256] [--layers 4] [--seq 128] [--batch 8]
"""
from __future__ import annotations

import argparse
import statistics
import time
from typing import Dict, Optional

import mindspore as ms
import numpy as np

from hyper_parallel_ms.testing import run_on_ranks, shutdown_pools
from hyper_parallel_ms.testing._probes import reset_peak_rss, status_kb


def _model(kind: str, policy: Optional[str], dim: int, layers: int, seq: int, vocab: int, parts: bool = False):
    """The example Llama on 2 ranks (``kind`` "tp" or "fsdp"), its blocks checkpointed with ``policy``
    ("none", "full", "selective"); ``parts``: the attention and feed_forward Cells instead of the blocks."""
    import sys
    from pathlib import Path
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from examples.llama import Attention, Block, FeedForward, Llama, LlamaConfig, tp_plan
    from hyper_parallel_ms.fsdp import fully_shard
    from hyper_parallel_ms.mesh import init_device_mesh
    from hyper_parallel_ms.nn import parallelize_module
    from hyper_parallel_ms.training import apply_activation_checkpointing
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("x",))
    ms.set_seed(0)
    model = Llama(LlamaConfig(vocab=vocab, dim=dim, layers=layers, heads=8, hidden=4 * dim, max_seq=seq))
    if kind == "tp":
        parallelize_module(model, mesh, tp_plan(sequence_parallel=True))
    if policy != "none":
        chosen = (Attention, FeedForward) if parts else Block
        apply_activation_checkpointing(model, check_fn=lambda c: isinstance(c, chosen),
                                       policy=None if policy == "full" else policy)
    if kind == "fsdp":
        for layer in model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
    return model, mesh


def _data(kind: str, rank: int, batch: int, seq: int, vocab: int):
    rng = np.random.default_rng(7)
    ids = rng.integers(0, vocab, (batch, seq))
    labels = np.eye(vocab, dtype=np.float32)[rng.integers(0, vocab, (batch, seq))]
    if kind == "fsdp":          # data parallel: each rank its half of the batch
        half = batch // 2
        ids, labels = ids[rank * half:(rank + 1) * half], labels[rank * half:(rank + 1) * half]
    return ms.Tensor(ids, ms.int32), ms.Tensor(labels)


def measure(kind: str, policy: str, dim: int, layers: int, seq: int, batch: int, vocab: int, steps: int) -> Dict:
    import sys
    from pathlib import Path
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from examples.llama import cross_entropy
    from hyper_parallel_ms.comm import CommDebugMode
    from hyper_parallel_ms.training import CheckpointWrapper, checkpoint_stats
    model, mesh = _model(kind, policy, dim, layers, seq, vocab)
    ids, labels = _data(kind, mesh.get_local_rank(0), batch, seq, vocab)
    params = model.trainable_params()
    step = ms.value_and_grad(lambda i, y: cross_entropy(model(i), y), None, params)
    base = reset_peak_rss()
    step(ids, labels)[0].asnumpy()
    rise = (status_kb("VmHWM") - base) * 1024
    times = []
    with CommDebugMode() as comms:
        for _ in range(steps):
            start = time.perf_counter()
            step(ids, labels)[0].asnumpy()
            times.append(time.perf_counter() - start)
    block = model.layers[0]
    stats = checkpoint_stats(block) if isinstance(block, CheckpointWrapper) else None
    return {"rise": rise, "time": statistics.median(times),
            "comms": {k: v / steps for k, v in comms.get_comm_counts().items()},
            "forwards": stats.forwards / (steps + 1) if stats else 1.0,
            "replayed": {k: v / (steps + 1) for k, v in stats.replayed.items()} if stats else {}}


def graph_counts(kind: str, dim: int, layers: int, seq: int, batch: int, vocab: int) -> Dict:
    """Op counts of the compiled gradient graph (ms.jit) with and without full checkpointing."""
    import glob
    import sys
    import tempfile
    from pathlib import Path
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from examples.llama import cross_entropy
    out = {}
    for name, policy, parts in (("none", "none", False), ("full blocks", "full", False),
                                ("full attention+feed_forward", "full", True)):
        model, mesh = _model(kind, policy, dim, layers, seq, vocab, parts)
        ids, labels = _data(kind, mesh.get_local_rank(0), batch, seq, vocab)

        def loss(i, y):
            return cross_entropy(model(i), y)
        where = tempfile.mkdtemp(prefix="hpms_ac_ir_")
        ms.set_context(save_graphs=True, save_graphs_path=where)
        try:
            ms.jit(ms.value_and_grad(loss, None, model.trainable_params()))(ids, labels)
        except (RuntimeError, TypeError, ValueError) as error:   # measured: some layouts do not compile
            first = next((line for line in str(error).splitlines() if line.strip()), "")
            out[name] = f"does not compile: {type(error).__name__}: {first[:160]}"
            continue
        finally:
            ms.set_context(save_graphs=False)
        text = open(sorted(glob.glob(where + "/**/*_validate_*.ir", recursive=True))[-1]).read()
        out[name] = {op: text.count(op + "(") for op in ("MatMul", "BatchMatMul", "AllReduce", "Softmax")}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--graph", action="store_true", help="also count the compiled graph's ops (ms.jit)")
    parser.add_argument("--kinds", default="tp,fsdp")
    args = parser.parse_args()
    mib = 2 ** 20
    sizes = (args.dim, args.layers, args.seq, args.batch, args.vocab)
    print(f"Llama dim={args.dim} layers={args.layers} seq={args.seq} batch={args.batch} vocab={args.vocab}, "
          "2 CPU ranks, PyNative")
    try:
        for kind in args.kinds.split(","):
            rows = {}
            for policy in ("none", "full", "selective"):
                shutdown_pools()            # fresh ranks: a fresh memory pool
                results = run_on_ranks(measure, 2, kind, policy, *sizes, args.steps, timeout=1800)
                r = results[0]
                r["rise"] = max(x["rise"] for x in results)
                rows[policy] = r
            none = rows["none"]
            for policy, r in rows.items():
                replayed = f", kept and replayed per step {r['replayed']}" if r["replayed"] else ""
                print(f"{kind:4s} {policy:9s}: first-step RSS rise {r['rise'] / mib:7.1f} MiB "
                      f"({r['rise'] / max(none['rise'], 1):.2f}x), step {r['time'] * 1e3:7.1f} ms "
                      f"({r['time'] / none['time']:.2f}x), block forwards/step {r['forwards']:.0f}, "
                      f"collectives/step {r['comms']}{replayed}")
            if args.graph:
                shutdown_pools()
                counts = run_on_ranks(graph_counts, 2, kind, *sizes, timeout=1800)[0]
                for name, found in counts.items():
                    print(f"{kind:4s} ms.jit graph nodes, {name}: {found}")
    finally:
        shutdown_pools()


if __name__ == "__main__":
    main()
