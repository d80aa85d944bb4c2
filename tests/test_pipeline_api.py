"""The pipelining API around the schedules, on CPU ranks and in one process: forward-only steps and
tuple outputs merged over micro-batches, the split of nested inputs into micro-batches and PyTorch's
TensorChunkSpec split / merge dims, a stage without trainable parameters, and PyTorch's names."""
from __future__ import annotations

import inspect

import mindspore as ms
import numpy as np
import pytest
from mindspore import nn

from hyper_parallel_ms import _mindspore as seam
from hyper_parallel_ms.testing import multi_rank
from tests._pipeline_models import (ATOL, RTOL, RUNTIME_SCHEDULES, STAGES_PER_RANK, Model, batch, loss_fn,
                                    make_schedule)


class _TwoOutputs(nn.Cell):
    """A last stage returning a tuple: the head's output and a per-row score."""

    def __init__(self, cell):
        super().__init__()
        self.cell = cell

    def construct(self, x):
        out = self.cell(x)
        return out, out.sum(axis=1)


@pytest.mark.parametrize("name", RUNTIME_SCHEDULES)
@multi_rank(2)
def test_a_schedule_without_loss_runs_forward_only_and_merges_tuple_outputs(name):
    from hyper_parallel_ms.mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("pp",))
    v = STAGES_PER_RANK[name]
    ms.set_seed(0)
    whole = Model(2 * v)
    x, _ = batch(0, 8)
    want = whole(x).asnumpy()
    schedule, models = make_schedule(name, mesh, 4, loss=None)
    holds_last = any(st.is_last for st in schedule.stages)
    calls = schedule.forward_calls
    out = schedule.step(*((x,) if any(st.is_first for st in schedule.stages) else ()))
    assert schedule.forward_calls - calls == 4 * v                      # one forward per stage and micro-batch
    if holds_last:
        np.testing.assert_allclose(out.asnumpy(), want, rtol=RTOL, atol=ATOL)
    else:
        assert out is None
    # a last stage returning a tuple: each element merged over the micro-batches, as PyTorch's step
    last = next(m for st, m in zip(schedule.stages, models) if st.is_last) if holds_last else None
    stages = []
    for st, m in zip(schedule.stages, models):
        cell = _TwoOutputs(m) if st.is_last else m
        stages.append(type(st)(cell, st.stage_index, st.num_stages, mesh=mesh))
    from hyper_parallel_ms import pipelining as pl
    cls = pl.get_schedule_class(name)
    merged = cls(stages[0] if v == 1 else stages, 4, None).step(
        *((x,) if any(st.is_first for st in stages) else ()))
    if last is not None:
        assert isinstance(merged, tuple) and len(merged) == 2
        np.testing.assert_allclose(merged[0].asnumpy(), want, rtol=RTOL, atol=ATOL)
        np.testing.assert_allclose(merged[1].asnumpy(), want.sum(axis=1), rtol=RTOL, atol=1e-5)


def test_split_microbatches_splits_tensors_inside_nested_tuples_lists_and_dicts():
    """Each Tensor of nested containers is split along dim 0 (torch.tensor_split's chunks), other
    values go to every micro-batch, and the containers' types are kept (PyTorch's tree split)."""
    from collections import namedtuple

    from hyper_parallel_ms.pipelining._microbatch import split_microbatches

    Pair = namedtuple("Pair", "a b")
    x = ms.Tensor(np.arange(10, dtype=np.float32).reshape(5, 2))
    m = ms.Tensor(np.arange(5, dtype=np.int32))
    mbs = split_microbatches((x, (m, [x]), {"mask": m, "pair": Pair(x, 3)}, "tag"), 2)
    assert len(mbs) == 2
    for mb, (a, b) in zip(mbs, ((0, 3), (3, 5))):
        xs, (ms_, (xs2,)), d, tag = mb
        assert isinstance(mb[1][1], list) and isinstance(d["pair"], Pair) and tag == "tag" and d["pair"].b == 3
        for got, want in ((xs, x), (ms_, m), (xs2, x), (d["mask"], m), (d["pair"].a, x)):
            np.testing.assert_array_equal(got.asnumpy(), want.asnumpy()[a:b])


def test_chunk_specs_split_and_merge_along_their_dims_and_bad_specs_are_named():
    """PyTorch's TensorChunkSpec: split dims per input (a structure like a nested input's, None: whole),
    keyword inputs the spec does not name along dim 0; outputs merged along the merge spec's dims."""
    from hyper_parallel_ms.pipelining import TensorChunkSpec
    from hyper_parallel_ms.pipelining._microbatch import merge_chunks, split_dims, split_microbatches
    from hyper_parallel_ms.pipelining._batch import check_chunk_specs

    x = ms.Tensor(np.arange(30, dtype=np.float32).reshape(3, 5, 2))
    kw = {"pair": (x, x), "m": x}
    dims = split_dims((x, x), kw, (TensorChunkSpec(-2), None), {"pair": (TensorChunkSpec(2), TensorChunkSpec(0))})
    assert dims == [1, None, 2, 0, 0]
    mbs = split_microbatches((x, x) + tuple(kw.values()), 2, dims)
    np.testing.assert_array_equal(mbs[1][0].asnumpy(), x.asnumpy()[:, 3:])          # 5 along dim 1: 3, 2
    assert mbs[1][1] is x
    np.testing.assert_array_equal(mbs[0][2][0].asnumpy(), x.asnumpy()[:, :, :1])
    np.testing.assert_array_equal(mbs[1][3].asnumpy(), x.asnumpy()[2:])
    merged = merge_chunks([(m[0], m[2][0]) for m in mbs], (TensorChunkSpec(1), None))
    np.testing.assert_array_equal(merged[0].asnumpy(), x.asnumpy())
    assert isinstance(merged[1], list) and len(merged[1]) == 2
    np.testing.assert_array_equal(merge_chunks([m[3] for m in mbs]).asnumpy(), x.asnumpy())
    with pytest.raises(ValueError, match=r"TensorChunkSpec\(3\) does not fit an output of shape \(3, 5, 2\)"):
        merge_chunks([x, x], TensorChunkSpec(3))
    with pytest.raises(ValueError, match="is a tuple, but the outputs are one value"):
        merge_chunks([x, x], (TensorChunkSpec(0),))
    assert TensorChunkSpec.from_tuple((0, 1)) == (TensorChunkSpec(0), TensorChunkSpec(1))
    assert TensorChunkSpec.from_dict({"m": 2}) == {"m": TensorChunkSpec(2)}
    with pytest.raises(ValueError, match=r"input 0: TensorChunkSpec\(3\) does not fit a Tensor of shape \(3, 5, 2\)"):
        split_dims((x,), {}, (TensorChunkSpec(3),), None)
    with pytest.raises(ValueError, match="args_chunk_spec has 1 entries for 2 positional inputs"):
        split_dims((x, x), {}, (TensorChunkSpec(0),), None)
    with pytest.raises(ValueError, match=r"kwargs_chunk_spec names \['n'\]"):
        split_dims((), kw, None, {"n": TensorChunkSpec(0)})
    with pytest.raises(ValueError, match="one of those per Tensor \\(2 leaves\\)"):
        split_dims((), kw, None, {"pair": (TensorChunkSpec(0),)})
    with pytest.raises(TypeError, match="TensorChunkSpec takes an int"):
        TensorChunkSpec("1")
    # HyperParallel's BatchDimSpec is a TensorChunkSpec by another name
    from hyper_parallel_ms.pipelining import BatchDimSpec
    assert BatchDimSpec(1) == TensorChunkSpec(1) and BatchDimSpec(1).batch_dim == 1
    assert BatchDimSpec.from_tuple((0, 1)) == (BatchDimSpec(0), BatchDimSpec(1))
    assert BatchDimSpec.from_dict({"m": 2}) == {"m": TensorChunkSpec(2)}
    assert split_dims((x, x), {}, (BatchDimSpec(-2), None), None) == [1, None]
    with pytest.raises(TypeError, match="batch_dims must be tuple"):
        BatchDimSpec.from_tuple([0])
    with pytest.raises(TypeError, match="batch_dim must be int"):
        BatchDimSpec("0")
    for bad in (dict(args_spec=TensorChunkSpec(0)), dict(kwargs_spec=(TensorChunkSpec(0),)),
                dict(merge_spec={"a": 1})):
        with pytest.raises(TypeError, match="chunk_spec|merge_spec"):
            check_chunk_specs(bad.get("args_spec"), bad.get("kwargs_spec"), bad.get("merge_spec"), "ScheduleGPipe")


@multi_rank(2)
def test_a_stage_without_trainable_parameters_trains_the_others():
    """Stage 0 wholly frozen (fine-tuning the top layers): its backward has nothing to compute, and
    MindSpore refused a backward without inputs, so the step failed on every rank; now the last
    stage's gradients equal one device (PyNative GPipe, compiled 1F1B)."""
    from hyper_parallel_ms.mesh import init_device_mesh
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("pp",))
    me = mesh.get_local_rank()

    def freeze(model):
        if me == 0:
            for p in model.get_parameters():
                p.requires_grad = False
    x, y = batch(0, 4)
    ms.set_seed(0)
    reference = Model(2)
    for p in list(reference.embed.get_parameters()) + list(reference.layers[0].get_parameters()):
        p.requires_grad = False
    params = reference.trainable_params()
    want = dict(zip([p.name for p in params],
                    ms.value_and_grad(lambda a, b: loss_fn(reference(a), b), None, params)(x, y)[1]))
    for name, jit in (("GPipe", False), ("1F1B", True)):
        schedule, _ = make_schedule(name, mesh, 2, jit=jit, prepare=freeze)
        schedule.step(*((x,) if me == 0 else ()), target=y if me == 1 else None)
        assert len(schedule.parameters()) == (0 if me == 0 else 4), name
        for p, g in zip(schedule.parameters(), schedule.gradients()):
            np.testing.assert_allclose(g.asnumpy(), want[p.name].asnumpy(), rtol=RTOL, atol=ATOL, err_msg=p.name)


def test_pytorch_names_of_the_pipelining_api():
    """PyTorch's get_schedule_class, PipelineScheduleSingle / PipelineScheduleMulti bases,
    split_args_kwargs_into_chunks / merge_chunks (the split of a batch and its inverse) and
    PipelineStage.submod."""
    from hyper_parallel_ms import pipelining as pl

    assert pl.get_schedule_class("1f1b") is pl.Schedule1F1B and pl.get_schedule_class("ZBVZeroBubble") is \
        pl.ScheduleZBVZeroBubble
    assert pl.get_schedule_class("dualpipev") is pl.ScheduleDualPipeV and pl.get_schedule_class(
        "InterleavedZeroBubble") is pl.ScheduleInterleavedZeroBubble
    assert pl.get_schedule_class("PipelineScheduleMulti") is pl.PipelineScheduleMulti
    with pytest.raises(ValueError, match="unknown pipeline schedule 'PipeDream'.*'GPipe'.*'DualPipeV'"):
        pl.get_schedule_class("PipeDream")
    assert issubclass(pl.ScheduleInterleavedZeroBubble, pl.PipelineScheduleMulti) and issubclass(
        pl.ScheduleDualPipeV, pl.PipelineScheduleMulti)
    assert issubclass(pl.ScheduleGPipe, pl.PipelineScheduleSingle) and issubclass(pl.Schedule1F1B,
                                                                                   pl.PipelineScheduleSingle)
    assert issubclass(pl.ScheduleLoopedBFS, pl.PipelineScheduleMulti) and pl.get_schedule_class("loopedbfs") is \
        pl.ScheduleLoopedBFS
    assert issubclass(pl.ScheduleInterleaved1F1B, pl.PipelineScheduleMulti) and issubclass(
        pl.ScheduleZBVZeroBubble, pl.PipelineScheduleMulti)
    x = ms.Tensor(np.arange(14, dtype=np.float32).reshape(7, 2))
    args_split, kwargs_split = pl.split_args_kwargs_into_chunks((x, 3), {"m": x.T}, 3, None,
                                                                {"m": pl.TensorChunkSpec(1)})
    assert [a[0].shape for a in args_split] == [(3, 2), (2, 2), (2, 2)] and all(a[1] == 3 for a in args_split)
    assert [k["m"].shape for k in kwargs_split] == [(2, 3), (2, 2), (2, 2)]
    np.testing.assert_array_equal(pl.merge_chunks([a[0] for a in args_split]).asnumpy(), x.asnumpy())
    np.testing.assert_array_equal(pl.merge_chunks([k["m"] for k in kwargs_split], pl.TensorChunkSpec(1)).asnumpy(),
                                  x.T.asnumpy())
    # keyword-argument chunks with a dict spec merge back into a dict (keys it does not name: dim 0), as PyTorch's
    _, pairs = pl.split_args_kwargs_into_chunks((), {"m": x.T, "n": x}, 3, None, {"m": pl.TensorChunkSpec(1)})
    for spec in ({"m": pl.TensorChunkSpec(1), "n": pl.TensorChunkSpec(0)}, {"m": pl.TensorChunkSpec(1)}):
        merged = pl.merge_chunks(pairs, spec)
        assert isinstance(merged, dict) and list(merged) == ["m", "n"], merged
        np.testing.assert_array_equal(merged["m"].asnumpy(), x.T.asnumpy())
        np.testing.assert_array_equal(merged["n"].asnumpy(), x.asnumpy())
    with pytest.raises(ValueError, match=r"output_merge_spec names \['z'\], which are not keys of the outputs"):
        pl.merge_chunks(pairs, {"z": pl.TensorChunkSpec(0)})
    with pytest.raises(ValueError, match=r"output_merge_spec\['m'\] TensorChunkSpec\(2\) does not fit an output"):
        pl.merge_chunks(pairs, {"m": pl.TensorChunkSpec(2)})
    cell = nn.Dense(2, 2)
    assert pl.PipelineStage(cell, 0, 1).submod is cell
    # HyperParallel's keywords: stage_num (num_stages' other name), has_backward
    assert pl.PipelineStage(cell, 0, stage_num=1).num_stages == 1 == pl.PipelineStage(cell, 0, 1, stage_num=1).num_stages
    assert pl.PipelineStage(cell, 0, 1).has_backward and not pl.PipelineStage(cell, 0, 1, has_backward=False).has_backward
    with pytest.raises(TypeError, match=r"num_stages \(PyTorch\) or stage_num \(HyperParallel\)"):
        pl.PipelineStage(cell, 0)
    with pytest.raises(ValueError, match="num_stages=1 and stage_num=2"):
        pl.PipelineStage(cell, 0, 1, stage_num=2)
    # each HyperParallel spelling is translated in one place (pipelining/_compat.py): either name, both when
    # they agree; a disagreement names both
    with pytest.raises(ValueError, match=r"args_chunk_spec=\(TensorChunkSpec\(0\),\) and args_batch_dim="
                                         r"\(BatchDimSpec\(1\),\); they name the same argument"):
        pl.ScheduleGPipe(pl.PipelineStage(cell, 0, 1), 2, args_chunk_spec=(pl.TensorChunkSpec(0),),
                         args_batch_dim=[pl.BatchDimSpec(1)])
    with pytest.raises(ValueError, match="n_microbatches=2 and micro_batch_num=3"):
        pl.ScheduleGPipe(pl.PipelineStage(cell, 0, 1), 2, micro_batch_num=3)
    agreed = pl.ScheduleGPipe(pl.PipelineStage(cell, 0, 1), 2, micro_batch_num=2, output_concat_dim=1,
                              output_merge_spec=pl.TensorChunkSpec(1), args_chunk_spec=(pl.TensorChunkSpec(0),),
                              args_batch_dim=[pl.BatchDimSpec(0)])
    assert (agreed.n_microbatches, agreed.output_merge_spec, agreed.args_chunk_spec) == (
        2, pl.TensorChunkSpec(1), (pl.TensorChunkSpec(0),))
    # the schedules' arguments are written once (PipelineSchedule); the bases show them under PyTorch's first name
    base = list(inspect.signature(pl.PipelineSchedule).parameters)
    # 13 + HyperParallel's overlap_b_f, enable_dxdw_split, p2p_transport and swap
    assert base[0] == "stages" and len(base) == 17
    assert list(inspect.signature(pl.ScheduleGPipe).parameters) == ["stage"] + base[1:]
    assert list(inspect.signature(pl.ScheduleDualPipeV).parameters) == base
    with pytest.raises(TypeError, match="ScheduleGPipe runs one PipelineStage per rank"):
        pl.ScheduleGPipe([pl.PipelineStage(cell, 0, 1)], 2)
    with pytest.raises(TypeError, match="has_backward must be True or False"):
        pl.PipelineStage(cell, 0, 1, has_backward=1)
    with pytest.raises(TypeError, match="fifth positional argument is group: pass group= or mesh= by keyword"):
        pl.PipelineStage(cell, 0, 1, None, "hccl_world_group")          # HyperParallel's positional group


@multi_rank(2)
def test_run_returns_hyperparallel_lists_per_microbatch():
    """HyperParallel's ``schedule.run(x)``: a list with one entry per micro-batch on the last stage's
    rank (``run(x)[0]`` is micro-batch 0's loss, not the first row of the merged outputs), ``[]``
    elsewhere: the losses with a loss_fn (the step trains, as step's gradients), else the outputs."""
    from hyper_parallel_ms.mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("pp",))
    last = mesh.get_local_rank() == 1
    ms.set_seed(0)
    whole = Model(2)
    x, y = batch(0, 8)
    want_out = [whole(x[2 * m:2 * m + 2]).asnumpy() for m in range(4)]
    want_loss = [float(loss_fn(whole(x[2 * m:2 * m + 2]), y[2 * m:2 * m + 2]).asnumpy()) for m in range(4)]
    schedule, _ = make_schedule("GPipe", mesh, 4)
    got = schedule.run(*(() if last else (x,)), target=y if last else None)
    stepped: list = []
    schedule.step(*(() if last else (x,)), target=y if last else None, losses=stepped)
    if last:
        np.testing.assert_allclose([float(v.asnumpy()) for v in got], want_loss, rtol=RTOL, atol=ATOL)
        assert [float(v.asnumpy()) for v in got] == [float(v.asnumpy()) for v in stepped]
    else:
        assert got == []
    forward, _ = make_schedule("GPipe", mesh, 4, loss=None)
    outs = forward.run(*(() if last else (x,)))
    if last:
        assert len(outs) == 4
        for o, w in zip(outs, want_out):
            np.testing.assert_allclose(o.asnumpy(), w, rtol=RTOL, atol=ATOL)
    else:
        assert outs == []
    # HyperParallel's has_backward=False on the first stage only: the pp ranks agree, and the schedule
    # runs forwards (the losses) with no backward on either rank
    from hyper_parallel_ms import pipelining as pl
    stages = [pl.PipelineStage(st.submodule, st.stage_index, stage_num=st.num_stages, mesh=mesh,
                               has_backward=bool(st.stage_index)) for st in schedule.stages]
    frozen = pl.ScheduleGPipe(stages[0], 4, loss_fn)
    assert frozen.has_backward is False and not frozen.forward_only
    got = frozen.run(*(() if last else (x,)), target=y if last else None)
    if last:
        np.testing.assert_allclose([float(v.asnumpy()) for v in got], want_loss, rtol=RTOL, atol=ATOL)
    with pytest.raises(pl.ScheduleError, match="has_backward=False"):
        frozen.gradients()


def _squared_errors(out, target):
    """A loss_fn that forgets to reduce (a named function: a compiled stage cannot take a lambda)."""
    return (out - target) ** 2


def _one_rank(name: str = "GPipe", loss=loss_fn, n: int = 4, **stage_kwargs):
    """``name``'s schedule over one stage holding all of ``Model(1)``, in this process (a pp mesh of one rank)."""
    from hyper_parallel_ms import pipelining as pl

    ms.set_seed(0)
    return pl.get_schedule_class(name)(pl.PipelineStage(Model(1), 0, 1, **stage_kwargs), n, loss)


def test_step_clears_the_losses_list_as_pytorch():
    """``step(..., losses=losses)`` and ``eval`` clear the list first: two steps of 4 micro-batches
    leave the second step's 4 losses (they were appended: 8), so ``sum(losses)`` is one step's."""
    ms.set_seed(0)
    whole = Model(1)
    schedule = _one_rank()
    losses: list = ["stale"]
    for step in range(2):
        x, y = batch(step, 8)
        schedule.step(x, target=y, losses=losses)
    want = [float(loss_fn(whole(x[2 * m:2 * m + 2]), y[2 * m:2 * m + 2]).asnumpy()) for m in range(4)]
    assert len(losses) == 4
    np.testing.assert_allclose([float(v.asnumpy()) for v in losses], want, rtol=RTOL, atol=ATOL)
    schedule.eval(x, target=y, losses=losses)
    assert len(losses) == 4
    schedule.eval(x, losses=losses)                 # no target: no losses
    assert losses == []
    assert len(schedule.run(x, target=y, losses=["stale"])) == 4


def test_loss_fn_must_be_callable_and_return_one_number():
    """A loss_fn that is not callable is refused when the schedule is built; one returning None, a
    float or a Tensor of several elements is refused at the step (PyNative and compiled stages),
    naming loss_fn and what it returned. A one-element loss of shape (1,) is a loss (PyTorch's too)."""
    with pytest.raises(TypeError, match="ScheduleGPipe: loss_fn must be callable, loss_fn\\(output, target\\) -> a "
                                        "scalar loss Tensor .*got 'mse'"):
        _one_rank(loss="mse")
    with pytest.raises(TypeError, match="ScheduleInterleaved1F1B: loss_fn must be callable"):
        _one_rank("Interleaved1F1B", loss=3)
    x, y = batch(0, 8)
    with pytest.raises(TypeError, match="loss_fn returned None on stage 0; loss_fn\\(output, target\\) must return "
                                        "the micro-batch's loss as a scalar Tensor"):
        _one_rank(loss=lambda out, target: None).step(x, target=y)
    with pytest.raises(TypeError, match="loss_fn returned a float \\(2.0\\) on stage 0"):
        _one_rank(loss=lambda out, target: 2.0).step(x, target=y)
    for jit in (False, True):
        with pytest.raises(ValueError, match=r"loss_fn returned a Tensor of shape \(2, 4\) on stage 0; it must "
                                             r"return the micro-batch's loss as a scalar"):
            _one_rank(loss=_squared_errors, jit=jit).step(x, target=y)
    with pytest.raises(ValueError, match=r"loss_fn returned a Tensor of shape \(2, 4\)"):      # eval too
        _one_rank(loss=_squared_errors).eval(x, target=y)
    scalar, single = _one_rank(), _one_rank(loss=lambda out, target: loss_fn(out, target).reshape(1))
    scalar.step(x, target=y)
    single.step(x, target=y)
    for a, b in zip(scalar.gradients(), single.gradients()):
        np.testing.assert_allclose(a.asnumpy(), b.asnumpy(), rtol=RTOL, atol=ATOL)


def test_stage_arguments_and_mismatched_stages_are_named():
    """PipelineStage(num_stages=0) names num_stages; a micro-batch that does not match input_args
    names input_args; a stage whose Cell cannot take the previous stage's outputs raises naming the
    stage, the shapes it received and from where, around MindSpore's error (two stages on one rank)."""
    from hyper_parallel_ms import pipelining as pl

    cell = nn.Dense(2, 2)
    with pytest.raises(ValueError, match="PipelineStage num_stages must be a positive int, the number of stages of "
                                         "the whole pipeline .*got 0"):
        pl.PipelineStage(cell, 0, 0)
    with pytest.raises(ValueError, match=r"stage_index must be in 0..1 \(num_stages=2\), got 2; pass this rank's "):
        pl.PipelineStage(cell, 2, 2)
    x, y = batch(0, 8)
    schedule = _one_rank(input_args=ms.Tensor(np.zeros((2, 3), np.float32)))
    with pytest.raises(ValueError, match=r"stage 0: a micro-batch's inputs have shapes \(\(2, 6\),\), but the stage "
                                         r"was built with input_args of shapes \(\(2, 3\),\)"):
        schedule.step(x, target=y)

    class Named(nn.Cell):
        """``cell`` under the attribute ``name`` (distinct parameter names per stage)."""

        def __init__(self, name: str, cell: nn.Cell) -> None:
            super().__init__()
            self.key = name
            setattr(self, name, cell)

        def construct(self, h):
            return getattr(self, self.key)(h)
    stages = [pl.PipelineStage(Named("a", nn.Dense(6, 8)), 0, 2), pl.PipelineStage(Named("b", nn.Dense(5, 4)), 1, 2)]
    with pytest.raises(RuntimeError, match=r"stage 1 failed to run its forward and loss_fn on micro-batch 0: "
                                           r"ValueError: For 'MatMul' .*'x1_col': 8 and 'x2_row': 5\.; its inputs "
                                           r"have shapes \[\(2, 8\)\], the outputs of stage 0 on this rank \(and a "
                                           r"target of \[\(2, 4\)\]\); the outputs of stage 0 must be what stage 1's "
                                           r"Cell takes") as info:
        pl.ScheduleInterleaved1F1B(stages, 4, loss_fn).step(x, target=y)
    assert isinstance(info.value.__cause__, ValueError)          # MindSpore's error, chained
    # the failed step dropped its records, the open one of the failed forward included: a later
    # gradient call and recorded block leave nothing recording outside them
    probe, px = nn.Dense(6, 3), ms.Tensor(np.ones((2, 6), np.float32))
    ms.grad(lambda v: probe(v).sum())(px)
    with seam.taped():
        probe(px)
    assert probe(px)._grad_node is None
    stages = [pl.PipelineStage(Named("c", nn.Dense(5, 8)), 0, 1)]
    with pytest.raises(RuntimeError, match=r"stage 0 failed to run its forward on micro-batch 0: .*its inputs have "
                                           r"shapes \[\(2, 6\)\], micro-batch 0 of the batch given to step\(\); the "
                                           r"batch's Tensors must be what stage 0's Cell takes"):
        pl.ScheduleLoopedBFS(stages, 4, None).step(x)
