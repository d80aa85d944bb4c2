"""reshard_after_forward in PyNative on 2 ranks: ``True`` (and an int) frees a unit's gathered
parameters after its forward and gathers them again in its backward (two all-gathers per unit
and step, FSDP2's count), ``False`` keeps them (one); both equal one device."""
from __future__ import annotations

import mindspore as ms
import numpy as np
import pytest

from hyper_parallel_ms.fsdp._module import fsdp_state
from hyper_parallel_ms.mesh import init_device_mesh
from hyper_parallel_ms.testing import multi_rank
from tests._fsdp_models import Net, accumulate_4, compare, loss_of, per_block


@multi_rank(2)
def test_reshard_after_forward_counts_and_parity_2_ranks():
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("dp",))
    rank = mesh.get_local_rank(0)
    for reshard, gathers in ((True, 6), (False, 3), (2, 6)):
        counts = []
        compare(per_block(mesh, reshard), rank, 2, loss_mesh=mesh, counts=counts, steps=3)
        # 3 units (2 blocks + root): one all-gather each in forward, one more in backward when freed
        assert counts == [{"all_gather": gathers, "reduce_scatter": 3}] * 3, (reshard, counts)
    counts = []
    compare(per_block(mesh, True), rank, 2, loss_mesh=mesh, counts=counts, steps=2,
            train=accumulate_4("set_requires_gradient_sync"), optimizer="adamw")
    assert counts == [{"all_gather": 24, "reduce_scatter": 3}] * 2, counts     # 4 micro-steps x 6


@multi_rank(2)
def test_reshard_after_forward_frees_the_gathered_values_until_the_backward_2_ranks():
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("dp",))
    for reshard in (True, False):
        ms.set_seed(0)
        model = Net()
        per_block(mesh, reshard)(model)
        states = [fsdp_state(layer) for layer in model.layers] + [fsdp_state(model)]
        x = ms.Tensor(np.ones((4, 8), np.float32))
        held = {}

        def loss(v):
            out = loss_of(model, v)
            # after the forward: records waiting for the backward, no gathered value held by them
            held["records"] = sum(s.saving.records_held() for s in states if s.saving is not None)
            return out
        ms.value_and_grad(loss, None, model.trainable_params())(x)
        if reshard:
            assert held["records"] > 0
            assert all(not s.saving._live for s in states)       # all used and dropped by the backward
        else:
            assert held["records"] == 0


class _Embedded(ms.nn.Cell):
    def __init__(self):
        super().__init__()
        self.emb = ms.nn.Embedding(16, 8)
        self.dense = ms.nn.Dense(8, 4)

    def construct(self, idx):
        return (self.dense(self.emb(idx)) ** 2).mean()


@multi_rank(2)
def test_a_backward_that_reads_no_gathered_value_gathers_nothing_2_ranks():
    """reshard_after_forward=True: the embedding unit's backward reads none of its gathered values (only
    the indices), so it is not gathered again: 2 forward gathers + 1 (the Dense's) in the backward;
    gradients equal one device. set_unshard_in_backward(False) (FSDP2's hint) is silent there and, on
    the Dense whose backward reads its weight, gathers anyway with a warning naming the unit."""
    import warnings

    from hyper_parallel_ms.comm import CommDebugMode
    from hyper_parallel_ms.fsdp import fully_shard
    from tests._parity import gathered

    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("dp",))
    idx = ms.Tensor(np.array([[1, 2, 3], [4, 5, 15]], np.int32))
    ms.set_seed(0)
    ref = _Embedded()
    want = ms.value_and_grad(ref, None, ref.trainable_params())(idx)[1]
    for hint in (None, "emb", "dense"):
        ms.set_seed(0)
        model = _Embedded()
        fully_shard(model.emb, mesh=mesh, reshard_after_forward=True)      # both units are roots: None keeps
        fully_shard(model.dense, mesh=mesh, reshard_after_forward=True)    # theirs for the backward
        if hint:
            getattr(model, hint).set_unshard_in_backward(False)
        step = ms.value_and_grad(model, None, model.trainable_params())
        with CommDebugMode() as mode, warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            _, grads = step(idx)
        assert mode.get_comm_counts() == {"all_gather": 3, "reduce_scatter": 2}, (hint, mode.get_comm_counts())
        named = [w for w in caught if "set_unshard_in_backward(False)" in str(w.message)]
        assert len(named) == (1 if hint == "dense" else 0) and (not named or "Dense" in str(named[0].message))
        if hint == "dense":         # warned once per unit; the user's setting is kept
            with warnings.catch_warnings(record=True) as again:
                warnings.simplefilter("always")
                step(idx)
            assert not [w for w in again if "set_unshard_in_backward" in str(w.message)]
            assert fsdp_state(model.dense).unshard_in_backward is False
        for p, g, w in zip(model.trainable_params(), grads, want):
            np.testing.assert_allclose(gathered(p, g), w.asnumpy(), rtol=1e-5, atol=1e-6, err_msg=p.name)
    with pytest.raises(TypeError, match="must be a bool"):
        model.emb.set_unshard_in_backward(0)
