"""Parity of a parallelized model with the same model on one device: forward loss, every
parameter's gradient (gathered), and parameters after optimizer steps."""
from __future__ import annotations

from typing import Callable, Optional

import mindspore as ms
import numpy as np
from mindspore import nn

from hyper_parallel_ms import comm
from hyper_parallel_ms.dtensor import DTensor
from hyper_parallel_ms.nn import GradientReducer, parameter_sharding


def gathered(param, value) -> np.ndarray:
    """The whole of ``value`` (a gradient or the parameter itself) from every rank's piece."""
    sharding = parameter_sharding(param)
    if sharding is None:
        return value.asnumpy()
    spec = sharding.spec
    piece = DTensor.from_local(ms.Tensor(value.asnumpy()), spec.mesh, spec.layout, shape=spec.shape)
    return piece.full_tensor().asnumpy()


def check_parity(make_model: Callable[[], nn.Cell], parallelize: Callable[[nn.Cell], None], batch_of: Callable,
                 loss_of: Callable, *, optimizer: str = "sgd", steps: int = 5, dp_mesh=None, dp_dim=None,
                 dp_index: int = 0, dp_size: int = 1, tol: float = 1e-5, jit: bool = False) -> Optional[float]:
    """``batch_of(dp_index, dp_size)`` gives this data-parallel rank's batch (``(0, 1)``: the whole)."""
    ms.set_seed(0)
    ref = make_model()
    ms.set_seed(0)
    par = make_model()
    parallelize(par)
    ref_params, par_params = ref.trainable_params(), par.trainable_params()
    assert [p.name for p in ref_params] == [p.name for p in par_params]
    reducer = GradientReducer(par_params, dp_mesh=dp_mesh, dp_dim=dp_dim)

    def make_opt(params):
        if optimizer == "sgd":
            return nn.SGD(params, learning_rate=0.1)
        return nn.AdamWeightDecay(params, learning_rate=0.01, weight_decay=0.01)
    ref_opt, par_opt = make_opt(ref_params), make_opt(par_params)

    def ref_loss(*batch):
        return loss_of(ref, *batch)

    def par_loss(*batch):
        return loss_of(par, *batch)
    ref_step = ms.value_and_grad(ref_loss, None, ref_params)
    par_step = ms.value_and_grad(par_loss, None, par_params)

    def par_train(*batch):
        loss, grads = par_step(*batch)
        return loss, reducer(grads)
    if jit:
        par_train = ms.jit(par_train)
    first = None
    for step in range(steps):
        full_batch = batch_of(0, 1, step)
        local_batch = batch_of(dp_index, dp_size, step)
        loss, grads = ref_step(*full_batch)
        p_loss, p_grads = par_train(*local_batch)
        if dp_mesh is not None:
            p_loss = comm.all_reduce(p_loss, dp_mesh, dp_dim, op="avg")
        np.testing.assert_allclose(p_loss.asnumpy(), loss.asnumpy(), rtol=tol, atol=tol, err_msg=f"loss, step {step}")
        if step == 0:
            first = float(loss.asnumpy())
            for p, g, rg in zip(par_params, p_grads, grads):
                np.testing.assert_allclose(gathered(p, g), rg.asnumpy(), rtol=tol, atol=tol,
                                           err_msg=f"gradient of {p.name}")
        ref_opt(grads)
        par_opt(p_grads)
    for p, rp in zip(par_params, ref_params):
        np.testing.assert_allclose(gathered(p, p), rp.asnumpy(), rtol=tol, atol=tol,
                                   err_msg=f"{p.name} after {steps} {optimizer} steps")
    return first
