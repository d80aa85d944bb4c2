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
        # 1F1B (one stage per rank, as HyperParallel's Schedule1F1B) pairs nothing: overlap_b_f is refused
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
    from mindspore import nn, ops
    out["overlap_b_f"] = run_overlap_b_f(mesh, me, ms, nn, ops)
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


def _failure(call) -> str:
    try:
        call()
    except Exception as exc:  # noqa: BLE001 - the message is the result
        return str(exc)
    return "accepted"


def _refusal(call) -> str:
    try:
        call()
    except RuntimeError as exc:
        return str(exc)
    return "accepted"


# ---------------------------------------------------------------- 5. OVERLAP_B_F pairs
WIDTH, ROWS = 8, 6


def _overlap_chunks(nn, ops, overlap, log, num_stages=4):
    """The 4 stage Cells of a model whose every chunk holds one expert-parallel-like layer (attention,
    dispatch, experts, combine) wrapped by ``overlap``'s sync hooks; the last stage returns the loss from
    ``labels`` (HyperParallel's). ``log`` gets the thread of each layer's backward."""
    import threading

    from hyper_parallel_ms._mindspore.autodiff import identity_with_gradient

    class Layer(nn.Cell):
        def __init__(self, first, last):
            super().__init__()
            self.embed = nn.Dense(3, WIDTH) if first else None
            self.attn, self.expert = nn.Dense(WIDTH, WIDTH), nn.Dense(WIDTH, WIDTH)
            self.head = nn.Dense(WIDTH, 1) if last else None
            dispatch, combine = (lambda h: h * 1.0), (lambda h: h * 1.0)     # all-to-alls' stand-ins
            self.dispatch = overlap.wrap_dispatch(dispatch) if overlap else dispatch
            self.combine = overlap.wrap_combine(combine, is_last_layer=True) if overlap else combine

        def construct(self, x, labels=None):
            x = self.embed(x) if self.embed is not None else x
            x = identity_with_gradient(x, lambda d: (log.append(threading.current_thread().name), d)[1])
            h = self.dispatch(ops.tanh(self.attn(x)))
            h = self.combine(ops.tanh(self.expert(h))) + x
            return ((self.head(h).squeeze(-1) - labels) ** 2).mean() if self.head is not None else h

    return list(nn.CellList([Layer(s == 0, s == num_stages - 1) for s in range(num_stages)]))   # names "s.attn..."


def run_overlap_b_f(mesh, me, ms, nn, ops) -> Dict[str, Any]:
    """ScheduleInterleaved1F1B(overlap_b_f=True), 4 stages on 2 pp ranks, 4 micro-batches: pairs run one
    after the other, then by MindFormers' own OVERLAP_B_F callback (CommComputeOverlap, two threads), then
    the unpaired schedule; and a callback that leaves the forward out."""
    from mindformers.pynative.base_models.gpt.parallelize import _make_overlap_b_f_callback

    from hyper_parallel_ms import pipelining as pl
    from hyper_parallel_ms.compat._pipeline import MetaStepType
    from hyper_parallel_ms.compat._schedules import ScheduleInterleaved1F1B
    from hyper_parallel_ms.training import disable_mindspore_backward_compat, enable_mindspore_backward_compat

    rng = np.random.default_rng(5)
    x = ms.Tensor(rng.standard_normal((4 * ROWS, 3)).astype(np.float32))
    y = ms.Tensor(rng.standard_normal((4 * ROWS,)).astype(np.float32))

    def build(overlap, log, overlap_b_f=True, dxdw=False):
        ms.set_seed(3)
        chunks = _overlap_chunks(nn, ops, overlap, log)
        stages = [pl.PipelineStage(chunks[s], s, 4, mesh=mesh) for s in (me, me + 2)]
        return ScheduleInterleaved1F1B(stages, 4, overlap_b_f=overlap_b_f, enable_dxdw_split=dxdw), chunks

    def grads_of(schedule, chunks):
        schedule.run(*((x,) if me == 0 else ()), labels=y)
        params = [p for s in (me, me + 2) for p in chunks[s].trainable_params()]
        out = [p.grad.asnumpy().copy() for p in params]
        for p in params:
            p.grad = None
        return out

    # one device: the 4 chunks in a row, the summed micro-batch losses' gradients
    ms.set_seed(3)
    whole = _overlap_chunks(nn, ops, None, [])
    params = [p for s in (me, me + 2) for p in whole[s].trainable_params()]

    def total(x, y):
        loss = 0
        for m in range(4):
            h = x[m * ROWS:(m + 1) * ROWS]
            for s in range(3):
                h = whole[s](h)
            loss = loss + whole[3](h, labels=y[m * ROWS:(m + 1) * ROWS])
        return loss
    reference = [g.asnumpy() for g in ms.grad(total, None, params)(x, y)]

    result: Dict[str, Any] = {}
    enable_mindspore_backward_compat()
    try:
        log: List[str] = []
        schedule, chunks = build(None, log)
        result["paired"] = sorted(str(a) for a in schedule.plan.paired if a.stage in (me, me + 2))
        steps = schedule.exec_order[me]                 # HyperParallel's MetaStep lists, a pair one OVERLAP_B_F step
        result["overlap_steps"] = sorted(f"{s.sub_steps[0].stage_index}B{s.sub_steps[0].micro_index}"
                                         for s in steps if s.type is MetaStepType.OVERLAP_B_F
                                         and [t.type for t in s.sub_steps] == [MetaStepType.BWD, MetaStepType.FWD])
        result["steps"] = len(steps) + len(result["overlap_steps"]) == len(schedule.plan.actions[me])
        sequential = grads_of(schedule, chunks)
        result["worst"] = max(float(np.abs(g - r).max() / np.abs(r).max()) for g, r in zip(sequential, reference))
        unpaired = grads_of(*build(None, [], overlap_b_f=False))

        from hyper_parallel_ms.pipelining import CommComputeOverlap
        overlap, log = CommComputeOverlap(), []
        schedule, chunks = build(overlap, log)
        schedule.register_custom_function(MetaStepType.OVERLAP_B_F, _make_overlap_b_f_callback(overlap))
        threaded = grads_of(schedule, chunks)
        result["backward_threads"] = sorted(set(log))
        result["threaded_backwards"] = sum(name == "hpms-overlap-backward" for name in log)
        result["threaded_vs_sequential"] = max(float(np.abs(a - b).max()) for a, b in zip(threaded, sequential))
        result["unpaired_vs_sequential"] = max(float(np.abs(a - b).max()) for a, b in zip(unpaired, sequential))
        # enable_dxdw_split: the pairs' input gradients in the pairs, their weight gradients after
        split = grads_of(*build(None, [], dxdw=True))
        overlap, log = CommComputeOverlap(), []
        schedule, chunks = build(overlap, log, dxdw=True)
        schedule.register_custom_function(MetaStepType.OVERLAP_B_F, _make_overlap_b_f_callback(overlap))
        split_threaded = grads_of(schedule, chunks)
        result["split_vs_sequential"] = max(float(np.abs(a - b).max() / max(np.abs(b).max(), 1e-30))
                                            for a, b in zip(split, sequential))
        result["split_threaded_vs_split"] = max(float(np.abs(a - b).max()) for a, b in zip(split_threaded, split))
        result["split_threaded_backwards"] = sum(name == "hpms-overlap-backward" for name in log)

        schedule, chunks = build(None, [])
        schedule.register_custom_function(
            MetaStepType.OVERLAP_B_F,
            lambda step, ctx: ctx.schedule._stage_dict[step.sub_steps[0].stage_index].backward_one_chunk(
                step.sub_steps[0].micro_index))
        result["left_out"] = _failure(lambda: grads_of(schedule, chunks))
        result["outside"] = _failure(lambda: schedule._stage_dict[me].forward_one_chunk(0))      # no pair running

        def twice(step, ctx):
            bwd, fwd = step.sub_steps
            chunks_ = ctx.schedule._stage_dict
            chunks_[bwd.stage_index].backward_one_chunk(bwd.micro_index)
            chunks_[fwd.stage_index].forward_one_chunk(fwd.micro_index)
            chunks_[bwd.stage_index].backward_one_chunk(bwd.micro_index)
        schedule, chunks = build(None, [])
        schedule.register_custom_function(MetaStepType.OVERLAP_B_F, twice)
        result["twice"] = _failure(lambda: grads_of(schedule, chunks))

        def other_labels(step, ctx):              # the forward given keywords that are not its micro-batch's
            bwd, fwd = step.sub_steps
            chunks_ = ctx.schedule._stage_dict
            chunks_[bwd.stage_index].backward_one_chunk(bwd.micro_index)
            chunks_[fwd.stage_index].forward_one_chunk(fwd.micro_index, ctx.arg_mbs[fwd.micro_index],
                                                       {"labels": ctx.kwarg_mbs[fwd.micro_index]["labels"] * 2})
        schedule, chunks = build(None, [])
        schedule.register_custom_function(MetaStepType.OVERLAP_B_F, other_labels)
        result["other_inputs"] = _failure(lambda: grads_of(schedule, chunks))
    finally:
        disable_mindspore_backward_compat()
    return result
