"""fully_shard's ``shard_placement_fn`` (FSDP2): parameters cut on a dim other than 0, evenly and
unevenly, train as the single-device model does in PyNative (reshard True / False) and compiled,
hold ``torch.chunk`` pieces of that dim recorded as ``Shard(dim)``, initialise under
``no_init_parameters()`` to the single-device values, and their state dicts reshard to and from
dim-0 units; a placement that is not a ``Shard`` of the parameter is refused, the Cell left as
it was."""
from __future__ import annotations

import mindspore as ms
import numpy as np
import pytest

from hyper_parallel_ms.fsdp import fully_shard
from hyper_parallel_ms.fsdp._param import is_piece
from hyper_parallel_ms.mesh import init_device_mesh
from hyper_parallel_ms.nn._parameter import parameter_sharding
from hyper_parallel_ms.placement import Shard
from hyper_parallel_ms.testing import multi_rank
from tests._fsdp_models import Net, compare
from tests._parity import gathered


def _last_dim(p):
    """Every parameter cut on its last dim: the weights' input dim (8 even, the blocks' down 7
    uneven: 4 / 3 on 2 ranks), the biases' only dim."""
    return Shard(-1)


def _shard(mesh, reshard_after_forward=True, placement=_last_dim):
    def shard(model):
        for layer in model.layers:
            fully_shard(layer, mesh=mesh, reshard_after_forward=reshard_after_forward, shard_placement_fn=placement)
        fully_shard(model, mesh=mesh, reshard_after_forward=reshard_after_forward, shard_placement_fn=placement)
    return shard


@multi_rank(2)
def test_parameters_cut_on_another_dim_train_as_one_device_2_ranks():
    from hyper_parallel_ms import checkpoint as dcp
    from hyper_parallel_ms import init_parameters, no_init_parameters
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("dp",))
    rank = mesh.get_local_rank()
    # the pieces: torch.chunk of the last dim, recorded as Shard(1) / Shard(0) on the dp mesh
    ms.set_seed(0)
    whole = Net()
    ms.set_seed(0)
    net = Net()
    _shard(mesh)(net)
    down = net.layers[0].down.weight
    assert down.shape == ((8, 4) if rank == 0 else (8, 3)) and net.inp.weight.shape == (8, 4)
    assert parameter_sharding(down).spec.placements == (Shard(1),)
    assert parameter_sharding(net.inp.bias).spec.placements == (Shard(0),)
    np.testing.assert_array_equal(down.asnumpy(), whole.layers[0].down.weight.asnumpy()[:, :4] if rank == 0 else
                                  whole.layers[0].down.weight.asnumpy()[:, 4:])
    for p, w in zip(net.trainable_params(), whole.trainable_params()):
        np.testing.assert_array_equal(gathered(p, p), w.asnumpy(), err_msg=p.name)
    # training: loss each step and parameters after 4 AdamW steps, as the single device on the whole batch
    for mode, reshard in (("pynative", True), ("pynative", False), ("jit", True)):
        compare(_shard(mesh, reshard), rank, 2, optimizer="adamw", steps=4, mode=mode, loss_mesh=mesh)
    # no_init_parameters: each rank initialises its piece of the cut dim to the single-device values
    with no_init_parameters():
        ms.set_seed(0)
        lazy = Net()
    _shard(mesh)(lazy)
    init_parameters(lazy)
    for p, w in zip(lazy.trainable_params(), whole.trainable_params()):
        np.testing.assert_array_equal(gathered(p, p), w.asnumpy(), err_msg=p.name)
    # full state dicts reshard between dim-1 and dim-0 units
    full = dcp.get_model_state_dict(net, options=dcp.StateDictOptions(full_state_dict=True))
    ms.set_seed(3)
    rows = Net()
    _shard(mesh, placement=None)(rows)
    assert parameter_sharding(rows.layers[0].down.weight).spec.placements == (Shard(0),)
    dcp.set_model_state_dict(rows, full)
    for p, q in zip(rows.trainable_params(), net.trainable_params()):
        np.testing.assert_array_equal(gathered(p, p), gathered(q, q), err_msg=p.name)
    ms.set_seed(4)
    cols = Net()
    _shard(mesh)(cols)
    dcp.set_model_state_dict(cols, dcp.get_model_state_dict(rows, options=dcp.StateDictOptions(full_state_dict=True)))
    for p, q in zip(cols.trainable_params(), net.trainable_params()):
        np.testing.assert_array_equal(p.asnumpy(), q.asnumpy(), err_msg=p.name)
    # anything but a Shard of an existing dim is refused, naming the parameter; the Cell is left as it was
    for bad, what in ((lambda p: Shard(2), r"Shard\(dim=2\) for 'inp.weight' of shape \(8, 8\)"),
                      (lambda p: "rows", r"'rows' for 'inp.weight'")):
        ms.set_seed(0)
        other = Net()
        with pytest.raises(ValueError, match=what + ".*must return None or Shard"):
            fully_shard(other, mesh=mesh, shard_placement_fn=bad)
        assert not any(is_piece(p) for p in other.trainable_params())
        assert [p.shape for p in other.trainable_params()] == [p.shape for p in whole.trainable_params()]
