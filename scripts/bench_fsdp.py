"""Benchmark: fully_shard / hsdp against plain data parallelism on CPU ranks, in one run.

Three sections, each printed with the command's settings (rank 0's figures, the machine as it is):

- ``time``: median step time (forward, backward, AdamWeightDecay step) in ``--rounds`` interleaved
  rounds of ``--steps`` steps, so that load from other processes falls on every variant alike:
  fully_shard per block and at the root with ``reshard_after_forward`` True, False and (on 4 or
  more ranks) 2, and plain data parallelism (full replicas) with MindSpore's
  ``nn.DistributedGradReducer`` and with this package's ``GradientReducer``; PyNative and compiled
  (the gradient step under ``ms.jit``). Ratios are to the faster plain data parallelism of the mode.
- ``counts``: the collectives of one step of each variant (CommDebugMode; compiled: recorded while
  the graph is compiled, once per read in the graph).
- ``floor``: PyNative, the step's collectives alone, back to back with no computation (fully_shard:
  each collective CommDebugMode recorded in one step, run again on zeros of its shape; plain data
  parallelism: its reducer on zero gradients), in interleaved rounds with the whole steps; and the
  ratio a variant would reach if everything but its collectives cost what plain data parallelism's
  does and nothing overlapped: ``(dp step - dp collectives + its collectives) / dp step``. On CPU
  this bounds what removing overhead can give; the rest needs overlap or cheaper collectives.
  ``--ranks 1`` measures every variant without any collective: the engine's own cost.
- ``compile``: the first call of the compiled step (``ms.jit``: compile and one step) of fully_shard
  (``reshard_after_forward=True``) and of plain data parallelism (``GradientReducer``), for each
  number of blocks in ``--compile-units``, each in a fresh process of ranks (nothing compiled
  before), and the loss of that call (equal in both).
- ``memory``: per variant, in a fresh pool (no memory freed by earlier work hides the rise), a
  model of ``--memory-units`` bias-free ``--memory-dim`` Dense units and 4 rows (parameters dominate)
  built under ``no_init_parameters()`` (no rank ever holds the whole model): the bytes held
  between steps (this rank's parameter pieces and AdamW state) and the measured rise of the peak
  resident set size during the first forward and backward (gradients, gathered parameters,
  activations); for fully_shard True / False and hsdp levels 1, 2 and 3.

The model: ``--units`` blocks, each a ``--dim`` x ``--dim`` Dense (fp32, with bias) and a tanh,
``--rows`` rows per rank; parameters dominate memory, collectives dominate time on CPU.

Usage: .venv/bin/python scripts/bench_fsdp.py [--ranks 2,4] [--sections time,floor,counts,memory,compile]
       [--units 6] [--dim 256] [--rows 64] [--rounds 3] [--steps 5] [--memory-dim 1024]
       [--compile-units 2,4,8]
"""
from __future__ import annotations

import argparse
import statistics
import time
from typing import Callable, Dict, List, Tuple

import mindspore as ms
import numpy as np

from hyper_parallel_ms.testing import compiled_collectives, run_on_ranks, shutdown_pools
from hyper_parallel_ms.testing._probes import reset_peak_rss, status_kb

MiB = 1024 * 1024


def _model(units: int, dim: int):
    from mindspore import nn
    layers = []
    for _ in range(units):
        layers += [nn.Dense(dim, dim), nn.Tanh()]
    return nn.SequentialCell([nn.SequentialCell(layers[i:i + 2]) for i in range(0, len(layers), 2)])


def _shard(model, mesh, how: str) -> None:
    """``how``: ``fsdp:<reshard>`` (True, False or an int) or ``hsdp:<level>``."""
    from hyper_parallel_ms import fully_shard, hsdp
    kind, value = how.split(":")
    for block in list(model) + [model]:
        if kind == "fsdp":
            reshard = {"True": True, "False": False}.get(value, None)
            fully_shard(block, mesh=mesh, reshard_after_forward=int(value) if reshard is None else reshard)
        else:
            hsdp(block, threshold=0, optimizer_level=value, comm_fusion=True)


def _variant(how: str, mesh, units: int, dim: int, mode: str) -> Tuple[Callable, object, Callable]:
    """A step function of one variant (``dp:<reducer>`` or a :func:`_shard` spec), its model and
    its gradient reducer (``None`` for fully_shard: its collectives run inside the step)."""
    from mindspore import nn
    from hyper_parallel_ms.nn import GradientReducer
    ms.set_seed(0)
    model = _model(units, dim)
    n = mesh.size()
    if how.startswith("dp:"):
        params = model.trainable_params()
        reduce = (nn.DistributedGradReducer(params, mean=True, degree=n) if how == "dp:mindspore"
                  else GradientReducer(params, dp_mesh=mesh, dp_dim="dp"))
    else:
        _shard(model, mesh, how)
        params = model.trainable_params()
        reduce = None
    opt = nn.AdamWeightDecay(params, learning_rate=1e-3)

    def loss_fn(x):
        return (model(x) ** 2).mean()
    grad = ms.value_and_grad(loss_fn, None, params)

    def step_fn(x):
        loss, grads = grad(x)
        return loss, (reduce(grads) if reduce is not None else grads)
    step = ms.jit(step_fn) if mode == "jit" else step_fn

    def run(x):
        loss, grads = step(x)
        opt(grads)
        return loss
    return run, model, reduce


def _variants(n: int) -> List[str]:
    out = ["fsdp:True", "fsdp:False"] + (["fsdp:2"] if n >= 4 else []) + ["dp:mindspore", "dp:package"]
    return out


def _batch(rows: int, dim: int):
    return ms.Tensor(np.random.default_rng(0).standard_normal((rows, dim)).astype(np.float32))


def measure_time(units: int, dim: int, rows: int, steps: int, rounds: int) -> Dict[str, Dict[str, float]]:
    from mindspore import communication
    from hyper_parallel_ms.mesh import init_device_mesh
    mesh = init_device_mesh("cpu", (communication.get_group_size(),), mesh_dim_names=("dp",))
    x = _batch(rows, dim)
    out: Dict[str, Dict[str, float]] = {}
    for mode in ("pynative", "jit"):
        runs = {how: _variant(how, mesh, units, dim, mode)[0] for how in _variants(mesh.size())}
        times: Dict[str, list] = {k: [] for k in runs}
        for run in runs.values():
            run(x).asnumpy()                                # warm-up: first-call checks, compiles
        for _ in range(rounds):
            for how, run in runs.items():
                for _ in range(steps):
                    began = time.perf_counter()
                    run(x).asnumpy()
                    times[how].append(time.perf_counter() - began)
        out[mode] = {k: statistics.median(v) for k, v in times.items()}
    return out


def measure_counts(units: int, dim: int, rows: int) -> Dict[str, Dict[str, Dict[str, int]]]:
    from mindspore import communication
    from hyper_parallel_ms.comm import CommDebugMode
    from hyper_parallel_ms.mesh import init_device_mesh
    mesh = init_device_mesh("cpu", (communication.get_group_size(),), mesh_dim_names=("dp",))
    x = _batch(rows, dim)
    out: Dict[str, Dict[str, Dict[str, int]]] = {"pynative": {}, "jit": {}}
    for how in _variants(mesh.size()):
        run = _variant(how, mesh, units, dim, "pynative")[0]
        with CommDebugMode() as debug:
            run(x).asnumpy()
        counts: Dict[str, int] = {}
        for r in debug.records:
            counts[f"{r.kind} over {r.group_size}"] = counts.get(f"{r.kind} over {r.group_size}", 0) + 1
        out["pynative"][how] = counts
        out["jit"][how] = compiled_collectives(_variant(how, mesh, units, dim, "jit")[0], x)
    return out


def measure_compile(how: str, units: int, dim: int, rows: int) -> Tuple[float, float]:
    """(seconds of the first call of the compiled step of variant ``how``, its loss)."""
    from mindspore import communication
    from hyper_parallel_ms.mesh import init_device_mesh
    mesh = init_device_mesh("cpu", (communication.get_group_size(),), mesh_dim_names=("dp",))
    run = _variant(how, mesh, units, dim, "jit")[0]
    x = _batch(rows, dim)
    began = time.perf_counter()
    loss = float(run(x).asnumpy())
    return time.perf_counter() - began, loss


def _collectives_alone(how: str, mesh, units: int, dim: int, rows: int) -> Tuple[Callable, Callable]:
    """(the whole PyNative step, the step's collectives alone) of one variant."""
    from hyper_parallel_ms import comm
    from hyper_parallel_ms.comm import CommDebugMode
    from mindspore import ops
    run, model, reduce = _variant(how, mesh, units, dim, "pynative")
    x = _batch(rows, dim)
    if reduce is not None:
        zeros = tuple(ops.zeros(p.shape, p.dtype) for p in model.trainable_params())
        return (lambda: run(x)), (lambda: reduce(zeros)[0])
    with CommDebugMode() as debug:
        run(x).asnumpy()
    calls = []
    for r in debug.records:
        t = ops.zeros(r.shape, ms.float32)
        if r.kind == "all_gather":
            calls.append(lambda t=t, d=r.mesh_dim: comm.all_gather(t, mesh, d, dim=0))
        elif r.kind == "reduce_scatter":
            calls.append(lambda t=t, d=r.mesh_dim: comm.reduce_scatter(t, mesh, d, dim=0, op="avg"))
        elif r.kind == "all_reduce":
            calls.append(lambda t=t, d=r.mesh_dim: comm.all_reduce(t, mesh, d, op="avg"))
        else:
            raise NotImplementedError(f"the floor section replays all_gather / reduce_scatter / all_reduce, "
                                      f"the step issued {r.kind}")

    def alone():
        out = None
        for call in calls:
            out = call()
        return out
    return (lambda: run(x)), alone


def measure_floor(units: int, dim: int, rows: int, steps: int, rounds: int) -> Dict[str, Tuple[float, float]]:
    """Per variant, PyNative: (median step time, median time of its collectives alone)."""
    from mindspore import communication
    from hyper_parallel_ms.mesh import init_device_mesh
    mesh = init_device_mesh("cpu", (communication.get_group_size(),), mesh_dim_names=("dp",))
    pairs = {how: _collectives_alone(how, mesh, units, dim, rows) for how in _variants(mesh.size())}
    times: Dict[Tuple[str, int], list] = {(how, i): [] for how in pairs for i in range(2)}
    for how, pair in pairs.items():
        for f in pair:
            f()                                               # warm-up
    ms.runtime.synchronize()
    for _ in range(rounds):
        for how, pair in pairs.items():
            for i, f in enumerate(pair):
                for _ in range(steps):
                    began = time.perf_counter()
                    f()
                    ms.runtime.synchronize()
                    times[(how, i)].append(time.perf_counter() - began)
    return {how: (statistics.median(times[(how, 0)]), statistics.median(times[(how, 1)])) for how in pairs}


def measure_memory(how: str, units: int, dim: int, rows: int) -> Dict[str, float]:
    """In a fresh rank process: the model built under no_init_parameters, sharded, initialised and
    its optimizer state made; then the rise of the peak RSS during the first forward and backward
    (before MindSpore's allocator holds memory from an earlier step: gathered parameters, the
    gradients, activations and temporaries of one step)."""
    from mindspore import communication, nn
    from hyper_parallel_ms import init_parameters, no_init_parameters
    from hyper_parallel_ms.mesh import init_device_mesh
    from mindspore import ops
    mesh = init_device_mesh("cpu", (communication.get_group_size(),), mesh_dim_names=("dp",))
    x = _batch(rows, dim)
    ms.set_seed(0)
    with no_init_parameters():          # parameters dominate: a small batch, no bias, no activation Cells
        model = nn.SequentialCell([nn.Dense(dim, dim, has_bias=False) for _ in range(units)])
    _shard(model, mesh, how)
    init_parameters(model)
    params = model.trainable_params()
    opt = nn.AdamWeightDecay(params, learning_rate=1e-3)
    grad = ms.value_and_grad(lambda v: ops.tanh(model(v)).sum(), None, params)
    base = reset_peak_rss()
    loss, grads = grad(x)
    loss.asnumpy()
    rise = (status_kb("VmHWM") - base) * 1024.0
    opt(grads)
    state = sum(p.nbytes for p in params) + sum(m.nbytes for m in list(opt.moments1) + list(opt.moments2))
    return {"step_rise": rise, "state": float(state), "grads": float(sum(g.nbytes for g in grads))}


def _print_time(n: int, result: Dict[str, Dict[str, float]], rounds: int, steps: int) -> None:
    for mode, times in result.items():
        plain = min(times["dp:mindspore"], times["dp:package"])
        print(f"N={n} {mode}: median step time over {rounds} interleaved rounds of {steps} steps "
              f"(ratio to the faster plain DP)")
        for how, t in times.items():
            print(f"    {how:<14} {t * 1e3:8.1f} ms  {t / plain:5.2f}x")


def _print_counts(n: int, result: Dict[str, Dict[str, Dict[str, int]]]) -> None:
    for mode, variants in result.items():
        print(f"N={n} {mode}: " + ("collectives of one step (CommDebugMode)" if mode == "pynative" else
                                   "collective primitives in the compiled step's graph (on CPU every collective "
                                   "is an AllReduce or MCCL's AllGather)"))
        for how, counts in variants.items():
            text = ", ".join(f"{k}: {v}" for k, v in sorted(counts.items())) or (
                "not recorded (MindSpore's own collectives)" if mode == "pynative" else "none found")
            print(f"    {how:<14} {text}")


def _print_floor(n: int, result: Dict[str, Tuple[float, float]], rounds: int, steps: int) -> None:
    plain = min(("dp:mindspore", "dp:package"), key=lambda k: result[k][0])
    dp_step, dp_comm = result[plain]
    print(f"N={n} pynative: the step's collectives alone (median over {rounds} interleaved rounds of {steps}); "
          f"floor: (dp step - dp collectives + its collectives) / dp step, against {plain}")
    for how, (step, alone) in result.items():
        print(f"    {how:<14} step {step * 1e3:7.1f} ms  collectives {alone * 1e3:6.1f} ms  "
              f"rest {(step - alone) * 1e3:6.1f} ms  step {step / dp_step:5.2f}x  "
              f"floor {(dp_step - dp_comm + alone) / dp_step:5.2f}x")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", default="2,4")
    parser.add_argument("--sections", default="time,floor,counts,memory")
    parser.add_argument("--units", type=int, default=6)
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--memory-units", type=int, default=8)
    parser.add_argument("--memory-dim", type=int, default=1024)
    parser.add_argument("--compile-units", default="2,4,8")
    args = parser.parse_args()
    sections = args.sections.split(",")
    try:
        for n in (int(s) for s in args.ranks.split(",")):
            if "time" in sections:
                _print_time(n, run_on_ranks(measure_time, n, args.units, args.dim, args.rows, args.steps,
                                            args.rounds, timeout=3600)[0], args.rounds, args.steps)
            if "floor" in sections:
                _print_floor(n, run_on_ranks(measure_floor, n, args.units, args.dim, args.rows, args.steps,
                                             args.rounds, timeout=3600)[0], args.rounds, args.steps)
            if "counts" in sections:
                _print_counts(n, run_on_ranks(measure_counts, n, args.units, args.dim, args.rows, timeout=1800)[0])
            if "compile" in sections:
                print(f"N={n} jit: the compiled step's first call (compile + one step), fresh ranks each")
                for units in (int(u) for u in args.compile_units.split(",")):
                    for how in ("fsdp:True", "dp:package"):
                        shutdown_pools()
                        seconds, loss = max(run_on_ranks(measure_compile, n, how, units, args.dim, args.rows,
                                                         timeout=1800))
                        print(f"    {units} blocks {how:<12} {seconds:6.1f} s  loss {loss:.6f}")
            if "memory" in sections:
                u, d = args.memory_units, args.memory_dim
                unit = d * d * 4
                print(f"N={n} memory: {u} units of {unit / MiB:.2f} MiB (parameters, fp32; the whole model "
                      f"{u * unit / MiB:.1f} MiB, its parameters + AdamW state {3 * u * unit / MiB:.1f} MiB); per rank: "
                      f"parameters + AdamW state held between steps, and the measured rise of the peak RSS "
                      f"during the first forward + backward (gradients {u * unit / n / MiB:.1f} MiB, gathered "
                      f"parameters, activations, temporaries)")
                for how in ("fsdp:True", "fsdp:False", "hsdp:level1", "hsdp:level2", "hsdp:level3"):
                    shutdown_pools()
                    r = max(run_on_ranks(measure_memory, n, how, u, d, 4, timeout=900),
                            key=lambda m: m["step_rise"])
                    print(f"    {how:<14} state {r['state'] / MiB:6.1f} MiB (1/N: {3 * u * unit / n / MiB:.1f}), "
                          f"step peak rise {r['step_rise'] / MiB:6.1f} MiB (max over ranks)")
    finally:
        shutdown_pools()


if __name__ == "__main__":
    import bench_fsdp                 # the ranks import the case functions by module name
    bench_fsdp.main()
