"""clip_grad_norm / TotalGradNorm against one device: the global norm and MindSpore's
ops.clip_by_global_norm, with clipping active (max_norm below the norm at every step), loss per
step and parameters after 3 AdamW steps (tests/_parity.py's rule), for TP with SequenceParallel,
fully_shard, hsdp levels 1-3 and FSDP x TP, on 2 and 4 ranks, PyNative and ms.jit (TP and fully_shard
also as GRAPH_MODE Cells); one all-reduce per communication group (CommDebugMode); norm_type inf;
error_if_nonfinite; across pipeline stages (pp=2, a tied embedding counted once); the cached norm
releases the parameters."""
from __future__ import annotations

import math

import mindspore as ms
import numpy as np
import pytest
from mindspore import ops

from hyper_parallel_ms.comm import CommDebugMode
from hyper_parallel_ms.mesh import init_device_mesh
from hyper_parallel_ms.testing import multi_rank

from tests._fsdp_models import Net, batch, loss_of
from tests._parity import STEPS, check_parity
from tests.test_parallel_styles import Transformer, _nll, _tokens, transformer_plan

MAX_NORM = 0.05


def _ref_norm(grads, norm_type=2.0) -> float:
    values = [np.abs(g.asnumpy().astype(np.float64)) for g in grads]
    if math.isinf(norm_type):
        return float(max(v.max() for v in values))
    return float(sum((v ** norm_type).sum() for v in values) ** (1.0 / norm_type))


def _clipping(norms: list, max_norm: float = MAX_NORM, jit: bool = False):
    """check_parity's transform_grads: MindSpore's clip on one device (recording the norm),
    clip_grad_norm on the reduced pieces (a TotalGradNorm built outside the graph under jit)."""
    from hyper_parallel_ms.training import TotalGradNorm, clip_grad_norm

    def on_reference(grads):
        norms.append(_ref_norm(grads))
        return ops.clip_by_global_norm(grads, max_norm)

    def make_parallel(params):
        parameters = TotalGradNorm(params) if jit else params

        def clip(grads):
            return clip_grad_norm(grads, max_norm, parameters=parameters)[0]
        return clip
    return on_reference, make_parallel


def _fsdp_batch(dp_index, dp_size, step):
    x = batch(step)
    rows = x.shape[0] // dp_size
    return (x[dp_index * rows:(dp_index + 1) * rows],)


def _fsdp(mesh):
    from hyper_parallel_ms.fsdp import fully_shard

    def shard(model):
        for layer in model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
    return shard


def _hsdp(**kwargs):
    from hyper_parallel_ms.fsdp import hsdp

    def shard(model):
        for layer in model.layers:
            hsdp(layer, threshold=0, **kwargs)
        hsdp(model, threshold=0, **kwargs)
    return shard


def _fsdp_tp(mesh, root_on_all_ranks: bool = False):
    """Blocks tensor-parallel over tp and fully_shard over dp; the root over dp too, or with
    ``root_on_all_ranks`` on fully_shard's default mesh of every rank."""
    from hyper_parallel_ms.fsdp import fully_shard
    from hyper_parallel_ms.nn import ColwiseParallel, RowwiseParallel, parallelize_module

    def shard(model):
        parallelize_module(model, mesh["tp"], {"layers.*.up": ColwiseParallel(), "layers.*.down": RowwiseParallel()})
        for layer in model.layers:
            fully_shard(layer, mesh=mesh["dp"])
        fully_shard(model, **({} if root_on_all_ranks else {"mesh": mesh["dp"]}))
    return shard


def _fsdp_tp_grads(root_on_all_ranks: bool = False):
    """On a (dp, tp) = (2, 2) mesh: the one-device gradients of batch 0, and the sharded model with
    its parameters and this rank's gradients (of its dp rows)."""
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    dp_index = mesh.get_coordinate()[0]
    x = batch(0)
    ms.set_seed(0)
    _, ref_grads = _grads(Net(), x)
    ms.set_seed(0)
    model = Net()
    _fsdp_tp(mesh, root_on_all_ranks)(model)
    params, grads = _grads(model, x[dp_index * 4:(dp_index + 1) * 4])
    return mesh, ref_grads, model, params, grads


def _clip_parity(make_model, shard, batch_of, loss, *, jit, graph=False, dp_mesh=None, dp_dim=None, dp_index=0,
                 dp_size=1):
    norms = []
    check_parity(make_model, shard, batch_of, loss, optimizer="adamw", jit=jit and not graph, graph=graph,
                 dp_mesh=dp_mesh, dp_dim=dp_dim, dp_index=dp_index, dp_size=dp_size,
                 transform_grads=_clipping(norms, jit=jit))
    assert len(norms) == STEPS and min(norms) > MAX_NORM, ("clipping must be active at every step", norms)


def _counts_and_norm(model, params, grads, norm_type=2.0):
    """The total norm, and the all-reduces TotalGradNorm issues."""
    from hyper_parallel_ms.training import TotalGradNorm
    norm = TotalGradNorm(params, norm_type=norm_type)
    with CommDebugMode() as mode:
        total = float(norm(grads).asnumpy())
    return total, mode.get_comm_counts(), norm.reductions


def _grads(model, x):
    params = model.trainable_params()
    return params, ms.value_and_grad(lambda v: loss_of(model, v), None, params)(x)[1]


@pytest.mark.parametrize("jit", [False, True])
@multi_rank(2, timeout=600)
def test_clip_parity_on_2_ranks(jit):
    """TP with SequenceParallel (the shares summed by GradientReducer, then clipped), fully_shard
    (uneven pieces) and hsdp levels 1-3. Under ms.jit fully_shard only (test time): the clip is the
    same code for every source of gradients; TP with SequenceParallel is clipped compiled in the
    example's test, and hsdp's levels hand the clip whole (level 1) or reduce-scattered pieces like
    fully_shard's."""
    dp = init_device_mesh("cpu", (2,), mesh_dim_names=("dp",))
    rank = dp.get_local_rank(0)
    common = dict(jit=jit, dp_mesh=dp, dp_dim="dp", dp_index=rank, dp_size=2)
    _clip_parity(Net, _fsdp(dp), _fsdp_batch, loss_of, **common)
    if jit:
        return
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    from hyper_parallel_ms.nn import parallelize_module
    _clip_parity(Transformer, lambda m: parallelize_module(m, mesh, transformer_plan(mesh)), _tokens, _nll, jit=jit)
    for level in ("level1", "level2", "level3"):
        _clip_parity(Net, _hsdp(optimizer_level=level), _fsdp_batch, loss_of, **common)


@multi_rank(2, timeout=600)
def test_clip_parity_in_graph_mode_on_2_ranks():
    """The parallel train step as a GRAPH_MODE Cell (the clip's TotalGradNorm built outside), fully_shard.
    TP with SequenceParallel clipped in a GRAPH_MODE train step: the example's test
    (tests/test_train_example.py::test_example_clips_and_checkpoints_on_2_ranks)."""
    dp = init_device_mesh("cpu", (2,), mesh_dim_names=("dp",))
    _clip_parity(Net, _fsdp(dp), _fsdp_batch, loss_of, jit=True, graph=True, dp_mesh=dp, dp_dim="dp",
                 dp_index=dp.get_local_rank(0), dp_size=2)


@pytest.mark.parametrize("jit", [False, True])
@multi_rank(4, timeout=600)
def test_clip_parity_on_4_ranks(jit):
    """FSDP x TP on (dp, tp) = (2, 2); in PyNative also HSDP (2 replicas of 2-rank shard groups) and
    fully_shard on 4 (their compiled clip is the 2-rank one's; kept out of ms.jit for test time)."""
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    dp_index = mesh.get_coordinate()[0]
    _clip_parity(Net, _fsdp_tp(mesh), _fsdp_batch, loss_of, jit=jit, dp_mesh=mesh, dp_dim="dp", dp_index=dp_index,
                 dp_size=2)
    if jit:
        return
    world = init_device_mesh("cpu", (4,), mesh_dim_names=("dp",))
    rank = world.get_local_rank(0)
    common = dict(jit=jit, dp_mesh=world, dp_dim="dp", dp_index=rank, dp_size=4)
    _clip_parity(Net, _hsdp(shard_size=2, optimizer_level="level2"), _fsdp_batch, loss_of, **common)
    _clip_parity(Net, _fsdp(world), _fsdp_batch, loss_of, **common)


@multi_rank(4, timeout=600)
def test_one_all_reduce_per_group_inf_norm_and_nonfinite_on_4_ranks():
    """The counts: one all-reduce per communication group splitting some parameter, whatever the
    number of parameters; norm_type inf equals the largest element; a nan on one rank raises on all."""
    from hyper_parallel_ms.training import clip_grad_norm
    mesh, ref_grads, model, params, grads = _fsdp_tp_grads()
    x = batch(0)
    assert len(params) == 12
    for norm_type in (2.0, float("inf"), 1.0):
        want = _ref_norm(ref_grads, norm_type)
        total, counts, reductions = _counts_and_norm(model, params, grads, norm_type)
        assert abs(total - want) <= 1e-5 * want, (norm_type, total, want)
        assert reductions == 2 and counts == {"all_reduce": 2}, counts       # dp and tp, not one per parameter
    # inf clipping scales like the one-device formula
    clipped, total = clip_grad_norm(grads, 0.01, parameters=params, norm_type=float("inf"))
    scale = 0.01 / max(_ref_norm(ref_grads, float("inf")), 0.01)
    np.testing.assert_allclose(clipped[0].asnumpy(), grads[0].asnumpy() * scale, rtol=1e-5, atol=1e-7)
    # only TP: one group; nothing sharded: no collective
    from hyper_parallel_ms.nn import ColwiseParallel, RowwiseParallel, parallelize_module
    plain = Net()
    params, grads = _grads(plain, x)
    assert _counts_and_norm(plain, params, grads)[1] == {}
    parallelize_module(plain, mesh["tp"], {"layers.*.up": ColwiseParallel(), "layers.*.down": RowwiseParallel()})
    params, grads = _grads(plain, x)
    assert _counts_and_norm(plain, params, grads)[1] == {"all_reduce": 1}
    # a non-finite gradient on one rank (before the dp average): every rank raises
    from hyper_parallel_ms.nn import GradientReducer
    poisoned = list(grads)
    if mesh.get_rank() == 3:
        poisoned[2] = poisoned[2] * float("nan")
    poisoned = GradientReducer(params, dp_mesh=mesh, dp_dim="dp")(tuple(poisoned))
    with pytest.raises(RuntimeError, match="non-finite"):
        clip_grad_norm(poisoned, 1.0, parameters=params, error_if_nonfinite=True)
    # the per-rank norm MindSpore's clip would use differs: the bug this fixes
    local = _ref_norm(grads)
    total = float(clip_grad_norm(grads, 1.0, parameters=params)[1].asnumpy())
    assert abs(local - total) > 1e-3 * total


@multi_rank(4, timeout=600)
def test_parameters_on_two_meshes_of_the_same_ranks_on_4_ranks():
    """Blocks tensor-parallel over tp and fully_shard over dp of a (2, 2) mesh, the root fully_shard on
    its default mesh of all 4 ranks: each entry is reduced over its own groups only, so the norm equals
    one device for every order (reducing the root's entry over the world group before the blocks' dp
    group dropped some ranks' shares and doubled others: 21.22 for 22.02); an inf gradient gives inf,
    not nan; max_norm 0 zeroes the gradients, a negative one is refused; PyTorch's foreach is taken."""
    from hyper_parallel_ms.training import clip_grad_norm
    _, ref_grads, model, params, grads = _fsdp_tp_grads(root_on_all_ranks=True)
    for norm_type in (2.0, float("inf"), 1.0, 3.0):
        want = _ref_norm(ref_grads, norm_type)
        total = _counts_and_norm(model, params, grads, norm_type)[0]
        assert abs(total - want) <= 1e-5 * want, (norm_type, total, want)
    poisoned = (grads[0] * float("inf"),) + tuple(grads[1:])
    assert math.isinf(_counts_and_norm(model, params, poisoned)[0])
    zeroed, total = clip_grad_norm(grads, 0.0, parameters=params, foreach=True)
    assert float(total.asnumpy()) > 0 and all(not g.asnumpy().any() for g in zeroed)
    with pytest.raises(ValueError, match="max_norm must be a number >= 0"):
        clip_grad_norm(grads, -1.0, parameters=params)


def test_the_cached_norm_does_not_keep_the_parameters():
    """clip_grad_norm builds a TotalGradNorm per parameter tuple once; the cache holds weak references,
    so a model dropped by its user is released (and its entry with it)."""
    import gc
    import weakref

    from hyper_parallel_ms.training import _clip, clip_grad_norm
    ms.set_seed(0)
    model = Net()
    params, grads = _grads(model, batch(0))
    before = len(_clip._NORMS)                                        # pylint: disable=protected-access
    clip_grad_norm(grads, 1.0, parameters=params)
    norm = _clip._norm_of(params, 2.0, False)                         # pylint: disable=protected-access
    assert _clip._norm_of(params, 2.0, False) is norm                 # built once  # pylint: disable=protected-access
    assert len(_clip._NORMS) == before + 1                            # pylint: disable=protected-access
    watched = weakref.ref(params[0])
    del model, params, grads, norm
    gc.collect()
    assert watched() is None
    assert len(_clip._NORMS) == before                                # pylint: disable=protected-access


def _pipeline_reference(tied: bool, norms: list):
    """The single-device model of tests/test_pipeline_compose.py, clipped by MindSpore's
    ops.clip_by_global_norm: (full-batch loss per step, the parameters after the steps)."""
    from tests import test_pipeline_compose as pc
    ms.set_seed(0)
    model = pc.Model(4, tied)
    params = model.trainable_params()
    opt = pc._optimizer(params)
    step_fn = ms.value_and_grad(lambda x, y: pc.loss_fn(model(x), y), None, params)
    losses = []
    for step in range(pc.STEPS):
        loss, grads = step_fn(*pc._batch(step, pc.IN if tied else pc.OUT))
        norms.append(_ref_norm(grads))
        losses.append(float(loss.asnumpy()))
        opt(ops.clip_by_global_norm(grads, MAX_NORM))
    return losses, {p.name: p.asnumpy() for p in params}


@pytest.mark.parametrize("name", ["GPipe", "ZBVZeroBubble"])
@multi_rank(2, timeout=600)
def test_clip_across_pipeline_stages_on_2_ranks(name):
    """pp=2 with the embedding tied to the head on the last stage: the norm of every stage's gradients,
    the tied one counted once (GPipe: held by both ranks; ZBV: the first and the last stage on rank 0),
    clipping active at every step; losses and parameters after 3 AdamW steps equal one device's."""
    from hyper_parallel_ms.comm import CommDebugMode
    from hyper_parallel_ms.training import TotalGradNorm, clip_grad_norm
    from tests import test_pipeline_compose as pc
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("pp",))
    norms: list = []
    losses, final = _pipeline_reference(True, norms)
    assert min(norms) > MAX_NORM, ("clipping must be active at every step", norms)
    schedule = pc._schedule(name, pc._stages(name, mesh, 4, lambda model: None, tied=True), 4,
                            shared_parameters=["head.weight"])
    params = schedule.parameters()
    opt = pc._optimizer(params)
    first, last = schedule.stages[0].is_first, schedule.stages[-1].is_last
    for step in range(pc.STEPS):
        x, y = pc._batch(step, pc.IN)
        mb: list = []
        schedule.step(*((x,) if first else ()), target=y if last else None, losses=mb)
        with CommDebugMode() as mode:
            grads, total = clip_grad_norm(schedule.gradients(), MAX_NORM, parameters=schedule)
        assert mode.get_comm_counts() == {"all_reduce": 1}                # one scalar over pp
        np.testing.assert_allclose(float(total.asnumpy()), norms[step], rtol=1e-5, err_msg=f"norm, step {step}")
        if last:
            np.testing.assert_allclose(np.mean([float(v.asnumpy()) for v in mb]), losses[step], rtol=1e-5,
                                       atol=1e-6, err_msg=f"loss, step {step}")
        opt(grads)
    for p in params:
        np.testing.assert_allclose(p.asnumpy(), final[p.name], rtol=1e-5, atol=1e-6, err_msg=p.name)
    # counted on every rank without the schedule's help: the tied weight would count twice (GPipe)
    alone = float(TotalGradNorm(params, pp_mesh=mesh)(schedule.gradients()).asnumpy())
    assert (abs(alone - float(total.asnumpy())) > 1e-4) == (name == "GPipe")
