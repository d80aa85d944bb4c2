"""Pipeline parallelism composed with the other axes, on 4 CPU ranks, against the single-device
model on the whole batch (each micro-batch's loss every step, parameters after 3 AdamWeightDecay
steps, rtol 1e-5):

* pp x tp (2 x 2): each stage parallelized with ``parallelize_module`` on ``mesh["tp"]``, the
  stages talking over ``mesh["pp"]`` (send / recv only between ranks of one tp coordinate);
* pp x fully_shard (2 x 2): each stage's blocks and root ``fully_shard(..., mesh=mesh["dp"])``,
  the plan lowered with UNSHARD / RESHARD / REDUCE_GRAD: CommDebugMode counts one reduce-scatter
  per sharded unit and step, and with ``reshard_after_forward=False`` one all-gather, whatever
  the number of micro-batches;
* tied embedding / head across the first and the last stage (``shared_parameters``): the
  gradient summed over the two ranks holding it by one all-reduce per step.

The MLP here (tanh, mean-square loss) has no element whose gradient is mathematically zero, so
AdamW is compared at the plain tolerance (tests/_parity.py's zero-gradient rule does not arise).
"""
from __future__ import annotations

import mindspore as ms
import numpy as np
import pytest
from mindspore import Parameter, nn, ops

from hyper_parallel_ms.testing import multi_rank

WIDTH, HIDDEN, IN, OUT = 8, 16, 6, 4
BATCH, STEPS = 16, 3
RTOL, ATOL = 1e-5, 1e-6


class Block(nn.Cell):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Dense(WIDTH, HIDDEN)
        self.down = nn.Dense(HIDDEN, WIDTH)

    def construct(self, x):
        return self.down(ops.tanh(self.up(x))) + x


class Model(nn.Cell):
    """``embed`` / ``layers`` / ``head``; with ``tied`` the head's weight is the embedding's (transposed use)."""

    def __init__(self, n_blocks: int, tied: bool = False) -> None:
        super().__init__()
        self.tied = tied
        self.embed = nn.Dense(IN, WIDTH)
        self.layers = nn.CellList([Block() for _ in range(n_blocks)])
        self.head = TiedHead(self.embed.weight) if tied else nn.Dense(WIDTH, OUT)

    def construct(self, x):
        x = x if self.embed is None else self.embed(x)
        for block in self.layers:
            x = block(x)
        return x if self.head is None else self.head(x)


class TiedHead(nn.Cell):
    """A head reading the embedding's ``(WIDTH, IN)`` weight as ``x @ W`` (IN outputs)."""

    def __init__(self, weight: Parameter) -> None:
        super().__init__()
        self.weight = weight

    def construct(self, x):
        return ops.matmul(x, self.weight)


def loss_fn(out, target):
    return ((out - target) ** 2).mean()


def _batch(step: int, out: int = OUT):
    rs = np.random.RandomState(200 + step)
    return ms.Tensor(rs.randn(BATCH, IN).astype(np.float32)), ms.Tensor(rs.randn(BATCH, out).astype(np.float32))


def _optimizer(params):
    return nn.AdamWeightDecay(params, learning_rate=0.01, beta1=0.9, beta2=0.999, weight_decay=0.01)


def _reference(n_blocks: int, rows: slice, n: int, tied: bool = False):
    """Per step the losses of the micro-batches of ``rows`` and the full-batch loss; then the parameters."""
    ms.set_seed(0)
    model = Model(n_blocks, tied)
    params = model.trainable_params()
    opt = _optimizer(params)
    step_fn = ms.value_and_grad(lambda x, y: loss_fn(model(x), y), None, params)
    history = []
    for step in range(STEPS):
        x, y = _batch(step, IN if tied else OUT)
        xs, ys = x[rows], y[rows]
        k = xs.shape[0] // n
        mb = [float(loss_fn(model(xs[m * k:(m + 1) * k]), ys[m * k:(m + 1) * k]).asnumpy()) for m in range(n)]
        loss, grads = step_fn(x, y)
        history.append((mb, float(loss.asnumpy())))
        opt(grads)
    return history, {p.name: p.asnumpy() for p in params}


def _stages(name: str, pp_mesh, n_blocks: int, prepare, tied: bool = False, jit: bool = False):
    """This rank's stages of schedule ``name`` (models built from the full model, same seed)."""
    from hyper_parallel_ms import pipelining as pl

    pp, me = pp_mesh.size(), pp_mesh.get_local_rank()
    v = 2 if name in ("Interleaved1F1B", "ZBVZeroBubble") else 1
    stages = []
    for s in pl.build_plan(name, pp, pp * v, stages_per_rank=v).stages_of(me):
        ms.set_seed(0)
        model = pl.split_blocks(Model(n_blocks, tied), s, pp * v, first=("embed",), last=("head",))
        prepare(model)
        stages.append(pl.PipelineStage(model, s, pp * v, mesh=pp_mesh, jit=jit))
    return stages


def _schedule(name: str, stages, n: int, **kwargs):
    from hyper_parallel_ms import pipelining as pl

    cls = {"GPipe": pl.ScheduleGPipe, "1F1B": pl.Schedule1F1B, "Interleaved1F1B": pl.ScheduleInterleaved1F1B,
           "ZBVZeroBubble": pl.ScheduleZBVZeroBubble}[name]
    return cls(stages[0] if len(stages) == 1 else stages, n, loss_fn, **kwargs)


def _train(schedule, rows: slice, history, final, gathered, *, tied: bool = False, reduce=None, label: str = ""):
    """Three steps of ``schedule`` on ``rows`` of each batch, checked against ``history`` / ``final``;
    returns the CommDebugMode records of the steps (the final check's gathers not counted)."""
    from hyper_parallel_ms import comm

    first, last = schedule.stages[0].is_first, schedule.stages[-1].is_last
    params = schedule.parameters()
    opt = _optimizer(params)
    records: list = []
    for step in range(STEPS):
        x, y = _batch(step, IN if tied else OUT)
        losses: list = []
        with comm.CommDebugMode() as mode:
            schedule.step(*((x[rows],) if first else ()), target=y[rows] if last else None, losses=losses)
            grads = schedule.gradients()
            grads = reduce(grads) if reduce is not None else grads
        records += mode.records
        if last:
            got = [float(v.asnumpy()) for v in losses]
            np.testing.assert_allclose(got, history[step][0], rtol=RTOL, atol=ATOL,
                                       err_msg=f"{label}: micro-batch losses, step {step}")
            if rows == slice(None):
                np.testing.assert_allclose(np.mean(got), history[step][1], rtol=RTOL, atol=ATOL,
                                           err_msg=f"{label}: loss, step {step}")
        opt(grads)
    for p in params:
        np.testing.assert_allclose(gathered(p, p), final[p.name], rtol=RTOL, atol=ATOL,
                                   err_msg=f"{label}: {p.name} after {STEPS} AdamWeightDecay steps")
    return records


# ----------------------------------------------------------------------------- pp x tp
@pytest.mark.parametrize("name, jit", [("1F1B", False), ("Interleaved1F1B", False), ("1F1B", True)])
@multi_rank(4, timeout=600)
def test_pp_x_tp_equals_one_device(name, jit):
    """jit: compiled tensor-parallel stages (each micro-batch's forward one ms.jit graph, its backward
    that graph's compiled backward)."""
    from hyper_parallel_ms.mesh import init_device_mesh
    from hyper_parallel_ms.nn import ColwiseParallel, GradientReducer, RowwiseParallel, parallelize_module
    from tests._parity import gathered

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "tp"))
    me = ms.communication.get_rank()
    assert mesh["pp"].mesh.tolist() == [r for r in range(4) if r % 2 == me % 2]     # the pp peers share tp
    plan = {"layers.*.up": ColwiseParallel(), "layers.*.down": RowwiseParallel()}
    stages = _stages(name, mesh["pp"], 4, lambda model: parallelize_module(model, mesh["tp"], plan), jit=jit)
    n = 4
    schedule = _schedule(name, stages, n)
    history, final = _reference(4, slice(None), n)
    # send / recv pair only the ranks of one tp coordinate: every transfer is on the "pp" dim
    records = _train(schedule, slice(None), history, final, gathered, reduce=GradientReducer(schedule.parameters()),
                  label=f"pp x tp, {name}")
    p2p = [r for r in records if r.kind in ("send", "recv")]
    assert p2p and {(r.mesh_dim, r.group_size) for r in p2p} == {("pp", 2)}
    assert {r.mesh_dim for r in records if r.kind not in ("send", "recv")} <= {"tp", "pp"}


# ----------------------------------------------------------------------------- pp x fully_shard
@pytest.mark.parametrize("name, jit, engine, reshard", [
    ("GPipe", False, "fully_shard", True), ("1F1B", False, "fully_shard", False),
    ("Interleaved1F1B", False, "fully_shard", False), ("ZBVZeroBubble", False, "fully_shard", True),
    ("ZBVZeroBubble", False, "fully_shard", False), ("1F1B", True, "fully_shard", True),
    ("1F1B", False, "hsdp", True)])
@multi_rank(4, timeout=600)
def test_pp_x_fully_shard_reduces_once_per_step(name, jit, engine, reshard):
    """The schedules over fully_shard stages run the plan lowered with UNSHARD / RESHARD /
    REDUCE_GRAD (PyTorch's): per step and sharded unit one all-gather when
    ``reshard_after_forward=False`` (not one per micro-batch) and one reduce-scatter, after the last
    micro-batch. jit: compiled fully_shard stages, whose compiled backwards reduce every micro-batch's
    gradient (sync cannot be turned off there); the reduced gradients are summed. hsdp: HyperParallel's
    engine given the stage's dp mesh (``mesh=``), level3 (resharded after forward), one collective per Cell."""
    from hyper_parallel_ms.fsdp import fully_shard, hsdp
    from hyper_parallel_ms.mesh import init_device_mesh
    from hyper_parallel_ms.pipelining import REDUCE_GRAD, UNSHARD
    from tests._parity import gathered

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp"))
    dp = mesh["dp"]
    me = ms.communication.get_rank()
    assert mesh["pp"].mesh.tolist() == [r for r in range(4) if r % 2 == me % 2]     # the pp peers share dp

    def shard(model):
        for cell in list(model.layers) + [model]:
            if engine == "hsdp":
                hsdp(cell, threshold=0, optimizer_level="level3", enable_grad_accumulation=True,
                     comm_fusion=True, mesh=dp)
            else:
                fully_shard(cell, mesh=dp, reshard_after_forward=reshard)     # also the stage's root
    stages = _stages(name, mesh["pp"], 4, shard, jit=jit)
    n = 4
    schedule = _schedule(name, stages, n)
    # the lowered plan: each stage gathered once and reduced once per step, on every rank
    kinds = [a.kind for a in schedule.plan.actions[mesh["pp"].get_local_rank()]]
    assert kinds.count(UNSHARD) == kinds.count(REDUCE_GRAD) == len(schedule.stages)
    d = dp.get_local_rank()
    rows = slice(d * BATCH // 2, (d + 1) * BATCH // 2)
    history, final = _reference(4, rows, n)
    # sharded units holding parameters: every block, and the root of a stage holding the embedding or the head
    units = sum(len(st.submodule.layers) + (st.is_first or st.is_last) for st in schedule.stages)
    records = _train(schedule, rows, history, final, gathered, label=f"pp x fully_shard, {name}")
    if jit:
        return
    dims = ("dp", "dp_shard")       # fully_shard's mesh dim, hsdp's (a mesh of its own over the same ranks)
    reduces = [r for r in records if r.mesh_dim in dims and r.kind in ("reduce_scatter", "all_reduce")]
    gathers = [r for r in records if r.mesh_dim in dims and r.kind == "all_gather"]
    # one gradient reduction per sharded unit and step (REDUCE_GRAD), not per micro-batch
    assert len(reduces) == units * STEPS, (len(reduces), units)
    if not reshard:
        # the textbook: one all-gather per unit and step (UNSHARD), whatever the micro-batches
        assert len(gathers) == units * STEPS, (len(gathers), units)
        from hyper_parallel_ms import comm
        x, _ = _batch(0)
        with comm.CommDebugMode() as mode:              # eval (forwards only): gathered once too, nothing reduced
            schedule.eval(*((x[rows],) if schedule.stages[0].is_first else ()))
        assert [r.kind for r in mode.records if r.mesh_dim in dims] == ["all_gather"] * units
    elif name == "ZBVZeroBubble":
        # resharded after forward: the first forward reads UNSHARD's values, each later one gathers and its
        # backward gathers again; ZBV's weight pass replays the recorded backward, which reads a unit's freed
        # values again where its input pass read them (a third gather; an input pass does not read every unit's)
        assert (2 * n - 1) * units * STEPS <= len(gathers) <= (3 * n - 2) * units * STEPS, (len(gathers), units)
    else:
        assert len(gathers) == (2 * n - 1) * units * STEPS, (len(gathers), units)


# ----------------------------------------------------------------------------- tied embedding / head
def _check_tied(name: str, pp: int, n_blocks: int) -> None:
    from hyper_parallel_ms.mesh import init_device_mesh
    from hyper_parallel_ms.pipelining import ScheduleError
    from tests._parity import gathered

    mesh = init_device_mesh("cpu", (pp,), mesh_dim_names=("pp",))
    stages = _stages(name, mesh, n_blocks, lambda model: None, tied=True)
    with pytest.raises(ScheduleError, match=r"shared_parameters \('tied.weight',\): held by 0 stage"):
        _schedule(name, stages, 4, shared_parameters=["tied.weight"])      # refused on every rank
    # MindSpore names the tied Parameter after its last holder: head.weight (split_blocks keeps that name)
    schedule = _schedule(name, stages, 4, shared_parameters=["head.weight"])
    names = [p.name for p in schedule.parameters()]
    assert len(names) == len(set(names))                                  # one parameter per rank
    history, final = _reference(n_blocks, slice(None), 4, tied=True)
    records = _train(schedule, slice(None), history, final, gathered, tied=True, label=f"tied, {name}")
    shared = [r for r in records if r.mesh_dim == "pp_shared"]
    holds = any(st.is_first or st.is_last for st in schedule.stages)
    cross = schedule.plan.placement[0] != schedule.plan.placement[-1]
    # one all-reduce of the tied gradient per step, over the two ranks holding it (none if one rank holds both)
    assert [(r.kind, r.group_size) for r in shared] == ([("all_reduce", 2)] * STEPS if holds and cross else [])


@pytest.mark.parametrize("name", ["GPipe", "ZBVZeroBubble"])
@multi_rank(2, timeout=600)
def test_tied_embedding_and_head_on_two_ranks(name):
    _check_tied(name, 2, 4)


@multi_rank(4, timeout=600)
def test_tied_embedding_and_head_on_four_ranks():
    _check_tied("1F1B", 4, 4)


# ----------------------------------------------------------------------------- checkpoints across stage splits
def _third_party_split_equals_one_device(mesh) -> None:
    """MindSpore's nn.TransformerEncoder inside an unchanged model, split by ``split_blocks`` at
    ``encoder.layers`` (pass-through Cells for the other stage's embedding, final norm and head):
    1F1B over 2 ranks gives each micro-batch's loss and the full-batch gradients of one device."""
    from hyper_parallel_ms import pipelining as pl
    from tests._pipeline_models import EncoderModel, token_batch, token_loss

    me, n = mesh.get_local_rank(), 4
    ms.set_seed(0)
    model = pl.split_blocks(EncoderModel(), me, 2, blocks="encoder.layers", first=("embed",),
                            last=("encoder.norm", "head"))
    schedule = pl.Schedule1F1B(pl.PipelineStage(model, me, 2, mesh=mesh), n, token_loss)
    ms.set_seed(0)
    full = EncoderModel()
    params = full.trainable_params()
    x, y = token_batch(0, 8)
    loss, grads = ms.value_and_grad(lambda x, y: token_loss(full(x), y), None, params)(x, y)
    want = {p.name: g.asnumpy() for p, g in zip(params, grads)}
    k = x.shape[0] // n
    per_mb = [float(token_loss(full(x[m * k:(m + 1) * k]), y[m * k:(m + 1) * k]).asnumpy()) for m in range(n)]
    losses: list = []
    schedule.step(*((x,) if me == 0 else ()), target=y if me == 1 else None, losses=losses)
    if me == 1:
        got = [float(v.asnumpy()) for v in losses]
        np.testing.assert_allclose(got, per_mb, rtol=RTOL, atol=ATOL)
        np.testing.assert_allclose(np.mean(got), float(loss.asnumpy()), rtol=RTOL, atol=ATOL)
    mine = schedule.parameters()
    assert mine and all(p.name in want for p in mine)                    # the full model's names
    for p, g in zip(mine, schedule.gradients()):
        np.testing.assert_allclose(g.asnumpy(), want[p.name], rtol=RTOL, atol=ATOL, err_msg=p.name)


@multi_rank(2, timeout=600)
def test_checkpoint_saved_with_two_stages_loads_into_four_stages_and_one_device():
    """Stage Cells keep full-model names, so a checkpoint saved by pp=2 stages (model and AdamW
    state, after a step) loads into another split (ZBV: four stages on the same two ranks) and
    into the whole model on one device, every value equal to what the stages hold. Then (same
    ranks) a third-party model split at a dotted path trains like one device
    (:func:`_third_party_split_equals_one_device`)."""
    import os
    import shutil
    import tempfile

    from mindspore.mint import distributed as dist

    from hyper_parallel_ms import checkpoint as dcp
    from hyper_parallel_ms.mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("pp",))
    holder = [None, None]
    dist.all_gather_object(holder, tempfile.mkdtemp(prefix="hpms_pp_ckpt_") if mesh.get_local_rank() == 0 else None)
    path = os.path.join(holder[0], "step_1")
    try:
        schedule = _schedule("1F1B", _stages("1F1B", mesh, 4, lambda model: None), 2)
        opt = _optimizer(schedule.parameters())
        x, y = _batch(0)
        schedule.step(*((x,) if schedule.stages[0].is_first else ()), target=y if schedule.stages[-1].is_last else None)
        opt(schedule.gradients())
        saved = {p.name: p.asnumpy() for p in schedule.parameters()}
        saved.update({m.name: m.asnumpy() for m in opt.moments1})
        model_sd, optim_sd = dcp.get_state_dict(schedule.stages[0].submodule, opt)
        dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=path)
        everything = [None, None]
        dist.all_gather_object(everything, saved)
        want = {**everything[0], **everything[1]}
        # into four stages (ZBV) on the same ranks: other initial values, all must come from the file
        for s in ("ZBVZeroBubble", None):
            ms.set_seed(7)
            if s is None:                          # the whole model, one device (each rank loads it)
                cells = [Model(4)]
            else:
                cells = [st.submodule for st in _stages(s, mesh, 4, lambda model: None)]
            for cell in cells:
                target_opt = _optimizer(cell.trainable_params())
                model_sd, optim_sd = dcp.get_state_dict(cell, target_opt)
                dcp.load({"model": model_sd, "optim": optim_sd}, checkpoint_id=path, no_dist=s is None)
                for p in cell.trainable_params():
                    np.testing.assert_array_equal(p.asnumpy(), want[p.name], err_msg=f"{p.name} into {s or 'one device'}")
                for m in target_opt.moments1:
                    np.testing.assert_array_equal(m.asnumpy(), want[m.name], err_msg=f"{m.name} into {s or 'one device'}")
    finally:
        dist.barrier()
        if mesh.get_local_rank() == 0:
            shutil.rmtree(holder[0], ignore_errors=True)
    _third_party_split_equals_one_device(mesh)
