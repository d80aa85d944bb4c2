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
from mindspore.mint import distributed as dist

from hyper_parallel_ms import checkpoint as dcp
from hyper_parallel_ms import comm
from hyper_parallel_ms.fsdp import fully_shard
from hyper_parallel_ms.mesh import init_device_mesh
from hyper_parallel_ms.nn import ColwiseParallel, GradientReducer, RowwiseParallel, parallelize_module
from hyper_parallel_ms.testing import multi_rank

from tests._fsdp_models import Net, batch, loss_of, make_optimizer
from tests._parity import ADAMW_LR, ZERO_GRAD, _compare_after_steps, adamw_noise_bound

WORLD, SAVED_AT, STEPS, TOL = 2, 3, 6, 1e-5


def _shared_dir() -> str:
    out = [None] * WORLD
    dist.all_gather_object(out, tempfile.mkdtemp(prefix="hpms_ckpt2_") if ms.communication.get_rank() == 0 else None)
    return out[0]


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
