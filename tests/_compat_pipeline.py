"""The rank side of tests/test_compat_pipeline.py: HyperParallel's PipelineStage override points
on this library's schedules, through MindFormers 2.1.0's own ``ScaledLossPipelineStage`` and
``_create_schedule``, on 2 pp ranks."""
from __future__ import annotations

from types import SimpleNamespace
from typing import Any, Dict, List

import numpy as np

N = 4                       # micro-batches
SIZES = (24, 48)            # the second step changes every shape crossing the stage boundary


def _reference(ms, Model, loss_fn, batch) -> List[Dict[str, np.ndarray]]:
    """One device: the gradients of the full batch's mean loss, per step (no update)."""
    ms.set_seed(0)
    model = Model(2)
    params = model.trainable_params()
    grad_fn = ms.grad(lambda x, y: loss_fn(model(x), y), None, params)
    return [{p.name: g.asnumpy() for p, g in zip(params, grad_fn(*batch(step, size)))}
            for step, size in enumerate(SIZES)]


def run_override_points() -> Dict[str, Any]:
    from tests._mindformers_qwen3 import _setup
    _setup()
    import mindspore as ms
    from mindformers.pynative.distributed.pipeline_parallel import ScaledLossPipelineStage, _create_schedule

    from hyper_parallel_ms import init_device_mesh
    from hyper_parallel_ms import pipelining as pl
    from tests._pipeline_models import Model, batch, loss_fn

    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("pp",))
    me = mesh.get_local_rank()
    reference = _reference(ms, Model, loss_fn, batch)
    out: Dict[str, Any] = {"rank": me}

    def stage_model():
        ms.set_seed(0)
        return pl.split_blocks(Model(2), me, 2, first=("embed",), last=("head",))

    def run(schedule, params) -> List[float]:
        worst = []
        for step, size in enumerate(SIZES):
            x, y = batch(step, size)
            schedule.step(*((x,) if me == 0 else ()), target=y if me == 1 else None)
            grads = {p.name: g.asnumpy() for p, g in zip(params, schedule.gradients())}
            worst.append(max(float(np.abs(g - reference[step][k]).max() / np.abs(reference[step][k]).max())
                             for k, g in grads.items()))
        return worst

    # 1. MindFormers' stage, built as its StageModelBuilder builds it (dyn_shape=True, group= and mesh=),
    #    with its loss_scale: the seed get_last_stage_sens returns is 1 * loss_scale, and the schedule
    #    sums the micro-batches (scale_grads=False, HyperParallel's): loss_scale = 1 / N gives the
    #    full batch's mean-loss gradients. Were the seed not the stage's, they would be N times larger.
    model = stage_model()
    stage = ScaledLossPipelineStage(submodule=model, stage_index=me, stage_num=2, device=mesh.device_type,
                                    group=mesh.get_group(), mesh=mesh, tp_mesh=None, has_backward=True,
                                    dyn_shape=True)
    stage.loss_scale = 1.0 / N
    out["dyn_shape"] = stage.dyn_shape
    out["mindformers_stage"] = run(pl.Schedule1F1B(stage, N, loss_fn, scale_grads=False), model.trainable_params())

    # 2. bwd_send_specs: what the engine sends back is what the override returns (doubled: the first
    #    stage's gradients double, the last stage's do not)
    calls = []

    class Doubling(pl.PipelineStage):
        def bwd_send_specs(self, micro_index):
            calls.append(micro_index)
            return [g * 2 for g in super().bwd_send_specs(micro_index)]

    model = stage_model()
    schedule = pl.ScheduleGPipe(Doubling(model, me, 2, mesh=mesh), N, loss_fn)
    x, y = batch(0, SIZES[0])
    schedule.step(*((x,) if me == 0 else ()), target=y if me == 1 else None)
    ratios = [float(np.abs(g.asnumpy()).sum() / np.abs(reference[0][p.name]).sum())
              for p, g in zip(model.trainable_params(), schedule.gradients())]
    out["doubling"] = {"ratios": ratios, "calls": calls}

    # 3. MindFormers' schedule factory passes the HyperParallel keywords its schedule class takes:
    #    the defaults are accepted, what is not built is refused by name
    refused = {}
    for key, value in (("pipeline_parallel_overlap_b_f", True), ("pipeline_parallel_p2p_transport", "hccl_rdma")):
        parallelism = SimpleNamespace(pipeline_parallel_interleave_num=1, **{key: value})
        try:
            _create_schedule("1f1b", stage, N, parallelism, has_moe=True)
        except NotImplementedError as exc:
            refused[key] = str(exc)
    try:
        _create_schedule("1f1b", stage, N, SimpleNamespace(pipeline_parallel_interleave_num=1), swap=True)
    except NotImplementedError as exc:
        refused["swap"] = str(exc)
    plain = _create_schedule("1f1b", stage, N, SimpleNamespace(pipeline_parallel_interleave_num=1))
    out["refused"] = refused
    out["plain"] = type(plain).__name__
    out["hyper_parallel_schedule"] = _hyper_parallel_schedule(mesh, me, stage_model, reference, batch, loss_fn)
    return out


def _hyper_parallel_schedule(mesh, me, stage_model, reference, batch, loss_fn) -> Dict[str, Any]:
    """4. HyperParallel's Schedule1F1B (compat._schedules): a list of one stage, no loss_fn (the last stage's
    output is the loss, computed from the ``labels`` keyword that every stage is given), refused without
    the backward compatibility, the gradients added into param.grad (summed over the micro-batches)."""
    from mindspore import nn
    from hyper_parallel_ms import pipelining as pl
    from hyper_parallel_ms.compat._pipeline import MicroBatch
    from hyper_parallel_ms.compat._schedules import Schedule1F1B
    from hyper_parallel_ms.training import disable_mindspore_backward_compat, enable_mindspore_backward_compat

    class WithLoss(nn.Cell):              # HyperParallel's stage Cells take the step's keywords
        def __init__(self, inner, last):
            super().__init__()
            self.inner, self.last = inner, last

        def construct(self, x, labels=None):
            out = self.inner(x)
            return (loss_fn(out, labels), out) if self.last else out

    model = stage_model()
    schedule = Schedule1F1B([pl.PipelineStage(WithLoss(model, me == 1), me, 2, mesh=mesh)], N)
    x, y = batch(0, SIZES[0])
    result: Dict[str, Any] = {"exec_order": len(schedule.exec_order[me]) > 0}
    try:
        schedule.run(x, labels=y)
    except RuntimeError as exc:
        result["refused"] = str(exc)
    enable_mindspore_backward_compat()
    try:
        outputs = schedule.run(x, labels=y)
        result["outputs"] = len(outputs)
        params = model.trainable_params()
        ref = {p.name: reference[0][p.name.split("inner.", 1)[-1]] for p in params}   # the wrapper's prefix
        result["worst"] = max(float(np.abs(p.grad.asnumpy() / N - ref[p.name]).max() / np.abs(ref[p.name]).max())
                              for p in params)
        first = {p.name: p.grad.asnumpy().copy() for p in params}
        schedule.run(x, labels=y)                          # a second run adds (gradient accumulation)
        result["accumulated"] = max(float(np.abs(p.grad.asnumpy() - 2 * first[p.name]).max()) for p in params)
        for p in params:
            p.grad = None
        # MindFormers' dynamic batch: 2 micro-batches from now on (count, splitter, then the action lists)
        actions = len(schedule.exec_order[me])
        schedule.micro_batch_num = 2
        result["refused_stale"] = _refusal(lambda: schedule.run(x, labels=y))
        schedule.build_exec_order()
        result["refused_splitter"] = _refusal(lambda: schedule.run(x, labels=y))
        schedule.split_micro_batch = MicroBatch(2, schedule._args_batch_dim, schedule._kwargs_batch_dim)
        result["outputs_2"] = len(schedule.run(x, labels=y))
        result["actions"] = (actions, len(schedule.exec_order[me]))
        result["worst_2"] = max(float(np.abs(p.grad.asnumpy() / 2 - ref[p.name]).max() / np.abs(ref[p.name]).max())
                                for p in params)
        for p in params:
            p.grad = None
    finally:
        disable_mindspore_backward_compat()
    return result


def _refusal(call) -> str:
    try:
        call()
    except RuntimeError as exc:
        return str(exc)
    return "accepted"
