"""HyperParallel's pipeline override points on this library's schedules, through MindFormers
2.1.0's own ``ScaledLossPipelineStage`` (``get_last_stage_sens`` with ``loss_scale``, built with
``dyn_shape=True``, ``group=`` and ``mesh=``) and ``_create_schedule`` (the HyperParallel schedule
keywords), and ``bwd_send_specs`` overridden: on 2 pp ranks, gradients against one device. One
rank call; ``MetaStepType`` and ``_MicroBatch`` in-process."""
from __future__ import annotations

import mindspore as ms
import numpy as np
import pytest

from hyper_parallel_ms.compat._pipeline import MetaStepType, MicroBatch
from hyper_parallel_ms.pipelining import F, SEND_B, BatchDimSpec, PipelineStage, ScheduleGPipe
from hyper_parallel_ms.testing import run_on_ranks

from tests._mindformers_qwen3 import available


@pytest.fixture(scope="module")
def runs():
    if available() is not None:
        pytest.skip(available())
    from tests._compat_pipeline import run_override_points
    return run_on_ranks(run_override_points, 2, timeout=300)


def test_mindformers_stage_seeds_the_backward_with_its_loss_scale(runs):
    for r in runs:
        assert r["dyn_shape"] is True
        # loss_scale 1/4 on 4 summed micro-batches = the full batch's mean-loss gradient, in both
        # steps (the second with every boundary shape changed); float32 sums of 4 micro-batches
        # against one: 2.7e-7 relative at worst, measured
        assert max(r["mindformers_stage"]) < 1e-5, r["mindformers_stage"]


def test_the_engine_sends_back_what_bwd_send_specs_returns(runs):
    first, last = runs
    assert first["doubling"]["ratios"] == pytest.approx([2.0] * 4, rel=1e-5)     # the doubled gradients reached it
    assert last["doubling"]["ratios"] == pytest.approx([1.0] * 4, rel=1e-5)
    assert last["doubling"]["calls"] == [0, 1, 2, 3] and first["doubling"]["calls"] == []


def test_mindformers_schedule_factory_keywords_are_refused_by_name_when_asked_for(runs):
    for r in runs:
        assert r["plain"] == "Schedule1F1B"
        assert set(r["refused"]) == {"pipeline_parallel_overlap_b_f", "pipeline_parallel_p2p_transport", "swap"}
        assert "overlap_b_f=True" in r["refused"]["pipeline_parallel_overlap_b_f"]
        assert "hccl_rdma" in r["refused"]["pipeline_parallel_p2p_transport"]
        assert "swap=True" in r["refused"]["swap"]


def test_hyper_parallel_schedule_trains_with_the_output_as_the_loss_into_param_grad(runs):
    """HyperParallel's Schedule1F1B: a list of one stage, no loss_fn, the keyword inputs (``labels``) given to
    every stage, the last stage's output (its first element) the loss; refused without
    ``enable_mindspore_backward_compat``; the gradients (summed over 4 micro-batches) in ``param.grad`` equal
    4 x the full batch's mean-loss gradients (measured 2.7e-7 relative), a second run adds to them; a new
    micro-batch count (``micro_batch_num``, ``split_micro_batch``, ``build_exec_order()``) trains 2."""
    for r in runs:
        got = r["hyper_parallel_schedule"]
        assert got["exec_order"]
        assert "enable_mindspore_backward_compat" in got["refused"]
        assert got["outputs"] == (4 if r["rank"] == 1 else 0)       # the last stage's outputs per micro-batch
        assert got["worst"] < 1e-5, got
        assert got["accumulated"] < 1e-6, got
        # the micro-batch count changed between steps (MindFormers' dynamic batch), refused until the action
        # lists and the splitter follow; then 2 micro-batches, their summed gradients 2 x the full batch's
        assert "call build_exec_order()" in got["refused_stale"], got["refused_stale"]
        assert "give it _MicroBatch(2, ...)" in got["refused_splitter"], got["refused_splitter"]
        assert got["outputs_2"] == (2 if r["rank"] == 1 else 0)
        assert got["actions"][1] < got["actions"][0], got["actions"]
        assert got["worst_2"] < 1e-5, got


def test_overlap_b_f_pairs_run_by_mindformers_callback_on_two_threads_equal_the_unpaired_step(runs):
    """ScheduleInterleaved1F1B(overlap_b_f=True), 4 stages on 2 ranks, 4 micro-batches, each chunk one
    expert-parallel-like layer under CommComputeOverlap's sync hooks: every steady-state B directly before
    an F is paired (3 on rank 0, 5 on rank 1, as HyperParallel's F1, [B_i, F_i+1]..., B_n); run one after
    the other, the gradients equal one device's (float32 sums of 4 micro-batches: 1e-7 measured, 1e-5
    bound) and equal the unpaired schedule's bit for bit; run by MindFormers' own OVERLAP_B_F callback
    (forward here, backward on CommComputeOverlap's thread, taking turns at the hooks) bit for bit too, each
    pair's backward on the second thread. A callback that leaves the forward out, or runs a half twice, fails
    the step on both ranks, naming the half; a stage's forward_one_chunk outside a pair, or given inputs other
    than its micro-batch's, is refused."""
    expected = {0: ["0B0", "2B0", "2B1"], 1: ["1B0", "1B1", "3B0", "3B1", "3B2"]}
    for r in runs:
        got = r["overlap_b_f"]
        assert got["paired"] == expected[r["rank"]], got["paired"]
        assert got["overlap_steps"] == expected[r["rank"]] and got["steps"], got      # exec_order's OVERLAP_B_F steps
        assert got["worst"] < 1e-5, got
        assert got["unpaired_vs_sequential"] == 0.0 and got["threaded_vs_sequential"] == 0.0, got
        assert got["threaded_backwards"] == len(expected[r["rank"]]), got
        # enable_dxdw_split (input gradients in the pairs, weight gradients after): the same gradients, by the
        # callback too
        assert got["split_vs_sequential"] < 1e-6 and got["split_threaded_vs_split"] == 0.0, got
        assert got["split_threaded_backwards"] == len(expected[r["rank"]]), got
        assert "did not run 3F1" in got["left_out"], got["left_out"]
        assert "no pair is running" in got["outside"], got["outside"]
        assert "ran twice in one pair" in got["twice"] or "pipeline step failed" in got["twice"], got["twice"]
        assert "not the step's own micro-batch" in got["other_inputs"] or "pipeline step failed" in got["other_inputs"], \
            got["other_inputs"]


def test_overlap_b_f_plans_keep_each_pair_whole():
    """Without processes: every marked B is directly followed by an F it does not feed, with the transfers of
    both halves before or after the pair (checked by the plan validator), for schedules of 2 to 4 ranks, even
    and uneven rounds, with fully_shard lowering too; the compute order is the unpaired plan's; other
    schedules refuse overlap_b_f; a hand-made pair split by a transfer is refused."""
    from hyper_parallel_ms.pipelining import ScheduleError, build_plan
    from hyper_parallel_ms.pipelining._action import Action, B
    from hyper_parallel_ms.pipelining._pairing import check_pairs

    for pp, n, v in ((2, 4, 2), (2, 3, 2), (3, 5, 2), (4, 8, 2), (4, 6, 3), (4, 2, 2), (2, 4, 1)):
        for fsdp in (False, True):
            plain = build_plan("Interleaved1F1B", pp, n, stages_per_rank=v, fsdp=fsdp)
            paired = build_plan("Interleaved1F1B", pp, n, stages_per_rank=v, fsdp=fsdp, overlap_b_f=True)
            assert paired.paired and all(a.kind is B for a in paired.paired)
            # a pair running at once holds its forward's state before its backward frees one
            assert all(q in (p, p + 1) for p, q in zip(plain.peak_activations(), paired.peak_activations()))
            for rank in range(pp):
                compute = [[a for a in p.actions[rank] if a.kind.is_compute] for p in (plain, paired)]
                assert compute[0] == compute[1]
                acts = paired.actions[rank]
                for i, a in enumerate(acts):
                    if a in paired.paired:
                        assert acts[i + 1].kind is F
    assert build_plan("Interleaved1F1B", 4, 8, overlap_b_f=True).peak_activations() == (12, 10, 8, 6)   # unpaired: 11, 9, 7, 5
    with pytest.raises(ScheduleError, match="Interleaved1F1B"):
        build_plan("1F1B", 2, 4, overlap_b_f=True)
    with pytest.raises(ScheduleError, match="comes next"):
        check_pairs({0: [Action.parse(a) for a in ("0B0", "0SEND_B0", "0F1")]}, frozenset({Action.parse("0B0")}), 1)
    with pytest.raises(ScheduleError, match="max_active_stages >= 2"):
        build_plan("Interleaved1F1B", 2, 4, fsdp=True, max_active_stages=1, overlap_b_f=True)
    # enable_dxdw_split: a pair's backward is its input gradient (I), the weight gradient (W) the next compute
    # action after the pair's forward; a first stage's paired backward stays whole (HyperParallel's)
    from hyper_parallel_ms.pipelining._action import I, W
    for fsdp in (False, True):
        whole = build_plan("Interleaved1F1B", 4, 8, fsdp=fsdp, overlap_b_f=True)
        split = build_plan("Interleaved1F1B", 4, 8, fsdp=fsdp, overlap_b_f=True, dxdw_split=True)
        assert {(a.stage, a.microbatch) for a in split.paired} == {(a.stage, a.microbatch) for a in whole.paired}
        for rank in range(4):
            compute = [a for a in split.actions[rank] if a.kind.is_compute]
            for i, a in enumerate(compute):
                if a in split.paired:
                    assert a.kind is (B if a.stage == 0 else I) and compute[i + 1].kind is F
                    if a.kind is I:
                        assert compute[i + 2] == Action(a.stage, W, a.microbatch)
    with pytest.raises(ScheduleError, match="needs overlap_b_f=True"):
        build_plan("Interleaved1F1B", 2, 4, dxdw_split=True)


def test_meta_step_types_and_the_micro_batch_splitter():
    assert MetaStepType.FWD.action_kind is F and MetaStepType.BWD_SEND.action_kind is SEND_B
    plain = [t for t in MetaStepType if not t.name.startswith("OVERLAP")]
    assert len({t.action_kind for t in plain}) == len(plain) == 11           # every kind of action, once
    for composite in (MetaStepType.OVERLAP_B_F, MetaStepType.OVERLAP_F_B):
        with pytest.raises(ValueError, match="sub_steps"):
            composite.action_kind
    x = ms.Tensor(np.arange(24, dtype=np.float32).reshape(4, 6))
    mask = ms.Tensor(np.arange(12, dtype=np.float32).reshape(3, 4))
    args, kwargs = MicroBatch(2, args_batch_dim=[BatchDimSpec(0)], kwargs_batch_dim={"mask": BatchDimSpec(1),
                                                                                       "scale": -1})(
        (x,), {"mask": mask, "scale": ms.Tensor(2.0)})
    assert [a[0].asnumpy().tolist() for a in args] == [x.asnumpy()[:2].tolist(), x.asnumpy()[2:].tolist()]
    assert [k["mask"].shape for k in kwargs] == [(3, 2), (3, 2)]
    assert all(float(k["scale"].asnumpy()) == 2.0 for k in kwargs)        # -1: given whole
    with pytest.raises(ValueError, match="micro_batch_num"):
        MicroBatch(0)


def test_stage_keywords_are_checked():
    from tests._pipeline_models import Model
    with pytest.raises(TypeError, match="dyn_shape"):
        PipelineStage(Model(1), 0, 1, dyn_shape="yes")
    stage = PipelineStage(Model(1), 0, 1, dyn_shape=True)
    assert stage.dyn_shape and stage._has_backward
    with pytest.raises(ValueError, match="enable_dxdw_split=True.*needs overlap_b_f=True"):
        ScheduleGPipe(stage, 2, lambda o, t: o.mean(), enable_dxdw_split=True)
