"""Gradient accumulation over 4 micro-steps equals one step on the 4x batch (loss each step,
parameters after 3 AdamW steps, against one device) for TP with data parallelism (GradientReducer
once, on the summed gradients), fully_shard and hsdp (sync off on 3 micro-steps) and FSDP x TP, on
2 and 4 ranks in PyNative (TP x dp also compiled, ms.jit and GRAPH_MODE); CommDebugMode shows no
data-parallel gradient reduction on the 3 non-sync micro-steps (only the forward all-gathers of the
pieces and TP's own activation collectives run there). Compiled fully_shard accumulation:
tests/test_fsdp_compiled.py (add up reduced steps)."""
from __future__ import annotations

from typing import Callable, List, Optional

from hyper_parallel_ms.comm import CommDebugMode
from hyper_parallel_ms.mesh import init_device_mesh
from hyper_parallel_ms.testing import multi_rank

from tests._fsdp_models import compare
from tests.test_clip_grad_norm import _fsdp, _fsdp_tp, _hsdp

MICRO = 4


def _accumulate(set_sync: Optional[str], log: List, make_reducer: Optional[Callable] = None) -> Callable:
    """compare's ``train``: 4 micro-steps, sync (``set_sync``, a method of the model) on the last only,
    the micro-gradients summed and (``make_reducer``) reduced once; ``log`` gets each micro-step's
    collectives as (synchronised, [(kind, mesh dim)])."""
    reducers = {}

    def train(model, step, x):
        rows = x.shape[0] // MICRO
        total_loss, total = 0.0, None
        for i in range(MICRO):
            if set_sync:
                getattr(model, set_sync)(i == MICRO - 1)
            with CommDebugMode() as mode:
                loss, grads = step(x[i * rows:(i + 1) * rows])
            log.append((i == MICRO - 1, [(r.kind, r.mesh_dim) for r in mode.records]))
            total_loss = total_loss + loss
            total = grads if total is None else tuple(a + b for a, b in zip(total, grads))
        if make_reducer is not None:
            if id(model) not in reducers:
                reducers[id(model)] = make_reducer(model.trainable_params())
            total = reducers[id(model)](total)
        return total_loss / MICRO, tuple(g / MICRO for g in total)
    return train


def _check_quiet(log: List) -> None:
    """No gradient reduction over a data-parallel mesh dim on a non-sync micro-step; some on sync ones."""
    def dp_reductions(records):
        return [r for r in records if r[1] and r[1].startswith("dp") and r[0] != "all_gather"]
    assert log and all(not dp_reductions(records) for synced, records in log if not synced), log
    assert all(dp_reductions(records) for synced, records in log if synced) or not any(s for s, _ in log), log


def _tp_with_reducer(mesh, log):
    from hyper_parallel_ms.nn import ColwiseParallel, GradientReducer, RowwiseParallel, parallelize_module

    def shard(model):
        parallelize_module(model, mesh["tp"], {"layers.*.up": ColwiseParallel(), "layers.*.down": RowwiseParallel()})
    return shard, _accumulate(None, log, lambda params: GradientReducer(params, dp_mesh=mesh, dp_dim="dp"))


@multi_rank(2, timeout=600)
def test_accumulation_on_2_ranks():
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("dp",))
    rank = mesh.get_local_rank(0)
    for shard, sync in ((_fsdp(mesh), "set_requires_gradient_sync"),
                        (_hsdp(optimizer_level="level2", enable_grad_accumulation=True), "set_requires_grad_sync"),
                        (_hsdp(optimizer_level="level1", enable_grad_accumulation=True), "set_requires_grad_sync")):
        log = []
        compare(shard, rank, 2, loss_mesh=mesh, optimizer="adamw", train=_accumulate(sync, log))
        _check_quiet(log)


@multi_rank(4, timeout=600)
def test_accumulation_on_4_ranks():
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    dp_index = mesh.get_coordinate()[0]
    dp_mesh = mesh["dp"]
    log = []
    shard, train = _tp_with_reducer(mesh, log)
    compare(shard, dp_index, 2, loss_mesh=dp_mesh, optimizer="adamw", train=train)
    # the reducer runs once, after the micro-steps: none of them reduces over dp
    assert all(not [r for r in records if r[1] == "dp"] for _, records in log), log
    log = []
    compare(_fsdp_tp(mesh), dp_index, 2, loss_mesh=dp_mesh, optimizer="adamw",
            train=_accumulate("set_requires_gradient_sync", log))
    _check_quiet(log)
    world = init_device_mesh("cpu", (4,), mesh_dim_names=("dp",))
    log = []
    compare(_hsdp(shard_size=2, optimizer_level="level2", enable_grad_accumulation=True), world.get_local_rank(0), 4,
            loss_mesh=world, optimizer="adamw", rows=16, train=_accumulate("set_requires_grad_sync", log))
    _check_quiet(log)


@multi_rank(4, timeout=600)
def test_compiled_accumulation_with_tensor_parallelism_on_4_ranks():
    """TP x dp (2, 2): each micro-step's gradient step compiled (ms.jit, then a GRAPH_MODE Cell),
    the micro-gradients summed and reduced over dp once: equal to one step on the whole batch."""
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    dp_index = mesh.get_coordinate()[0]
    for mode in ("jit", "graph"):
        log = []
        shard, train = _tp_with_reducer(mesh, log)
        compare(shard, dp_index, 2, loss_mesh=mesh["dp"], optimizer="adamw", train=train, mode=mode)
