"""Checkpoints on 2 ranks: a fully_shard and a tensor-parallel model with AdamWeightDecay,
saved after a few steps, exported and resumed on one device through MindSpore's own loaders
(``load_checkpoint`` + strict ``load_param_into_net`` of the net and of the optimizer), the
further steps equal to the uninterrupted one-device run; and the storage / planner extension
points (an in-memory store with resharding, a planner that filters keys)."""
from __future__ import annotations

import os
import shutil
import tempfile

import mindspore as ms
import numpy as np
import pytest
from mindspore.mint import distributed as dist

from hyper_parallel_ms import checkpoint as dcp
from hyper_parallel_ms import comm
from hyper_parallel_ms.checkpoint._pieces import flatten
from hyper_parallel_ms.checkpoint._safetensors import crc32
from hyper_parallel_ms.fsdp import fully_shard
from hyper_parallel_ms.mesh import init_device_mesh
from hyper_parallel_ms.nn import ColwiseParallel, GradientReducer, RowwiseParallel, parallelize_module
from hyper_parallel_ms.testing import multi_rank

from tests._fsdp_models import Net, batch, loss_of, make_optimizer
from tests._parity import ADAMW_LR, ZERO_GRAD, _compare_after_steps, adamw_noise_bound

WORLD, SAVED_AT, STEPS, TOL = 2, 3, 6, 1e-5


def comm_objects(obj) -> list:
    """Every rank's ``obj``, in rank order."""
    out = [None] * WORLD
    dist.all_gather_object(out, obj)
    return out


def _shared_dir() -> str:
    return comm_objects(tempfile.mkdtemp(prefix="hpms_ckpt2_") if ms.communication.get_rank() == 0 else None)[0]


def _train(model, opt, steps, *, dp_mesh=None, reducer=None) -> list:
    """Losses of ``steps`` (each on the whole batch, or on this dp rank's rows)."""
    params = opt.parameters
    grad_fn = ms.value_and_grad(lambda x: loss_of(model, x), None, params)
    losses = []
    for step in steps:
        x = batch(step)
        if dp_mesh is not None:
            rows = x.shape[0] // WORLD
            x = x[dp_mesh.get_local_rank(0) * rows:(dp_mesh.get_local_rank(0) + 1) * rows]
        loss, grads = grad_fn(x)
        opt(reducer(grads) if reducer is not None else grads)
        if dp_mesh is not None:
            loss = comm.all_reduce(loss, dp_mesh, 0, op="avg")
        losses.append(float(loss.asnumpy()))
    return losses


def _reference():
    """The uninterrupted one-device run: losses, final parameters, and the elements whose
    gradient is rounding noise at every step (see tests/_parity.py)."""
    ms.set_seed(0)
    model = Net()
    opt = make_optimizer("adamw", model.trainable_params())
    grad_fn = ms.value_and_grad(lambda x: loss_of(model, x), None, opt.parameters)
    losses, quiet = [], {p.name: np.ones(p.shape, bool) for p in opt.parameters}
    for step in range(STEPS):
        loss, grads = grad_fn(batch(step))
        for p, g in zip(opt.parameters, grads):
            quiet[p.name] &= np.abs(g.asnumpy()) <= ZERO_GRAD
        opt(grads)
        losses.append(float(loss.asnumpy()))
    return losses, {p.name: p.asnumpy() for p in opt.parameters}, quiet


def _parallel(layout: str):
    ms.set_seed(0)
    model = Net()
    if layout == "fully_shard":
        mesh = init_device_mesh("cpu", (WORLD,), mesh_dim_names=("dp",))
        for layer in model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        return model, dict(dp_mesh=mesh)
    mesh = init_device_mesh("cpu", (WORLD,), mesh_dim_names=("tp",))
    parallelize_module(model, mesh, {"layers.*.up": ColwiseParallel(), "layers.*.down": RowwiseParallel()})
    return model, dict(reducer=GradientReducer(model.trainable_params(), dp_mesh=None))


@multi_rank(WORLD, timeout=600)
def test_fully_shard_and_tp_checkpoints_resume_on_one_device_through_mindspore_loaders():
    base = _shared_dir()
    rank = ms.communication.get_rank()
    ref_losses, ref_params, quiet = _reference()
    # this model has no mathematically zero gradient: every element is compared at TOL
    assert not any(q.any() for q in quiet.values())
    try:
        for layout in ("fully_shard", "tp"):
            model, how = _parallel(layout)
            opt = make_optimizer("adamw", model.trainable_params())
            first = _train(model, opt, range(SAVED_AT), **how)
            np.testing.assert_allclose(first, ref_losses[:SAVED_AT], rtol=TOL, atol=TOL, err_msg=layout)
            model_sd, optim_sd = dcp.get_state_dict(model, opt)
            path = os.path.join(base, layout)
            dcp.save({"model": model_sd, "optim": optim_sd, "step": SAVED_AT}, checkpoint_id=path)
            full = os.path.join(base, f"{layout}_rank{rank}.safetensors")
            dcp.export_full(path, full)
            ms.set_seed(5)                                 # other initial values: all must come from the file
            single = Net()
            single_opt = make_optimizer("adamw", single.trainable_params())
            params = ms.load_checkpoint(full, format="safetensors")
            assert ms.load_param_into_net(single, params, strict_load=True)[0] == []
            assert ms.load_param_into_net(single_opt, params, strict_load=True)[0] == []
            assert int(single_opt.global_step.asnumpy()[0]) == SAVED_AT
            resumed = _train(single, single_opt, range(SAVED_AT, STEPS))
            np.testing.assert_allclose(resumed, ref_losses[SAVED_AT:], rtol=TOL, atol=TOL,
                                       err_msg=f"resumed from {layout}, rank {rank}")
            for p in single_opt.parameters:
                _compare_after_steps(p.name, p.asnumpy(), ref_params[p.name], quiet[p.name], TOL,
                                     adamw_noise_bound(ADAMW_LR, STEPS), f"resumed from {layout}")
    finally:
        dist.barrier()
        if rank == 0:
            shutil.rmtree(base, ignore_errors=True)


class MemoryWriter(dcp.StorageWriter):
    """A store in this process's memory: chunk arrays by (file, key), and the metadata."""

    def __init__(self) -> None:
        self.arrays, self.metadata = {}, None

    def reset(self, checkpoint_id):
        self.arrays, self.metadata = {}, None

    def set_up_storage_writer(self, is_coordinator, *, rank=0, use_collectives=True):
        pass

    def write_data(self, rank, arrays, checksums):
        out = {}
        for key, a in arrays.items():
            self.arrays[(f"memory/{rank}", key)] = np.array(a)
            out[key] = dcp.StoredChunk(f"memory/{rank}", checksums.get(key, crc32(a)), a.nbytes)
        return out

    def finish(self, metadata):
        self.metadata = metadata


class MemoryReader(dcp.StorageReader):
    def __init__(self, arrays, metadata) -> None:
        self.arrays, self.metadata, self.reads = arrays, metadata, []

    def reset(self, checkpoint_id):
        self.reads = []

    def read_metadata(self):
        return self.metadata

    def read_chunk(self, key, chunk):
        self.reads.append((chunk.file, chunk.key))
        return self.arrays[(chunk.file, chunk.key)]


def _joined(writer: MemoryWriter) -> dict:
    """The ranks' stores joined: one store that every rank reads (as an object store)."""
    store = {}
    for part in comm_objects(writer.arrays):
        store.update(part)
    return store


def _full(model, opt):
    """Every tensor of the model and optimizer state, whole, on every rank (collective)."""
    options = dcp.StateDictOptions(full_state_dict=True)
    model_sd, optim_sd = dcp.get_state_dict(model, opt, options=options)
    refs, _ = flatten({"model": model_sd, "optim": optim_sd}, for_save=False)
    return {k: ref.local_numpy().copy() for k, ref in refs.items()}


class ModelOnly(dcp.DefaultSavePlanner):
    def set_up_planner(self, state_dict, *, is_coordinator):
        super().set_up_planner({k: v for k, v in state_dict.items() if k != "optim"}, is_coordinator=is_coordinator)


class SkipHead(dcp.DefaultLoadPlanner):
    def create_local_plan(self):
        plan = super().create_local_plan()
        return dcp.LoadPlan({k: v for k, v in plan.tensors.items() if ".head." not in k}, plan.values)


@multi_rank(WORLD)
def test_in_memory_storage_reshards_and_planners_filter_keys():
    rank = ms.communication.get_rank()
    saved, how = _parallel("tp")
    opt = make_optimizer("adamw", saved.trainable_params())
    _train(saved, opt, range(2), **how)
    expected = _full(saved, opt)
    writer = MemoryWriter()
    model_sd, optim_sd = dcp.get_state_dict(saved, opt)
    meta = dcp.save({"model": model_sd, "optim": optim_sd, "step": 2}, storage_writer=writer)
    assert len(meta.tensors["model.layers.0.up.weight"].chunks) == WORLD           # one piece per tp rank
    store, metadata = _joined(writer), comm_objects(writer.metadata)[0]
    target, _ = _parallel("fully_shard")                                        # resharded: tp -> fsdp
    target_opt = make_optimizer("adamw", target.trainable_params())
    reader = MemoryReader(store, metadata)
    state = {"model": dcp.get_model_state_dict(target), "optim": dcp.get_optimizer_state_dict(target, target_opt),
             "step": 0}
    dcp.load(state, storage_reader=reader)
    assert state["step"] == 2 and {f for f, _ in reader.reads} == {"memory/0", "memory/1"}
    got = _full(target, target_opt)
    assert got.keys() == expected.keys()
    for key, value in expected.items():
        np.testing.assert_array_equal(got[key], value, err_msg=f"{key}, rank {rank}")
    # planners: a save without the optimizer, a load that leaves the head out
    writer = MemoryWriter()
    model_sd, optim_sd = dcp.get_state_dict(saved, opt)
    meta = dcp.save({"model": model_sd, "optim": optim_sd}, storage_writer=writer, planner=ModelOnly())
    assert meta.tensors and all(k.startswith("model.") for k in meta.tensors)
    store = _joined(writer)
    fresh, _ = _parallel("fully_shard")
    ms.set_seed(3)
    before = _full(fresh, make_optimizer("adamw", fresh.trainable_params()))
    dcp.load({"model": dcp.get_model_state_dict(fresh)}, storage_reader=MemoryReader(store, meta), planner=SkipHead())
    after = {k: v for k, v in _full(fresh, make_optimizer("adamw", fresh.trainable_params())).items()
             if k.startswith("model.")}
    for key, value in after.items():
        want = before[key] if ".head." in key else expected[key]
        np.testing.assert_array_equal(value, want, err_msg=f"{key}, rank {rank}")


class _Normed(ms.nn.Cell):
    """BatchNorm statistics: module state each rank updates from its own batch rows."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = ms.nn.Dense(8, 8)
        self.bn = ms.nn.BatchNorm1d(8)

    def construct(self, x):
        return self.bn(self.fc(x))


@multi_rank(WORLD)
def test_module_state_differing_between_ranks_saves_the_lowest_ranks_copy():
    rank = ms.communication.get_rank()
    mesh = init_device_mesh("cpu", (WORLD,), mesh_dim_names=("dp",))
    ms.set_seed(0)
    model = fully_shard(_Normed(), mesh=mesh)
    model.set_train(True)
    model(batch(rank))                                # each rank's rows: the statistics differ
    mean = model.bn.moving_mean.asnumpy().copy()
    assert not np.array_equal(*comm_objects(mean))
    writer = MemoryWriter()
    with pytest.warns(UserWarning, match=r"module state \['model.bn.moving_mean', 'model.bn.moving_variance'\] "
                                         r"differs between ranks.*lowest rank's copy"):
        meta = dcp.save({"model": dcp.get_model_state_dict(model)}, storage_writer=writer)
    assert len(meta.tensors["model.bn.moving_mean"].chunks) == 1
    fresh = fully_shard(_Normed(), mesh=mesh)
    dcp.load({"model": dcp.get_model_state_dict(fresh)}, storage_reader=MemoryReader(_joined(writer), meta))
    np.testing.assert_array_equal(fresh.bn.moving_mean.asnumpy(), comm_objects(mean)[0])    # rank 0's, everywhere
    # writes spread over the ranks: the differing state is still rank 0's (its checksum is rank 0's)
    for spread in (dict(save_to_minimum_rank=False), dict(remove_redundancy=False)):
        writer = MemoryWriter()
        with pytest.warns(UserWarning, match="lowest rank's copy"):
            meta = dcp.save({"model": dcp.get_model_state_dict(model)}, storage_writer=writer, **spread)
        fresh = fully_shard(_Normed(), mesh=mesh)
        dcp.load({"model": dcp.get_model_state_dict(fresh)}, storage_reader=MemoryReader(_joined(writer), meta))
        np.testing.assert_array_equal(fresh.bn.moving_mean.asnumpy(), comm_objects(mean)[0], err_msg=str(spread))
    # a frozen weight (not batch norm statistics) whose copies differ is still refused
    frozen = {"w": ms.Parameter(ms.Tensor(np.full((2,), float(rank), np.float32)), name="w", requires_grad=False)}
    with pytest.raises(dcp.CheckpointError, match="'w' is a plain tensor .* differs between ranks"):
        dcp.save(frozen, storage_writer=MemoryWriter())
    # a trainable tensor saved as replicated whose copies differ is still refused (a piece saved as whole)
    plain = {"w": ms.Tensor(np.full((2,), float(rank), np.float32))}
    with pytest.raises(dcp.CheckpointError, match="'w' is a plain tensor .* differs between ranks"):
        dcp.save(plain, storage_writer=MemoryWriter())


def _whole_state(model) -> dict:
    options = dcp.StateDictOptions(full_state_dict=True)
    return {k: v.asnumpy() for k, v in dcp.get_model_state_dict(model, options=options).items()}


@multi_rank(WORLD)
def test_loads_initialise_deferred_parameters_and_reach_unsharded_units():
    """A load into a model built under no_init_parameters() (fully_shard'ed: the forward then asked for
    init_parameters, which replaced every loaded value with a fresh draw, 0.77 off, silently; a plain
    model: MindSpore's "uninitialized" error) counts as its initialisation; a load while a unit holds
    values gathered by unshard() is seen by the next forward (it used the values gathered before)."""
    from hyper_parallel_ms import init_parameters, no_init_parameters
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("dp",))
    base = _shared_dir()
    ms.set_seed(0)
    source = Net()
    saved = _whole_state(source)
    dcp.save({"model": dcp.get_model_state_dict(source)}, checkpoint_id=os.path.join(base, "net"))
    x = batch(0)
    want = source(x).asnumpy()
    for shard in (True, False):
        ms.set_seed(5)
        with no_init_parameters():
            model = Net()
        if shard:
            fully_shard(model, mesh=mesh)
        dcp.load({"model": dcp.get_model_state_dict(model)}, checkpoint_id=os.path.join(base, "net"))
        np.testing.assert_allclose(model(x).asnumpy(), want, rtol=1e-6, atol=1e-7, err_msg=f"fully_shard={shard}")
        init_parameters(model)                       # nothing left to initialise: the loaded values stay
        for k, v in _whole_state(model).items():
            np.testing.assert_array_equal(v, saved[k], err_msg=k)
    ms.set_seed(5)
    model = Net()
    fully_shard(model, mesh=mesh)
    model.unshard()
    dcp.set_model_state_dict(model, {k: ms.Tensor(v) for k, v in saved.items()})
    np.testing.assert_allclose(model(x).asnumpy(), want, rtol=1e-6, atol=1e-7)
    dist.barrier()
    if ms.communication.get_rank() == 0:
        shutil.rmtree(base, ignore_errors=True)


@multi_rank(WORLD)
def test_full_state_dicts_on_rank0_load_everywhere_with_broadcast_from_rank0():
    """PyTorch's StateDictOptions: full_state_dict with cpu_offload gives the whole state to rank 0
    only (the others an empty dict); set_state_dict with broadcast_from_rank0 takes rank 0's and every
    rank keeps its pieces, here of another layout (fully_shard -> tensor parallel). A sharded value
    given to rank 0 is refused on both ranks."""
    rank = ms.communication.get_rank()
    saved, how = _parallel("fully_shard")
    opt = make_optimizer("adamw", saved.trainable_params())
    _train(saved, opt, range(2), **how)
    expected = _full(saved, opt)
    options = dcp.StateDictOptions(full_state_dict=True, cpu_offload=True)
    model_sd, optim_sd = dcp.get_state_dict(saved, opt, options=options)
    if rank == 0:
        assert model_sd.keys() == {k[len("model."):] for k in expected if k.startswith("model.")}
        assert all(isinstance(v, np.ndarray) for v in model_sd.values())
    else:
        assert model_sd == {} and optim_sd == {}
    target, _ = _parallel("tp")
    target_opt = make_optimizer("adamw", target.trainable_params())
    keys = dcp.set_state_dict(target, target_opt, model_state_dict=model_sd, optim_state_dict=optim_sd,
                              options=dcp.StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
    assert keys.missing_keys == () and keys.unexpected_keys == ()
    got = _full(target, target_opt)
    assert got.keys() == expected.keys()
    for key, value in expected.items():
        np.testing.assert_array_equal(got[key], value, err_msg=f"{key}, rank {rank}")
    with pytest.raises(ValueError, match="needs full_state_dict=True"):
        dcp.StateDictOptions(broadcast_from_rank0=True)
    pieces = dcp.get_model_state_dict(saved) if rank == 0 else {}
    with pytest.raises(dcp.CheckpointError, match="rank 0.*sharded tensor"):
        dcp.set_model_state_dict(target, pieces, options=dcp.StateDictOptions(full_state_dict=True,
                                                                              broadcast_from_rank0=True))
    for key, value in expected.items():
        if key.startswith("model."):
            np.testing.assert_array_equal(_full(target, target_opt)[key], value, err_msg=key)
