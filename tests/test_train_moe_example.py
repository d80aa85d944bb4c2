"""The MoE training example (``examples/train_moe.py``): 3 AdamW steps of the DeepSeek-style model (2 blocks of
attention + MoE with 4 routed experts, top-2, sigmoid router with an expert bias, one shared expert) with
ep=2 (ExpertParallel, the dense parts replicated) and with ep=2 x tp=2 (ExpertTensorParallel, attention heads,
shared expert, embedding and head tensor-parallel), each against one device training the same steps on the
whole batch; and 2 steps of each with its blocks checkpointed (full recompute on ep=2, the selective policy on
ep=2 x tp=2), the single-device run not checkpointed, at the same tolerances.

Tolerances: the losses and the whole gradient's norm (sharded pieces combined) within 1e-5 relative: fp32
sums in another order differ by ~1e-7 (measured: losses 1.2e-7, norms 8e-8 and 5e-7); a dense gradient
left unsummed over ep or summed twice changes the norm by far more (the norm catches what AdamW's scale
invariance would hide from the losses). Every parameter (expert bias and counters included, sharded ones
gathered) within 1e-5 absolute: three AdamW steps move an element by up to ~3 lr = 9e-3, fp32 rounding of
the gradients moves the update by far less (measured 3.4e-6 and 2.4e-6, the embedding table); dense
gradients left unsummed over ep move the parameters by 7e-2 and the norm by 76%. The expert bias, updated
by sign from integer counts summed over ep, matches exactly as long as every token picks the same experts.
"""
from __future__ import annotations

from examples.train_moe import MoETrainConfig, train
from hyper_parallel_ms.testing import multi_rank


def _train(**overrides) -> None:
    cfg = MoETrainConfig(**{**dict(steps=3), **overrides})
    result = train(cfg, log=lambda line: None)
    assert len(result["losses"]) == cfg.steps and result["losses"][-1] < result["losses"][0]        # it learns
    assert result["recomputes"] == (cfg.layers * cfg.steps if cfg.activation_checkpoint else 0)
    assert result["max_relative_difference"] <= 1e-5, (result["losses"], result["reference_losses"])
    assert result["max_relative_norm_difference"] <= 1e-5, (result["grad_norms"], result["reference_grad_norms"])
    assert result["parameters_checked"] == 33
    assert result["max_parameter_difference"] <= 1e-5, (result["worst_parameter"], result["max_parameter_difference"])


@multi_rank(2, timeout=600)
def test_moe_example_trains_with_ep2_equal_to_one_device():
    _train(ep=2, tp=1)
    _train(ep=2, tp=1, steps=2, activation_checkpoint="full")       # each block's recompute runs its dispatch again


@multi_rank(4, timeout=600)
def test_moe_example_trains_with_ep2_x_tp2_equal_to_one_device():
    _train(ep=2, tp=2)
    _train(ep=2, tp=2, steps=2, activation_checkpoint="selective")


def test_dry_run_reports_each_rank_s_expert_and_dense_pieces():
    """The planner (``simulate``, one process, no values) on the example's model placed by its own
    ``parallelize_moe`` (memory only: a step's token moves need the routing, see docs/expert-parallel.md):
    each rank's parameter bytes are the routed experts over ep x tp, the tensor-parallel dense parts over tp,
    the rest (norms, router gate, expert bias, counters) whole; AdamW's two moments per trainable piece."""
    from mindspore import nn

    from examples.moe import MoEConfig, MoEModel, is_expert_parameter, parallelize_moe
    from hyper_parallel_ms import no_init_parameters, simulate

    cfg = MoEConfig(vocab=64, dim=32, layers=2, heads=4, moe_hidden=32, experts=8)
    whole = MoEModel(cfg)
    split_over_tp = ("tok_embeddings.", "attention.w", "shared_experts.w", "output.")

    def build(mesh):
        with no_init_parameters():
            model = MoEModel(cfg)
        parallelize_moe(model, mesh)
        return model, nn.AdamWeightDecay(model.trainable_params())

    for ep, tp in [(1, 1), (4, 1), (2, 2)]:
        report = simulate(build, mesh_shape=(ep, tp), mesh_dim_names=("ep", "tp"), device_type="cpu")
        assert not report.problems, report.problems
        want = trainable = 0
        for p in whole.get_parameters():
            nbytes = p.size * 4
            if is_expert_parameter(p.name):
                nbytes //= ep * tp
            elif tp > 1 and any(part in p.name for part in split_over_tp):
                nbytes //= tp
            want += nbytes
            trainable += nbytes if p.requires_grad else 0
        for rank in range(ep * tp):
            assert report[rank].param_bytes == want, (ep, tp, rank, report[rank].param_bytes, want)
            assert report[rank].optimizer_bytes == 2 * trainable, (ep, tp, rank)
