"""HyperParallel 1.0's options MindFormers' PyNative stack passes, on this library: fully_shard's
``replicate_params`` / ``comm_fusion``, ``MixedPrecisionPolicy(apply_grad_on_fp32_main_grad=)``,
``FSDPModule.set_reduce_op_type``, ``DeviceMesh._unflatten``, models built on the meta device
(sharded and fully_shard-ed with no host copies), HyperParallel's fully_shard convention for DTensor
parameters, and ``get_platform().differentiable_all_reduce``. One call on 2 CPU ranks; the
argument checks in the pytest process."""
from __future__ import annotations

import numpy as np
import pytest
import mindspore as ms
from mindspore import nn, ops

from hyper_parallel_ms import MixedPrecisionPolicy, Replicate, Shard, init_device_mesh
from hyper_parallel_ms.fsdp import fully_shard
from hyper_parallel_ms.fsdp._module import fsdp_state
from hyper_parallel_ms.testing import run_on_ranks
from tests._fsdp_models import Net, compare, per_block


def _options_on_ranks():
    from mindspore.communication import get_rank
    from hyper_parallel_ms import DTensor, comm
    from hyper_parallel_ms._mindspore import is_meta, process_device_target
    from hyper_parallel_ms.compat import alias_hyper_parallel
    from hyper_parallel_ms.nn import ShardingPlan, shard_module
    rank = get_rank()
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("dp",))
    out = {}

    # replicate_params: kept whole on both ranks, gradients averaged: the run equals one device
    def replicated(model):
        fully_shard(model.layers[0], mesh=mesh, replicate_params=[model.layers[0].up.weight])
        fully_shard(model, mesh=mesh)
        out["replicated_shape"] = tuple(model.layers[0].up.weight.shape)
    compare(replicated, rank, 2, steps=2, loss_mesh=mesh)

    # comm_fusion=False: one group (one all-gather, one reduction) per parameter; True / None: per dtype
    model = Net()
    fully_shard(model, mesh=mesh, comm_fusion=False)
    out["groups_unfused"] = (len(fsdp_state(model).groups), len(model.trainable_params()))
    model = Net()
    fully_shard(model, mesh=mesh, comm_fusion=True)
    out["groups_fused"] = len(fsdp_state(model).groups)

    # set_reduce_op_type("sum"): gradients summed over the ranks (twice the mean here)
    def summed(model):
        per_block(mesh)(model)
        for cell in [model, *model.layers]:
            cell.set_reduce_op_type("sum")
    ms.set_seed(0)
    a = Net()
    ms.set_seed(0)
    b = Net()
    per_block(mesh)(a)
    summed(b)
    x = ms.Tensor(np.random.default_rng(rank).standard_normal((4, 8)).astype(np.float32))
    ga = ms.grad(lambda x: (a(x) ** 2).mean(), None, a.trainable_params())(x)
    gb = ms.grad(lambda x: (b(x) ** 2).mean(), None, b.trainable_params())(x)
    out["sum_over_avg"] = [float(np.abs(q.asnumpy() - 2 * p.asnumpy()).max()) for p, q in zip(ga, gb)]

    # apply_grad_on_fp32_main_grad with float32 parameters: float32 gradients
    model = Net()
    fully_shard(model, mesh=mesh, mp_policy=MixedPrecisionPolicy(apply_grad_on_fp32_main_grad=True))
    grads = ms.grad(lambda x: (model(x) ** 2).mean(), None, model.trainable_params())(x)
    out["main_grad_dtypes"] = {str(g.dtype) for g in grads}

    # a model built on the meta device: shard_module, then fully_shard, without host copies; then
    # materialised and loaded, it computes as one device
    with ms.DeviceCtx("meta"):
        out["target_under_meta"] = process_device_target()
        meta = Net()
    dp_tp = init_device_mesh("cpu", (1, 2), mesh_dim_names=("dp", "tp"))
    shard_module(meta.head, dp_tp["tp"], ShardingPlan(plan={"weight": (Shard(0),), "bias": (Shard(0),)}))
    fully_shard(meta, mesh=dp_tp["dp"])
    out["meta_pieces"] = [p.name for p in meta.trainable_params() if not is_meta(p)]
    out["meta_head_piece"] = tuple(meta.head.weight.shape)

    # HyperParallel's fully_shard: a DTensor parameter Replicate over "tp", computed with to_local()
    # on this rank's rows only, gets the sum of the ranks' gradients (this library's: its own share)
    alias_hyper_parallel()
    from hyper_parallel.core.fully_shard.api import fully_shard as hp_fully_shard  # noqa: E402
    tp = dp_tp["tp"]

    class Scale(nn.Cell):
        def __init__(self):
            super().__init__()
            self.weight = ms.Parameter(ms.Tensor(np.ones(4, np.float32)))

        def construct(self, x):
            w = self.weight.to_local() if isinstance(self.weight, DTensor) else self.weight
            return x * w
    rows = ms.Tensor(np.arange(8, dtype=np.float32).reshape(2, 4)[rank:rank + 1])
    for name, engine in (("pytorch", fully_shard), ("hyper_parallel", hp_fully_shard)):
        cell = Scale()
        shard_module(cell, tp, ShardingPlan(plan={"weight": (Replicate(),)}))
        engine(cell, mesh=dp_tp["dp"])            # as MindFormers: fully_shard over a 1-rank dp mesh
        out[f"{name}_grad"] = ms.grad(lambda x: cell(x).sum(), None, cell.trainable_params())(rows)[0].asnumpy()

    # get_platform().differentiable_all_reduce: the sum, and the gradient all-reduced
    from hyper_parallel.platform import get_platform  # noqa: E402
    platform = get_platform()
    v = ms.Tensor(np.full((3,), rank + 1.0, np.float32))
    out["platform_sum"] = platform.differentiable_all_reduce(v, "sum", None).asnumpy()
    out["platform_grad"] = ms.grad(lambda t: (platform.differentiable_all_reduce(t, "sum", tp.get_group("tp"))
                                              * (rank + 1)).sum())(v).asnumpy()
    # differentiable_all_to_all_single(_async): rank r sends rows [r, 2 - r] of its 3 (uneven splits; the rows'
    # value 10 * rank + row), its gradient the exchange back (of dout = 1 + the received row's position)
    rows = ms.Tensor(np.arange(6, dtype=np.float32).reshape(3, 2) + 10 * rank)
    sends, receives = [1 + rank, 2 - rank], [1 + rank, 2 - rank]     # rank 0: [1, 2], rank 1: [2, 1]
    for name in ("differentiable_all_to_all_single", "differentiable_all_to_all_single_async"):
        exchange = getattr(platform, name)
        weight = ms.Tensor(np.arange(1, 4, dtype=np.float32).reshape(3, 1))
        out[name] = exchange(rows, sends, receives, tp.get_group("tp")).asnumpy()
        out[name + "_grad"] = ms.grad(lambda t: (exchange(t, sends, receives, tp.get_group("tp")) * weight).sum())(
            rows).asnumpy()

    # HyperParallel's checkpoint layouts (MindFormers' LayoutAdapter reads them)
    from hyper_parallel.core.distributed_checkpoint import get_current_layout, get_global_layout  # noqa: E402
    # an optimizer's states are clones of its parameters (MindFormers' AdamW: fp32_param.clone("zeros")): laid out
    # like them, for a style's piece, a fully_shard piece and a shard_module Parameter(DTensor)
    from hyper_parallel_ms.nn import ColwiseParallel, parallelize_module  # noqa: E402
    from hyper_parallel_ms.nn._parameter import parameter_spec  # noqa: E402
    styled, sharded, placed = Net(), Net(), Net()
    parallelize_module(styled, tp, {"head": ColwiseParallel()})
    fully_shard(sharded, mesh=mesh)
    shard_module(placed.head, tp, ShardingPlan(plan={"weight": (Shard(0),)}))

    class States(nn.Cell):
        def __init__(self, params):
            super().__init__()
            self.states = ms.ParameterTuple(params)
    clones = []
    for how, source in (("styled", styled.head.weight), ("sharded", sharded.head.weight),
                        ("placed", placed.head.weight)):
        state = source.clone("zeros")
        state.name = f"adam_m.{how}.{source.name}"
        clones.append((source, state))
    layouts = get_current_layout(States([state for _, state in clones]))[rank]
    out["clones"] = [(parameter_spec(state) == parameter_spec(source), tuple(state.shape),
                      float(np.abs(state.asnumpy()).max()), layouts[state.name].get("tensor_map"),
                      layouts[state.name]["full_shape"]) for source, state in clones]
    # MindSpore's own optimizers clone through ParameterTuple.clone (nn.Adam's moments)
    out["parameter_tuple_clone"] = [
        parameter_spec(ms.ParameterTuple([p]).clone(prefix="moments", init="zeros")[0]) == parameter_spec(p)
        for p in (styled.head.weight, placed.head.weight)]
    # a master copy made as MindFormers makes it, Parameter(param.float()), keeps no record: laid out like the
    # parameter it is named after, given the piece's shape (a same-named tensor of another shape stays whole)
    weight = styled.head.weight
    master = ms.Parameter(weight.float(), name="main_param." + weight.name)
    other = ms.Parameter(ms.Tensor(np.zeros((5, 5), np.float32)), name="adam_v." + weight.name)
    layouts = get_current_layout(States([weight, master, other]))[rank]
    out["master"] = (layouts[master.name] == dict(layouts[weight.name], type=layouts[master.name]["type"]),
                     layouts[other.name])
    model = Net()
    fully_shard(model, mesh=mesh)
    out["layout_current"] = get_current_layout(model)
    out["layout_global"] = get_global_layout([model, meta])

    # DeviceMesh._unflatten of the world dim
    world = init_device_mesh("cpu", (2,), mesh_dim_names=("world",))
    unflat = world._unflatten(0, (1, 2), ("dp", "tp"), backend_override={"dp": "fake"})
    out["unflatten"] = (unflat.shape, unflat.mesh_dim_names, unflat["tp"].rank_list)
    for bad in (((3,), ("x",)), ((2,), ("a", "b"))):
        try:
            world._unflatten(0, *bad)
            out[f"unflatten_{bad}"] = "accepted"
        except ValueError as err:
            out[f"unflatten_{bad}"] = str(err)
    return out


def test_hyper_parallel_options_on_two_ranks():
    for rank, out in enumerate(run_on_ranks(_options_on_ranks, 2)):
        assert out["replicated_shape"] == (7, 8)                          # whole: (4, 8) / (3, 8) if cut
        assert out["groups_unfused"][0] == out["groups_unfused"][1] > out["groups_fused"] == 1
        assert max(out["sum_over_avg"]) < 1e-6
        assert out["main_grad_dtypes"] == {"Float32"}
        assert out["target_under_meta"] == "CPU"
        assert out["meta_pieces"] == [] and out["meta_head_piece"] == ((2, 8) if rank == 0 else (1, 8))
        rows = np.arange(8, dtype=np.float32).reshape(2, 4)
        np.testing.assert_array_equal(out["pytorch_grad"], rows[rank])          # this rank's share
        np.testing.assert_array_equal(out["hyper_parallel_grad"], rows.sum(0))  # summed over "tp"
        np.testing.assert_array_equal(out["platform_sum"], np.full(3, 3.0))
        # each clone: the source's spec, this rank's piece of zeros, its layout in the checkpoint metadata
        head = tuple(Net().head.weight.shape)
        for same_spec, shape, biggest, tensor_map, full_shape in out["clones"]:
            assert same_spec and biggest == 0.0 and tensor_map is not None, out["clones"]
            assert full_shape == list(head) and shape[0] < head[0], out["clones"]
        assert out["master"] == (True, {"type": "Float32", "full_shape": [5, 5]}), out["master"]
        assert out["parameter_tuple_clone"] == [True, True]
        # rank 0 keeps its row 0 and gets rank 1's rows 0-1; rank 1 gets rank 0's rows 1-2 and keeps its row 2
        expected = np.arange(6, dtype=np.float32).reshape(3, 2)[[0, 0, 1]] + [[0], [10], [10]] if rank == 0 else \
            np.arange(6, dtype=np.float32).reshape(3, 2)[[1, 2, 2]] + [[0], [0], [10]]
        # the gradient of each sent row: the weight (1, 2, 3) of the position it took at its destination
        grad = np.array([[1.0], [1.0], [2.0]] if rank == 0 else [[2.0], [3.0], [3.0]]) * np.ones((1, 2))
        for name in ("differentiable_all_to_all_single", "differentiable_all_to_all_single_async"):
            np.testing.assert_array_equal(out[name], expected)
            np.testing.assert_array_equal(out[name + "_grad"], grad)
        np.testing.assert_array_equal(out["platform_grad"], np.full(3, 3.0))  # d/dv of sum_r (r+1) * sum(v)
        inp = {"device_matrix": [2], "alias_name": ["dp"], "rank_list": [0, 1], "tensor_map": [0, -1],
               "full_shape": [8, 8], "type": "Float32"}
        assert out["layout_current"] == {rank: out["layout_current"][rank]} and out["layout_current"][rank]["inp.weight"] == inp
        assert sorted(out["layout_global"]) == [0, 1]
        head = out["layout_global"][1]["head.weight"]          # meta model: Shard(0) over "tp", whole over "dp"
        assert (head["device_matrix"], head["alias_name"], head["tensor_map"], head["full_shape"]) == \
            ([1, 2], ["dp", "tp"], [[0, 1], -1], [3, 8])     # tp cuts first, dp (1 rank) cuts its piece
        assert out["unflatten"] == ((1, 2), ("dp", "tp"), (0, 1))
        assert "multiply to 3" in out["unflatten_((3,), ('x',))"]
        assert "must pair up" in out["unflatten_((2,), ('a', 'b'))"]


def test_option_arguments_are_checked():
    with pytest.raises(TypeError, match="apply_grad_on_fp32_main_grad must be a bool"):
        MixedPrecisionPolicy(apply_grad_on_fp32_main_grad=1)
    with pytest.raises(TypeError, match="comm_fusion must be None or a bool"):
        fully_shard(Net(), comm_fusion="yes")
