"""Pipeline schedules on 4 CPU ranks against the unsplit model on one rank, in one run.

For GPipe, 1F1B, Interleaved1F1B and ZBVZeroBubble on pp=4 ranks (an MLP of ``--blocks`` blocks,
``--microbatches`` micro-batches of ``--rows`` rows), prints per schedule: the median step time
(slowest rank) and its ratio to the unsplit model's step on one rank (same whole batch, forward
plus backward on the kept tape); the measured bubble fraction (mean over ranks of 1 - time in
compute actions / step time, each compute action waited for) against the plan's unit-time
bubble and (p - 1) / (m + p - 1); forwards per stage and micro-batch; the most micro-batch
forwards whose activations a rank held at once (rank 0 and the maximum) and the peak RSS rise
of rank 0 during a step, with the activations those forwards keep (activation memory, GPipe vs
1F1B; MindSpore has no allocator statistics on CPU).

The 4 ranks share this machine's cores (2 here, shared with other work): step times include
that contention, so the ratio to one rank is no speed-up claim; the bubble and memory columns
are what the schedules change.

Usage: PYTHONPATH=. python scripts/bench_pipeline.py [--blocks 8 --width 256 --hidden 1024 --rows 256
       --microbatches 8 --repeats 3]
"""
from __future__ import annotations

import argparse
import statistics
import time
from typing import Dict, List

import mindspore as ms
import numpy as np
from mindspore import nn, ops

from hyper_parallel_ms.testing import run_on_ranks, shutdown_pools

SCHEDULES = (("GPipe", 1), ("1F1B", 1), ("Interleaved1F1B", 2), ("ZBVZeroBubble", 2))
PP = 4


class Block(nn.Cell):
    def __init__(self, width: int, hidden: int, calls: list) -> None:
        super().__init__()
        self.up, self.down, self.calls = nn.Dense(width, hidden), nn.Dense(hidden, width), calls

    def construct(self, x):
        self.calls.append(1)
        return self.down(ops.tanh(self.up(x))) + x


class Model(nn.Cell):
    def __init__(self, blocks: int, width: int, hidden: int) -> None:
        super().__init__()
        self.calls: list = []
        self.layers = nn.CellList([Block(width, hidden, self.calls) for _ in range(blocks)])

    def construct(self, x):
        for block in self.layers:
            x = block(x)
        return x


def loss_fn(out, target):
    return ((out - target) ** 2).mean()


def _data(rows: int, width: int):
    rs = np.random.RandomState(0)
    return ms.Tensor(rs.randn(rows, width).astype(np.float32)), ms.Tensor(rs.randn(rows, width).astype(np.float32))


def measure(blocks: int, width: int, hidden: int, rows: int, m: int, repeats: int) -> Dict[str, dict]:
    """On every rank: each schedule's step statistics (median over ``repeats`` steps after a warm-up)."""
    from hyper_parallel_ms import comm, pipelining as pl
    from hyper_parallel_ms.mesh import init_device_mesh
    from hyper_parallel_ms.testing._probes import reset_peak_rss, status_kb

    mesh = init_device_mesh("cpu", (PP,), mesh_dim_names=("pp",))
    me = mesh.get_local_rank()
    x, y = _data(rows * m, width)
    out: Dict[str, dict] = {}
    for name, v in SCHEDULES:
        num_stages = PP * v
        plan = pl.build_plan(name, PP, m, stages_per_rank=v)
        stages, models = [], []
        for s in plan.stages_of(me):
            ms.set_seed(0)
            model = pl.split_blocks(Model(blocks, width, hidden), s, num_stages)
            models.append(model)
            stages.append(pl.PipelineStage(model, s, num_stages, mesh=mesh))
        cls = getattr(pl, "Schedule" + name)
        schedule = cls(stages[0] if v == 1 else stages, m, loss_fn)
        schedule.profile = True
        first, last = schedule.stages[0].is_first, schedule.stages[-1].is_last
        samples: List[tuple] = []
        for k in range(repeats + 1):
            comm.all_reduce(ms.Tensor(np.zeros(1, np.float32)), mesh, "pp")     # start together
            before = reset_peak_rss()
            calls = sum(len(md.calls) for md in models)
            schedule.step(*((x,) if first else ()), target=y if last else None)
            rise = (status_kb("VmHWM") - before) * 1024
            stats = schedule.step_stats
            forwards = (sum(len(md.calls) for md in models) - calls) / sum(len(md.layers) for md in models) / m
            if k:
                samples.append((stats.seconds, stats.compute_seconds, stats.peak_live_forwards, rise, forwards))
        # bytes one micro-batch's forward of one block keeps for its backward: x, up(x), tanh(up(x)), down(...)
        per_forward = len(models[0].layers) * rows * (2 * width + 2 * hidden) * 4
        out[name] = {"seconds": statistics.median(s[0] for s in samples),
                     "busy": statistics.median(s[1] / s[0] for s in samples),
                     "live": max(s[2] for s in samples), "rss_rise": statistics.median(s[3] for s in samples),
                     "forwards": samples[-1][4], "plan_bubble": plan.bubble_fraction(),
                     "activations": max(s[2] for s in samples) * per_forward}
    return out


def unsplit_step_seconds(blocks: int, width: int, hidden: int, rows: int, repeats: int) -> float:
    """The whole model on one rank, whole batch: forward on a tape and its backward (median seconds)."""
    from hyper_parallel_ms._mindspore import tape_backward, taped_call

    ms.set_seed(0)
    model = Model(blocks, width, hidden)
    params = model.trainable_params()
    x, y = _data(rows, width)
    times = []

    def step(a, b):
        return loss_fn(model(a), b)
    for k in range(repeats + 1):
        began = time.perf_counter()
        loss = taped_call(step, x, y)
        tape_backward([loss], [ms.Tensor(np.ones(loss.shape, np.float32))], params)
        ms.runtime.synchronize()
        if k:
            times.append(time.perf_counter() - began)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=int, default=8)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--rows", type=int, default=256, help="rows per micro-batch")
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    m = args.microbatches
    ranks = run_on_ranks(measure, PP, args.blocks, args.width, args.hidden, args.rows, m, args.repeats, timeout=1200)
    shutdown_pools()
    one = unsplit_step_seconds(args.blocks, args.width, args.hidden, args.rows * m, args.repeats)
    print(f"pp={PP} ranks, {args.blocks} blocks {args.width}->{args.hidden}->{args.width}, {m} micro-batches of "
          f"{args.rows} rows; unsplit model on one rank: {one * 1e3:.0f} ms per step")
    print(f"{'schedule':16s} {'step ms':>8s} {'/ 1 rank':>8s} {'bubble':>7s} {'plan':>6s} {'(p-1)/(m+p-1)':>13s} "
          f"{'fwd/mb':>6s} {'live r0':>7s} {'live max':>8s} {'act MiB r0':>10s} {'RSS rise r0 MiB':>15s}")
    theory = (PP - 1) / (m + PP - 1)
    for name, _ in SCHEDULES:
        rows = [r[name] for r in ranks]
        step = max(r["seconds"] for r in rows)
        bubble = 1 - float(np.mean([r["busy"] for r in rows]))
        print(f"{name:16s} {step * 1e3:8.0f} {step / one:8.2f} {bubble:7.3f} {rows[0]['plan_bubble']:6.3f} "
              f"{theory:13.3f} {max(r['forwards'] for r in rows):6.2f} {rows[0]['live']:7d} "
              f"{max(r['live'] for r in rows):8d} {rows[0]['activations'] / 2 ** 20:10.1f} "
              f"{rows[0]['rss_rise'] / 2 ** 20:15.1f}")
    print("bubble: measured 1 - compute / step time (contention of 4 ranks on shared cores included); plan: the "
          "schedule's unit-time bubble; act MiB: live forwards x the activations one forward keeps (x, up, tanh, "
          "down per block); RSS barely moves because MindSpore's CPU memory pool keeps freed blocks")


if __name__ == "__main__":
    import bench_pipeline             # the ranks import the case function by module name
    bench_pipeline.main()
