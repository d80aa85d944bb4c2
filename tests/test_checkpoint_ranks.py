"""Checkpoints across layouts on 4 ranks: save on every layout of {single device, tp2 (x2
replicas), tp4, dp2 x tp2 fully-sharded pieces (one dim over two mesh dims, tp major),
fsdp (Shard(0) over 4 ranks, uneven: 7 rows as 2, 2, 2, 1), DTensor parameters, tp2 styles then
fully_shard over dp2} and load
into every other, model and Adam state, bit-exact; training resumed from a checkpoint (on
the same and on another layout) gives the losses of the uninterrupted run; a rank failing
during a save or a load makes every rank fail with the cause, nothing committed or
changed; a rank killed while writing leaves the previous checkpoint loadable (that test runs
last: the killed pool restarts for the next test that needs 4 ranks)."""
from __future__ import annotations

import os
import shutil
import tempfile

import pytest

import mindspore as ms
import numpy as np
from mindspore import Parameter, nn, ops
from mindspore.mint import distributed as dist

from hyper_parallel_ms import checkpoint as dcp
from hyper_parallel_ms import comm
from hyper_parallel_ms.checkpoint._pieces import flatten
from hyper_parallel_ms.layout import Layout
from hyper_parallel_ms.mesh import init_device_mesh
from hyper_parallel_ms.dtensor import distribute_tensor
from hyper_parallel_ms.fsdp import fully_shard
from hyper_parallel_ms.nn import (ColwiseParallel, GradientReducer, RowwiseParallel, distribute_module,
                                  parallelize_module)
from hyper_parallel_ms.nn._parameter import sharded_parameter
from hyper_parallel_ms.placement import Replicate, Shard
from hyper_parallel_ms.testing import RankFailure, multi_rank, run_on_ranks

WORLD = 4
LAYOUTS = ("single", "tp2", "tp4", "dp2xtp2_fsdp", "fsdp", "dtensor", "fully_shard_x_tp")


class MLP(nn.Cell):
    def __init__(self, dim: int = 7, hidden: int = 12) -> None:
        super().__init__()
        self.up = nn.Dense(dim, hidden)
        self.down = nn.Dense(hidden, dim)

    def construct(self, x):
        return self.down(ops.relu(self.up(x)))


def _hand_made(model: MLP, mesh, layouts) -> None:
    """Pieces as fully_shard records them: a ParameterSharding per parameter (no hooks)."""
    for cell_name, attr in (("up", "weight"), ("up", "bias"), ("down", "weight"), ("down", "bias")):
        cell = getattr(model, cell_name)
        param = getattr(cell, attr)
        setattr(cell, attr, sharded_parameter(param, mesh, layouts[f"{cell_name}.{attr}"], src_data_rank=None))


def build(layout: str, seed: int = 0):
    """(model, dp mesh or None) on ``layout``."""
    ms.set_seed(seed)
    model = MLP()
    if layout in ("tp2", "tp4"):
        shape, names = ((2, 2), ("dp", "tp")) if layout == "tp2" else ((4,), ("tp",))
        mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
        parallelize_module(model, mesh["tp"], {"up": ColwiseParallel(), "down": RowwiseParallel()})
        return model, (mesh if layout == "tp2" else None)
    if layout == "dp2xtp2_fsdp":
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        s00 = (Shard(0), Shard(0))
        _hand_made(model, mesh, {"up.weight": Layout((2, 2), s00, shard_order={0: (1, 0)}), "up.bias": s00,
                                 "down.weight": (Shard(0), Shard(1)), "down.bias": (Shard(0), Replicate())})
    elif layout == "dtensor":                    # Parameter(DTensor), as distribute_module / shard_module make them
        mesh = init_device_mesh("cpu", (4,), mesh_dim_names=("tp",))

        def partition(name, cell, mesh):
            if name in ("up", "down"):
                cell.weight = Parameter(distribute_tensor(cell.weight, mesh, [Shard(0 if name == "up" else 1)]),
                                        name=cell.weight.name)
        distribute_module(model, mesh, partition)
    elif layout == "fully_shard_x_tp":          # the real thing: tp styles, then fully_shard over dp
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        parallelize_module(model, mesh["tp"], {"up": ColwiseParallel(), "down": RowwiseParallel()})
        fully_shard(model, mesh=mesh["dp"])
    elif layout == "fsdp":
        mesh = init_device_mesh("cpu", (4,), mesh_dim_names=("dp",))
        _hand_made(model, mesh, dict.fromkeys(("up.weight", "up.bias", "down.weight", "down.bias"), (Shard(0),)))
    return model, None


def _expected(seed: int):
    """Full values for every model and optimizer tensor (the same keys on every layout)."""
    rng = np.random.default_rng(seed)
    ref = MLP()
    model = {n: rng.standard_normal(p.shape).astype(np.float32) for n, p in ref.parameters_and_names()}
    state = {n: {s: rng.standard_normal(p.shape).astype(np.float32) for s in ("moment1", "moment2")}
             for n, p in ref.parameters_and_names()}
    group = {"global_step": np.array([seed + 7], np.int32), "learning_rate": np.array(0.01 * (seed + 1), np.float32),
             "beta1_power": np.array(0.9 ** (seed + 1), np.float32),
             "beta2_power": np.array(0.999 ** (seed + 1), np.float32), "params": list(model)}
    return model, {"state": state, "param_groups": [group]}


def _flat_expected(seed: int):
    model, optim = _expected(seed)
    out = {f"model.{k}": v for k, v in model.items()}
    out.update({f"optim.state.{k}.{s}": v for k, slots in optim["state"].items() for s, v in slots.items()})
    out.update({f"optim.param_groups.0.{k}": v for k, v in optim["param_groups"][0].items() if k != "params"})
    return out


def _check_pieces(state, seed: int, context: str) -> int:
    refs, _ = flatten(state, for_save=False)
    expected = _flat_expected(seed)
    assert set(refs) == set(expected), context
    for key, ref in refs.items():
        box = tuple(slice(o, o + s) for o, s in zip(ref.piece.offsets, ref.piece.sizes))
        np.testing.assert_array_equal(ref.local_numpy(), expected[key][box], err_msg=f"{key}: {context}")
    return len(refs)


def _shared_dir() -> str:
    out = [None] * WORLD
    dist.all_gather_object(out, tempfile.mkdtemp(prefix="hpms_ckpt_") if ms.communication.get_rank() == 0 else None)
    return out[0]


@multi_rank(WORLD)
def test_save_on_each_layout_load_on_every_other_bit_exact():
    base = _shared_dir()
    rank = ms.communication.get_rank()
    try:
        for i, layout in enumerate(LAYOUTS):
            model, _ = build(layout)
            opt = nn.Adam(model.trainable_params(), learning_rate=0.01)
            full_model, full_optim = _expected(i)
            dcp.set_state_dict(model, opt, model_state_dict=full_model, optim_state_dict=full_optim)
            model_sd, optim_sd = dcp.get_state_dict(model, opt)
            state = {"model": model_sd, "optim": optim_sd, "saved_on": layout}
            if layout == "fsdp":                                        # files written in the background
                meta = dcp.async_save(state, checkpoint_id=os.path.join(base, layout)).result()
            else:
                meta = dcp.save(state, checkpoint_id=os.path.join(base, layout),
                                save_to_minimum_rank=layout == "single")
            chunks = len(meta.tensors["model.up.weight"].chunks)
            assert chunks == {"single": 1, "tp2": 2, "tp4": 4, "dp2xtp2_fsdp": 4, "fsdp": 4,
                              "dtensor": 4, "fully_shard_x_tp": 4}[layout], (layout, chunks)
            files = sorted(os.listdir(os.path.join(base, layout)))
            if layout == "single":                                       # replicas written once, by rank 0
                assert files == ["metadata.json", "rank_0.safetensors"], files
            if layout == "tp2":                      # the default spreads the replicas' writes over their holders
                assert files == ["metadata.json"] + [f"rank_{r}.safetensors" for r in range(WORLD)], files
        for i, saved in enumerate(LAYOUTS):
            for target in LAYOUTS:
                model, _ = build(target, seed=100)
                opt = nn.Adam(model.trainable_params(), learning_rate=0.5)
                state = {"model": dcp.get_model_state_dict(model), "optim": dcp.get_optimizer_state_dict(model, opt),
                         "saved_on": ""}
                dcp.load(state, checkpoint_id=os.path.join(base, saved))
                assert state["saved_on"] == saved
                state.pop("saved_on")
                # the model and optimizer themselves (not only the dict) hold the saved values
                live = {"model": dcp.get_model_state_dict(model), "optim": dcp.get_optimizer_state_dict(model, opt)}
                assert _check_pieces(live, i, f"saved on {saved}, loaded on {target}, rank {rank}") == 16
    finally:
        dist.barrier()
        if rank == 0:
            shutil.rmtree(base, ignore_errors=True)


def _batch(step: int):
    return ms.Tensor(np.random.default_rng(50 + step).standard_normal((4, 3, 7)).astype(np.float32))


def _train(model, opt, dp_mesh, steps) -> list:
    params = opt.parameters
    reducer = GradientReducer(params, dp_mesh=dp_mesh, dp_dim="dp" if dp_mesh is not None else None)
    dp_index, dp_size = (dp_mesh.get_coordinate()[0], 2) if dp_mesh is not None else (0, 1)

    def loss_fn(x):
        return (model(x) ** 2).mean()
    grad_fn = ms.value_and_grad(loss_fn, None, params)
    losses = []
    for step in steps:
        x = _batch(step)
        rows = 4 // dp_size
        loss, grads = grad_fn(x[dp_index * rows:(dp_index + 1) * rows])
        opt(reducer(grads))
        if dp_mesh is not None:
            loss = comm.all_reduce(loss, dp_mesh, "dp", op="avg")
        losses.append(float(loss.asnumpy()))
    return losses


def _sgd(model):
    return nn.SGD(model.trainable_params(), learning_rate=0.05, momentum=0.9)


@multi_rank(WORLD)
def test_set_state_dict_refuses_pieces_of_another_layout_on_every_rank():
    """set_model_state_dict / set_optimizer_state_dict given the pieces of a model laid out over
    another mesh dim (ColwiseParallel over tp into fully_shard over dp: equal local shapes, other
    rows) copied them into the wrong rows (0.48 off), silently; refused on every rank now, nothing
    changed; whole tensors load exactly."""
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    ms.set_seed(0)
    a = nn.Dense(8, 6)
    parallelize_module(a, mesh["tp"], ColwiseParallel())
    oa = nn.Momentum(a.trainable_params(), 0.1, 0.9)
    oa(ms.value_and_grad(lambda x: (a(x) ** 2).mean(), None, a.trainable_params())(ms.Tensor(np.ones((2, 8),
                                                                                            np.float32)))[1])
    ms.set_seed(3)
    b = nn.Dense(8, 6)
    fully_shard(b, mesh=mesh["dp"])
    ob = nn.Momentum(b.trainable_params(), 0.1, 0.9)
    full = dcp.StateDictOptions(full_state_dict=True)
    before = {k: v.asnumpy().copy() for k, v in dcp.get_model_state_dict(b, options=full).items()}
    with pytest.raises(dcp.CheckpointError, match="is a piece of another layout .*full_state_dict=True"):
        dcp.set_model_state_dict(b, dcp.get_model_state_dict(a))
    with pytest.raises(dcp.CheckpointError, match="piece of another layout"):
        dcp.set_optimizer_state_dict(b, ob, dcp.get_optimizer_state_dict(a, oa))
    for k, v in dcp.get_model_state_dict(b, options=full).items():
        np.testing.assert_array_equal(v.asnumpy(), before[k], err_msg=k)
    want = dcp.get_model_state_dict(a, options=full)
    dcp.set_model_state_dict(b, want)
    dcp.set_optimizer_state_dict(b, ob, dcp.get_optimizer_state_dict(a, oa, options=full))
    for k, v in dcp.get_model_state_dict(b, options=full).items():
        np.testing.assert_array_equal(v.asnumpy(), want[k].asnumpy(), err_msg=k)
    moments = dcp.get_optimizer_state_dict(b, ob, options=full)["state"]["weight"]
    np.testing.assert_array_equal(moments["moments"].asnumpy(),
                                  dcp.get_optimizer_state_dict(a, oa, options=full)["state"]["weight"]["moments"].asnumpy())


@multi_rank(WORLD)
def test_training_resumed_from_a_checkpoint_matches_the_uninterrupted_run():
    base = _shared_dir()
    rank = ms.communication.get_rank()
    try:
        model, dp = build("tp4")
        opt = _sgd(model)
        reference = _train(model, opt, dp, range(6))
        model, dp = build("tp4")
        opt = _sgd(model)
        first = _train(model, opt, dp, range(3))
        assert first == reference[:3]
        model_sd, optim_sd = dcp.get_state_dict(model, opt)
        dcp.save({"model": model_sd, "optim": optim_sd, "step": 3}, checkpoint_id=os.path.join(base, "step_3"))
        for layout in ("tp4", "tp2", "single"):
            model, dp = build(layout, seed=9)
            opt = _sgd(model)
            model_sd, optim_sd = dcp.get_state_dict(model, opt)
            state = {"model": model_sd, "optim": optim_sd, "step": 0}
            dcp.load(state, checkpoint_id=os.path.join(base, "step_3"))
            resumed = _train(model, opt, dp, range(state["step"], 6))
            np.testing.assert_allclose(resumed, reference[3:], rtol=1e-5, atol=1e-6,
                                       err_msg=f"resumed on {layout}, rank {rank}")
            if layout == "tp4":
                assert resumed == reference[3:]
    finally:
        dist.barrier()
        if rank == 0:
            shutil.rmtree(base, ignore_errors=True)


@multi_rank(WORLD)
def test_a_rank_failing_fails_every_rank_and_changes_nothing():
    from hyper_parallel_ms.checkpoint import _filesystem
    base = _shared_dir()
    rank = ms.communication.get_rank()
    path = os.path.join(base, "ckpt")
    try:
        model, _ = build("fsdp")
        opt = nn.Adam(model.trainable_params(), learning_rate=0.01)
        dcp.set_state_dict(model, opt, model_state_dict=_expected(1)[0], optim_state_dict=_expected(1)[1])
        state = {"model": dcp.get_model_state_dict(model), "optim": dcp.get_optimizer_state_dict(model, opt)}
        dcp.save(state, checkpoint_id=path)
        # a second save to the same id dies on rank 1 (disk full): every rank raises, nothing is committed
        dcp.set_state_dict(model, opt, model_state_dict=_expected(2)[0], optim_state_dict=_expected(2)[1])
        real = _filesystem.write_file

        def disk_full(*args, **kwargs):
            raise OSError("No space left on device")
        _filesystem.write_file = disk_full if rank == 1 else real
        try:
            dcp.save(state, checkpoint_id=path)
            raise AssertionError("save succeeded although rank 1 failed")
        except dcp.CheckpointError as exc:
            assert "nothing was committed" in str(exc) and "rank 1: writing" in str(exc) and "No space" in str(exc)
        finally:
            _filesystem.write_file = real
        dcp.load(state, checkpoint_id=path)                          # the previous checkpoint is intact
        assert _check_pieces(state, 1, "previous checkpoint after a failed save") == 16
        # a corrupted file read by rank 2 only: every rank fails before any value changes
        dist.barrier()
        if rank == 0:
            data = os.path.join(path, "rank_2.safetensors")
            raw = bytearray(open(data, "rb").read())
            raw[-1] ^= 0x55
            open(data, "wb").write(bytes(raw))
        dist.barrier()
        dcp.set_state_dict(model, opt, model_state_dict=_expected(3)[0], optim_state_dict=_expected(3)[1])
        try:
            dcp.load(state, checkpoint_id=path)
            raise AssertionError("load of a corrupted checkpoint succeeded")
        except dcp.CheckpointError as exc:
            assert "rank 2: tensor" in str(exc) and "rank_2.safetensors fails its checksum" in str(exc), str(exc)
        assert _check_pieces(state, 3, "values after a failed load") == 16
        # without collectives every rank writes its own part and metadata; a load merges them
        dcp.save(state, checkpoint_id=os.path.join(base, "local"), use_collectives=False)
        dist.barrier()                                               # the save itself does not synchronise
        assert sorted(f for f in os.listdir(os.path.join(base, "local")) if f.startswith("metadata_rank_")) == [
            f"metadata_rank_{r}.json" for r in range(WORLD)]
        model, _ = build("tp2", seed=5)
        opt = nn.Adam(model.trainable_params(), learning_rate=0.01)
        other = {"model": dcp.get_model_state_dict(model), "optim": dcp.get_optimizer_state_dict(model, opt)}
        dcp.load(other, checkpoint_id=os.path.join(base, "local"))
        assert _check_pieces(other, 3, "rank-local save loaded on tp2") == 16
        # a plain tensor said replicated whose copies differ (a piece without its layout) is refused
        try:
            dcp.save({"w": np.full(3, rank // 2, np.float32)}, checkpoint_id=os.path.join(base, "bad"))
            raise AssertionError("ranks holding different data as one replicated tensor were saved")
        except dcp.CheckpointError as exc:
            assert "'w' is a plain tensor" in str(exc) and "ranks [0, 1] vs ranks [2, 3]" in str(exc), str(exc)
        # host copies (cpu_offload) of pieces stay pieces
        model, _ = build("fsdp", seed=6)
        opt = nn.Adam(model.trainable_params(), learning_rate=0.01)
        dcp.set_state_dict(model, opt, model_state_dict=_expected(4)[0], optim_state_dict=_expected(4)[1])
        model_sd, optim_sd = dcp.get_state_dict(model, opt, options=dcp.StateDictOptions(cpu_offload=True))
        assert isinstance(model_sd["down.weight"], dcp.ShardedTensor)
        dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=os.path.join(base, "offload"))
        dcp.load(other, checkpoint_id=os.path.join(base, "offload"))
        assert _check_pieces(other, 4, "cpu_offload pieces loaded on tp2") == 16
    finally:
        dist.barrier()
        if rank == 0:
            shutil.rmtree(base, ignore_errors=True)


@multi_rank(WORLD, timeout=600)
def test_example_saves_every_n_steps_and_resumes_on_another_layout():
    from examples.train_tp import TrainConfig, latest_checkpoint, train
    base = _shared_dir()
    rank = ms.communication.get_rank()
    small = dict(seq=8, dim=16, hidden=32, vocab=32, layers=1, mode="pynative", checkpoint_dir=base)
    try:
        first = train(TrainConfig(dp=2, tp=2, steps=3, save_every=2, check=False, **small), log=lambda line: None)
        assert latest_checkpoint(base) == os.path.join(base, "step_2")
        resumed = train(TrainConfig(dp=1, tp=4, steps=4, resume=True, **small), log=lambda line: None)
        assert resumed["start_step"] == 2 and len(resumed["losses"]) == 2
        np.testing.assert_allclose(resumed["losses"][0], first["losses"][2], rtol=1e-5)
        assert resumed["max_relative_difference"] <= 1e-4, (resumed["losses"], resumed["reference_losses"])
    finally:
        dist.barrier()
        if rank == 0:
            shutil.rmtree(base, ignore_errors=True)


def save_then_die_midway(base: str) -> None:
    """Rank function: a committed save, then a second save to the same id during which rank 1
    is killed half-way through writing its file."""
    from hyper_parallel_ms.checkpoint import _filesystem
    model, _ = build("fsdp")
    opt = nn.Adam(model.trainable_params(), learning_rate=0.01)
    dcp.set_state_dict(model, opt, model_state_dict=_expected(1)[0], optim_state_dict=_expected(1)[1])
    state = {"model": dcp.get_model_state_dict(model), "optim": dcp.get_optimizer_state_dict(model, opt)}
    dcp.save(state, checkpoint_id=os.path.join(base, "ckpt"))
    dcp.set_state_dict(model, opt, model_state_dict=_expected(2)[0], optim_state_dict=_expected(2)[1])
    if ms.communication.get_rank() == 1:
        def killed_while_writing(path, arrays, *args, **kwargs):
            with open(path, "wb") as f:
                f.write(b"\0" * 1000)
                f.flush()
            os._exit(9)
        _filesystem.write_file = killed_while_writing
    dcp.save(state, checkpoint_id=os.path.join(base, "ckpt"))


def test_a_rank_killed_during_save_leaves_the_previous_checkpoint():
    base = tempfile.mkdtemp(prefix="hpms_ckpt_kill_")
    try:
        with pytest.raises(RankFailure, match="rank 1 died"):
            run_on_ranks(save_then_die_midway, WORLD, base)
        partial = os.path.join(base, "ckpt.partial")
        assert os.path.isdir(partial) and "metadata.json" not in os.listdir(partial)      # never committed
        os.rename(partial, os.path.join(base, "other.partial"))   # a save with no committed predecessor
        with pytest.raises(dcp.CheckpointError, match="was never committed"):
            dcp.load({"w": np.zeros(1, np.float32)}, checkpoint_id=os.path.join(base, "other"), no_dist=True)
        model = MLP()                                        # the previous checkpoint, into a single device
        opt = nn.Adam(model.trainable_params(), learning_rate=0.01)
        state = {"model": dcp.get_model_state_dict(model), "optim": dcp.get_optimizer_state_dict(model, opt)}
        dcp.load(state, checkpoint_id=os.path.join(base, "ckpt"), no_dist=True)
        assert _check_pieces(state, 1, "previous checkpoint after a rank was killed during a save") == 16
    finally:
        shutil.rmtree(base, ignore_errors=True)
