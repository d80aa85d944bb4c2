"""The suite's tests on 8 ranks, in one file so that one pool of 8 rank processes serves them (a pool
is per pytest worker and per world size; two files would start two): a 3-D device mesh, and the training
example on pp x dp x tp = 2 x 2 x 2."""
from __future__ import annotations

import numpy as np

from examples.train_tp import TrainConfig, train
from hyper_parallel_ms.testing import multi_rank
from tests.test_train_example import CLIP


@multi_rank(8)
def test_mesh_3d_on_8_ranks():
    """A (pp, dp, tp) mesh: each rank's coordinate, sub-meshes and groups, an all-reduce over each dim."""
    import mindspore as ms
    from mindspore import communication
    from hyper_parallel_ms import comm
    from hyper_parallel_ms.mesh import init_device_mesh

    r = communication.get_rank()
    mesh = init_device_mesh("cpu", (2, 2, 2), mesh_dim_names=("pp", "dp", "tp"))
    coord = (r // 4, (r // 2) % 2, r % 2)
    assert mesh.get_coordinate() == list(coord) and mesh.coordinate == coord
    assert mesh["dp", "tp"].mesh.tolist() == [[4 * coord[0] + 2 * i + j for j in range(2)] for i in range(2)]
    assert mesh["pp", "tp"].comm_group("pp").ranks == (r % 4, r % 4 + 4)
    x = ms.Tensor(np.full((1,), float(r), np.float32))
    strides = {"pp": 4, "dp": 2, "tp": 1}
    for name, stride in strides.items():
        base = r - stride * coord[("pp", "dp", "tp").index(name)]
        assert comm.all_reduce(x, mesh, name).asnumpy()[0] == 2 * base + stride


@multi_rank(8, timeout=900)
def test_example_trains_on_a_3d_mesh_of_8_ranks():
    """pp x dp x tp = 2 x 2 x 2, the blocks fully sharded over dp and tensor parallel over tp inside
    each stage (1F1B, sequence and loss parallelism, clipping by every stage's gradients): 2 steps,
    losses and gradient norms equal to the single-device run."""
    cfg = TrainConfig(pp=2, dp=2, tp=2, fsdp=True, schedule="1f1b", microbatches=2, layers=2, steps=2, seq=8,
                      dim=32, hidden=64, vocab=64, mode="pynative", clip_grad_norm=CLIP)
    result = train(cfg, log=lambda line: None)
    assert len(result["losses"]) == 2 and result["forwards_per_microbatch"] == 1.0
    assert result["max_relative_difference"] <= 1e-4, (result["losses"], result["reference_losses"])
    assert min(result["reference_grad_norms"]) > CLIP, result["reference_grad_norms"]
    assert result["max_relative_norm_difference"] <= 1e-4, (result["grad_norms"], result["reference_grad_norms"])
