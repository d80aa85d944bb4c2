"""The training example: 5 steps on 2 and 4 ranks (tp, and dp x tp) in graph mode and in
PyNative, losses matching a single-device run of the same steps within 1e-4 (relative); with
``--clip-grad-norm`` (active at every step) and ``--activation-checkpoint`` the gradient norms too
(TP and fully_shard compiled as GRAPH_MODE Cells, a pipeline in PyNative).

Why losses and 1e-4 are safe on any x86 CPU under AdamW: the model has no bias before a softmax,
and table rows no token reaches get exactly zero gradients (AdamW leaves them unchanged), so no
parameter is driven by rounding noise; one that were would have a zero loss gradient and move the
loss only to second order. A wrong gradient or update moves the loss by far more than 1e-4."""
from __future__ import annotations

import numpy as np
import pytest

from examples.train_tp import TrainConfig, train
from hyper_parallel_ms.testing import multi_rank


CLIP = 0.2          # below the example's gradient norm at every step: clipping is active


def _train(**overrides):
    cfg = TrainConfig(**{**dict(steps=5, seq=8, dim=32, hidden=64, vocab=64), **overrides})
    result = train(cfg, log=lambda line: None)
    assert len(result["losses"]) == cfg.steps
    assert result["losses"][-1] < result["losses"][0]          # it learns
    assert result["max_relative_difference"] <= 1e-4, (result["losses"], result["reference_losses"])
    if cfg.clip_grad_norm:
        assert min(result["reference_grad_norms"]) > cfg.clip_grad_norm, result["reference_grad_norms"]
        assert result["max_relative_norm_difference"] <= 1e-4, (result["grad_norms"], result["reference_grad_norms"])
    return result["max_relative_difference"]


@pytest.mark.parametrize("mode, loss_parallel", [("jit", True), ("pynative", False)])
@multi_rank(2, timeout=600)
def test_example_trains_on_2_ranks(mode, loss_parallel):
    """Loss parallelism (vocabulary-sharded logits, ParallelCrossEntropy) is the default; the
    pynative case keeps the gathered-logits path of ``--no-loss-parallel``."""
    _train(tp=2, mode=mode, loss_parallel=loss_parallel)


@multi_rank(4, timeout=600)
def test_example_trains_on_4_ranks_dp_x_tp():
    """dp x tp in PyNative. Compiled, the example's model runs on tp=2 (ms.jit above, GRAPH_MODE with
    sequence parallelism in test_example_clips_and_checkpoints_on_2_ranks; the styles without it in
    GRAPH_MODE: tests/test_styles_graph_matrix.py) and dp x tp's gradient reduction in ms.jit and
    GRAPH_MODE on (2, 2) (``tests/test_grad_accumulation.py``): the 4-rank GRAPH_MODE run was the
    suite's slowest test."""
    _train(dp=2, tp=2, mode="pynative")


@pytest.mark.parametrize("mode, checkpoint", [("graph", "full"), ("pynative", "selective")])
@multi_rank(2, timeout=600)
def test_example_clips_and_checkpoints_on_2_ranks(mode, checkpoint):
    """--clip-grad-norm with --activation-checkpoint on tp=2 with sequence parallelism (the clip
    compiled in a GRAPH_MODE train step), then, in PyNative, fully_shard over dp=2 with its blocks
    checkpointed (fully_shard's clip in a GRAPH_MODE Cell: tests/test_clip_grad_norm.py)."""
    _train(tp=2, mode=mode, activation_checkpoint=checkpoint, clip_grad_norm=CLIP, steps=4)
    if mode == "pynative":           # fully_shard units (the blocks) checkpointed whole
        _train(dp=2, tp=1, fsdp=True, mode=mode, activation_checkpoint=checkpoint, clip_grad_norm=CLIP, steps=4)


@pytest.mark.parametrize("schedule, dp, tp, fsdp", [("1f1b", 1, 2, False), ("zb", 2, 1, True),
                                                    ("interleaved", 2, 1, False)])
@multi_rank(4, timeout=600)
def test_example_trains_as_a_pipeline_on_4_ranks(schedule, dp, tp, fsdp):
    """--pp 2 (pp x tp with loss parallelism, clipping by every stage's gradients and checkpointed
    attention / feed-forward; pp x fully_shard over dp with the zero-bubble V schedule; pp x dp with
    gradients averaged over dp, interleaved): 2 steps, losses (and gradient norms) equal to the
    single-device run, one forward per micro-batch (the checkpointed Cells' recompute aside)."""
    clip = CLIP if tp == 2 else 0.0
    cfg = TrainConfig(pp=2, dp=dp, tp=tp, fsdp=fsdp, schedule=schedule, microbatches=2, layers=4, steps=2, seq=8,
                      dim=32, hidden=64, vocab=64, mode="pynative", clip_grad_norm=clip,
                      activation_checkpoint="full" if clip else "")
    result = train(cfg, log=lambda line: None)
    assert len(result["losses"]) == 2 and result["forwards_per_microbatch"] == 1.0
    assert result["max_relative_difference"] <= 1e-4, (result["losses"], result["reference_losses"])
    if clip:
        assert min(result["reference_grad_norms"]) > clip, result["reference_grad_norms"]
        assert result["max_relative_norm_difference"] <= 1e-4, (result["grad_norms"], result["reference_grad_norms"])


# absolute, after 3 AdamW steps of lr 3e-3 (a parameter moves by up to lr a step): measured <= 3.3e-6 here with
# cp, the rounding of gradients near AdamW's eps amplified (the example's default size: 8.9e-6 on tp=2, 2.4e-5 on
# cp=2, see TrainConfig.param_tolerance); 6e-2 when the gradients are not averaged over cp
PARAM_TOLERANCE = 5e-5


def _train_cp(**overrides):
    """``_train`` for --cp (3 steps, PyNative, clip active): also every parameter, gathered whole, against
    the single-device model's, and each checkpointed Cell recomputed once per step (its forward, the
    context-parallel attention and its collectives, run again in the backward)."""
    cfg = TrainConfig(**{**dict(steps=3, seq=8, dim=32, hidden=64, vocab=64, mode="pynative", tp=1,
                                clip_grad_norm=CLIP), **overrides})
    result = train(cfg, log=lambda line: None)
    assert len(result["losses"]) == cfg.steps - result["start_step"]
    assert result["max_relative_difference"] <= 1e-4, (result["losses"], result["reference_losses"])
    assert min(result["reference_grad_norms"]) > cfg.clip_grad_norm, result["reference_grad_norms"]
    assert result["max_relative_norm_difference"] <= 1e-4, (result["grad_norms"], result["reference_grad_norms"])
    if cfg.cp > 1:
        assert result["max_parameter_difference"] <= PARAM_TOLERANCE, result["max_parameter_difference"]
        cells = 2 if cfg.activation_checkpoint in ("full", "selective") and not cfg.fsdp else 1   # attention, ffn
        calls = (cfg.steps - result["start_step"]) * (cfg.microbatches if cfg.pp > 1 else 1)
        expected = cfg.layers // cfg.pp * cells * calls if cfg.activation_checkpoint else 0
        assert result["recomputes"] == expected, (result["recomputes"], expected)
    return result


@multi_rank(2, timeout=600)
def test_example_trains_with_context_parallelism_on_2_ranks():
    """--cp 2: each sequence over 2 ranks (load-balanced shards inside context_parallel, attention
    through scaled_dot_product_attention), the loss averaged over cp: with --fsdp (the blocks and the
    root fully sharded over the flattened dp x cp ranks, which average the gradients) and the blocks
    checkpointed whole (the recompute reruns the context-parallel attention inside the step's
    context_parallel block); with the GradientReducer averaging over cp and attention_core (the
    attentions alone recomputed); then a checkpoint saved at step 2 by a cp x fsdp run resumes as
    tp=2 and as cp x fsdp. Each equal to one device (losses, clipped gradient norms, parameters)."""
    import os
    import shutil
    import tempfile

    import mindspore as ms
    from mindspore.mint import distributed as dist

    _train_cp(cp=2, fsdp=True, activation_checkpoint="full")
    core = _train_cp(cp=2, activation_checkpoint="attention_core")
    # what attention_core keeps: the q, k, v projections of each layer and step; the context-parallel
    # attention (one custom-bprop Cell: its score blocks) and the output projection are recomputed
    layers = TrainConfig().layers
    assert core["saved_ops"] == {"Dense": 3 * layers * 3}, core["saved_ops"]
    holder = [None, None]
    dist.all_gather_object(holder, tempfile.mkdtemp(prefix="hpms_cp_example_") if ms.communication.get_rank() == 0
                           else None)
    try:
        saved = dict(cp=2, fsdp=True, checkpoint_dir=holder[0])
        train(TrainConfig(steps=2, save_every=2, check=False, seq=8, dim=32, hidden=64, vocab=64, mode="pynative",
                          tp=1, clip_grad_norm=CLIP, **saved), log=lambda line: None)
        assert _train_cp(tp=2, resume=True, checkpoint_dir=holder[0])["start_step"] == 2
        assert _train_cp(resume=True, **saved)["start_step"] == 2
    finally:
        dist.barrier()
        if ms.communication.get_rank() == 0:
            shutil.rmtree(holder[0], ignore_errors=True)


@multi_rank(4, timeout=600)
def test_example_trains_with_context_parallelism_composed_on_4_ranks():
    """--cp 2 with, on 4 ranks: --tp 2 (heads over tp, sequence parallelism on each cp shard, the
    attention and feed-forward checkpointed selectively); --dp 2 (gradients averaged over dp x cp by
    the GradientReducer); --dp 2 --fsdp (fully_shard over the flattened dp x cp); --pp 2 (each stage
    with its cp group, the schedule run inside the step's context_parallel block, 1F1B, the stages
    fully sharded over cp and checkpointed whole). 3 steps each, equal to one device."""
    _train_cp(cp=2, tp=2, activation_checkpoint="selective")
    _train_cp(cp=2, dp=2)
    _train_cp(cp=2, dp=2, fsdp=True)
    _train_cp(cp=2, pp=2, fsdp=True, activation_checkpoint="full", schedule="1f1b", microbatches=2)


def test_context_parallel_flags_that_cannot_run_are_refused_naming_the_fix():
    from examples.train_tp import check_context_parallel

    with pytest.raises(ValueError, match="drop --compile-stages"):
        check_context_parallel(TrainConfig(cp=2, pp=2, mode="pynative", compile_stages=True, loss_parallel=False))
    with pytest.raises(ValueError, match="drop --hsdp-replicate"):
        check_context_parallel(TrainConfig(cp=2, dp=2, fsdp=True, hsdp_replicate=2, mode="pynative"))
    with pytest.raises(ValueError, match="--cp runs in --mode pynative"):
        check_context_parallel(TrainConfig(cp=2, mode="jit"))
    with pytest.raises(ValueError, match="--seq 12 must divide by 2 x cp = 8"):
        check_context_parallel(TrainConfig(cp=4, seq=12, mode="pynative"))
    with pytest.raises(ValueError, match="--batch 4 must divide by --dp 3"):
        check_context_parallel(TrainConfig(cp=2, dp=3, mode="pynative"))
    check_context_parallel(TrainConfig(cp=2, tp=2, seq=16, mode="pynative"))
    check_context_parallel(TrainConfig(cp=2, dp=2, pp=2, fsdp=True, checkpoint_dir="ckpt", mode="pynative",
                                       activation_checkpoint="attention_core"))


def test_checkpoint_and_clip_flags_that_cannot_run_are_refused_naming_the_fix():
    from examples.train_tp import check_training_config

    with pytest.raises(ValueError, match="selective .* use --mode pynative, not 'jit'"):
        check_training_config(TrainConfig(mode="jit", activation_checkpoint="selective"))
    with pytest.raises(ValueError, match="--activation-checkpoint must be full or selective"):
        check_training_config(TrainConfig(activation_checkpoint="some"))
    with pytest.raises(ValueError, match="--fsdp .* runs in --mode pynative"):
        check_training_config(TrainConfig(mode="graph", fsdp=True, activation_checkpoint="full"))
    with pytest.raises(ValueError, match="--clip-grad-norm must be a positive norm"):
        check_training_config(TrainConfig(clip_grad_norm=-1.0))
    check_training_config(TrainConfig(mode="graph", activation_checkpoint="full", clip_grad_norm=1.0))


@multi_rank(2, timeout=600)
def test_example_trains_compiled_pipeline_stages_on_2_ranks():
    """--pp 2 --tp 1 --compile-stages --activation-checkpoint full: each stage's forward (the loss
    with the last) one ms.jit graph with the attention and feed-forward Cells marked for MindSpore's
    graph recompute, its backward that graph's backward; losses equal to the single-device run, one
    forward per micro-batch."""
    cfg = TrainConfig(pp=2, tp=1, schedule="1f1b", microbatches=2, layers=2, steps=2, seq=8, dim=32, hidden=64,
                      vocab=64, mode="pynative", compile_stages=True, loss_parallel=False,
                      activation_checkpoint="full")
    result = train(cfg, log=lambda line: None)
    assert len(result["losses"]) == 2 and result["forwards_per_microbatch"] == 1.0
    assert result["max_relative_difference"] <= 1e-4, (result["losses"], result["reference_losses"])


@multi_rank(2, timeout=600)
def test_pipeline_checkpoints_resume_with_and_without_pipelining():
    """--pp 2 (1F1B, one stage per rank) saves each rank's stage (full-model keys) every step;
    training resumes from step 1 as pp=1 x tp=2 and from step 2 as pp=2 GPipe, each equal to the
    uninterrupted single-device run."""
    import os
    import shutil
    import tempfile

    import mindspore as ms
    from mindspore.mint import distributed as dist

    from examples.checkpoints import latest_checkpoint

    holder = [None, None]
    dist.all_gather_object(holder, tempfile.mkdtemp(prefix="hpms_pp_example_") if ms.communication.get_rank() == 0
                           else None)
    base = holder[0]
    small = dict(seq=8, dim=32, hidden=64, vocab=64, layers=2, mode="pynative", microbatches=2, checkpoint_dir=base)
    quiet = {"log": lambda line: None}
    try:
        first = train(TrainConfig(pp=2, tp=1, schedule="1f1b", steps=2, save_every=1, check=False, **small), **quiet)
        assert latest_checkpoint(base) == os.path.join(base, "step_2")
        dist.barrier()
        if ms.communication.get_rank() == 0:
            shutil.move(os.path.join(base, "step_2"), os.path.join(base, "later"))
        dist.barrier()
        as_tp = train(TrainConfig(pp=1, tp=2, steps=2, resume=True, **small), **quiet)       # from step 1
        assert as_tp["start_step"] == 1 and len(as_tp["losses"]) == 1
        np.testing.assert_allclose(as_tp["losses"][0], first["losses"][1], rtol=1e-5)
        assert as_tp["max_relative_difference"] <= 1e-4, (as_tp["losses"], as_tp["reference_losses"])
        dist.barrier()
        if ms.communication.get_rank() == 0:
            shutil.move(os.path.join(base, "later"), os.path.join(base, "step_2"))
        dist.barrier()
        as_pp = train(TrainConfig(pp=2, tp=1, schedule="gpipe", steps=3, resume=True, **small), **quiet)
        assert as_pp["start_step"] == 2 and len(as_pp["losses"]) == 1
        assert as_pp["max_relative_difference"] <= 1e-4, (as_pp["losses"], as_pp["reference_losses"])
    finally:
        dist.barrier()
        if ms.communication.get_rank() == 0:
            shutil.rmtree(base, ignore_errors=True)


def test_pipeline_flags_that_cannot_run_are_refused_naming_the_fix():
    from examples.train_pp import check_pipeline_config

    with pytest.raises(ValueError, match="use --mode pynative, not 'jit'"):
        check_pipeline_config(TrainConfig(pp=2, mode="jit"))
    with pytest.raises(ValueError, match="makes 4 stages but the model has 2 layers: use --layers 4"):
        check_pipeline_config(TrainConfig(pp=2, mode="pynative", schedule="interleaved"))
    with pytest.raises(ValueError, match="4 rows do not split into --microbatches 3"):
        check_pipeline_config(TrainConfig(pp=2, mode="pynative", microbatches=3))
    with pytest.raises(ValueError, match="--schedule must be one of"):
        check_pipeline_config(TrainConfig(pp=2, mode="pynative", schedule="dualpipe"))
    with pytest.raises(ValueError, match="--compile-stages compiles plain and tensor-parallel stages with a "
                                         "one-hot loss: add --no-loss-parallel"):
        check_pipeline_config(TrainConfig(pp=2, tp=2, mode="pynative", compile_stages=True))
    with pytest.raises(ValueError, match="drop --fsdp"):
        check_pipeline_config(TrainConfig(pp=2, tp=1, mode="pynative", compile_stages=True, loss_parallel=False,
                                          fsdp=True))
    check_pipeline_config(TrainConfig(pp=2, tp=2, mode="pynative", compile_stages=True, loss_parallel=False))
    with pytest.raises(ValueError, match="use --schedule gpipe or 1f1b, not 'zb' \\(2 stages per rank\\)"):
        check_pipeline_config(TrainConfig(pp=2, mode="pynative", schedule="zb", layers=4, checkpoint_dir="ckpt"))
    with pytest.raises(ValueError, match="use --activation-checkpoint full or another --schedule"):
        check_pipeline_config(TrainConfig(pp=2, mode="pynative", schedule="zb", layers=4,
                                          activation_checkpoint="attention_core"))
    check_pipeline_config(TrainConfig(pp=2, mode="pynative"))          # the defaults run
