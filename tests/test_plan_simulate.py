"""simulate(): a training script's own code run as ranks of a simulated cluster, without values,
in this process (memory per rank, communication of a step, classes of equivalent ranks,
cross-rank checks). The comparison with real ranks is in tests/test_plan_real.py."""
from __future__ import annotations

import json
import resource
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = str(Path(__file__).resolve().parents[1])


def _cpu():
    import mindspore as ms
    if ms.get_context("device_target") != "CPU":
        ms.set_device("CPU")
    if ROOT not in sys.path:
        sys.path.insert(0, ROOT)


def _mlp_build(hidden: int = 48, uneven_on=None, optimizer: str = "adamw", step: bool = True):
    """fn(mesh): a two-layer MLP, Colwise / Rowwise on mesh["tp"], gradients averaged over dp;
    ``uneven_on``: the rank that applies another plan."""
    import mindspore as ms
    from mindspore import nn
    from hyper_parallel_ms import no_init_parameters
    from hyper_parallel_ms.nn import ColwiseParallel, GradientReducer, RowwiseParallel, parallelize_module

    class MLP(nn.Cell):
        def __init__(self):
            super().__init__()
            self.fc1 = nn.Dense(16, hidden, has_bias=False)
            self.fc2 = nn.Dense(hidden, 16, has_bias=False)

        def construct(self, x):
            return self.fc2(ms.ops.relu(self.fc1(x)))

    class WithLoss(nn.Cell):
        def __init__(self, net):
            super().__init__()
            self.net = net

        def construct(self, x):
            return (self.net(x) ** 2).mean()

    def build(mesh):
        with no_init_parameters():
            model = MLP()
        plan = {"fc1": ColwiseParallel(), "fc2": RowwiseParallel()}
        if mesh.get_rank() == uneven_on:
            plan = {"fc1": RowwiseParallel(), "fc2": ColwiseParallel()}
        parallelize_module(model, mesh["tp"], plan)
        params = model.trainable_params()
        opt = (nn.AdamWeightDecay(params) if optimizer == "adamw" else nn.Momentum(params, 0.1, 0.9))
        if not step:
            return model, opt
        reducer = GradientReducer(params, dp_mesh=mesh, dp_dim="dp")
        grad_fn = ms.value_and_grad(WithLoss(model), None, opt.parameters)
        x = ms.Tensor(np.ones((4, 16), np.float32))

        def one_step():
            loss, grads = grad_fn(x)
            opt(reducer(grads))
            return loss
        return model, opt, one_step
    return build


def test_memory_per_rank_from_the_pieces_and_the_optimizer_slots():
    _cpu()
    from hyper_parallel_ms import simulate
    for hidden, optimizer, slots in ((48, "adamw", ("adam_m", "adam_v")), (50, "momentum", ("moments",))):
        report = simulate(_mlp_build(hidden, optimizer=optimizer, step=False), mesh_shape=(2, 4),
                          mesh_dim_names=("dp", "tp"), ranks=range(8))
        per_tp = [report[r].param_bytes for r in range(4)]
        assert sum(per_tp) == 2 * 16 * hidden * 4                    # the tp ranks' pieces tile both weights
        for r in range(8):
            rank = report[r]
            assert rank.grad_bytes == rank.param_bytes
            assert tuple(sorted(rank.optimizer_slots)) == tuple(sorted(slots))
            assert rank.optimizer_bytes == len(slots) * rank.param_bytes
            assert rank.activation_bytes is None and rank.comm_bytes is None      # no step given
            assert rank.param_bytes == report[r % 4].param_bytes                 # dp replicas hold the same
    # hidden 50 over tp 4: torch.chunk rows 13, 13, 13, 11
    assert [report[r].param_bytes for r in range(4)] == [2 * 13 * 16 * 4] * 3 + [2 * 11 * 16 * 4]


def _simulate_large_llama() -> dict:
    """The plan of a 1.0 GiB (fp32) Llama on (pp 1, dp 2, tp 2), and the rise of this process's peak RSS."""
    _cpu()
    from examples.plan_llama import ParallelDims, llama_training
    from examples.llama import LlamaConfig
    from hyper_parallel_ms import simulate
    config = LlamaConfig(vocab=32000, dim=2048, layers=4, heads=16, hidden=5632, max_seq=512)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    report = simulate(llama_training(config, ParallelDims(dp=2, tp=2, seq=512)), mesh_shape=(1, 2, 2),
                      mesh_dim_names=("pp", "dp", "tp"), ranks=[0])
    return {"rise_kib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before, "ok": report.ok,
            "table": report.table(), "param_bytes": report[0].param_bytes, "comm_bytes": report[0].comm_bytes,
            "activation_bytes": report[0].activation_bytes}


def test_a_large_model_is_never_materialised():
    """Measured in a fresh process: in the pytest process the peak RSS also answers for what earlier
    tests left in the allocator (the same simulation rose 25 MiB alone, 316 MiB once after the
    suite's earlier tests)."""
    import subprocess
    code = ("import json, sys; sys.path.insert(0, %r); from tests.test_plan_simulate import _simulate_large_llama; "
            "print(json.dumps(_simulate_large_llama()))" % ROOT)
    run = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True, cwd=ROOT)
    result = json.loads(run.stdout.strip().splitlines()[-1])
    assert result["ok"], result["table"]
    matrices = 4 * (32000 * 2048 * 2 + 4 * (4 * 2048 * 2048 + 3 * 2048 * 5632))
    norms = 4 * 2048 * (2 * 4 + 1)
    assert result["param_bytes"] == matrices // 4 + norms // 2   # fsdp 2 x tp 2; norms replicated over tp
    assert result["comm_bytes"] > 0 and result["activation_bytes"] > 0
    assert result["rise_kib"] < 300 * 1024, f"peak RSS rose {result['rise_kib'] / 1024:.0f} MiB"


def test_a_rank_that_would_materialise_parameters_is_reported():
    _cpu()
    from mindspore import nn
    from hyper_parallel_ms import no_init_parameters, simulate

    def build(mesh):
        with no_init_parameters():
            model = nn.Dense(1024, 1024)
        model.init_parameters_data()
        return model, None
    report = simulate(build, mesh_shape=(2,), mesh_dim_names=("dp",), ranks=[1])
    assert [p.kind for p in report.problems] == ["error"] and report.problems[0].ranks == (1,)
    assert "would be given values" in report.problems[0].message


def test_an_error_of_a_class_is_reported_for_every_rank_it_stands_for():
    """A sequence of 7 over 4 ranks raises on every real rank (the conversion cannot tell the global
    length from a piece): the dry run names that error, for all 4 ranks, not only those it ran."""
    _cpu()
    import mindspore as ms
    from mindspore import nn
    from hyper_parallel_ms import Replicate, Shard, simulate
    from hyper_parallel_ms.nn import PrepareModuleInput, parallelize_module

    def build(mesh):
        model = nn.SequentialCell([nn.Dense(4, 4)])
        parallelize_module(model, mesh, {"0": PrepareModuleInput(input_layouts=(Replicate(),),
                                                                 desired_input_layouts=(Shard(1),),
                                                                 use_local_output=True)})
        optimizer = nn.SGD(model.trainable_params(), 0.1)
        grad = ms.value_and_grad(lambda x: model(x).sum(), None, model.trainable_params())
        x = ms.Tensor(np.ones((2, 7, 4), np.float32))
        return model, optimizer, lambda: optimizer(grad(x)[1])
    report = simulate(build, mesh_shape=(4,), mesh_dim_names=("tp",))
    assert len(report.computed) < 4
    assert [(p.kind, p.ranks) for p in report.problems] == [("error", (0, 1, 2, 3))]
    assert "shards dim 1 of length 7 over 4 ranks unevenly" in report.problems[0].message


def test_an_error_in_user_code_names_the_cell_and_carries_its_traceback():
    _cpu()
    import mindspore as ms
    from mindspore import nn
    from hyper_parallel_ms import no_init_parameters, simulate

    class Faulty(nn.Cell):
        def __init__(self):
            super().__init__()
            self.fc = nn.Dense(4, 4)

        def construct(self, x):
            return self.fc(x)[:, 7]          # IndexError: the user's bug, two Cells down

    class Model(nn.Cell):
        def __init__(self):
            super().__init__()
            self.body = nn.SequentialCell([nn.Dense(4, 4), Faulty()])

        def construct(self, x):
            return self.body(x).sum()

    def build(mesh):
        with no_init_parameters():
            model = Model()
        optimizer = nn.SGD(model.trainable_params(), 0.1)
        grad = ms.value_and_grad(model, None, optimizer.parameters)
        return model, optimizer, lambda: grad(ms.Tensor(np.ones((2, 4), np.float32)))
    report = simulate(build, mesh_shape=(2,), mesh_dim_names=("dp",))
    [problem] = report.problems
    assert problem.kind == "error" and problem.ranks == (0, 1) and problem.where == "body.1 (Faulty)"
    assert "Traceback" in problem.traceback and "return self.fc(x)[:, 7]" in problem.traceback
    table = report.table()
    assert "return self.fc(x)[:, 7]" in table and "dryrun" not in table.split("at body.1 (Faulty)")[1]
    assert json.loads(report.to_json())["problems"][0]["traceback"] == problem.traceback


def test_equivalent_ranks_run_once_and_stand_for_the_others_exactly():
    _cpu()
    from hyper_parallel_ms import simulate
    even = simulate(_mlp_build(48), mesh_shape=(2, 4), mesh_dim_names=("dp", "tp"))
    assert even.ok and len(even) == 8 and len(even.classes()) == 1
    assert len(even.computed) == 3                  # the first rank and one probe per dim
    uneven = simulate(_mlp_build(50), mesh_shape=(2, 4), mesh_dim_names=("dp", "tp"))
    assert sorted(uneven.classes()) == [0, 1, 2, 3]                 # tp distinguishes ranks, dp does not
    for r in (5, 7):
        alone = simulate(_mlp_build(50), mesh_shape=(2, 4), mesh_dim_names=("dp", "tp"), ranks=[r])[r]
        stood = uneven[r]
        assert stood.represented_by == r % 4 and alone.represented_by == r
        for field in ("param_bytes", "grad_bytes", "optimizer_bytes", "activation_bytes", "comm_bytes", "comm"):
            assert getattr(stood, field) == getattr(alone, field), field
    # every dim of more than one rank distinguishes ranks: the middle coordinates are classes too (they
    # were listed but never run: KeyError)
    middle = simulate(_mlp_build(50), mesh_shape=(1, 4), mesh_dim_names=("dp", "tp"))
    assert sorted(middle.classes()) == [0, 1, 2, 3] and sorted(middle.computed) == [0, 1, 2, 3]
    alone = simulate(_mlp_build(50), mesh_shape=(1, 4), mesh_dim_names=("dp", "tp"), ranks=[2])[2]
    assert middle[2].param_bytes == alone.param_bytes and middle[2].comm == alone.comm


def _pipeline(pp: int, dp: int = 1, tp: int = 1):
    """The example Llama (tiny, one block per stage) as ``simulate`` arguments on a (pp, dp, tp) mesh."""
    from examples.llama import LlamaConfig
    from examples.plan_llama import llama_training
    from hyper_parallel_ms.dryrun import ParallelDims
    dims = ParallelDims(pp=pp, dp=dp, tp=tp, fsdp=dp > 1, microbatches=pp, seq=32)
    config = LlamaConfig(vocab=64, dim=64, layers=pp, heads=4, hidden=128, max_seq=32)
    shape, names = dims.mesh
    return llama_training(config, dims), dict(mesh_shape=shape, mesh_dim_names=names)


@pytest.mark.parametrize("pp", [3, 4, 8])
def test_every_stage_of_a_deep_pipeline_runs_with_the_default_ranks(pp):
    """The last stage receives its forward inputs from the stage before it, which it runs first:
    that stage, not the first (a representative picked before the pp dim was probed), whose
    messages would be read as its own ("2RECV_F0 received the message of 0SEND_F0")."""
    _cpu()
    from hyper_parallel_ms import simulate
    build, mesh = _pipeline(pp)
    report = simulate(build, **mesh)
    assert report.problems == [] and sorted(report.computed) == list(range(pp))
    held = [report[s].activation_bytes for s in range(pp)]
    assert all(h is not None and h > 0 for h in held)
    assert held == sorted(held, reverse=True) and len(set(held)) == pp      # 1F1B: stage s holds pp - s micro-batches
    for s in range(pp):
        sent = {kind for kind, dim in report[s].comm if dim == "pp"}
        assert sent == ({"send", "recv"}), (s, report[s].comm)
    if pp == 3:
        alone = simulate(build, ranks=[pp - 1], **mesh)       # the stages before run as the last one needs them
        assert alone.problems == [] and alone[pp - 1].activation_bytes == held[-1]


def test_a_deep_pipeline_with_dp_and_tp_stands_for_every_rank_exactly():
    _cpu()
    from hyper_parallel_ms import simulate
    build, mesh = _pipeline(3, dp=2, tp=2)
    by_class = simulate(build, **mesh)
    last = [3, 7, 11]                                     # the last dp and tp coordinates of each stage
    every = simulate(build, ranks=last, **mesh)
    assert by_class.problems == [] and every.problems == [] and len(by_class.computed) == 5
    assert [by_class[r].represented_by for r in last] == [0, 4, 8] and sorted(every.computed) == last
    for r in last:
        for field in ("param_bytes", "grad_bytes", "optimizer_bytes", "activation_bytes", "comm_bytes", "flops",
                      "comm"):
            assert getattr(by_class[r], field) == getattr(every[r], field), (r, field)


def test_a_plan_that_differs_on_one_rank_of_64_is_reported_naming_the_rank_and_the_cell():
    _cpu()
    from hyper_parallel_ms import simulate
    report = simulate(_mlp_build(48, uneven_on=37, step=False), mesh_shape=(16, 4), mesh_dim_names=("dp", "tp"),
                      ranks=range(64))
    assert [(p.kind, p.ranks) for p in report.problems] == [("plan", (37,))]
    problem = report.problems[0]
    assert problem.where in ("fc1", "fc1.weight") and "rank 37 applies a different plan" in problem.message
    assert "RowwiseParallel" in problem.message and "ColwiseParallel" in problem.message
    assert "rank 37" in report.table()


def _diverging_build(kind: str):
    """A step in which rank 1 of a 2-rank tp mesh issues another collective (or message) than rank 0."""
    import mindspore as ms
    from mindspore import nn
    from hyper_parallel_ms import comm

    class Head(nn.Cell):
        def construct(self, x):
            return x

    def build(mesh):
        model = Head()
        me = mesh.get_local_rank("tp")

        def step():
            x = ms.Tensor(np.ones((2, 3), np.float32))
            model(x)
            if kind == "collective":
                comm.all_reduce(x if me == 0 else ms.Tensor(np.ones((3, 3), np.float32)), mesh, "tp")
            elif me == 0:
                comm.send(x, mesh, "tp", dst=1)
            else:
                comm.recv(ms.Tensor(np.ones((3, 3), np.float32)), mesh, "tp", src=0)
        return model, None, step
    return build


def test_collective_sequences_and_messages_that_differ_in_a_group_are_reported():
    _cpu()
    from hyper_parallel_ms import simulate
    report = simulate(_diverging_build("collective"), mesh_shape=(2,), mesh_dim_names=("tp",), ranks=[0, 1])
    assert [p.kind for p in report.problems] == ["collectives"]
    assert "would hang" in report.problems[0].message and "(3, 3)" in report.problems[0].message
    report = simulate(_diverging_build("p2p"), mesh_shape=(2,), mesh_dim_names=("tp",), ranks=[0, 1])
    assert [(p.kind, p.ranks) for p in report.problems] == [("p2p", (0, 1))]
    assert "sent ((2, 3), 'Float32'), received ((3, 3), 'Float32')" in report.problems[0].message


def test_report_table_and_json():
    _cpu()
    from hyper_parallel_ms import simulate
    report = simulate(_mlp_build(48), mesh_shape=(2, 4), mesh_dim_names=("dp", "tp"))
    data = json.loads(report.to_json())
    assert data["mesh_shape"] == [2, 4] and len(data["ranks"]) == 8 and data["problems"] == []
    first = data["ranks"][0]
    assert first["param_bytes"] == report[0].param_bytes and first["comm_bytes"] == report[0].comm_bytes
    assert set(first["comm"]) == {f"{k}/{d}" for k, d in report[0].comm}
    assert sum(s.bytes for s in report[0].comm.values()) == report[0].comm_bytes
    table = report.table()
    assert "0-7" in table and "comm tp" in table and "no cross-rank problem found" in table
    with pytest.raises(KeyError, match="rank 9 was not simulated"):
        report[9]
    with pytest.raises(ValueError, match="mesh_shape must be"):
        simulate(_mlp_build(48), mesh_shape=(0,))
    with pytest.raises(ValueError, match="ranks must be ranks of the 8-rank mesh"):
        simulate(_mlp_build(48), mesh_shape=(2, 4), mesh_dim_names=("dp", "tp"), ranks=[8])


def test_shape_only_ops_give_the_shapes_and_dtypes_of_real_ops():
    _cpu()
    import mindspore as ms
    from mindspore import Tensor, nn, ops
    from hyper_parallel_ms.dryrun._abstract import AbstractTensor, abstract_scope, is_abstract
    rng = np.random.default_rng(0)
    x = Tensor(rng.standard_normal((2, 6, 8)).astype(np.float32))
    w = Tensor(rng.standard_normal((8, 12)).astype(np.float32))
    ids = Tensor(np.array([[1, 2, 3], [0, 4, 5]], np.int32))
    table = Tensor(rng.standard_normal((7, 8)).astype(np.float32))
    cases = [
        lambda x, w, ids, t: ops.matmul(x, w), lambda x, w, ids, t: x.reshape(2, 6, -1, 2).transpose(0, 2, 1, 3),
        lambda x, w, ids, t: ops.softmax(x, -1), lambda x, w, ids, t: x.mean(-1, keep_dims=True),
        lambda x, w, ids, t: ops.rsqrt(x * x + 1.0), lambda x, w, ids, t: ops.silu(x) * x,
        lambda x, w, ids, t: x[:, 1:4], lambda x, w, ids, t: ops.gather(t, ids, 0),
        lambda x, w, ids, t: x.astype(ms.float16), lambda x, w, ids, t: x < 0.5,
        lambda x, w, ids, t: ops.log_softmax(x, -1).sum(), lambda x, w, ids, t: ops.stop_gradient(x) - x,
        lambda x, w, ids, t: nn.Dense(8, 3)(x.reshape(-1, 8)),
    ]
    with abstract_scope():
        abstract = [AbstractTensor(tuple(a.shape), a.dtype) for a in (x, w, ids, table)]
        for i, case in enumerate(cases):
            real, shaped = case(x, w, ids, table), case(*abstract)
            assert is_abstract(shaped), i
            assert (tuple(shaped.shape), shaped.dtype) == (tuple(real.shape), real.dtype), i
        assert float(abstract[0].sum().asnumpy()) == 0.0          # values: zeros
        with pytest.raises(RuntimeError, match="a shape-only run has no values"):
            bool(abstract[0].sum() > 0)
        with pytest.raises(NotImplementedError, match="no shape rule for MindSpore op 'Erfc'"):
            ops.erfc(abstract[0])
