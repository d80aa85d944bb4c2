"""Activation checkpointing (checkpoint_wrapper / apply_activation_checkpointing): the same names
and paths, the single-device answer (loss per step, gradients, parameters after 3 AdamW steps:
tests/_parity.py) for full and selective checkpoints of TP blocks and of fully_shard units on 2
ranks, wrapped before and after the parallel engine, in PyNative and ms.jit; each wrapped block's
forward runs twice per step (forward and recompute); under fully_shard the full recompute gathers
the block's parameters again (one more all-gather per unit and step), the selective one calls the
gather but hands back the forward's result (no collective kernel runs); PyTorch's Llama plan with
sequence parallelism; pipeline stages (GPipe, 1F1B, ZBV) with checkpointed blocks."""
from __future__ import annotations

import mindspore as ms
import numpy as np
import pytest
from mindspore import Parameter, nn, ops

from hyper_parallel_ms.comm import CommDebugMode
from hyper_parallel_ms.mesh import init_device_mesh
from hyper_parallel_ms.testing import multi_rank
from hyper_parallel_ms.training import (CheckpointImpl, CheckpointWrapper, apply_activation_checkpointing,
                                        checkpoint_stats, checkpoint_wrapper, create_selective_checkpoint_contexts)

from tests._parity import STEPS, check_parity

CALLS = {"n": 0}


class Block(nn.Cell):
    """An MLP block counting its forwards (Python side: PyNative only)."""

    def __init__(self, dim: int = 8, hidden: int = 6) -> None:
        super().__init__()
        self.up = nn.Dense(dim, hidden)
        self.down = nn.Dense(hidden, dim)

    def construct(self, x):
        CALLS["n"] += 1
        return x + self.down(ops.tanh(self.up(x)))


class Net(nn.Cell):
    def __init__(self, dim: int = 8, blocks: int = 2) -> None:
        super().__init__()
        self.inp = nn.Dense(dim, dim)
        self.layers = nn.CellList([Block(dim) for _ in range(blocks)])
        self.head = nn.Dense(dim, 3)

    def construct(self, x):
        x = self.inp(x)
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def _batch(dp_index, dp_size, step):
    x = ms.Tensor(np.random.default_rng(100 + step).standard_normal((8, 8)).astype(np.float32))
    rows = 8 // dp_size
    return (x[dp_index * rows:(dp_index + 1) * rows],)


def _loss(model, x):
    return (model(x) ** 2).mean()


def _grads(model, x):
    params = model.trainable_params()
    return ms.value_and_grad(lambda v: _loss(model, v), None, params)(x)


def _wrap_blocks(model, policy=None):
    return apply_activation_checkpointing(model, check_fn=lambda c: isinstance(c, Block), policy=policy)


# ------------------------------------------------------------------ one device
def test_wrapping_keeps_parameter_names_paths_and_the_objects():
    ms.set_seed(0)
    plain = Net()
    ms.set_seed(0)
    model = Net()
    layer = model.layers[0]
    _wrap_blocks(model)
    assert model.layers[0] is layer and isinstance(layer, CheckpointWrapper) and isinstance(layer, Block)
    assert not isinstance(model.head, CheckpointWrapper)
    assert [p.name for p in model.trainable_params()] == [p.name for p in plain.trainable_params()]
    assert [n for n, _ in model.cells_and_names()] == [n for n, _ in plain.cells_and_names()]
    assert type(layer).__name__ == "Block"


@pytest.mark.parametrize("policy", [None, "selective", {"MatMul"}])
def test_single_device_gradients_are_exact_and_the_block_runs_twice(policy):
    ms.set_seed(0)
    plain = Net()
    ms.set_seed(0)
    model = _wrap_blocks(Net(), policy)
    x = _batch(0, 1, 0)[0]
    loss, grads = _grads(plain, x)
    CALLS["n"] = 0
    c_loss, c_grads = _grads(model, x)
    assert CALLS["n"] == 4, "two blocks, each run in the forward and again in the backward"
    assert float(c_loss.asnumpy()) == float(loss.asnumpy())
    for p, g, cg in zip(plain.trainable_params(), grads, c_grads):
        np.testing.assert_allclose(cg.asnumpy(), g.asnumpy(), rtol=1e-6, atol=1e-7, err_msg=p.name)
    stats = checkpoint_stats(model.layers[0])
    assert (stats.forwards, stats.recomputes) == (2, 1)
    if policy is None:
        assert not stats.saved and not stats.replayed
    else:
        # the two Dense matmuls are kept and handed back; the rest (BiasAdd, Tanh, AddExt) run again
        assert stats.saved == stats.replayed == {"MatMul": 2}, (stats.saved, stats.replayed)
        assert "MatMul" not in stats.recomputed and stats.recomputed["Tanh"] == 1, stats.recomputed


def test_a_parameter_replaced_after_wrapping_gets_exact_gradients():
    """Cell.recompute() would keep the old Parameter (silently zero gradients): the wrapper reads
    the Cell's parameters when it runs."""
    ms.set_seed(0)
    plain = Block()
    ms.set_seed(0)
    block = checkpoint_wrapper(Block())
    for cell in (plain, block):
        w = cell.up.weight
        cell.up.weight = Parameter(ms.Tensor(w.asnumpy() * 2), name=w.name)
    x = _batch(0, 1, 0)[0]
    _, grads = _grads(plain, x)
    _, c_grads = _grads(block, x)
    assert np.abs(c_grads[0].asnumpy()).max() > 1e-3
    for g, cg in zip(grads, c_grads):
        np.testing.assert_allclose(cg.asnumpy(), g.asnumpy(), rtol=1e-6, atol=1e-7)


def test_no_grad_forward_runs_once():
    block = checkpoint_wrapper(Block())
    CALLS["n"] = 0
    block(_batch(0, 1, 0)[0])
    assert CALLS["n"] == 1 and checkpoint_stats(block).recomputes == 0


def test_full_checkpoint_compiles_and_selective_is_refused_under_jit_and_graph_mode():
    ms.set_seed(0)
    plain = Net()
    ms.set_seed(0)
    model = _wrap_blocks(Net())
    x = _batch(0, 1, 0)[0]
    _, grads = _grads(plain, x)
    params = model.trainable_params()

    def loss(v):
        return _loss(model, v)
    _, j_grads = ms.jit(ms.value_and_grad(loss, None, params))(x)
    for g, jg in zip(grads, j_grads):
        np.testing.assert_allclose(jg.asnumpy(), g.asnumpy(), rtol=1e-6, atol=1e-7)
    from tests._fsdp_models import GradStep, compiled
    _, g_grads = compiled("graph", GradStep(model, params))(x)          # GRAPH_MODE
    for g, gg in zip(grads, g_grads):
        np.testing.assert_allclose(gg.asnumpy(), g.asnumpy(), rtol=1e-6, atol=1e-7)
    selective = _wrap_blocks(Net(), "selective")
    params = selective.trainable_params()

    def sel_loss(v):
        return _loss(selective, v)
    with pytest.raises(NotImplementedError, match="selective checkpoint policy.*policy=None under ms.jit"):
        ms.jit(ms.value_and_grad(sel_loss, None, params))(x)
    with pytest.raises(NotImplementedError, match="selective checkpoint policy"):
        compiled("graph", GradStep(selective, params))(x)


def test_nesting_and_bad_policies_are_refused_and_leave_the_cell_as_it_was():
    model = Net()
    checkpoint_wrapper(model.layers[0])
    with pytest.raises(ValueError, match=r"\['layers.0'\] already checkpointed"):
        checkpoint_wrapper(model)
    with pytest.raises(ValueError, match="inside the checkpointed"):
        apply_activation_checkpointing(model, check_fn=lambda c: isinstance(c, nn.Dense))
    inner = Net()
    checkpoint_wrapper(inner)
    checkpoint_wrapper(inner.layers[0].up)          # wrapped after its parent: caught when it runs
    with pytest.raises(ValueError, match="Net is checkpointed and holds the checkpointed 'layers.0.up'"):
        inner(_batch(0, 1, 0)[0])     # a forward: an error inside ms.grad leaves MindSpore's executor recording
    block = Block()
    with pytest.raises(ValueError, match="policy must be None, 'full', 'selective'"):
        checkpoint_wrapper(block, policy="some")
    with pytest.raises(TypeError, match="by name"):
        checkpoint_wrapper(block, policy=[1])
    with pytest.raises(TypeError, match=r"policy must be None, 'full', 'selective', a collection.*got 42 \(int\)"):
        checkpoint_wrapper(block, policy=42)
    assert type(block) is Block and not isinstance(block, CheckpointWrapper)
    with pytest.raises(ValueError, match="needs a selective policy"):
        create_selective_checkpoint_contexts(None)
    with pytest.raises(ValueError, match="is not checkpointed"):
        checkpoint_stats(block)
    with pytest.raises(NotImplementedError, match="custom checkpoint function"):
        checkpoint_wrapper(block, checkpoint_fn=lambda f, *a: f(*a))
    with pytest.raises(TypeError, match="checkpoint_impl must be a CheckpointImpl"):
        checkpoint_wrapper(block, "reentrant")
    with pytest.raises(TypeError, match="auto_wrap_policy must be"):
        apply_activation_checkpointing(Net(), auto_wrap_policy=3)
    assert type(block) is Block


def test_pytorch_keywords_of_the_wrappers():
    """PyTorch's checkpoint_wrapper(module, checkpoint_impl, use_reentrant=, preserve_rng_state=) and
    apply_activation_checkpointing(model, checkpoint_wrapper_fn, check_fn, auto_wrap_policy) (a set
    of classes, as ModuleWrapPolicy takes): the same exact gradients, the chosen Cells wrapped."""
    ms.set_seed(0)
    plain = Net()
    ms.set_seed(0)
    model = Net()
    checkpoint_wrapper(model.layers[0], CheckpointImpl.REENTRANT, use_reentrant=True, preserve_rng_state=False)
    apply_activation_checkpointing(model, checkpoint_wrapper, auto_wrap_policy={Block},
                                   check_fn=lambda c: c is not model.layers[0])
    assert all(isinstance(b, CheckpointWrapper) for b in model.layers) and not isinstance(model.head, CheckpointWrapper)
    x = _batch(0, 1, 0)[0]
    _, grads = _grads(plain, x)
    _, c_grads = _grads(model, x)
    for p, g, cg in zip(plain.trainable_params(), grads, c_grads):
        np.testing.assert_allclose(cg.asnumpy(), g.asnumpy(), rtol=1e-6, atol=1e-7, err_msg=p.name)
    other = Net()
    apply_activation_checkpointing(other, auto_wrap_policy=lambda c: isinstance(c, nn.Dense) and c is other.head)
    assert isinstance(other.head, CheckpointWrapper) and not isinstance(other.layers[0], CheckpointWrapper)


def test_selective_contexts_with_mindspore_recompute():
    ms.set_seed(0)
    block = Block()
    x = _batch(0, 1, 0)[0]
    _, grads = _grads(block, x)
    context_fn = create_selective_checkpoint_contexts(lambda name: name == "MatMul")

    def loss(v):
        return (ms.recompute(block, v, use_reentrant=False, context_fn=context_fn) ** 2).mean()
    _, c_grads = ms.value_and_grad(loss, None, block.trainable_params())(x)
    for g, cg in zip(grads, c_grads):
        np.testing.assert_allclose(cg.asnumpy(), g.asnumpy(), rtol=1e-6, atol=1e-7)


# ------------------------------------------------------------------ 2 ranks
def _tp(mesh, policy, wrap_first):
    from hyper_parallel_ms.nn import ColwiseParallel, RowwiseParallel, parallelize_module

    def shard(model):
        if wrap_first:
            _wrap_blocks(model, policy)
        parallelize_module(model, mesh, {"layers.*.up": ColwiseParallel(), "layers.*.down": RowwiseParallel()})
        if not wrap_first:
            _wrap_blocks(model, policy)
    return shard


def _fsdp(mesh, policy, wrap_first):
    from hyper_parallel_ms.fsdp import fully_shard

    def shard(model):
        if wrap_first:
            _wrap_blocks(model, policy)
        for layer in model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        if not wrap_first:
            _wrap_blocks(model, policy)
    return shard


def _counted(models: list, shard):
    def run(model):
        shard(model)
        models.append(model)
    return run


@pytest.mark.parametrize("jit", [False, True])
@multi_rank(2, timeout=900)
def test_tp_blocks_parity_on_2_ranks(jit):
    """ColwiseParallel / RowwiseParallel MLP blocks, checkpointed before and after parallelize_module."""
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    policies = [None] if jit else [None, "selective"]
    for policy in policies:
        for wrap_first in (True, False):
            CALLS["n"] = 0
            models = []
            check_parity(Net, _counted(models, _tp(mesh, policy, wrap_first)), _batch, _loss, optimizer="adamw",
                         jit=jit)
            if not jit:
                # STEPS steps: the one-device reference runs each block once, the checkpointed one twice
                assert CALLS["n"] == STEPS * 2 + STEPS * 2 * 2, CALLS["n"]
                stats = checkpoint_stats(models[0].layers[0])
                assert (stats.forwards, stats.recomputes) == (2 * STEPS, STEPS)
                if policy == "selective":
                    # the matmuls and the styles' all-reduces are kept from the forward and not run again
                    assert stats.replayed == stats.saved and stats.replayed["AllReduce"] >= STEPS, stats.replayed
                    assert "AllReduce" not in stats.recomputed and "MatMul" not in stats.recomputed, stats.recomputed


def _gathers(shard, dp_index):
    """All-gathers per step (CommDebugMode) of one gradient step of Net sharded by ``shard``."""
    ms.set_seed(0)
    model = Net()
    shard(model)
    x = _batch(dp_index, 2, 0)[0]
    pieces = [(cell, name, p) for cell in (c for _, c in model.cells_and_names())
              for name, p in cell.parameters_dict(recurse=False).items()]
    _grads(model, x)                      # first call: MindSpore's one-time checks
    with CommDebugMode() as mode:
        _grads(model, x)
    # after the recompute each Cell holds its piece Parameters again (fully_shard's reshard ran)
    assert all(cell.parameters_dict(recurse=False)[name] is p for cell, name, p in pieces)
    return mode.get_comm_counts().get("all_gather", 0), model


@multi_rank(2, timeout=900)
def test_fully_shard_units_parity_and_gathers_on_2_ranks():
    """Blocks checkpointed before and after fully_shard (per block, then the root), PyNative; and
    checkpointed after fully_shard in ms.jit (one compile: test time)."""
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("dp",))
    rank = mesh.get_local_rank(0)
    common = dict(optimizer="adamw", dp_mesh=mesh, dp_dim="dp", dp_index=rank, dp_size=2)
    for policy, wrap_first, jit in ((None, True, False), (None, False, False), ("selective", True, False),
                                    (None, False, True)):
        CALLS["n"] = 0
        check_parity(Net, _fsdp(mesh, policy, wrap_first), _batch, _loss, jit=jit, **common)
        if not jit:
            assert CALLS["n"] == STEPS * 2 + STEPS * 2 * 2, CALLS["n"]
    plain, _ = _gathers(lambda m: _fsdp_only(mesh, m), rank)
    full, model = _gathers(_fsdp(mesh, None, True), rank)
    selective, model = _gathers(_fsdp(mesh, "selective", True), rank)
    # one unit per block and the root: each block gathers in its forward and again in its backward
    # (the default reshard_after_forward=None reshards every unit but the root, which keeps its
    # parameters for the backward); a checkpointed block's second gather is its recompute's, which
    # replaces the re-gather, so the count is the same
    assert plain == 2 * 2 + 1 and full == plain, (plain, full)
    # the selective recompute calls the gather again (CommDebugMode records the call) but its
    # collective kernel is not run: the forward's result is handed back
    assert selective == plain, (plain, selective)
    stats = checkpoint_stats(model.layers[0])
    # the unit's gather (on the world group of CPU ranks MCCL's AllGather, else a composed AllReduce)
    gathers = stats.replayed["AllReduce"] + stats.replayed["AllGather"]
    assert stats.replayed == stats.saved and gathers >= 2, stats.replayed
    assert "AllReduce" not in stats.recomputed and "AllGather" not in stats.recomputed, stats.recomputed


def _inplace_update_works() -> bool:
    p = Parameter(ms.Tensor(np.ones(3, np.float32)), name="probe")
    try:
        p.copy_(ms.Tensor(np.zeros(3, np.float32)))
        return bool((p.asnumpy() == 0).all())
    except RuntimeError:
        return False


@multi_rank(2, timeout=900)
def test_a_cell_inside_a_fully_shard_unit_is_refused_and_the_executor_left_clean():
    """A checkpointed Cell whose parameters an enclosing fully_shard unit gathers (the unit frees them
    after its forward: the recompute would read the pieces; compiled, the example Llama's losses were a
    few percent off) is refused: in PyNative inside value_and_grad, after which in-place updates still
    work (the failed gradient call's record is dropped), and while ms.jit compiles. Checkpointing the
    unit itself stays exact (the parity test above)."""
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("dp",))
    ms.set_seed(0)
    model = Net()
    _fsdp_only(mesh, model)
    checkpoint_wrapper(model.layers[0].up)
    x = _batch(mesh.get_local_rank(0), 2, 0)[0]
    params = model.trainable_params()

    def loss(v):
        return _loss(model, v)
    with pytest.raises(NotImplementedError, match="Checkpoint the unit itself"):
        ms.jit(ms.value_and_grad(loss, None, params))(x)
    assert _inplace_update_works()
    with pytest.raises(NotImplementedError, match=r"checkpointed inside a fully_shard / hsdp unit.*'weight'"):
        _grads(model, x)
    assert _inplace_update_works()


@multi_rank(4, timeout=900)
def test_checkpointed_tp_blocks_in_fully_shard_units_parity_on_4_ranks():
    """Blocks checkpointed, then tensor parallel over "tp" and fully sharded over "dp" of a (2, 2)
    mesh (FSDP x TP: each checkpointed block is a unit), PyNative (compiled, each pair of the three is
    compiled elsewhere: checkpointed fully_shard units above, FSDP x TP in test_fsdp_compiled.py,
    checkpointed TP blocks in test_tp_blocks_parity_on_2_ranks; test time)."""
    from hyper_parallel_ms.fsdp import fully_shard
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    rank = mesh.get_coordinate()[0]

    def shard(model):
        _tp(mesh["tp"], None, True)(model)
        for layer in model.layers:
            fully_shard(layer, mesh=mesh["dp"])
        fully_shard(model, mesh=mesh["dp"])
    CALLS["n"] = 0
    check_parity(Net, shard, _batch, _loss, optimizer="adamw", dp_mesh=mesh, dp_dim="dp", dp_index=rank, dp_size=2)
    assert CALLS["n"] == STEPS * 2 + STEPS * 2 * 2, CALLS["n"]      # each checkpointed block ran twice


def _fsdp_only(mesh, model):
    from hyper_parallel_ms.fsdp import fully_shard
    for layer in model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)


@multi_rank(2, timeout=900)
def test_sequence_parallel_transformer_on_2_ranks():
    """PyTorch's Llama plan (SequenceParallel norms, PrepareModuleInput with deferred Colwise
    gradients, Rowwise with sequence-sharded outputs), whole blocks checkpointed: PyNative full and
    selective, ms.jit full. (The example Llama's blocks, whose RMSNorm is SequenceParallel, do not
    compile under ms.jit when checkpointed whole: scripts/bench_activation_checkpoint.py --graph.)"""
    from hyper_parallel_ms.nn import parallelize_module
    from tests.test_parallel_styles import Transformer, _nll, _tokens, transformer_plan
    from tests.test_parallel_styles import Block as SPBlock
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))

    def shard(policy):
        def run(model):
            parallelize_module(model, mesh, transformer_plan(mesh, defer=True))
            apply_activation_checkpointing(model, check_fn=lambda c: isinstance(c, SPBlock), policy=policy)
        return run
    for policy, jit in ((None, False), ("selective", False), (None, True)):
        check_parity(Transformer, shard(policy), _tokens, _nll, optimizer="adamw", jit=jit)


@pytest.mark.parametrize("name", ["GPipe", "1F1B", "ZBVZeroBubble"])
@multi_rank(2, timeout=600)
def test_pipeline_stages_with_checkpointed_blocks_on_2_ranks(name):
    """The blocks of every stage checkpointed: each micro-batch's gradients equal one device's; a block
    runs its forward once per micro-batch and once more per backward pass that needs it (ZBV's split
    backward, input gradients then weight gradients, recomputes twice on the stage that splits it)."""
    from tests import _pipeline_models as pipe
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("pp",))
    n = 2
    schedule, models = pipe.make_schedule(name, mesh, n)
    for model in models:
        apply_activation_checkpointing(model, check_fn=lambda c: isinstance(c, pipe.Block))
    history, _ = pipe.one_device_run(schedule.plan.num_stages, n)
    x, y = pipe.batch(0, pipe.BATCHES[0])
    schedule.step(*((x,) if schedule.stages[0].is_first else ()), target=y if schedule.stages[-1].is_last else None)
    for p, g in zip(schedule.parameters(), schedule.gradients()):
        np.testing.assert_allclose(g.asnumpy(), history[0][1][p.name], rtol=pipe.RTOL, atol=pipe.ATOL, err_msg=p.name)
    for model in models:
        for block in model.layers:
            stats = checkpoint_stats(block)
            assert stats.forwards == n + stats.recomputes and stats.recomputes in (n, 2 * n), vars(stats)


@multi_rank(2, timeout=600)
def test_dtensor_parameters_full_checkpoint_exact_selective_refused_on_2_ranks():
    """shard_module / distribute_module Cells compute on DTensors: full checkpointing gives their
    gradients; a selective policy, whose op interception would see plain local tensors, is refused."""
    import hyper_parallel_ms as hp
    from hyper_parallel_ms.nn import ShardingPlan, shard_module
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    plan = ShardingPlan(plan={"up.weight": ("tp", "None"), "up.bias": ("tp",), "down.weight": ("None", "tp")})
    x = _batch(0, 1, 0)[0]
    grads = {}
    for policy in ("plain", None, "selective"):
        ms.set_seed(0)
        block = shard_module(Block(), mesh, plan)
        if policy != "plain":
            checkpoint_wrapper(block, policy=policy)
        step = hp.value_and_grad(lambda v: (block(v) ** 2).mean(), None, block.trainable_params())
        if policy == "selective":                   # a forward: an error inside a gradient call leaves
            with pytest.raises(NotImplementedError, match="cannot run on DTensors.*policy=None"):
                block(x)                            # MindSpore's executor recording on this rank
            continue
        grads[policy] = [g.full_tensor().asnumpy() for g in step(x)[1]]
        if policy is None:
            assert (checkpoint_stats(block).forwards, checkpoint_stats(block).recomputes) == (2, 1)
    for g, want in zip(grads[None], grads["plain"]):
        np.testing.assert_allclose(g, want, rtol=1e-6, atol=1e-7)
