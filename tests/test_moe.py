"""Mixture of experts: the router's tie-breaking and arguments, the dropless layer against a numpy reference
and compiled, and expert parallelism on 2 CPU ranks (each with its own tokens) equal to one device: outputs,
expert gradients, dense gradients summed over the ranks, the aux-loss-free bias update; composed with
fully_shard, activation checkpointing (the recompute's dispatch, counts, a diverging recompute refused),
the distributed checkpoint (ep=2 to one device; model and Adam state ep=2 to ep=4 and one device) and, on 4
ranks, with ExpertTensorParallel / TensorParallel and pipeline stages (pp=2 x ep=2)."""
from __future__ import annotations

import mindspore as ms
import numpy as np
import pytest
from mindspore import nn

from hyper_parallel_ms.moe import (ExpertParallel, GroupedExperts, MoE, TensorParallel,
                                   TokenChoiceTopKRouter, auxiliary_loss, update_expert_bias)
from hyper_parallel_ms.testing import multi_rank

RTOL, ATOL = 1e-5, 1e-6      # fp32: sums of a few dozen products of values below one


def _moe(seed: int = 0, **options) -> MoE:
    np.random.seed(seed)
    ms.set_seed(seed)
    return MoE(dim=16, hidden_dim=32, num_experts=4, top_k=2, num_shared_experts=1, **options)


def _grads(model, x, weights, scale):
    params = model.trainable_params()

    def loss(v):
        return (model(v) * weights).sum() / scale
    return dict(zip([p.name for p in params], ms.grad(loss, None, params)(x)))


def _silu(a):
    return a / (1 + np.exp(-a))


def _numpy_moe(model: MoE, x: np.ndarray):
    """One device, token by token: the router's probabilities (softmax or sigmoid), top-k of them plus the
    expert bias (ties: lower index, argsort being stable), scores normed and scaled, each expert's SwiGLU on
    the token weighted before (or its output after), plus the shared expert. Returns (the output, the tokens
    per expert, the probabilities)."""
    router = model.router
    tokens = x.reshape(-1, model.dim)
    logits = tokens @ router.gate.weight.asnumpy().T
    if router.score_func == "sigmoid":
        probs = 1 / (1 + np.exp(-logits))
    else:
        probs = np.exp(logits - logits.max(1, keepdims=True))
        probs /= probs.sum(1, keepdims=True)
    bias = 0 if model.expert_bias is None else model.expert_bias.asnumpy()
    top = np.argsort(-(probs + bias), 1, kind="stable")[:, :model.top_k]
    scores = np.take_along_axis(probs, top, 1)
    if router.route_norm:
        scores = scores / (scores.sum(1, keepdims=True) + 1e-20)
    scores = scores * router.route_scale
    w1, w2, w3 = (getattr(model.experts, n).asnumpy() for n in ("w1", "w2", "w3"))
    out = np.zeros_like(tokens)
    for t, row in enumerate(tokens):
        for e, score in zip(top[t], scores[t]):
            v = row * score if model.score_before_experts else row
            y = (_silu(v @ w1[e].T) * (v @ w3[e].T)) @ w2[e].T
            out[t] += y if model.score_before_experts else y * score
    shared = model.shared_experts
    out += (_silu(tokens @ shared.w1.weight.asnumpy().T) * (tokens @ shared.w3.weight.asnumpy().T)) \
        @ shared.w2.weight.asnumpy().T
    return out.reshape(x.shape), np.bincount(top.reshape(-1), minlength=model.num_experts), probs


def test_router_breaks_ties_toward_the_lower_expert_and_checks_its_arguments():
    x = ms.Tensor(np.random.default_rng(0).standard_normal((5, 8)).astype(np.float32))
    for score_func in ("softmax", "sigmoid"):
        router = TokenChoiceTopKRouter(8, 4, 3, score_func=score_func, route_norm=True, route_scale=2.0)
        router.gate.weight.set_data(ms.Tensor(np.zeros((4, 8), np.float32)))          # every score ties
        scores, experts, counts = router(x)
        assert experts.asnumpy().tolist() == [[0, 1, 2]] * 5 and counts.asnumpy().tolist() == [5, 5, 5, 0]
        np.testing.assert_allclose(scores.asnumpy(), np.full((5, 3), 2 / 3), rtol=1e-6)
        bias = ms.Tensor(np.array([0, 0, 0, 1e-3], np.float32))                         # selection only
        scores, experts, _ = router(x, bias)
        assert experts.asnumpy().tolist() == [[3, 0, 1]] * 5
        np.testing.assert_allclose(scores.asnumpy(), np.full((5, 3), 2 / 3), rtol=1e-6)
    for kwargs, err, match in [(dict(top_k=5), ValueError, "top_k must be at most num_experts"),
                               (dict(score_func="relu"), ValueError, "score_func must be one of"),
                               (dict(route_norm=1), TypeError, "route_norm must be True or False"),
                               (dict(num_experts=0), ValueError, "num_experts must be a positive int")]:
        with pytest.raises(err, match=match):
            TokenChoiceTopKRouter(**{**dict(dim=8, num_experts=4, top_k=2), **kwargs})
    with pytest.raises(ValueError, match="load_balance_coeff must be None or a positive number"):
        MoE(8, 16, 4, 2, load_balance_coeff=0)


def test_moe_layer_matches_numpy_and_compiles():
    """Dropless routing, tokens sorted by expert, shared expert: values and counts against a token-by-token
    numpy reference (softmax; sigmoid with route_norm, route_scale, an expert bias, scores after the experts);
    the aux-loss-free bias update and the classic auxiliary loss against their formulas; ms.jit (the experts on
    static shapes, the auxiliary loss's gradient included) gives the PyNative values and gradients."""
    x = ms.Tensor(np.random.default_rng(1).standard_normal((2, 5, 16)).astype(np.float32))
    for options in ({}, dict(score_func="sigmoid", route_norm=True, route_scale=2.5, load_balance_coeff=0.1,
                             score_before_experts=False)):
        model = _moe(**options)
        if model.expert_bias is not None:
            model.expert_bias.set_data(ms.Tensor(np.array([0.0, 0.3, -0.2, 0.1], np.float32)))
        want, counts, _ = _numpy_moe(model, x.asnumpy())
        np.testing.assert_allclose(model(x).asnumpy(), want, rtol=RTOL, atol=ATOL)
        np.testing.assert_array_equal(model.tokens_per_expert.asnumpy(), counts)      # 10 tokens x top-2
        if model.expert_bias is not None:          # delta = coeff * sign(mean - counts), centred; counts reset
            delta = 0.1 * np.sign(counts.mean() - counts)
            bias = model.expert_bias.asnumpy() + delta - delta.mean()
            assert update_expert_bias(model) == 1 and not model.tokens_per_expert.asnumpy().any()
            np.testing.assert_allclose(model.expert_bias.asnumpy(), bias, rtol=1e-6, atol=1e-7)
    coeff = 0.05
    model, plain = _moe(aux_loss_coeff=coeff), _moe()
    _, counts, probs = _numpy_moe(model, x.asnumpy())
    aux = auxiliary_loss(ms.Tensor(probs), ms.Tensor(counts.astype(np.int32)), 2, coeff)
    np.testing.assert_allclose(aux.asnumpy(), coeff * 4 * (counts / 20 * probs.mean(0)).sum(), rtol=1e-6)
    weights = ms.Tensor(np.random.default_rng(2).standard_normal((2, 5, 16)).astype(np.float32))

    def loss(v):
        return (model(v) * weights).sum() / 10.0

    def with_aux(v):                                # the auxiliary loss added by hand, on the plain MoE
        tokens = v.reshape(-1, 16)
        _, _, routed = plain.router(tokens)
        return (plain(v) * weights).sum() / 10.0 + auxiliary_loss(plain.router.probabilities(tokens), routed, 2,
                                                                  coeff)
    params, same = model.trainable_params(), plain.trainable_params()
    eager = ms.grad(loss, None, params)(x)
    by_hand = ms.grad(with_aux, None, same)(x)
    for p, g, h in zip(params, eager, by_hand):
        np.testing.assert_allclose(g.asnumpy(), h.asnumpy(), rtol=RTOL, atol=ATOL, err_msg=p.name)
    gate = ms.grad(lambda v: (plain(v) * weights).sum() / 10.0, None, same)(x)[0]      # without it: another one
    assert params[0].name == "router.gate.weight" and np.abs(gate.asnumpy() - eager[0].asnumpy()).max() > 1e-4
    value, compiled = ms.jit(ms.value_and_grad(loss, None, params))(x)
    np.testing.assert_allclose(value.asnumpy(), loss(x).asnumpy(), rtol=RTOL)
    for p, g, e in zip(params, compiled, eager):
        np.testing.assert_allclose(g.asnumpy(), e.asnumpy(), rtol=RTOL, atol=ATOL, err_msg=p.name)


def test_expert_styles_refuse_by_name():
    from hyper_parallel_ms.mesh import init_device_mesh
    from hyper_parallel_ms.nn import parallelize_module
    mesh = init_device_mesh("cpu", (3,), mesh_dim_names=("ep",), simulate=(3, 0))
    with pytest.raises(ValueError, match=r"ExpertParallel on the root Cell: 4 experts do not divide over the 3"):
        parallelize_module(GroupedExperts(8, 16, 4), mesh, ExpertParallel())
    with pytest.raises(TypeError, match=r"ExpertParallel on 'shared_experts': a FeedForward without the stacked"):
        parallelize_module(MoE(8, 16, 3, 2, num_shared_experts=1), mesh, {"shared_experts": ExpertParallel()})
    experts = parallelize_module(GroupedExperts(8, 16, 6), mesh, ExpertParallel())
    with pytest.raises(NotImplementedError, match="expert parallelism on a simulated rank: the other ranks' token counts"):
        experts(ms.Tensor(np.ones((2, 8), np.float32)), ms.Tensor(np.array([2, 0, 0, 0, 0, 0], np.int32)))
    with pytest.raises(TypeError, match=r"TensorParallel on 'shared_experts.w1': a Dense without the stacked expert"):
        parallelize_module(MoE(8, 16, 3, 2, num_shared_experts=1), mesh, {"shared_experts.w1": TensorParallel()})


@multi_rank(2)
def test_expert_parallel_equals_one_device():
    """MoE(16, 32, 4 experts, top-2, 1 shared) with ExpertParallel on its experts over ep=2, each rank with its
    own tokens: outputs equal the one-device MoE's on all tokens; with the loss summed over tokens and divided
    by the global token count, expert gradients equal one device's and dense gradients summed over the ranks
    equal one device's. Also: a rank whose experts get no token (the bias steers every token to experts 0
    and 1), the aux-loss-free bias update equal to one device's, the token moves counted by CommDebugMode,
    and ms.jit refusing the data-dependent token moves by name."""
    from hyper_parallel_ms import comm
    from hyper_parallel_ms.mesh import init_device_mesh
    from hyper_parallel_ms.nn import parallelize_module
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("ep",))
    me = mesh.get_local_rank()
    rng = np.random.default_rng(3)
    x_all = rng.standard_normal((2, 2, 3, 16)).astype(np.float32)          # (rank, batch, seq, dim)
    w_all = rng.standard_normal((2, 2, 3, 16)).astype(np.float32)
    count = float(x_all.shape[0] * x_all.shape[1] * x_all.shape[2])
    for options, steer in [({}, None), (dict(score_func="sigmoid", route_norm=True, load_balance_coeff=0.1),
                                        [1.0, 1.0, 0.0, 0.0])]:
        one, ep = _moe(**options), _moe(**options)
        if steer is not None:
            for model in (one, ep):
                model.expert_bias.set_data(ms.Tensor(np.array(steer, np.float32)))
        parallelize_module(ep, mesh, {"experts": ExpertParallel()})
        assert tuple(ep.experts.w1.shape) == (2, 32, 16)
        want = one(ms.Tensor(x_all.reshape(4, 3, 16))).asnumpy().reshape(2, 2, 3, 16)
        with comm.CommDebugMode() as debug:
            got = ep(ms.Tensor(x_all[me]))
        np.testing.assert_allclose(got.asnumpy(), want[me], rtol=RTOL, atol=ATOL)
        assert debug.get_comm_counts() == {"all_gather": 1, "all_to_all_single": 2}, debug.summary()
        one_grads = _grads(one, ms.Tensor(x_all.reshape(4, 3, 16)), ms.Tensor(w_all.reshape(4, 3, 16)), count)
        ep_grads = _grads(ep, ms.Tensor(x_all[me]), ms.Tensor(w_all[me]), count)
        for name, grad in ep_grads.items():
            if name.startswith("experts."):
                np.testing.assert_allclose(grad.asnumpy(), one_grads[name].asnumpy()[2 * me:2 * me + 2],
                                           rtol=RTOL, atol=ATOL, err_msg=name)
            else:
                np.testing.assert_allclose(comm.all_reduce(grad, mesh, "ep").asnumpy(), one_grads[name].asnumpy(),
                                           rtol=RTOL, atol=ATOL, err_msg=name)
        if steer is not None:
            assert bool(np.any(ep_grads["experts.w1"].asnumpy())) == (me == 0)          # rank 1's experts got nothing
            assert update_expert_bias(one) == 1 and update_expert_bias(ep, mesh) == 1
            np.testing.assert_allclose(ep.expert_bias.asnumpy(), one.expert_bias.asnumpy(), rtol=1e-6)
            assert not ep.tokens_per_expert.asnumpy().any()
    with pytest.raises(NotImplementedError, match=r"ExpertParallel on 'experts' moves tokens by the counts"):
        ms.jit(ep)(ms.Tensor(x_all[me]))
    _ep_borrowed_from_dp_with_fully_shard(mesh, x_all, w_all)
    _ep_under_activation_checkpointing(mesh, x_all, w_all)
    _checkpoint_saved_on_ep2_loads_on_one_device(mesh)
    _calls_of_mindformers_expert_parallel(mesh)


def _ep_borrowed_from_dp_with_fully_shard(mesh, x_all, w_all):
    """ep borrowed from the dp ranks (torchtitan's layout): experts over ep, the dense parts fully_shard over the
    same ranks (the experts' pieces left to EP), gradients summed (divide factor 1, the loss divided by the
    global token count): the dense pieces' and the experts' gradients are one device's."""
    from hyper_parallel_ms.fsdp import fully_shard
    from hyper_parallel_ms.nn import parallelize_module
    me = mesh.get_local_rank()
    one, model = _moe(), _moe()
    parallelize_module(model, mesh, {"experts": ExpertParallel()})
    experts = [model.experts.w1, model.experts.w2, model.experts.w3]
    fully_shard(model, mesh=mesh, ignored_params=set(experts)).set_gradient_divide_factor(1.0)
    count = float(np.prod(x_all.shape[:-1]))
    one_grads = _grads(one, ms.Tensor(x_all.reshape(4, 3, 16)), ms.Tensor(w_all.reshape(4, 3, 16)), count)
    for name, grad in _grads(model, ms.Tensor(x_all[me]), ms.Tensor(w_all[me]), count).items():
        whole = one_grads[name].asnumpy()
        rows = -(-whole.shape[0] // 2)
        want = whole[2 * me:2 * me + 2] if name.startswith("experts.") else whole[rows * me:rows * (me + 1)]
        np.testing.assert_allclose(grad.asnumpy(), want, rtol=RTOL, atol=ATOL, err_msg=name)


def _checkpoint_saved_on_ep2_loads_on_one_device(mesh):
    """A distributed checkpoint of the ExpertParallel model (each rank writing its two experts) loads into a
    whole MoE on one device with the original values."""
    import os
    import shutil
    import tempfile
    from mindspore.mint import distributed as dist
    from hyper_parallel_ms import checkpoint as dcp
    from hyper_parallel_ms.nn import parallelize_module
    one, model = _moe(), _moe()
    parallelize_module(model, mesh, {"experts": ExpertParallel()})
    where = [tempfile.mkdtemp(prefix="hpms_moe_") if mesh.get_rank() == 0 else None] * 2
    dist.all_gather_object(where, where[0])
    path = os.path.join(where[0], "ep2")
    try:
        dcp.save({"model": dcp.get_model_state_dict(model)}, checkpoint_id=path)
        fresh = _moe(seed=9)
        state = {"model": dcp.get_model_state_dict(fresh)}
        dcp.load(state, checkpoint_id=path, no_dist=True)
        for p, q in zip(fresh.get_parameters(), one.get_parameters()):
            np.testing.assert_array_equal(p.asnumpy(), q.asnumpy(), err_msg=p.name)
    finally:
        dist.barrier()
        if mesh.get_rank() == 0:
            shutil.rmtree(where[0], ignore_errors=True)


def _check_against_one_device(model, one, mesh, x_all, w_all, token_rank, expert_slices, data_parallel_experts=False):
    """``model`` (parallelized) on this rank's tokens ``x_all[token_rank]`` against ``one`` on all of them:
    outputs, expert gradients (this rank's slices of one device's; summed over mesh dim 0 first where the
    experts are replicated there), dense gradients summed over mesh dim 0."""
    from hyper_parallel_ms import comm
    count = float(np.prod(x_all.shape[:-1]))
    whole = ms.Tensor(x_all.reshape((-1,) + x_all.shape[2:]))
    want = one(whole).asnumpy().reshape(x_all.shape)
    np.testing.assert_allclose(model(ms.Tensor(x_all[token_rank])).asnumpy(), want[token_rank], rtol=RTOL, atol=ATOL)
    one_grads = _grads(one, whole, ms.Tensor(w_all.reshape((-1,) + w_all.shape[2:])), count)
    grads = _grads(model, ms.Tensor(x_all[token_rank]), ms.Tensor(w_all[token_rank]), count)
    for name, grad in grads.items():
        if name.startswith("experts."):
            grad = comm.all_reduce(grad, mesh, 0) if data_parallel_experts else grad
            np.testing.assert_allclose(grad.asnumpy(), one_grads[name].asnumpy()[expert_slices[name[-2:]]],
                                       rtol=RTOL, atol=ATOL, err_msg=name)
        else:
            np.testing.assert_allclose(comm.all_reduce(grad, mesh, 0).asnumpy(), one_grads[name].asnumpy(),
                                       rtol=RTOL, atol=ATOL, err_msg=name)


@multi_rank(4)
def test_expert_tensor_parallel_and_tensor_parallel_equal_one_device():
    """On a (2, 2) mesh: ExpertTensorParallel (experts over ep, each expert's hidden features over tp; the tp
    ranks of a group hold the same tokens) and TensorParallel of the experts over tp (the ep dim as data
    parallelism): outputs and gradients equal one device's as for ExpertParallel; TensorParallel compiles."""
    from hyper_parallel_ms.mesh import init_device_mesh
    from hyper_parallel_ms.moe import ExpertTensorParallel
    from hyper_parallel_ms.nn import parallelize_module
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("ep", "tp"))
    ep, tp = mesh.coordinate
    rng = np.random.default_rng(4)
    x_all = rng.standard_normal((2, 2, 3, 16)).astype(np.float32)
    w_all = rng.standard_normal((2, 2, 3, 16)).astype(np.float32)
    hidden = slice(16 * tp, 16 * tp + 16)
    one, etp = _moe(), _moe()
    parallelize_module(etp, mesh, {"experts": ExpertTensorParallel()})
    assert tuple(etp.experts.w2.shape) == (2, 16, 16)
    experts = slice(2 * ep, 2 * ep + 2)
    _check_against_one_device(etp, one, mesh, x_all, w_all, ep, {"w1": (experts, hidden), "w3": (experts, hidden),
                                                                 "w2": (experts, slice(None), hidden)})
    one, tpm = _moe(), _moe()
    parallelize_module(tpm, mesh["tp"], {"experts": TensorParallel()})
    everything = slice(None)
    _check_against_one_device(tpm, one, mesh, x_all, w_all, ep, {"w1": (everything, hidden), "w3": (everything, hidden),
                                                                 "w2": (everything, everything, hidden)},
                              data_parallel_experts=True)
    np.testing.assert_allclose(ms.jit(tpm)(ms.Tensor(x_all[ep])).asnumpy(), tpm(ms.Tensor(x_all[ep])).asnumpy(),
                               rtol=RTOL, atol=ATOL)
    _checkpoint_saved_on_ep2_loads_on_ep4_and_one_device()
    _pipeline_stages_with_expert_parallel()


def _calls_of_mindformers_expert_parallel(mesh):
    """What MindFormers 2.1's PyNative ExpertParallel calls of this library, on its GroupedMLP's shapes:
    shard_module with (Shard(0),) for the stacked weights and Replicate for the rest, DTensor.to_local /
    from_local over ``layout.mesh`` and ``layout.alias_placements``, the mesh's group and shape, and a Cell
    forward hook registered through functools.partial."""
    import functools
    from mindspore import Parameter, nn
    from hyper_parallel_ms import DTensor, Replicate, Shard
    from hyper_parallel_ms.nn import ShardingPlan, shard_module

    class GroupedMLP(nn.Cell):
        def __init__(self):
            super().__init__()
            self.weight1 = Parameter(ms.Tensor(np.arange(4 * 3 * 8, dtype=np.float32).reshape(4, 3, 8)), name="weight1")
            self.weight2 = Parameter(ms.Tensor(np.ones((4, 4, 3), np.float32)), name="weight2")
            self.scale = Parameter(ms.Tensor(np.ones(3, np.float32)), name="scale")

        def construct(self, x):
            return x * self.scale.to_local()

    cell = GroupedMLP()
    shard_module(cell, mesh, ShardingPlan(plan={"weight1": (Shard(0),), "weight2": (Shard(0),),
                                                "scale": (Replicate(),)}))
    me = mesh.get_local_rank()
    assert isinstance(cell.weight1, DTensor) and tuple(cell.weight1.to_local().shape) == (2, 3, 8)
    np.testing.assert_array_equal(cell.weight1.to_local().asnumpy(),
                                  np.arange(96, dtype=np.float32).reshape(4, 3, 8)[2 * me:2 * me + 2])
    assert "ep" in cell.weight1.device_mesh.mesh_dim_names and mesh.mesh_shape == (2,) and mesh.get_group()
    seen = []
    cell.register_forward_pre_hook(functools.partial(lambda m, c, args: seen.append(m) or args, mesh))
    local = ms.Tensor(np.ones((2, 3), np.float32))
    layout = DTensor.from_local(local, mesh, (Shard(0),)).layout
    wrapped = DTensor.from_local(cell(local), layout.mesh, layout.alias_placements)
    assert seen == [mesh] and tuple(wrapped.shape) == (4, 3) and wrapped.placements == (Shard(0),)


class _Block(nn.Cell):
    """A residual block around an MoE (the Cell activation checkpointing wraps)."""

    def __init__(self, moe: MoE) -> None:
        super().__init__()
        self.moe = moe

    def construct(self, x):
        return x + self.moe(x * 1.5)


def _ep_under_activation_checkpointing(mesh, x_all, w_all):
    """A block holding an ExpertParallel MoE, checkpointed: the recompute in the backward runs the dispatch
    again (one all-gather of the counts and the two exchanges more than the plain step; checkpoint_stats: two
    forwards, one recompute), the gradients are one device's, ``tokens_per_expert`` counts each token once (the
    recompute adds nothing) and no dispatch is left pending. With policy="selective" the collective kernels'
    outputs are kept from the forward and replayed (not run again). A recompute that routes differently from its forward
    (the expert bias changed in between) is refused on every rank, naming the cause; the next step is exact."""
    from mindspore import ops
    from hyper_parallel_ms import comm
    from hyper_parallel_ms.nn import parallelize_module
    from hyper_parallel_ms.training import apply_activation_checkpointing, checkpoint_stats, checkpoint_wrapper
    me = mesh.get_local_rank()
    count = float(np.prod(x_all.shape[:-1]))
    whole, weights = ms.Tensor(x_all.reshape(4, 3, 16)), ms.Tensor(w_all.reshape(4, 3, 16))
    mine, my_weights = ms.Tensor(x_all[me]), ms.Tensor(w_all[me])
    one = _Block(_moe(load_balance_coeff=0.1))
    one_grads = _grads(one, whole, weights, count)
    routed = one.moe.tokens_per_expert.asnumpy()
    plain = _Block(_moe(load_balance_coeff=0.1))
    parallelize_module(plain, mesh, {"moe.experts": ExpertParallel()})
    with comm.CommDebugMode() as without:
        _grads(plain, mine, my_weights, count)
    for policy in (None, "selective"):
        model = nn.SequentialCell([_Block(_moe(load_balance_coeff=0.1))])
        parallelize_module(model, mesh, {"0.moe.experts": ExpertParallel()})
        if policy is None:
            checkpoint_wrapper(model[0])
        else:
            apply_activation_checkpointing(model, check_fn=lambda cell: isinstance(cell, _Block), policy=policy)
        with comm.CommDebugMode() as debug:
            grads = _grads(model, mine, my_weights, count)
        more = {k: v - without.get_comm_counts().get(k, 0) for k, v in debug.get_comm_counts().items()}
        stats = checkpoint_stats(model[0])
        assert (stats.forwards, stats.recomputes) == (2, 1), policy
        assert more == {"all_gather": 1, "all_to_all_single": 2}, (more, debug.summary())   # the dispatch again
        if policy is not None:                              # its collectives' kernels replayed, not run again
            assert stats.replayed["AllGather"] == 1 and "AllGather" not in stats.recomputed, dict(stats.replayed)
        for name, grad in grads.items():
            name = name[2:]                                                 # "0." of the SequentialCell
            if name.startswith("moe.experts."):
                want, got = one_grads[name].asnumpy()[2 * me:2 * me + 2], grad.asnumpy()
            else:
                want, got = one_grads[name].asnumpy(), comm.all_reduce(grad, mesh, "ep").asnumpy()
            np.testing.assert_allclose(got, want, rtol=RTOL, atol=ATOL, err_msg=f"{policy}: {name}")
        counted = comm.all_reduce(model[0].moe.tokens_per_expert, mesh, "ep").asnumpy()
        np.testing.assert_array_equal(counted, routed, err_msg=f"{policy}: tokens counted once")
        assert not model[0].moe.experts._hpms_expert_dispatch[1], "a dispatch left pending"
    steer = ms.Tensor(np.array([1.0, 1.0, 0.0, 0.0], np.float32))

    def bias_changed_before_the_backward(v):
        out = (model(v) * my_weights).sum() / count
        ops.assign(model[0].moe.expert_bias, steer)
        return out
    checkpoint_wrapper(plain)
    model = nn.SequentialCell([plain])
    with pytest.raises(RuntimeError, match="the recompute in the backward routed the tokens differently from the "
                                           "forward"):
        ms.grad(bias_changed_before_the_backward, None, model.trainable_params())(mine)
    model[0].moe.expert_bias.set_data(ms.Tensor(np.zeros(4, np.float32)))
    again = _grads(model, mine, my_weights, count)
    np.testing.assert_allclose(again["0.moe.experts.w1"].asnumpy(),
                               one_grads["moe.experts.w1"].asnumpy()[2 * me:2 * me + 2], rtol=RTOL, atol=ATOL,
                               err_msg="the step after the refusal")


def _saved_values(seed: int = 5):
    """Whole values of every MoE parameter and of Adam's moments (moment2 positive) and scalars."""
    rng = np.random.default_rng(seed)
    ref = _moe(load_balance_coeff=0.1)
    model = {n: (rng.standard_normal(p.shape) * 0.3).astype(np.float32) for n, p in ref.parameters_and_names()}
    trainable = [p.name for p in ref.trainable_params()]
    state = {n: {"moment1": (rng.standard_normal(model[n].shape) * 1e-2).astype(np.float32),
                 "moment2": (np.abs(rng.standard_normal(model[n].shape)) * 1e-4).astype(np.float32)} for n in trainable}
    group = {"global_step": np.array([3], np.int32), "learning_rate": np.array(0.01, np.float32),
             "beta1_power": np.array(0.9 ** 3, np.float32), "beta2_power": np.array(0.999 ** 3, np.float32),
             "params": trainable}
    return model, {"state": state, "param_groups": [group]}


def _checkpoint_saved_on_ep2_loads_on_ep4_and_one_device():
    """Model and Adam state saved with the experts Shard(0) over ep=2 (a (dp 2, ep 2) mesh: two replicas of each
    expert pair) load on ep=4 (one expert per rank) and on one device bit-exact (the moments and scalars too);
    one Adam step from the loaded state on ep=4 (each rank its own tokens, dense gradients summed over the ranks)
    gives one device's parameters."""
    import os
    import shutil
    import tempfile
    from mindspore.mint import distributed as dist
    from hyper_parallel_ms import checkpoint as dcp
    from hyper_parallel_ms import comm
    from hyper_parallel_ms.mesh import init_device_mesh
    from hyper_parallel_ms.nn import parallelize_module
    rank = ms.communication.get_rank()
    where = [tempfile.mkdtemp(prefix="hpms_moe_") if rank == 0 else None] * 4
    dist.all_gather_object(where, where[0])
    path = os.path.join(where[0], "ep2")
    try:
        model = _moe(load_balance_coeff=0.1)
        parallelize_module(model, init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "ep"))["ep"],
                           {"experts": ExpertParallel()})
        opt = ms.nn.Adam(model.trainable_params(), learning_rate=0.5)
        values, moments = _saved_values()
        dcp.set_state_dict(model, opt, model_state_dict=values, optim_state_dict=moments)
        model_sd, optim_sd = dcp.get_state_dict(model, opt)
        meta = dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=path)
        chunks = {key: len(meta.tensors[key].chunks) for key in ("model.experts.w1", "optim.state.experts.w1.moment1")}
        assert chunks == dict.fromkeys(chunks, 2), chunks          # the ep=2 pieces, each written once of its replicas
        ep4 = init_device_mesh("cpu", (4,), mesh_dim_names=("ep",))
        loaded, one = _moe(seed=9, load_balance_coeff=0.1), _moe(seed=11, load_balance_coeff=0.1)
        parallelize_module(loaded, ep4, {"experts": ExpertParallel()})
        assert tuple(loaded.experts.w1.shape) == (1, 32, 16)
        optimizers = {"ep4": ms.nn.Adam(loaded.trainable_params(), learning_rate=0.5),
                      "one device": ms.nn.Adam(one.trainable_params(), learning_rate=0.5)}
        for label, target in (("ep4", loaded), ("one device", one)):
            optimizer = optimizers[label]
            state = {"model": dcp.get_model_state_dict(target),
                     "optim": dcp.get_optimizer_state_dict(target, optimizer)}
            dcp.load(state, checkpoint_id=path, no_dist=target is one)
            got, got_optim = dcp.get_state_dict(target, optimizer, options=dcp.StateDictOptions(full_state_dict=True))
            for name, value in values.items():
                np.testing.assert_array_equal(got[name].asnumpy(), value, err_msg=f"{label}: {name}")
            for name, slots in moments["state"].items():
                for slot, value in slots.items():
                    np.testing.assert_array_equal(got_optim["state"][name][slot].asnumpy(), value,
                                                  err_msg=f"{label}: {name}.{slot}")
            assert float(optimizer.learning_rate.asnumpy()) == np.float32(0.01), label
        rng = np.random.default_rng(7)
        x_all, w_all = (rng.standard_normal((4, 3, 16)).astype(np.float32) for _ in range(2))
        one_grads = _grads(one, ms.Tensor(x_all), ms.Tensor(w_all), 12.0)
        optimizers["one device"](tuple(one_grads[p.name] for p in one.trainable_params()))
        grads = _grads(loaded, ms.Tensor(x_all[rank:rank + 1]), ms.Tensor(w_all[rank:rank + 1]), 12.0)
        optimizers["ep4"](tuple(grads[p.name] if p.name.startswith("experts.") else
                                comm.all_reduce(grads[p.name], ep4, 0) for p in loaded.trainable_params()))
        stepped = dict(one.parameters_and_names())
        for p in loaded.trainable_params():
            want = stepped[p.name].asnumpy()
            want = want[rank:rank + 1] if p.name.startswith("experts.") else want
            np.testing.assert_allclose(p.asnumpy(), want, rtol=RTOL, atol=ATOL, err_msg=f"after a step: {p.name}")
        assert np.abs(one.experts.w1.asnumpy() - values["experts.w1"]).max() > 1e-3       # the step moved them
    finally:
        dist.barrier()
        if rank == 0:
            shutil.rmtree(where[0], ignore_errors=True)


class _PipelinedMoE(nn.Cell):
    """embed, two residual MoE blocks, head: a 2-stage pipeline holds one block per stage."""

    def __init__(self) -> None:
        super().__init__()
        np.random.seed(0)
        ms.set_seed(0)
        self.embed = nn.Dense(6, 16)
        self.layers = nn.CellList([_Block(MoE(16, 32, 4, 2, num_shared_experts=1)) for _ in range(2)])
        self.head = nn.Dense(16, 4)

    def construct(self, x):
        x = self.embed(x)
        for block in self.layers:
            x = block(x)
        return self.head(x)


def _mean_square(out, target):
    return ((out - target) ** 2).mean()


def _pipeline_stages_with_expert_parallel():
    """pp=2 x ep=2 on 4 ranks: each stage's MoE block with ExpertParallel over the ep ranks of its stage (which
    feed different rows of the batch), the blocks checkpointed, 1F1B over 2 micro-batches, 2 SGD steps: every
    micro-batch loss equals one device's on the same rows, and the parameters (dense gradients averaged over
    ep, the experts' divided by ep: each rank's loss is the mean of its own rows) one device's on the whole
    batch. Compiled stages (jit=True) are refused on every rank, naming ExpertParallel and the cause."""
    from hyper_parallel_ms import comm
    from hyper_parallel_ms import pipelining as pl
    from hyper_parallel_ms.mesh import init_device_mesh
    from hyper_parallel_ms.nn import parallelize_module
    from hyper_parallel_ms.training import apply_activation_checkpointing, checkpoint_stats
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "ep"))
    pp, ep = mesh.coordinate
    rows = slice(8 * ep, 8 * ep + 8)
    batches = [tuple(ms.Tensor(np.random.default_rng(30 + s).standard_normal((16, n)).astype(np.float32))
                     for n in (6, 4)) for s in range(2)]
    one = _PipelinedMoE()
    params = one.trainable_params()
    step = ms.value_and_grad(lambda x, y: _mean_square(one(x), y), None, params)
    optimizer, history = ms.nn.SGD(params, learning_rate=0.1), []
    for x, y in batches:
        history.append([float(_mean_square(one(x[rows][m:m + 4]), y[rows][m:m + 4]).asnumpy()) for m in (0, 4)])
        optimizer(step(x, y)[1])
    stage = pl.split_blocks(_PipelinedMoE(), pp, 2, first=("embed",), last=("head",))
    parallelize_module(stage, mesh["ep"], {"layers.*.moe.experts": ExpertParallel()})
    apply_activation_checkpointing(stage, check_fn=lambda cell: isinstance(cell, _Block))
    schedule = pl.Schedule1F1B(pl.PipelineStage(stage, pp, 2, mesh=mesh["pp"]), 2, _mean_square)
    params = schedule.parameters()
    optimizer = ms.nn.SGD(params, learning_rate=0.1)
    for (x, y), want in zip(batches, history):
        losses: list = []
        schedule.step(*((x[rows],) if pp == 0 else ()), target=y[rows] if pp == 1 else None, losses=losses)
        optimizer(tuple(g / 2 if ".experts." in p.name else comm.all_reduce(g, mesh, "ep", op="avg")
                        for p, g in zip(params, schedule.gradients())))
        if pp == 1:
            np.testing.assert_allclose([float(v.asnumpy()) for v in losses], want, rtol=RTOL, atol=ATOL)
    block, = stage.layers                                                   # this stage keeps one block
    assert (checkpoint_stats(block).forwards, checkpoint_stats(block).recomputes) == (8, 4)
    final = dict(one.parameters_and_names())
    for p in params:
        want = final[p.name].asnumpy()[2 * ep:2 * ep + 2] if ".experts." in p.name else final[p.name].asnumpy()
        np.testing.assert_allclose(p.asnumpy(), want, rtol=RTOL, atol=ATOL, err_msg=p.name)
    compiled = pl.split_blocks(_PipelinedMoE(), pp, 2, first=("embed",), last=("head",))
    parallelize_module(compiled, mesh["ep"], {"layers.*.moe.experts": ExpertParallel()})
    schedule = pl.Schedule1F1B(pl.PipelineStage(compiled, pp, 2, mesh=mesh["pp"], jit=True), 2, _mean_square)
    with pytest.raises(RuntimeError, match=r"ExpertParallel on 'layers.\d.moe.experts' moves tokens by the counts"):
        x, y = batches[0]
        schedule.step(*((x[rows],) if pp == 0 else ()), target=y[rows] if pp == 1 else None)
