"""loss_parallel and ParallelCrossEntropy against single-device cross-entropy: loss and
logits gradient (fp32, 1e-5) on 2 ranks, even and uneven class counts, PyNative and ms.jit."""
from __future__ import annotations

import itertools

import mindspore as ms
import numpy as np
from mindspore import mint, nn, ops

from hyper_parallel_ms.comm import CommDebugMode
from hyper_parallel_ms.dtensor import DTensor
from hyper_parallel_ms.layout import chunk_sizes
from hyper_parallel_ms.mesh import init_device_mesh
from hyper_parallel_ms.nn import ParallelCrossEntropy, loss_parallel
from hyper_parallel_ms.placement import Replicate, Shard
from hyper_parallel_ms.testing import multi_rank

ROWS = 6
_ENTRY_POINTS = {
    "ops": lambda x, t, **kw: ops.cross_entropy(x, t, **kw),
    "nn": lambda x, t, **kw: nn.CrossEntropyLoss(**kw)(x, t),
    "mint": lambda x, t, **kw: mint.nn.functional.cross_entropy(x, t, **kw),
}


def _case(classes: int, ignore: bool):
    rng = np.random.default_rng(classes)
    logits = rng.standard_normal((ROWS, classes)).astype(np.float32) * 3
    target = rng.integers(0, classes, ROWS).astype(np.int32)
    if ignore:
        target[[1, 4]] = -100
    weights = rng.standard_normal(ROWS).astype(np.float32)   # for the gradient of reduction="none"
    return logits, target, weights


def _scalar(loss, weights):
    return loss.sum() if loss.ndim == 0 else (loss * ms.Tensor(weights)).sum()


def _reference(logits, target, weights, **kw):
    """Single-device loss and logits gradient (ops.cross_entropy on the whole logits)."""
    def f(x):
        return _scalar(ops.cross_entropy(x, ms.Tensor(target), **kw), weights)
    x = ms.Tensor(logits)
    loss = ops.cross_entropy(x, ms.Tensor(target), **kw).asnumpy()
    return loss, ms.grad(f)(x).asnumpy()


def _piece(array, mesh):
    start = sum(chunk_sizes(array.shape[1], 2)[:mesh.get_local_rank(0)])
    return array[:, start:start + chunk_sizes(array.shape[1], 2)[mesh.get_local_rank(0)]]


def _context_case(mesh, entry, classes, ignore, reduction, smoothing):
    logits, target, weights = _case(classes, ignore)
    kw = dict(reduction=reduction, label_smoothing=smoothing)
    target_dt = DTensor.from_local(ms.Tensor(target), mesh, [Replicate()]) if entry == "nn" else ms.Tensor(target)

    def f(local):
        x = DTensor.from_local(local, mesh, [Shard(1)], shape=logits.shape)
        with loss_parallel():
            loss = _ENTRY_POINTS[entry](x, target_dt, **kw)
        assert isinstance(loss, DTensor) and loss.placements == (Replicate(),)
        return _scalar(loss.to_local(), weights), loss.to_local()
    local = ms.Tensor(np.ascontiguousarray(_piece(logits, mesh)))
    (_, loss), grad = ms.value_and_grad(f, has_aux=True)(local)
    want_loss, want_grad = _reference(logits, target, weights, **kw)
    np.testing.assert_allclose(loss.asnumpy(), want_loss, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(grad.asnumpy(), _piece(want_grad, mesh), rtol=1e-5, atol=1e-5)


def _all_context_cases():
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    done = 0
    for entry, reduction, ignore, smoothing in itertools.product(_ENTRY_POINTS, ("mean", "sum", "none"),
                                                                 (False, True), (0.0, 0.1)):
        classes = 7 if done % 2 else 8          # uneven and even pieces
        try:
            _context_case(mesh, entry, classes, ignore, reduction, smoothing)
        except AssertionError as error:
            raise AssertionError(f"{entry} reduction={reduction} ignore={ignore} smoothing={smoothing} "
                                 f"classes={classes}: {error}") from error
        done += 1
    return done


@multi_rank(2)
def test_loss_parallel_entry_points_match_single_device():
    assert _all_context_cases() == 36


def _cell_case(mesh, jit, reduction, smoothing, classes, all_ignored=False):
    logits, target, weights = _case(classes, True)
    if all_ignored:          # a batch of padding only: loss nan (0 / 0) and gradient 0, as one device
        target[:] = -100
    cell = ParallelCrossEntropy(mesh, num_classes=classes, reduction=reduction, label_smoothing=smoothing)

    def f(local, t):
        loss = cell(local, t)
        return _scalar(loss, weights), loss
    step = ms.value_and_grad(f, has_aux=True)
    if jit:
        step = ms.jit(step)
    (_, loss), grad = step(ms.Tensor(np.ascontiguousarray(_piece(logits, mesh))), ms.Tensor(target))
    want_loss, want_grad = _reference(logits, target, weights, reduction=reduction, label_smoothing=smoothing)
    np.testing.assert_allclose(loss.asnumpy(), want_loss, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(grad.asnumpy(), _piece(want_grad, mesh), rtol=1e-5, atol=1e-5)


def _cell_cases():
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    _cell_case(mesh, False, "mean", 0.1, 7)
    _cell_case(mesh, False, "none", 0.0, 8)
    _cell_case(mesh, True, "mean", 0.1, 7)
    _cell_case(mesh, True, "sum", 0.0, 8)
    _cell_case(mesh, False, "mean", 0.0, 3)    # pieces of 2 and 1 classes
    _cell_case(mesh, False, "mean", 0.1, 7, all_ignored=True)
    _cell_case(mesh, True, "mean", 0.0, 8, all_ignored=True)
    return True


@multi_rank(2)
def test_parallel_cross_entropy_cell_pynative_and_jit():
    assert _cell_cases()


def _raises(kind, words, fn, *args):
    try:
        fn(*args)
    except kind as error:
        assert words in str(error), error
    else:
        raise AssertionError(f"expected {kind.__name__} mentioning {words!r}")


def _comm_check():
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    logits, target, _ = _case(8, True)
    x = DTensor.from_local(ms.Tensor(np.ascontiguousarray(_piece(logits, mesh))), mesh, [Shard(1)], shape=logits.shape)
    with CommDebugMode() as inside:
        with loss_parallel():
            inside_loss = ops.cross_entropy(x, ms.Tensor(target), label_smoothing=0.1).full_tensor()
    with CommDebugMode() as outside:
        outside_loss = ops.cross_entropy(x.full_tensor(), ms.Tensor(target), label_smoothing=0.1)
    np.testing.assert_allclose(inside_loss.asnumpy(), outside_loss.asnumpy(), rtol=1e-5, atol=1e-5)
    original = ops.cross_entropy
    with loss_parallel():
        assert ops.cross_entropy is not original
    assert ops.cross_entropy is original            # restored; outside, the op rules compute it (as PyTorch)
    np.testing.assert_allclose(ops.cross_entropy(x, ms.Tensor(target)).full_tensor().asnumpy(),
                               ops.cross_entropy(x.full_tensor(), ms.Tensor(target)).asnumpy(), rtol=1e-5)
    with loss_parallel():
        _raises(NotImplementedError, "class weights", ops.cross_entropy, x, ms.Tensor(target),
                ms.Tensor(np.ones(8, np.float32)))
        _raises(ValueError, "replicated targets", ops.cross_entropy, x, DTensor.from_local(
            ms.Tensor(target[3 * mesh.get_local_rank(0):][:3]), mesh, [Shard(0)]))
    with loss_parallel():
        _raises(ValueError, "class indices in [0, 8)", ops.cross_entropy, x, ms.Tensor(np.full(ROWS, 8, np.int32)))
    _raises(ValueError, "(N, 6) local logits", ParallelCrossEntropy(mesh, num_classes=12), x.to_local(),
            ms.Tensor(target))
    counts = inside.get_comm_counts()
    return {str(k): v for k, v in counts.items()}, {str(k): v for k, v in outside.get_comm_counts().items()}


@multi_rank(2)
def test_loss_parallel_gathers_no_logits():
    inside, outside = _comm_check()
    assert not any("gather" in k for k in inside), inside
    assert sum(v for k, v in inside.items() if "all_reduce" in k) == 4, inside
    assert any("gather" in k for k in outside), outside
