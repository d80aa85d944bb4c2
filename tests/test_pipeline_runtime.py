"""The pipeline runtime on CPU ranks: every schedule, on 2 and 4 ranks, with num_stages, more and
(where the schedule allows) fewer micro-batches, gives each micro-batch's loss, the gradients
and the parameters after 3 AdamWeightDecay steps of the single-device model on the whole batch;
one forward per stage and micro-batch; shapes re-found when the batch shape changes; the
error cases raise on every rank (never a hang)."""
from __future__ import annotations

import mindspore as ms
import numpy as np
import pytest
from mindspore import nn

from hyper_parallel_ms.testing import multi_rank
from tests._pipeline_models import (ATOL, BATCHES, IN, OUT, RTOL, RUNTIME_SCHEDULES, SCHEDULES, STAGES_PER_RANK, WIDTH,
                                    Block, Model, batch, loss_fn, make_schedule, one_device_run, optimizer)


def _check_parity(name: str, n: int, jit: bool = False, stages_per_rank=None) -> None:
    from hyper_parallel_ms.mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (ms.communication.get_group_size(),), mesh_dim_names=("pp",))
    schedule, models = make_schedule(name, mesh, n, jit=jit, stages_per_rank=stages_per_rank)
    num_stages = schedule.plan.num_stages
    history, final = one_device_run(num_stages, n)
    first, last = schedule.stages[0].is_first, schedule.stages[-1].is_last
    params = schedule.parameters()
    names = [p.name for p in params]
    assert len(set(names)) == len(names) and set(names) <= set(final), names      # full-model names
    opt = optimizer(params)
    for step, size in enumerate(BATCHES):
        x, y = batch(step, size)
        losses: list = []
        runs_before = [m.forwards() for m in models]
        eager_before = [m.eager_forwards() for m in models]
        out = schedule.step(*((x,) if first else ()), target=y if last else None, losses=losses)
        # activations held: GPipe every micro-batch, 1F1B at most the stages from here to the last
        live = schedule.step_stats.peak_live_forwards
        me = mesh.get_local_rank()
        if name == "GPipe":
            assert live == n, (live, n)
        elif name == "1F1B":
            assert live == min(n, mesh.size() - me), (live, n, me)
        # one forward per block and micro-batch, PyNative or compiled: the backward reuses the forward's record
        ran = [m.forwards() - r for m, r in zip(models, runs_before)]
        assert ran == [n * len(m.layers) for m in models], ran
        assert [m.eager_forwards() - e for m, e in zip(models, eager_before)] == ([0] * len(models) if jit else ran)
        want_losses, want_grads = history[step]
        if last:
            np.testing.assert_allclose([float(v.asnumpy()) for v in losses], want_losses, rtol=RTOL, atol=ATOL,
                                       err_msg=f"{name}, n={n}: micro-batch losses, step {step}")
            assert out.shape == (size, OUT)
        else:
            assert out is None and losses == []
        for p, g in zip(params, schedule.gradients()):
            np.testing.assert_allclose(g.asnumpy(), want_grads[p.name], rtol=RTOL, atol=ATOL,
                                       err_msg=f"{name}, n={n}: gradient of {p.name}, step {step}")
        opt(schedule.gradients())
    for p in params:
        np.testing.assert_allclose(p.asnumpy(), final[p.name], rtol=RTOL, atol=ATOL,
                                   err_msg=f"{name}, n={n}: {p.name} after {len(BATCHES)} AdamWeightDecay steps")
    assert schedule.forward_calls == len(schedule.stages) * n * len(BATCHES)


class MaskedModel(Model):
    """``Model`` whose first stage takes its input transposed, ``(IN, rows)``, and keyword inputs:
    ``masks``, nested Tensors (``scale`` of ``(rows, IN)``, ``bias`` a list of one ``(IN, rows)``),
    and a float ``shift`` (given to every micro-batch)."""

    def construct(self, x, masks=None, shift=0.0):
        if masks is not None:                # stage 0 (and the one-device model)
            x = x.T * masks["scale"] + masks["bias"][0].T + shift
        return super().construct(x)


@pytest.mark.parametrize("name,n,jit", [("1F1B", 3, False), ("ZBVZeroBubble", 3, False), ("GPipe", 4, True)])
@multi_rank(2)
def test_uneven_microbatches_and_keyword_inputs_equal_one_device(name, n, jit):
    """Batches of 7 and 10 rows that do not split evenly (torch.tensor_split's chunks: 3, 2, 2 and
    4, 3, 3 over 3; 2, 2, 2, 1 and 3, 3, 2, 2 over 4) and keyword inputs of stage 0 (a dict holding a
    Tensor and a list of one, each split with the batch as PyTorch's tree split; a float given to each
    micro-batch), the input and one mask split along dim 1 (PyTorch's args_chunk_spec /
    kwargs_chunk_spec with TensorChunkSpec), PyTorch's eval (forwards only, with and without a
    target) and step(return_outputs=False) between the steps: each micro-batch's loss, the full-batch
    gradients (micro-batch m weighs rows_m / rows) and the parameters after 2 AdamWeightDecay steps
    equal one device."""
    from hyper_parallel_ms import pipelining as pl
    from hyper_parallel_ms.mesh import init_device_mesh
    from hyper_parallel_ms.pipelining._microbatch import chunk_sizes

    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("pp",))
    v = STAGES_PER_RANK[name]
    num_stages = 2 * v
    ms.set_seed(0)
    reference = MaskedModel(num_stages)
    params = reference.trainable_params()
    ref_opt = optimizer(params)
    stages = []
    for s in pl.build_plan(name, 2, num_stages, stages_per_rank=v).stages_of(mesh.get_local_rank()):
        ms.set_seed(0)
        model = pl.split_blocks(MaskedModel(num_stages), s, num_stages, first=("embed",), last=("head",))
        stages.append(pl.PipelineStage(model, s, num_stages, mesh=mesh, jit=jit))
    cls = {"GPipe": pl.ScheduleGPipe, "1F1B": pl.Schedule1F1B, "ZBVZeroBubble": pl.ScheduleZBVZeroBubble}[name]
    if name == "1F1B":         # HyperParallel's names: micro_batch_num, args_batch_dim, kwargs_batch_dim
        schedule = cls(stages[0], micro_batch_num=n, loss_fn=loss_fn, args_batch_dim=[pl.BatchDimSpec(1)],
                       kwargs_batch_dim={"masks": {"scale": pl.BatchDimSpec(0), "bias": [pl.BatchDimSpec(1)]}},
                       overlap_p2p=True)
    else:
        schedule = cls(stages[0] if v == 1 else stages, n, loss_fn, (pl.TensorChunkSpec(1),),
                       {"masks": {"scale": pl.TensorChunkSpec(0), "bias": [pl.TensorChunkSpec(1)]}})
    first, last = schedule.stages[0].is_first, schedule.stages[-1].is_last
    opt = optimizer(schedule.parameters())
    for step, size in enumerate((7, 10)):
        x, y = batch(step, size)
        x = x.T                                                       # (IN, rows): split along dim 1
        mask, bias = (ms.Tensor(np.random.RandomState(7 + step + k).rand(size, IN).astype(np.float32)) for k in (0, 9))
        bias = bias.T
        bounds = [int(b) for b in np.cumsum([0] + chunk_sizes(size, n))]
        want_losses = [float(loss_fn(reference(x[:, a:b], masks={"scale": mask[a:b], "bias": [bias[:, a:b]]},
                                               shift=0.5), y[a:b]).asnumpy()) for a, b in zip(bounds[:-1], bounds[1:])]
        masks = {"scale": mask, "bias": [bias]}
        _, want = ms.value_and_grad(lambda x, y: loss_fn(reference(x, masks=masks, shift=0.5), y), None, params)(x, y)
        want = {p.name: g.asnumpy() for p, g in zip(params, want)}
        ref_opt(tuple(ms.Tensor(want[p.name]) for p in params))
        losses: list = []
        out = schedule.step(*((x,) if first else ()), target=y if last else None, losses=losses,
                            **(dict(masks=masks, shift=0.5) if first else {}))
        if last:
            assert out.shape == (size, OUT)
            np.testing.assert_allclose([float(v.asnumpy()) for v in losses], want_losses, rtol=RTOL, atol=ATOL)
        for p, g in zip(schedule.parameters(), schedule.gradients()):
            np.testing.assert_allclose(g.asnumpy(), want[p.name], rtol=RTOL, atol=ATOL, err_msg=f"{p.name}, {size}")
        opt(schedule.gradients())
        # PyTorch's eval: forwards only, with the updated parameters; losses where a target is given,
        # the merged outputs; the step's gradients are kept
        after = [float(loss_fn(reference(x[:, a:b], masks={"scale": mask[a:b], "bias": [bias[:, a:b]]}, shift=0.5),
                               y[a:b]).asnumpy()) for a, b in zip(bounds[:-1], bounds[1:])]
        for with_target in (True, False):
            eval_losses: list = []
            out = schedule.eval(*((x,) if first else ()), target=y if last and with_target else None,
                                losses=eval_losses, **(dict(masks=masks, shift=0.5) if first else {}))
            if last:
                np.testing.assert_allclose(out.asnumpy(), reference(x, masks=masks, shift=0.5).asnumpy(), rtol=RTOL,
                                           atol=ATOL)
                np.testing.assert_allclose([float(v.asnumpy()) for v in eval_losses], after if with_target else [],
                                           rtol=RTOL, atol=ATOL)
        for p, g in zip(schedule.parameters(), schedule.gradients()):
            np.testing.assert_allclose(g.asnumpy(), want[p.name], rtol=RTOL, atol=ATOL, err_msg=f"{p.name} after eval")
        assert schedule.step(*((x,) if first else ()), target=y if last else None, return_outputs=False,
                             **(dict(masks=masks, shift=0.5) if first else {})) is None
        ref_opt(tuple(ms.Tensor(g) for g in ms.value_and_grad(
            lambda x, y: loss_fn(reference(x, masks=masks, shift=0.5), y), None, params)(x, y)[1]))
        opt(schedule.gradients())
    final = {p.name: p.asnumpy() for p in params}
    for p in schedule.parameters():
        np.testing.assert_allclose(p.asnumpy(), final[p.name], rtol=RTOL, atol=ATOL, err_msg=p.name)


def _microbatch_counts(name: str, pp: int):
    """num_stages, more, and fewer where the schedule allows it (1F1B and DualPipeV refuse fewer)."""
    stages = pp * STAGES_PER_RANK[name]
    return (stages, 2 * stages if 2 * stages <= 12 else 12) + (() if name in ("1F1B", "DualPipeV") else (stages // 2,))


@pytest.mark.parametrize("name", SCHEDULES)
@multi_rank(2)
def test_every_schedule_equals_one_device_on_two_ranks(name):
    """The looped schedules also with one stage per rank (their one-stage forms, as PyTorch runs them)."""
    for n in _microbatch_counts(name, 2):
        _check_parity(name, n)
    if name in ("Interleaved1F1B", "LoopedBFS", "InterleavedZeroBubble"):
        _check_parity(name, 3, stages_per_rank=1)


@pytest.mark.parametrize("name", RUNTIME_SCHEDULES)
@multi_rank(4)
def test_every_schedule_equals_one_device_on_four_ranks(name):
    for n in _microbatch_counts(name, 4):
        _check_parity(name, n)


@pytest.mark.parametrize("name", RUNTIME_SCHEDULES)
@multi_rank(2)
def test_compiled_stages_equal_one_device_on_two_ranks(name):
    """jit=True: each micro-batch's stage forward (and loss) one ms.jit graph, its backward that
    graph's compiled backward; one graph run per block and micro-batch, none as Python."""
    counts = _microbatch_counts(name, 2)
    for n in (counts[0], counts[-1]):         # num_stages, and fewer (more for 1F1B)
        _check_parity(name, n, jit=True)


@multi_rank(2)
def test_errors_raise_on_every_rank():
    from hyper_parallel_ms import pipelining as pl
    from hyper_parallel_ms.mesh import init_device_mesh
    from hyper_parallel_ms.pipelining import PipelineError, ScheduleError

    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("pp",))
    me = mesh.get_local_rank()
    # a batch that does not split: only stage 0's rank sees it, every rank raises
    schedule, _ = make_schedule("1F1B", mesh, 2)
    x, y = batch(0, 5)
    with pytest.raises(ValueError, match=r"first stage's input 0 \(positional arguments, then keyword arguments, nested "
                                         r"tuples, lists and dicts flattened\) "
                                         "has batch size 1, fewer rows than 2 micro-batches"):
        schedule.step(*((x[:1],) if me == 0 else ()), target=y[:1] if me == 1 else None)
    # an uneven split pairs chunks only when every Tensor has the batch's rows (an even one allows a
    # target of another length, e.g. one row per token)
    with pytest.raises(ValueError, match=r"does not split evenly into 2 micro-batches needs the same rows in every "
                                         r"Tensor .*, got \[4, 5\]"):
        schedule.step(*((x,) if me == 0 else ()), target=y if me == 1 else None, mask=x[:4])
    with pytest.raises(ValueError, match=r"got \[4, 5\]"):
        schedule.step(*((x,) if me == 0 else ()), target=y[:4] if me == 1 else None)
    with pytest.raises(ValueError, match="first stage's input 0 .* is a 0-d Tensor"):
        schedule.step(*((x[0, 0],) if me == 0 else ()), target=y if me == 1 else None)
    # a chunk spec that does not fit stage 0's inputs: its rank names the spec, the other raises too
    schedule.args_chunk_spec = (pl.TensorChunkSpec(2),)
    with pytest.raises(ValueError, match=r"input 0: TensorChunkSpec\(2\) does not fit a Tensor of shape \(5, 6\)"
                                         if me == 0 else "do not fit args_chunk_spec / kwargs_chunk_spec"):
        schedule.step(*((x,) if me == 0 else ()), target=y if me == 1 else None)
    schedule.args_chunk_spec = None
    x, y = batch(0, 4)
    with pytest.raises(ValueError, match="last stage's target has batch size 1, fewer rows than 2"):
        schedule.step(*((x,) if me == 0 else ()), target=y[:1] if me == 1 else None)
    with pytest.raises(ValueError, match="rank holding the last stage got no target"):
        schedule.step(*((x,) if me == 0 else ()))
    losses: list = []
    schedule.step(*((x,) if me == 0 else ()), target=y if me == 1 else None, losses=losses)   # still usable
    assert len(losses) == (2 if me == 1 else 0)
    # fewer micro-batches than 1F1B allows: refused at construction
    with pytest.raises(ScheduleError, match="1F1B needs at least as many micro-batches as stages: got 1"):
        make_schedule("1F1B", mesh, 1)
    # a stage count that does not fit the mesh
    with pytest.raises(ScheduleError, match="3 stages do not fit the pp mesh of 2 ranks with 1 stage"):
        make_schedule("GPipe", mesh, 2, num_stages=3, stage_of=(me,))
    # a stage on the wrong rank (rank 0 holds stage 1 too): named on every rank
    with pytest.raises(ScheduleError, match=r"rank 0 must hold stages \(0,\)"):
        make_schedule("GPipe", mesh, 2, stage_of=(1,))
    # no loss_fn on the last stage's rank: forward only on every rank (PyTorch's); a target or a request
    # for gradients is refused, naming loss_fn
    forward_only, _ = make_schedule("GPipe", mesh, 2, loss=loss_fn if me == 0 else None)
    assert forward_only.forward_only
    with pytest.raises(ValueError, match="the last stage got a target, but the schedule has no loss_fn"):
        forward_only.step(*((x,) if me == 0 else ()), target=y if me == 1 else None)
    with pytest.raises(ScheduleError, match="runs forward only: no gradients"):
        forward_only.gradients()
    with pytest.raises(TypeError, match=r"needs n_microbatches \(PyTorch\) or micro_batch_num \(HyperParallel\)"):
        make_schedule("GPipe", mesh, None)

    # stages built separately with one parameter name each (an untied copy, or a weight tied across the
    # stages but not listed in shared_parameters): every rank raises, naming the fix
    def separate(model):
        model.layers = nn.CellList([Block()])                    # "layers.0.dense.weight" on both ranks
    with pytest.raises(ScheduleError, match=r"held by several stages: this rank \(pp rank \d\) holds "
                                            r"\['layers.0.dense.bias', 'layers.0.dense.weight'.*shared_parameters"):
        make_schedule("GPipe", mesh, 2, prepare=separate)
    # clipping by one stage's parameters (not the schedule): refused, naming the schedule
    from hyper_parallel_ms.training import clip_grad_norm
    schedule, _ = make_schedule("GPipe", mesh, 2)
    schedule.step(*((x,) if me == 0 else ()), target=y if me == 1 else None)
    with pytest.raises(ValueError, match=r"parameters of one pipeline stage.*pass the schedule itself"):
        clip_grad_norm(schedule.gradients(), 1.0, parameters=schedule.parameters())
    clip_grad_norm(schedule.gradients(), 1.0, parameters=schedule)
    # PyTorch's PipelineStage arguments: device, input_args / output_args (checked each micro-batch), group
    ms.set_seed(0)
    model = pl.split_blocks(Model(2), me, 2, first=("embed",), last=("head",))
    good = (ms.Tensor(np.zeros((2, IN), np.float32)),) if me == 0 else (ms.Tensor(np.zeros((2, WIDTH), np.float32)),)
    stage = pl.PipelineStage(model, me, 2, "cpu", input_args=good, group=mesh)
    pl.ScheduleGPipe(stage, 2, loss_fn).step(*((x,) if me == 0 else ()), target=y if me == 1 else None)
    x5, y5 = batch(1, 5)      # micro-batches of 3 and 2 rows: input_args' rows (dim 0) are not compared
    pl.ScheduleGPipe(stage, 2, loss_fn).step(*((x5,) if me == 0 else ()), target=y5 if me == 1 else None)
    bad = pl.PipelineStage(model, me, 2, "cpu", input_args=ms.Tensor(np.zeros((3, 1), np.float32)), group=mesh)
    # the stage's rank raises the check's ValueError, the other rank a PipelineError naming it
    with pytest.raises((ValueError, PipelineError), match=r"stage 0: a micro-batch's inputs have shapes \(\(2, 6\),\)"):
        pl.ScheduleGPipe(bad, 2, loss_fn).step(*((x,) if me == 0 else ()), target=y if me == 1 else None)
    # stages that do not fit together (stage 0 sends WIDTH features, stage 1 takes 5): rank 1 names the stage,
    # the shapes it received and from where around MindSpore's MatMul error, rank 0 a PipelineError carrying it
    narrow = pl.PipelineStage(model if me == 0 else nn.Dense(5, OUT), me, 2, mesh=mesh)
    with pytest.raises(RuntimeError, match=r"stage 1 failed to run its forward and loss_fn on micro-batch 0: "
                                           r"ValueError: For 'MatMul' .*'x1_col': 8 and 'x2_row': 5\.; its inputs "
                                           r"have shapes \[\(2, 8\)\], received from stage 0 on pp rank 0"):
        pl.ScheduleGPipe(narrow, 2, loss_fn).step(*((x,) if me == 0 else ()), target=y if me == 1 else None)
    with pytest.raises(ValueError, match="runs on 'cpu' devices"):
        pl.PipelineStage(model, me, 2, "npu:0", mesh=mesh)
    with pytest.raises(NotImplementedError, match="dw_builder"):
        pl.PipelineStage(model, me, 2, dw_builder=lambda: None, mesh=mesh)


def test_split_blocks_keeps_full_model_names_and_even_shares():
    from hyper_parallel_ms.pipelining import split_blocks

    ms.set_seed(0)
    full = [p.name for p in Model(5).trainable_params()]
    shares = []
    for s in range(2):
        ms.set_seed(0)
        model = split_blocks(Model(5), s, 2, first=("embed",), last=("head",))
        shares.append([p.name for p in model.trainable_params()])
        # the other stage's layers: pass-through Cells (a construct needs no None checks)
        assert [type(model.embed).__name__, type(model.head).__name__] == (
            ["Dense", "PassThrough"] if s == 0 else ["PassThrough", "Dense"])
        # Cell paths (state-dict keys, checkpoints) are the full model's too; indexing stays positional
        assert [name for name, p in model.parameters_and_names() if p.requires_grad] == shares[-1]
        assert model.layers[0] is list(model.layers)[0] and len(model.layers) == (3 if s == 0 else 2)
    assert shares[0] + shares[1] == full and "layers.3.dense.weight" in shares[1] and len(shares[0]) == 2 + 3 * 2
    with pytest.raises(ValueError, match="5 blocks cannot make 6 stages"):
        split_blocks(Model(5), 0, 6)
    with pytest.raises(TypeError, match=r"Model.embed must be an nn.CellList or nn.SequentialCell"):
        split_blocks(Model(5), 0, 2, blocks="embed")


def test_split_blocks_splits_a_third_party_model_at_dotted_paths():
    """MindSpore's nn.TransformerEncoder inside a model whose construct knows nothing about stages:
    ``blocks="encoder.layers"``, the embedding and the head replaced by pass-through Cells on the
    stages that drop them, every kept name the full model's; a refused call leaves the model as it was."""
    from hyper_parallel_ms.pipelining import split_blocks
    from hyper_parallel_ms.pipelining._split import PassThrough
    from tests._pipeline_models import D_MODEL, SEQ, EncoderModel

    ms.set_seed(0)
    full = EncoderModel()
    names = [p.name for p in full.trainable_params()]
    cells = [name for name, _ in full.cells_and_names()]
    hidden = ms.Tensor(np.random.RandomState(0).randn(3, SEQ, D_MODEL).astype(np.float32))
    kept = []
    for s in range(2):
        ms.set_seed(0)
        model = split_blocks(EncoderModel(), s, 2, blocks="encoder.layers", first=("embed",),
                             last=("encoder.norm", "head"))
        kept.append([p.name for p in model.trainable_params()])
        assert [name for name, p in model.parameters_and_names() if p.requires_grad] == kept[-1]
        assert {name for name, _ in model.cells_and_names()} <= set(cells)          # Cell paths: the full model's
        assert list(model.encoder.layers.name_cells()) == [str(s)]             # block s under its own key
        dropped = {"embed": model.embed, "encoder.norm": model.encoder.norm, "head": model.head}
        passing = {path for path, cell in dropped.items() if isinstance(cell, PassThrough)}
        assert passing == ({"encoder.norm", "head"} if s == 0 else {"embed"})
        assert all(dropped[path].replaces == path for path in passing)
        assert model.embed(hidden, None, key=1) is hidden if s == 1 else model.head(hidden) is hidden
    assert kept[0] + kept[1] == names                     # every parameter on one stage, in the full model's order
    assert "encoder.layers.1.self_attn.in_proj_weight" in kept[1] and "embed.embedding_table" in kept[0]
    # one tensor-parallel plan for every stage: a key naming a layer another stage runs is skipped here, no warning
    import warnings

    from hyper_parallel_ms.mesh import init_device_mesh
    from hyper_parallel_ms.nn import ColwiseParallel, RowwiseParallel, parallelize_module
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        parallelize_module(model, init_device_mesh("cpu", (1,), mesh_dim_names=("tp",)),
                           {"embed": RowwiseParallel(), "head": ColwiseParallel()})
    assert isinstance(model.embed, PassThrough)
    # a missing step of a dotted path is named; the model is left as it was
    model = EncoderModel()
    with pytest.raises(AttributeError, match=r"blocks='encoder.blocks': EncoderModel.encoder has no attribute "
                                             r"'blocks'; its child Cells are \['layers', 'norm'\]"):
        split_blocks(model, 0, 2, blocks="encoder.blocks")
    with pytest.raises(AttributeError, match=r"last='decoder.norm': EncoderModel has no Cell 'decoder'"):
        split_blocks(model, 0, 2, blocks="encoder.layers", last=("decoder.norm",))
    with pytest.raises(TypeError, match=r"first must be a tuple of attribute paths, got the string 'embed'"):
        split_blocks(model, 1, 2, blocks="encoder.layers", first="embed")
    assert [p.name for p in model.trainable_params()] == names and len(model.encoder.layers) == 2
    assert isinstance(model.embed, nn.Embedding)


def _stage_raises_mid_step(at: str) -> None:
    """Two 1F1B steps on 2 ranks (4 micro-batches); in the second, the action ``at`` (e.g. "1F1")
    raises on the rank holding its stage."""
    from hyper_parallel_ms.mesh import init_device_mesh
    from hyper_parallel_ms.pipelining import Action, F

    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("pp",))
    schedule, _ = make_schedule("1F1B", mesh, 4)
    target = Action.parse(at)
    runtime = schedule._runtime                      # pylint: disable=protected-access  (fault injection)
    name = "_forward" if target.kind is F else "_backward"
    original = getattr(runtime, name)

    def faulty(s: int, m: int) -> None:
        if faulty.armed and (s, m) == (target.stage, target.microbatch):
            raise RuntimeError(f"fault injected at {target}")
        original(s, m)
    faulty.armed = False
    setattr(runtime, name, faulty)
    first = mesh.get_local_rank() == 0
    for step in range(2):
        x, y = batch(step, 8)
        faulty.armed = step == 1
        schedule.step(*((x,) if first else ()), target=None if first else y)


@pytest.mark.parametrize("at", ["1F1",     # rank 0 waits in recv for 1B0's gradient
                                "0B3"])    # rank 1 has finished its list: it learns in the step's agreement
def test_a_stage_raising_mid_step_makes_every_rank_raise(at):
    """No rank waits for the failed one: it raises its own error, the other (blocked in recv or
    done) a PipelineError naming the failed rank, its action and its error, within the harness's
    3 s grace (the pool restarts after)."""
    from hyper_parallel_ms.testing import RankFailure, run_on_ranks

    with pytest.raises(RankFailure) as info:
        run_on_ranks(_stage_raises_mid_step, 2, at, timeout=120)
    text = str(info.value)
    failed, other = int(at[0]), 1 - int(at[0])
    assert "hung" not in text and "rank 0 raised" in text and "rank 1 raised" in text, text
    parts = dict(enumerate(text.split("rank 0 raised:")[1].split("rank 1 raised:")))
    own, told = parts[failed], parts[other]
    assert f"RuntimeError: fault injected at {at}" in own, own
    assert (f"PipelineError: pipeline step failed: pp rank {failed} at {at}: RuntimeError: fault injected at {at}"
            in told), told
