"""all_finite: one skip-or-step verdict for every rank. A forced overflow (inf) on ONE rank's
gradients skips the step on every rank and MindSpore's DynamicLossScaler lowers the scale on
every rank, so the sharded model stays equal to the one-device run that skips that step; MindSpore's
per-rank amp.all_finite would let the other ranks step. PyNative and ms.jit, one all-reduce."""
from __future__ import annotations

import mindspore as ms
import numpy as np
from mindspore import amp, nn

from hyper_parallel_ms.comm import CommDebugMode
from hyper_parallel_ms.mesh import init_device_mesh
from hyper_parallel_ms.testing import multi_rank

from tests._fsdp_models import Net, batch, loss_of
from tests._parity import gathered
from tests.test_clip_grad_norm import _fsdp_tp

OVERFLOW_STEP, STEPS = 1, 3


def _train(model, rows, overflow_here: bool, check, jit: bool):
    """STEPS scaled AdamW steps, an inf in the gradients at OVERFLOW_STEP where ``overflow_here``;
    returns the scale after each step and whether each step was taken."""
    params = model.trainable_params()
    optimizer = nn.AdamWeightDecay(params, learning_rate=0.01)
    scaler = amp.DynamicLossScaler(2.0 ** 10, 2, 1000)

    def scaled_loss(x):
        return scaler.scale(loss_of(model, x))
    grad_fn = ms.value_and_grad(scaled_loss, None, params)

    def verdict(grads):
        finite = check(grads)
        scaler.adjust(finite)
        return finite
    if jit:
        verdict = ms.jit(verdict)
    scales, stepped = [], []
    for step in range(STEPS):
        _, grads = grad_fn(batch(step)[rows])
        grads = scaler.unscale(grads)
        if step == OVERFLOW_STEP and overflow_here:
            grads = (grads[0] * float("inf"),) + tuple(grads[1:])
        finite = bool(verdict(grads).asnumpy())
        if finite:
            optimizer(grads)
        scales.append(float(scaler.scale_value.asnumpy()))
        stepped.append(finite)
    return scales, stepped


@multi_rank(4, timeout=600)
def test_overflow_on_one_rank_skips_the_step_on_every_rank_4_ranks():
    from hyper_parallel_ms.training import all_finite
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    dp_index, rank = mesh.get_coordinate()[0], mesh.get_rank()
    rows = slice(dp_index * 4, (dp_index + 1) * 4)
    ms.set_seed(0)
    ref = Net()
    ref_scales, ref_stepped = _train(ref, slice(None), True, amp.all_finite, jit=False)
    assert ref_stepped == [True, False, True] and ref_scales == [2.0 ** 10, 2.0 ** 9, 2.0 ** 9], ref_scales
    for jit in (False, True):
        ms.set_seed(0)
        model = Net()
        _fsdp_tp(mesh)(model)

        def agreed(grads):
            return all_finite(grads, mesh)
        scales, stepped = _train(model, rows, rank == 3, agreed, jit)
        assert stepped == ref_stepped and scales == ref_scales, (jit, stepped, scales)
        for p, rp in zip(model.trainable_params(), ref.trainable_params()):
            np.testing.assert_allclose(gathered(p, p), rp.asnumpy(), rtol=1e-5, atol=1e-5, err_msg=p.name)
    # one all-reduce over the 2 x 2 mesh, and MindSpore's per-rank check alone disagrees
    grads = (ms.Tensor(np.ones(3, np.float32) * (np.inf if rank == 3 else 1.0)),)
    with CommDebugMode() as mode:
        finite = bool(all_finite(grads, mesh).asnumpy())
    assert mode.get_comm_counts() == {"all_reduce": 1} and not finite
    assert bool(amp.all_finite(grads).asnumpy()) == (rank != 3)
