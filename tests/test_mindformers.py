"""MindFormers 2.1.0's PyNative training stack on this library: its PyNativeQwen3ForCausalLM,
parallelized by its own ``parallelize_model`` / ``ParallelismConfig`` over HyperParallel's API
(served by ``alias_hyper_parallel``), trains 3 AdamW steps on 2 CPU ranks equal to one device:
TP=2 with sequence parallelism, FSDP over dp=2, and context parallelism cp=2 (MindFormers' colossal
and Ulysses methods, on its flash attention with the compressed causal mask: one sequence of 2048).
MindFormers' pipeline path does not build a Qwen3 model in 2.1.0 (its stage builder passes
``layer_start``, which PyNativeQwen3ForCausalLM does not take): see docs/mindformers.md; it builds its
DeepSeek-V3, which its Trainer trains over pp=2 (and pp=2 x tp=2 on 4 ranks). And
MindFormers' MoE, PyNativeDeepseekV3ForCausalLM at tiny sizes, with its own expert parallelism over
ep=2 (experts sharded, tokens exchanged by all-to-all): over the dp ranks (dense parameters fully
sharded over dp=2; the token permutation written out and fused) and over the ranks of TP=2 with
sequence parallelism. And MindFormers' Muon optimizer on sharded weights (its point-to-point strategy, through
HyperParallel's redistribution inference on DTensor layouts; on 2 ranks, and on a 2 x 2 mesh of 4). And its ``Trainer`` end to end (TP=2 + SP,
FSDP over dp=2): ``loss.backward(sense)`` (``enable_mindspore_backward_compat``), its global gradient norm
and clipping on ``param.grad`` (DTensors), its own AdamW. One rank call runs them all (24 s at load 4 to 75 s at load 10, measured on
2 shared cores; the context-parallel runs and their one-device reference, sequence 2048, about half
of it; the MoE runs 8 to 25 s)."""
from __future__ import annotations

import numpy as np
import pytest

from hyper_parallel_ms.testing import run_on_ranks

from tests._mindformers_qwen3 import available, run_all

pytestmark = pytest.mark.skipif(available() is not None, reason=str(available()))

STEPS = 3


@pytest.fixture(scope="module")
def runs():
    return run_on_ranks(run_all, 2, STEPS, timeout=600)


def _assert_params_equal(params, reference):
    # rtol 1e-4 of each parameter's largest value: AdamW turns a gradient's float32 rounding into
    # up to lr-sized differences on elements whose gradient is near zero (measured worst: 1.0e-4
    # of the largest value for TP, 1e-5 for FSDP; lr 1e-2, 3 steps)
    assert set(params) == set(reference)
    for name, ref in reference.items():
        np.testing.assert_allclose(params[name], ref, rtol=1e-4, atol=1.5e-4 * np.abs(ref).max(), err_msg=name)


def test_tensor_parallel_with_sequence_parallel_trains_as_one_device(runs):
    ref_losses, ref_params = runs[0]["one_device"]
    assert ref_losses[-1] < ref_losses[0]                          # it trains
    for rank in runs:
        losses, params = rank["tp2_sp"]
        np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)  # both ranks see the whole batch
        _assert_params_equal(params, ref_params)


def test_fully_shard_over_two_data_parallel_ranks_trains_as_one_device(runs):
    ref_losses, ref_params = runs[0]["one_device"]
    # each rank trains on its own row: the one-device loss is their mean
    mean = np.mean([rank["fsdp_dp2"][0] for rank in runs], axis=0)
    np.testing.assert_allclose(mean, ref_losses, rtol=1e-5)
    for rank in runs:
        _assert_params_equal(rank["fsdp_dp2"][1], ref_params)


@pytest.mark.parametrize("method, ulysses_degree", [("colossal", 1), ("ulysses", 2)])
def test_context_parallel_trains_as_one_device(runs, method, ulysses_degree):
    ref_losses, ref_params = runs[0]["one_device_cp"]
    # each rank's loss is the mean over its half of the sequence: the one-device loss is their mean
    mean = np.mean([rank[f"cp2_{method}"][0] for rank in runs], axis=0)
    np.testing.assert_allclose(mean, ref_losses, rtol=1e-5)
    for rank in runs:
        _, params, applied = rank[f"cp2_{method}"]
        assert applied == (method, ulysses_degree)          # what MindFormers' parallelize_model applied
        # measured worst: 1.3e-5 of the largest value (both methods; gradients within 1e-5 relative)
        _assert_params_equal(params, ref_params)


@pytest.mark.parametrize("case, reference, data_parallel", [
    ("moe_ep2", "one_device_moe", 2),                    # ep over the dp ranks, dense parameters FSDP
    ("moe_ep2_fused", "one_device_moe_fused", 2),        # the same with moe_token_permute / unpermute
    ("moe_tp2_sp_ep2", "one_device_moe", 1),             # ep over the tp ranks, dense parameters TP + SP
])
def test_moe_with_expert_parallelism_trains_as_one_device(runs, case, reference, data_parallel):
    from tests._mindformers_moe import EXPERT_BIAS, EXPERTS
    ref_losses, ref_params = runs[0][reference]
    # it trains: the first step lowers the loss (lr 1e-2 makes the third overshoot, here as on ep=2)
    assert ref_losses[1] < ref_losses[0]
    # dp=2: each rank trains on its own row, the one-device loss (all tokens counted) is their mean;
    # dp=1: each rank's loss is the whole batch's (measured: 1.1e-7 and 4.2e-7 relative)
    losses = np.array([rank[case][0] for rank in runs])
    np.testing.assert_allclose(losses.mean(0), ref_losses, rtol=1e-5)
    if data_parallel == 1:
        np.testing.assert_allclose(losses, [ref_losses] * len(runs), rtol=1e-5)
    for rank in runs:
        _, params, applied = rank[case]
        experts = {k: v for k, v in applied.items() if ".experts.weight" in k}
        assert len(experts) == 4 and all(shape[0] == EXPERTS // 2 for shape in experts.values())   # 2 of 4 experts
        # per step and MoE layer: the counts, the tokens out and back, and the backward of both token moves
        assert applied["all_to_all_single"] == STEPS * 2 * 5
        # measured worst: 1.6e-5 (dp) and 3.2e-5 (tp) of the largest value; the expert bias (updated from
        # the token counts summed over the ranks after each step, as MindFormers' trainer does) equal
        _assert_params_equal(params, ref_params)
        for name, ref in ref_params.items():
            if name.endswith(".expert_bias"):
                assert np.abs(ref - EXPERT_BIAS).max() > 1e-3                 # the update moved it
                np.testing.assert_allclose(params[name], ref, rtol=1e-6, err_msg=name)


def test_mindformers_muon_steps_sharded_weights_as_one_device(runs):
    """MindFormers' Muon (``allgather_deredundency``): each 2-D weight's shards go to one owner rank by
    point-to-point ops planned with HyperParallel's ``RedistributionOperatorInfer`` on the DTensor's layout, the
    owner runs Newton-Schulz (split by MindFormers' per-head rule for linear_qb) and sends each rank its slice
    (``_infer_slice_area_by_rank``). Equal to one device bit for bit: the owner computes on the same whole
    matrix with the same kernels, and the gathers and slices move values unchanged (measured difference 0.0;
    a reversed gather group or slice order makes it 1.2e-2, the size of a step). Its default ``allgather``
    strategy on the same DTensors (every rank gathers, runs Newton-Schulz, keeps its piece of the bfloat16
    result by ``distribute_tensor``): equal too, bit for bit."""
    from tests._mindformers_muon import SHARDS
    owners = set()
    for rank in runs:
        result = rank["muon_deredundancy"]
        for name, shard in SHARDS.items():
            assert result["change"][name] > 1e-3                               # the weight moved
            assert result["difference"][name] == 0.0, name
            assert result["allgather_difference"][name] == 0.0, name
            decision, ops = result["decisions"][name]
            if shard is None:                                                  # replicated: nothing to move
                assert (decision, ops) == ("p2p_replica_local", [])
            else:
                assert (decision, ops) == ("p2p_shard_domain", [("all_concat", (shard, 2, [0, 1]))])
                assert result["local_shapes"][name][shard] * 2 == {0: 12, 1: 16}[shard]
                owners.add(result["owners"][name])
    assert owners == {0, 1}                                                    # both directions sent
    # its all-gather fallback: ops inferred, group from get_platform().create_group, all_gather_into_tensor
    assert all(rank["muon_deredundancy"]["fallback_gather"] == 0.0 for rank in runs)


def test_mindformers_trainer_trains_as_one_device(runs):
    """MindFormers' ``Trainer`` end to end (tests/_mindformers_trainer.py): built from a config dict, the model and
    a MindSpore dataset; its ``enable_mindspore_backward_compat`` (this library's), its parallelization (TP=2 + SP;
    FSDP over dp=2, each dp rank reading its row), ``init_states``, its AdamW and constant schedule from the
    config, ``train()``: ``loss.backward(sense)``, ``_calculate_global_grad_norm`` on ``param.grad`` (DTensors laid
    out like the parameters: the norm counts a tensor-parallel replica once) clipped at 0.5, AdamW on the local
    pieces. Against its trainer step on one device, whose ``loss.backward`` gradients equal
    ``ms.value_and_grad``'s and whose clipping scaled every gradient."""
    ref_losses, ref_norms, ref_params, ref_checks = runs[0]["backward_one_device"]
    assert ref_losses[-1] < ref_losses[0]
    assert ref_checks["value_and_grad"] == 0.0              # loss.backward() gives ms.value_and_grad's gradients
    assert ref_checks["clipping"] <= 1e-6                   # the optimizer got them times the coefficient (9e-8)
    assert min(ref_norms) > 0.5                             # every step clipped
    for rank in runs:
        for case, tensor_parallel, data_parallel in (("trainer_tp2_sp", 2, 1), ("trainer_fsdp_dp2", 1, 2)):
            losses, norms, params, built = rank[case]
            assert built == {"model": ["FSDPPyNativeQwen3ForCausalLM"], "optimizer": "AdamW",
                             "tensor_parallel": tensor_parallel, "data_parallel": data_parallel}, built
            # its step-end loss is averaged over the ranks; the global norm over all ranks equals one device's
            # (were a replica counted twice: 6e-4 relative off)
            np.testing.assert_allclose(losses, ref_losses, rtol=1e-5, err_msg=case)
            np.testing.assert_allclose(norms, ref_norms, rtol=1e-5, err_msg=case)
            # AdamW (lr 1e-2) turns float32 rounding of near-zero gradients into steps of up to lr: measured
            # worst 1.3e-4 (TP, one element), 6.7e-6 (FSDP); bound: a tenth of one step
            for name, ref in ref_params.items():
                np.testing.assert_allclose(params[name], ref, rtol=1e-4, atol=1e-3, err_msg=f"{case} {name}")


def test_mindformers_trainer_checkpoint_resumes_as_an_uninterrupted_run(runs):
    """MindFormers' checkpoint callback (model and AdamW states per rank, its layout metadata from
    HyperParallel's ``get_current_layout``) after 2 steps of TP=2 + SP, loaded by its Trainer into TP=2 + SP and
    into FSDP over dp=2 (its loader reshards the pieces by those layouts), and its DeepSeek-V3 over pp=2 (each
    stage saved and loaded on its rank): the third step's loss and the parameters after it equal the
    uninterrupted 3-step run's. The AdamW moments are clones of the sharded
    parameters and keep their layouts (a clone reported as a whole tensor of the piece's shape stored every
    rank's moments under one name: resumed in place, the step after the resume was 5e-2 off in loss; resharded,
    the load failed on their shapes)."""
    for rank in runs:
        for case, uninterrupted in (("tp2_sp", "trainer_tp2_sp"), ("fsdp_dp2", "trainer_tp2_sp"),
                                    ("pp2_moe", "trainer_pp2_moe")):
            losses, _, params, _ = rank[uninterrupted]
            resumed_losses, resumed = rank["trainer_resumed"][case]
            np.testing.assert_allclose(resumed_losses, losses[-1:], rtol=1e-5, err_msg=case)   # pp: the last stage's
            assert resumed.keys() == params.keys(), case
            for name, value in params.items():
                np.testing.assert_allclose(resumed[name], value, rtol=1e-4, atol=1e-3, err_msg=f"{case} {name}")


def test_mindformers_trainer_pipeline_trains_as_one_device(runs):
    """MindFormers' pipeline path through its ``Trainer``: ``parallelize_model`` for ``pipeline_parallel=2`` builds
    each rank's stage of its DeepSeek-V3 (layer 0 with the embedding, layer 1 with the head) as its
    ``ScaledLossPipelineStage`` and its schedule as HyperParallel's ``Schedule1F1B`` (no loss_fn: the last stage's
    output is the loss; the keyword inputs go to every stage; the gradients into ``param.grad``); its
    ``training_pp_step`` over 2 micro-batches, its clipped global norm over both stages, its AdamW, its
    expert-bias update; against the trainer step on one device."""
    ref_losses, ref_norms, ref_params, _ = runs[0]["backward_one_device_moe"]
    held = {}
    for rank in runs:
        losses, norms, params, built = rank["trainer_pp2_moe"]
        assert built["schedule"] == "Schedule1F1B" and built["stages"] == ["ScaledLossPipelineStage"]
        if losses:                                           # the last stage's rank: the micro-batches' mean
            np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
        np.testing.assert_allclose(norms, ref_norms, rtol=1e-5)     # the global norm over both stages
        held.update(params)
        # measured worst: 4.7e-6 (an expert's weight); the expert bias (its update from the token counts) too
        for name, value in params.items():
            np.testing.assert_allclose(value, ref_params[name], rtol=1e-4, atol=1e-4, err_msg=name)
    assert [r["trainer_pp2_moe"][3]["layers"] for r in runs] == [["0"], ["1"]]
    assert set(held) == set(ref_params)                      # every parameter on one of the stages
    assert sum(bool(r["trainer_pp2_moe"][0]) for r in runs) == 1


@pytest.fixture(scope="module")
def four_ranks():
    from tests._mindformers_trainer import four_rank_runs
    return run_on_ranks(four_rank_runs, 4, STEPS, timeout=600)


def test_mindformers_trainer_pipeline_with_tensor_parallelism_trains_as_one_device(four_ranks):
    """Its Trainer over pp=2 x tp=2 on 4 ranks (its DeepSeek-V3: each stage's layer tensor-parallel with sequence
    parallelism over its 2 ranks, the stage built by its ``StageModelBuilder`` with the tp mesh; its
    ``init_states`` filling DTensor pieces; the clipped global norm over both axes): losses (on the last stage's
    ranks), norms and every parameter against the trainer step on one device (measured: losses 2e-7, parameters
    9e-5 of the largest value at worst, AdamW's rounding of near-zero gradients, the bound of the pp=2 test)."""
    ref_losses, ref_norms, ref_params, _ = four_ranks[0]["reference"]
    held = {}
    for rank, result in enumerate(four_ranks):
        losses, norms, params, built = result["pp2_tp2"]
        assert (built["tensor_parallel"], built["schedule"], built["layers"]) == (2, "Schedule1F1B", [str(rank // 2)])
        if losses:
            np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
        np.testing.assert_allclose(norms, ref_norms, rtol=1e-5)
        held.update(params)
        for name, value in params.items():
            np.testing.assert_allclose(value, ref_params[name], rtol=1e-4, atol=1e-4, err_msg=name)
    assert set(held) == set(ref_params)
    assert [bool(r["pp2_tp2"][0]) for r in four_ranks] == [False, False, True, True]      # the last stage's ranks


def test_mindformers_muon_on_a_two_dimensional_mesh_as_one_device(four_ranks):
    """MindFormers' Muon (``allgather_deredundency``) on a 2 x 2 mesh: a weight sharded over both mesh dims on one
    tensor dim (one all_concat over the 4 ranks), one sharded on two tensor dims (two all_concats, over the
    column and the row of the rank), one sharded on one mesh dim and replicated over the other (its replica-local
    path: an owner in each replica group, ranks 0 and 2); 2 steps equal to one device bit for bit, and its
    default ``allgather`` strategy too (measured difference 0.0)."""
    from tests._mindformers_muon import SHARDS_2D
    for rank, r in enumerate(four_ranks):
        result = r["muon_2d"]
        for name in SHARDS_2D:
            assert result["change"][name] > 1e-3, name
            assert result["difference"][name] == 0.0 and result["allgather_difference"][name] == 0.0, name
        row, column = [rank - rank % 2, rank - rank % 2 + 1], [rank % 2, rank % 2 + 2]
        decisions = result["decisions"]
        assert decisions["decoder.layers.0.self_attention.linear_qb.weight"] == (
            "p2p_shard_domain", [("all_concat", (0, 4, [0, 1, 2, 3]))])
        assert decisions["decoder.layers.0.mlp.linear_fc2.weight"] == (
            "p2p_shard_domain", [("all_concat", (0, 2, column)), ("all_concat", (1, 2, row))])
        assert decisions["decoder.layers.0.self_attention.linear_proj.weight"] == (
            "p2p_replica_local", [("all_concat", (1, 2, row))])
        assert result["owners"]["decoder.layers.0.self_attention.linear_proj.weight"] == row[0]
        assert result["fallback_gather"] == 0.0
