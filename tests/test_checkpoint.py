"""Checkpoints in one process: planner and file format, model + optimizer round trips,
export to and import from a full MindSpore checkpoint, casts and partial loads (the faults:
``test_checkpoint_faults.py``)."""
from __future__ import annotations

import mindspore as ms
import numpy as np
import pytest
from mindspore import nn, ops

from hyper_parallel_ms import checkpoint as dcp
from hyper_parallel_ms.checkpoint._metadata import TensorEntry
from hyper_parallel_ms.checkpoint._boxes import Piece, assign_writers, overlap_reads
from hyper_parallel_ms.checkpoint._safetensors import SafetensorsFile, write_file
from hyper_parallel_ms.layout import Layout
from hyper_parallel_ms.placement import Replicate, Shard

from tests._checkpoint_models import MLP, _snapshot, _trained



# ------------------------------------------------------------------ planner, format
def _pieces_of(layout: Layout, shape, ranks_of_coord):
    plans = [[] for _ in range(max(ranks_of_coord.values()) + 1)]
    for coord, rank in ranks_of_coord.items():
        plans[rank].append(Piece("w", shape, "float32", layout.global_offset(shape, coord),
                                 layout.local_shape(shape, coord)))
    return plans


def test_assign_writers_dedups_replicas_and_handles_uneven_and_ordered_shards():
    lay = Layout((2, 2), (Replicate(), Shard(0)))
    ranks = {c: i for i, c in enumerate(lay.coordinates())}
    writes = assign_writers(_pieces_of(lay, (5, 3), ranks))
    assert [[(p.offsets, p.sizes) for p in w] for w in writes] == [[((0, 0), (3, 3))], [((3, 0), (2, 3))], [], []]
    spread = assign_writers(_pieces_of(lay, (5, 3), ranks), save_to_minimum_rank=False)
    assert sorted(len(w) for w in spread) == [0, 0, 1, 1]
    assert sum(len(w) for w in assign_writers(_pieces_of(lay, (5, 3), ranks), remove_redundancy=False)) == 4
    nested = Layout((2, 2), (Shard(0), Shard(0)), shard_order={0: (1, 0)})   # tp major, dp minor: uneven 7 rows
    writes = assign_writers(_pieces_of(nested, (7, 2), {c: i for i, c in enumerate(nested.coordinates())}))
    assert [w[0].offsets[0] for w in writes] == [0, 4, 2, 6]
    assert [w[0].sizes[0] for w in writes] == [2, 2, 2, 1]


def test_assign_writers_rejects_inconsistent_or_incomplete_pieces():
    with pytest.raises(dcp.CheckpointError, match="'w'.*cover 3 of 6"):
        assign_writers([[Piece("w", (2, 3), "float32", (0, 0), (1, 3))]])
    with pytest.raises(dcp.CheckpointError, match="rank 0 has global shape"):
        assign_writers([[Piece("w", (2, 3), "float32", (0, 0), (2, 3))], [Piece("w", (2, 3), "float16", (0, 0), (2, 3))]])
    replicas = [[Piece("w", (2,), "float32", (0,), (2,), crc32=c)] for c in (1, 2)]
    with pytest.raises(dcp.CheckpointError, match=r"plain tensor .* differs between ranks \[0\] vs ranks \[1\]"):
        assign_writers(replicas)


def test_overlap_reads_overlaps_saved_chunks():
    chunks = tuple(dcp.Chunk((o, 0), (2, 3), "f", f"w@{o}", 0, 24) for o in (0, 2, 4))
    reads = overlap_reads("w", TensorEntry((6, 3), "float32", chunks), (1, 1), (4, 2), "ckpt")
    assert [(r.chunk.offsets, r.src, r.dst) for r in reads] == [
        ((0, 0), (slice(1, 2), slice(1, 3)), (slice(0, 1), slice(0, 2))),
        ((2, 0), (slice(0, 2), slice(1, 3)), (slice(1, 3), slice(0, 2))),
        ((4, 0), (slice(0, 1), slice(1, 3)), (slice(3, 4), slice(0, 2)))]
    with pytest.raises(dcp.CheckpointError, match="cover 2 of the 6"):
        overlap_reads("w", TensorEntry((6, 3), "float32", chunks[:1] + chunks[2:]), (1, 0), (3, 2), "ckpt")


def test_safetensors_files_are_read_by_the_safetensors_package_and_mindspore(tmp_path):
    from safetensors.numpy import load_file
    arrays = {"a": np.arange(12, dtype=np.float32).reshape(3, 4), "b": np.array([1, 2], np.int64),
              "c": np.zeros((0, 2), np.float16)}
    path = str(tmp_path / "x.safetensors")
    write_file(path, arrays)
    for k, v in load_file(path).items():
        np.testing.assert_array_equal(v, arrays[k])
    loaded = ms.load_checkpoint(path, format="safetensors")
    np.testing.assert_array_equal(loaded["a"].asnumpy(), arrays["a"])
    assert SafetensorsFile(path).read("b").tolist() == [1, 2]


def test_write_file_takes_given_checksums_and_computes_the_others(tmp_path, monkeypatch):
    """A plain tensor's CRC-32 from the save plan is not computed a second time by the write."""
    import zlib
    from hyper_parallel_ms.checkpoint import _safetensors
    arrays = {"a": np.arange(6, dtype=np.float32), "b": np.ones(3, np.int64)}
    computed = []
    monkeypatch.setattr(_safetensors, "crc32", lambda a: computed.append(a.nbytes) or zlib.crc32(a.tobytes()))
    sums = write_file(str(tmp_path / "x.safetensors"), arrays, checksums={"a": 1234})
    assert sums == {"a": (1234, 24), "b": (zlib.crc32(arrays["b"].tobytes()), 24)} and computed == [24]
    np.testing.assert_array_equal(SafetensorsFile(str(tmp_path / "x.safetensors")).read("a"), arrays["a"])


# ------------------------------------------------------------------ round trips
def test_model_and_optimizer_round_trip_with_values(tmp_path):
    model, opt = _trained(0)
    expected = _snapshot(model, opt)
    model_sd, optim_sd = dcp.get_state_dict(model, opt)
    assert set(optim_sd["state"]["up.weight"]) == {"moment1", "moment2"}
    assert {"global_step", "learning_rate", "beta1_power", "beta2_power"} <= set(optim_sd["param_groups"][0])
    meta = dcp.save({"model": model_sd, "optim": optim_sd, "step": 2, "note": "x"},
                    checkpoint_id=str(tmp_path / "c"))
    assert meta.tensors["model.up.weight"].shape == (12, 6) and meta.values["step"] == 2
    assert meta.values["optim.param_groups.0.params"] == ["up.weight", "up.bias", "down.weight", "down.bias"]
    other, other_opt = _trained(1, steps=1)
    assert not np.array_equal(other.up.weight.asnumpy(), expected["up.weight"])
    state = {"model": dcp.get_model_state_dict(other), "optim": dcp.get_optimizer_state_dict(other, other_opt),
             "step": 0, "note": ""}
    dcp.load(state, checkpoint_id=str(tmp_path / "c"))
    assert state["step"] == 2 and state["note"] == "x"
    got = _snapshot(other, other_opt)
    for name, value in expected.items():
        np.testing.assert_array_equal(got[name], value, err_msg=name)


def test_full_state_dict_and_set_functions(tmp_path):
    model, opt = _trained(0)
    full_model = dcp.get_model_state_dict(model, options=dcp.StateDictOptions(full_state_dict=True, cpu_offload=True))
    full_optim = dcp.get_optimizer_state_dict(model, opt, options=dcp.StateDictOptions(cpu_offload=True))
    assert isinstance(full_model["up.weight"], np.ndarray)
    other, other_opt = _trained(1, steps=1)
    keys = dcp.set_state_dict(other, other_opt, model_state_dict=full_model, optim_state_dict=full_optim)
    assert keys.missing_keys == () and keys.unexpected_keys == ()
    for name, value in _snapshot(model, opt).items():
        np.testing.assert_array_equal(_snapshot(other, other_opt)[name], value, err_msg=name)
    with pytest.raises(dcp.CheckpointError, match="missing keys \\['down.bias'\\]"):
        dcp.set_model_state_dict(other, {k: v for k, v in full_model.items() if k != "down.bias"})


def test_export_to_mindspore_and_import_full_checkpoint(tmp_path):
    model, opt = _trained(0)
    dcp.save({"model": dcp.get_model_state_dict(model)}, checkpoint_id=str(tmp_path / "c"))
    shapes = dcp.export_full(str(tmp_path / "c"), str(tmp_path / "full.safetensors"), prefix="model.")
    assert shapes["up.weight"] == (12, 6)
    plain = MLP()
    not_loaded, _ = ms.load_param_into_net(plain, ms.load_checkpoint(str(tmp_path / "full.safetensors"),
                                                                     format="safetensors"))
    assert not_loaded == []
    np.testing.assert_array_equal(plain.down.weight.asnumpy(), model.down.weight.asnumpy())
    ms.save_checkpoint(model, str(tmp_path / "net.ckpt"))
    for path in ("full.safetensors", "net.ckpt"):
        fresh = MLP()
        dcp.load(dcp.get_model_state_dict(fresh), checkpoint_id=str(tmp_path / path))
        np.testing.assert_array_equal(fresh.up.weight.asnumpy(), model.up.weight.asnumpy())


_OPTIMIZERS = {"AdamWeightDecay": lambda p: nn.AdamWeightDecay(p, 0.01), "Adam": lambda p: nn.Adam(p, 0.01),
               "Momentum": lambda p: nn.Momentum(p, 0.01, 0.9), "SGD": lambda p: nn.SGD(p, 0.01, momentum=0.9),
               "Lamb": lambda p: nn.Lamb(p, 0.01), "Adagrad": lambda p: nn.Adagrad(p, learning_rate=0.01),
               "RMSProp": lambda p: nn.RMSProp(p, 0.01)}


def _filled(make, seed: int):
    """A model and its optimizer whose every Parameter holds distinct values (``seed``)."""
    ms.set_seed(seed)
    model = MLP()
    opt = make(model.trainable_params())
    rng = np.random.default_rng(seed)
    for p in opt.parameters_dict().values():          # the model's weights, moments, step, lr, powers
        p.set_data(ms.Tensor(rng.integers(1, 50, p.shape).astype(p.asnumpy().dtype)))
    return model, opt


def test_export_writes_mindspore_optimizer_names_that_strict_loads_resume(tmp_path):
    for name, make in _OPTIMIZERS.items():
        model, opt = _filled(make, 0)
        model_sd, optim_sd = dcp.get_state_dict(model, opt)
        path = str(tmp_path / name)
        dcp.save({"model": model_sd, "optim": optim_sd, "step": 2}, checkpoint_id=path)
        dcp.export_full(path, path + ".safetensors")
        params = ms.load_checkpoint(path + ".safetensors", format="safetensors")
        assert set(params) == set(opt.parameters_dict()), name       # nothing more, nothing less
        fresh, fresh_opt = _filled(make, 1)
        not_loaded, rest = ms.load_param_into_net(fresh, params, strict_load=True)
        assert not_loaded == [] and sorted(rest) == sorted(set(params) - set(dict(fresh.parameters_and_names())))
        not_loaded, _ = ms.load_param_into_net(fresh_opt, params, strict_load=True)
        assert not_loaded == [], (name, not_loaded)
        again, again_opt = _filled(make, 2)                  # the exported file imported by load
        dcp.load({"model": dcp.get_model_state_dict(again), "optim": dcp.get_optimizer_state_dict(again, again_opt)},
                 checkpoint_id=path + ".safetensors")
        for k, p in opt.parameters_dict().items():
            np.testing.assert_array_equal(fresh_opt.parameters_dict()[k].asnumpy(), p.asnumpy(), err_msg=f"{name} {k}")
            np.testing.assert_array_equal(again_opt.parameters_dict()[k].asnumpy(), p.asnumpy(), err_msg=f"{name} {k}")
    assert set(dcp.get_optimizer_state_dict(model, opt)["state"]["up.weight"]) == {"mean_square", "moment"}


def test_checkpoints_with_the_slot_names_of_earlier_releases_still_load(tmp_path):
    model, opt = _filled(_OPTIMIZERS["AdamWeightDecay"], 0)
    model_sd, optim_sd = dcp.get_state_dict(model, opt)
    earlier = {fqn: {{"adam_m": "moments1", "adam_v": "moments2"}[s]: v for s, v in slots.items()}
               for fqn, slots in optim_sd["state"].items()}
    dcp.save({"model": model_sd, "optim": dict(optim_sd, state=earlier)}, checkpoint_id=str(tmp_path / "c"))
    fresh, fresh_opt = _filled(_OPTIMIZERS["AdamWeightDecay"], 1)
    dcp.load({"model": dcp.get_model_state_dict(fresh), "optim": dcp.get_optimizer_state_dict(fresh, fresh_opt)},
             checkpoint_id=str(tmp_path / "c"))
    for k, p in opt.parameters_dict().items():
        np.testing.assert_array_equal(fresh_opt.parameters_dict()[k].asnumpy(), p.asnumpy(), err_msg=k)


def test_a_key_matching_nothing_or_a_tensor_in_another_role_is_refused(tmp_path):
    from hyper_parallel_ms.checkpoint._names import mindspore_names
    model, opt = _filled(_OPTIMIZERS["AdamWeightDecay"], 0)
    dcp.save({"model": dcp.get_model_state_dict(model), "optim": dcp.get_optimizer_state_dict(model, opt)},
             checkpoint_id=str(tmp_path / "c"))
    dcp.export_full(str(tmp_path / "c"), str(tmp_path / "full.safetensors"))
    arrays = {k: SafetensorsFile(str(tmp_path / "full.safetensors")).read(k) for k in
              SafetensorsFile(str(tmp_path / "full.safetensors")).keys()}
    fresh, fresh_opt = _filled(_OPTIMIZERS["AdamWeightDecay"], 1)
    before = _snapshot(fresh, fresh_opt)

    def load(named):
        write_file(str(tmp_path / "x.safetensors"), named)
        dcp.load({"model": dcp.get_model_state_dict(fresh), "optim": dcp.get_optimizer_state_dict(fresh, fresh_opt)},
                 checkpoint_id=str(tmp_path / "x.safetensors"))
    renamed = {("state.up.weight.moments1" if k == "adam_m.up.weight" else k): v for k, v in arrays.items()}
    with pytest.raises(dcp.CheckpointError, match=r"match no entry.*'state.up.weight.moments1'"):
        load(renamed)                                        # the names of earlier releases
    with pytest.raises(dcp.CheckpointError, match=r"'optim.state.up.weight.adam_m' \(checkpoint key "
                                                  r"'adam_m.up.weight'\).*holds shape \(12,\)"):
        load(dict(arrays, **{"adam_m.up.weight": arrays["up.bias"]}))       # the bias's moment on a weight's
    with pytest.raises(dcp.CheckpointError, match=r"match no entry.*'extra'"):
        load(dict(arrays, extra=arrays["up.bias"]))
    with pytest.raises(dcp.CheckpointError, match="match no entry of the state dict: .adam_m"):
        dcp.load({"model": dcp.get_model_state_dict(fresh)}, checkpoint_id=str(tmp_path / "full.safetensors"))
    assert _snapshot(fresh, fresh_opt).keys() == before.keys()
    for k, v in _snapshot(fresh, fresh_opt).items():
        np.testing.assert_array_equal(v, before[k], err_msg=f"{k} changed by a refused load")
    dcp.load({"model": dcp.get_model_state_dict(fresh)}, checkpoint_id=str(tmp_path / "full.safetensors"),
             planner=dcp.DefaultLoadPlanner(allow_unused=True))              # the model alone, asked for
    np.testing.assert_array_equal(fresh.up.weight.asnumpy(), model.up.weight.asnumpy())
    assert mindspore_names({"model.w": (2,)}, {"step": 1}) == {"model.w": "w"}          # {"model": ...} alone
    assert mindspore_names({"model.w": (2,), "x": (1,)}, {}) == {"model.w": "model.w", "x": "x"}   # a bare dict
    groups = {"optim.param_groups.0.params": ["w"]}
    with pytest.raises(dcp.CheckpointError, match="names no parameter"):
        mindspore_names({"model.w": (2,), "optim.state.v.adam_m": (2,)}, groups)
    with pytest.raises(dcp.CheckpointError, match=r"moment 'optim.state.w.adam_m' has shape \(3,\)"):
        mindspore_names({"model.w": (2,), "optim.state.w.adam_m": (3,)}, groups)
    with pytest.raises(dcp.CheckpointError, match="both have MindSpore's name 'adam_m.w'"):
        mindspore_names({"model.adam_m.w": (2,), "model.w": (2,), "optim.state.w.adam_m": (2,)}, groups)


def test_async_save_snapshots_the_state_and_commits_on_result(tmp_path):
    path = str(tmp_path / "c")
    param = ms.Parameter(ms.Tensor(np.arange(4, dtype=np.float32)), name="w")
    history = [1.0]
    pending = dcp.async_save({"w": param, "step": 1, "history": history}, checkpoint_id=path, no_dist=True)
    param.set_data(ms.Tensor(np.zeros(4, np.float32)))          # training goes on
    history.append(2.0)                                         # non-tensor values too (they were saved changed)
    meta = pending.result()
    assert pending.done() and meta.values["step"] == 1 and meta.values["history"] == [1.0]
    state = {"w": np.full(4, -1, np.float32), "step": 0, "history": []}
    dcp.load(state, checkpoint_id=path)
    assert state["w"].tolist() == [0, 1, 2, 3] and state["step"] == 1 and state["history"] == [1.0]


def test_bfloat16_int_and_scalar_tensors_round_trip(tmp_path):
    src = {"b": ms.Parameter(ms.Tensor(np.array([1.5, -2.25, 3.0], np.float32)).astype(ms.bfloat16), name="b"),
           "i": ms.Tensor(np.array([[1, 2]], np.int64)), "s": ms.Parameter(ms.Tensor(0.125, ms.float32), name="s")}
    dcp.save(src, checkpoint_id=str(tmp_path / "c"))
    dst = {"b": ms.Parameter(ms.Tensor(np.zeros(3, np.float32)).astype(ms.bfloat16), name="b2"),
           "i": ms.Tensor(np.zeros((1, 2), np.int64)), "s": ms.Parameter(ms.Tensor(0.0, ms.float32), name="s2")}
    dcp.load(dst, checkpoint_id=str(tmp_path / "c"))
    assert dst["b"].dtype == ms.bfloat16
    assert dst["b"].astype(ms.float32).asnumpy().tolist() == [1.5, -2.25, 3.0]
    assert dst["i"].asnumpy().tolist() == [[1, 2]] and float(dst["s"].asnumpy()) == 0.125
    dcp.export_full(str(tmp_path / "c"), str(tmp_path / "full.safetensors"))
    loaded = ms.load_checkpoint(str(tmp_path / "full.safetensors"), format="safetensors")
    assert loaded["b"].dtype == ms.bfloat16 and loaded["b"].astype(ms.float32).asnumpy().tolist() == [1.5, -2.25, 3.0]


def test_mint_optimizers_state_dicts_round_trip_and_other_objects_are_refused(tmp_path):
    """mint.optim / experimental.optim optimizers (moments as ParameterTuples ``exp_avg``,
    ``momentum_buf``, ... and a step counter) save and load as nn optimizers do: a resumed run's next
    step equals the uninterrupted one. Anything that is not a MindSpore optimizer is refused naming
    the supported kinds."""
    from mindspore import mint
    from mindspore.experimental import optim as exp_optim
    x = ms.Tensor(np.random.default_rng(0).standard_normal((4, 6)).astype(np.float32))

    def run(make, steps, seed=0):
        ms.set_seed(seed)
        model = MLP()
        opt = make(model.trainable_params())
        grad_fn = ms.value_and_grad(lambda: (model(x) ** 2).mean(), None, opt.parameters)
        for _ in range(steps):
            opt(grad_fn()[1])
        return model, opt, grad_fn

    for make in (lambda p: mint.optim.Adam(p, lr=0.01), lambda p: mint.optim.SGD(p, lr=0.1, momentum=0.9),
                 lambda p: exp_optim.RMSprop(p, lr=0.01, momentum=0.5)):
        model, opt, _ = run(make, 2)
        path = str(tmp_path / type(opt).__name__)
        sd = {"model": dcp.get_model_state_dict(model), "optim": dcp.get_optimizer_state_dict(model, opt)}
        assert sd["optim"]["state"]["up.weight"], type(opt).__name__
        dcp.save(sd, checkpoint_id=path)
        other, other_opt, other_grad = run(make, 1, seed=1)
        dcp.load({"model": dcp.get_model_state_dict(other), "optim": dcp.get_optimizer_state_dict(other, other_opt)},
                 checkpoint_id=path)
        for name, value in _snapshot(model, opt).items():
            np.testing.assert_array_equal(_snapshot(other, other_opt)[name], value, err_msg=name)
        _, _, grad_fn = model, opt, ms.value_and_grad(lambda: (model(x) ** 2).mean(), None, opt.parameters)
        opt(grad_fn()[1])
        other_opt(other_grad()[1])
        for name, value in _snapshot(model, opt).items():
            np.testing.assert_array_equal(_snapshot(other, other_opt)[name], value, err_msg=name)
    model = nn.Dense(2, 2)
    with pytest.raises(TypeError, match=r"read MindSpore optimizers .*got \['builtins.dict'\]"):
        dcp.get_optimizer_state_dict(model, {"lr": 0.1})
    assert set(dcp.get_optimizer_state_dict(model, [nn.SGD(model.trainable_params(), 0.1)])) == {"state",
                                                                                                   "param_groups"}


class _AppState:
    """PyTorch's Stateful pattern: a model and a step counter saved and loaded as one value."""

    def __init__(self, model) -> None:
        self.model, self.step = model, 0

    def state_dict(self):
        return {"model": dcp.get_model_state_dict(self.model), "step": self.step}

    def load_state_dict(self, state) -> None:
        dcp.set_model_state_dict(self.model, state["model"])
        self.step = state["step"]


def test_stateful_values_save_their_state_dict_and_load_through_load_state_dict(tmp_path):
    """PyTorch DCP's Stateful protocol (was refused: 'neither a tensor nor JSON-serialisable')."""
    path = str(tmp_path / "c")
    model = nn.Dense(3, 2)
    app = _AppState(model)
    app.step = 7
    want = {k: v.asnumpy().copy() for k, v in model.parameters_and_names()}
    dcp.save({"app": app, "epoch": 2}, checkpoint_id=path, no_dist=True)
    for p in model.get_parameters():
        p.set_data(ops.zeros_like(p))
    app.step = 0
    state = {"app": app, "epoch": 0}
    dcp.load(state, checkpoint_id=path, no_dist=True)
    assert app.step == 7 and state["epoch"] == 2 and state["app"] is app
    for k, v in model.parameters_and_names():
        np.testing.assert_array_equal(v.asnumpy(), want[k], err_msg=k)


def test_a_load_casts_floating_tensors_and_refuses_other_kinds(tmp_path):
    """PyTorch's load copies into the target (``copy_`` casts): an fp32 checkpoint loads into fp16
    and bf16 models, rounded as MindSpore's cast rounds; a float tensor into an int target (or back)
    is refused naming both dtypes, before anything changes. set_model_state_dict casts alike."""
    model, opt = _trained(0)
    dcp.save({"model": dcp.get_model_state_dict(model)}, checkpoint_id=str(tmp_path / "c"))
    want = {k: v.asnumpy() for k, v in dcp.get_model_state_dict(model).items()}
    for dtype in (ms.float16, ms.bfloat16):
        other = MLP()
        for p in other.get_parameters():
            p.set_dtype(dtype)
        dcp.load({"model": dcp.get_model_state_dict(other)}, checkpoint_id=str(tmp_path / "c"))
        for key, value in dcp.get_model_state_dict(other).items():
            assert value.dtype == dtype, key
            expected = ms.Tensor(want[key]).astype(dtype).astype(ms.float32).asnumpy()
            np.testing.assert_array_equal(value.astype(ms.float32).asnumpy(), expected, err_msg=key)
    fp16 = MLP()
    for p in fp16.get_parameters():
        p.set_dtype(ms.float16)
    dcp.set_model_state_dict(fp16, {k: ms.Tensor(v) for k, v in want.items()})
    np.testing.assert_array_equal(fp16.up.weight.asnumpy(), want["up.weight"].astype(np.float16))
    ints = {"model": {"up.weight": ms.Parameter(ms.Tensor(np.zeros((12, 6), np.int32)), name="iw")}}
    with pytest.raises(dcp.CheckpointError, match=r"'model\.up\.weight'.*float32.*int32"):
        dcp.load(ints, checkpoint_id=str(tmp_path / "c"), planner=dcp.DefaultLoadPlanner(allow_partial_load=True))
    assert not ints["model"]["up.weight"].asnumpy().any()
    with pytest.raises(dcp.CheckpointError, match="'up.weight'.*holds int32, the target is float16"):
        dcp.set_model_state_dict(fp16, {**{k: ms.Tensor(v * 2) for k, v in want.items()},
                                        "up.weight": ms.Tensor(np.ones((12, 6), np.int32))})
    np.testing.assert_array_equal(fp16.down.weight.asnumpy(), want["down.weight"].astype(np.float16))


def test_allow_partial_load_keeps_the_entries_a_checkpoint_lacks(tmp_path):
    """PyTorch's DefaultLoadPlanner(allow_partial_load=True): the entries the checkpoint holds are
    loaded, the others (a new head, a counter saved later) keep their values; by default the load
    is refused naming the entries and the option."""
    model, _ = _trained(0)
    dcp.save({"model": dcp.get_model_state_dict(model)}, checkpoint_id=str(tmp_path / "c"))
    other, _ = _trained(1, steps=1)
    head = ms.Parameter(ms.Tensor(np.full((3,), 7.0, np.float32)), name="head")
    state = {"model": dcp.get_model_state_dict(other), "head": head, "step": 5}
    with pytest.raises(dcp.CheckpointError, match=r"2 entries.*'head'.*allow_partial_load=True"):
        dcp.load(state, checkpoint_id=str(tmp_path / "c"))
    assert not np.array_equal(other.up.weight.asnumpy(), model.up.weight.asnumpy())
    dcp.load(state, checkpoint_id=str(tmp_path / "c"), planner=dcp.DefaultLoadPlanner(allow_partial_load=True))
    np.testing.assert_array_equal(other.up.weight.asnumpy(), model.up.weight.asnumpy())
    np.testing.assert_array_equal(other.down.bias.asnumpy(), model.down.bias.asnumpy())
    assert head.asnumpy().tolist() == [7.0, 7.0, 7.0] and state["step"] == 5
