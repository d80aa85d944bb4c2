"""simulate() of the split-backward pipeline schedules (ZBVZeroBubble, InterleavedZeroBubble,
DualPipeV) against real ranks: a pp x tp and a pp x dp (fully_shard) model of four stages, each
rank holding two, run for one step on 4 CPU ranks and simulated for those 4 ranks in this
process. Every collective and transfer of the step (CommDebugMode's records: kind, mesh dim, group,
shape, dtype, bytes, peer) must be equal, call by call: the input-gradient pass issues the
tensor-parallel input gradient's all-reduce and fully_shard's re-gather, the weight pass the
gradient reduction, as MindSpore's split backward does."""
from __future__ import annotations

import mindspore as ms
import numpy as np
import pytest
from mindspore import nn, ops

from hyper_parallel_ms.testing import run_on_ranks

STAGES, MICROBATCHES, ROWS, WIDTH = 4, 4, 8, 8


class _Block(nn.Cell):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Dense(WIDTH, 2 * WIDTH)
        self.down = nn.Dense(2 * WIDTH, WIDTH)

    def construct(self, x):
        return x + self.down(ops.tanh(self.up(x)))


def _loss(out, target):
    return ((out - target) ** 2).mean()


def zero_bubble_training(schedule_name: str, parallel: str):
    """``build(mesh)`` on a ``("pp", parallel)`` mesh: this rank's two stages (one block each) of the
    schedule's placement, tensor-parallel (``"tp"``) or fully sharded (``"dp"``)."""
    def build(mesh):
        from hyper_parallel_ms import fully_shard, init_parameters, no_init_parameters
        from hyper_parallel_ms import pipelining as pl
        from hyper_parallel_ms.nn import ColwiseParallel, RowwiseParallel, parallelize_module
        pp = mesh["pp"]
        held = pl.build_plan(schedule_name, pp.size(), MICROBATCHES, stages_per_rank=2).stages_of(pp.get_local_rank())
        stages = []
        for s in held:
            with no_init_parameters():
                ms.set_seed(s)
                block = _Block()
            block.update_parameters_name(f"stage{s}.")        # distinct names across stages
            if parallel == "tp":
                parallelize_module(block, mesh["tp"], {"up": ColwiseParallel(), "down": RowwiseParallel()})
            else:
                fully_shard(block, mesh=mesh["dp"])
            init_parameters(block)
            stages.append(pl.PipelineStage(block, s, STAGES, mesh=pp))
        schedule = pl.get_schedule_class(schedule_name)(stages, MICROBATCHES, _loss)
        optimizer = nn.AdamWeightDecay(schedule.parameters(), learning_rate=1e-3)
        x = ms.Tensor(np.ones((ROWS, WIDTH), np.float32))
        first, last = schedule.stages[0].is_first, schedule.stages[-1].is_last

        def step():
            schedule.step(*((x,) if first else ()), target=x if last else None)
            optimizer(schedule.gradients())
        return stages[0].submod, optimizer, step
    return build


def _record(rec) -> tuple:
    return rec.kind, rec.mesh_dim, tuple(rec.group), tuple(rec.shape), rec.dtype, rec.bytes, rec.peer


def real_rank(schedule_name: str, parallel: str) -> list:
    from hyper_parallel_ms.comm import CommDebugMode
    from hyper_parallel_ms.mesh import init_device_mesh
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", parallel))
    _, _, step = zero_bubble_training(schedule_name, parallel)(mesh)
    with CommDebugMode() as mode:
        step()
    return [_record(r) for r in mode.records]


@pytest.mark.parametrize("schedule_name,parallel", [("ZBVZeroBubble", "tp"), ("InterleavedZeroBubble", "dp"),
                                                    ("DualPipeV", "tp")])
def test_split_backward_records_equal_real_ones_call_by_call(schedule_name, parallel):
    from hyper_parallel_ms.dryrun import _session
    real = run_on_ranks(real_rank, 4, schedule_name, parallel, timeout=600)
    sim = _session._Simulation(zero_bubble_training(schedule_name, parallel), (2, 2), ("pp", parallel), "cpu")
    for r in range(4):
        kinds = {rec[0] for rec in real[r]}
        assert {"send", "recv"} <= kinds and kinds - {"send", "recv"}, (r, kinds)      # transfers and collectives
        assert [_record(x) for x in sim.outcome(r).step_records] == real[r], r
