"""The collectives on Ascend NPUs with the native HCCL primitives: forward values and
gradients of every collective, PyNative and ms.jit. Needs ``HPMS_TEST_DEVICE=Ascend`` and
4 NPUs; on CPU it is skipped and its twin, ``test_comm.py``, runs the same checks on the
composed path (and the native primitives MCCL has)."""
from __future__ import annotations

import os

import pytest

from hyper_parallel_ms.testing import multi_rank

pytestmark = [pytest.mark.npu,
              pytest.mark.skipif(os.environ.get("HPMS_TEST_DEVICE") != "Ascend",
                                 reason="needs Ascend NPUs (HPMS_TEST_DEVICE=Ascend); CPU twin: test_comm.py")]

CASES = [("all_gather", {}), ("all_gather", {"pieces": "uneven", "dim": 1}), ("all_reduce", {"op": "sum"}),
         ("all_reduce", {"op": "max"}), ("reduce_scatter", {}), ("reduce_scatter", {"pieces": "uneven", "dim": 1}),
         ("all_to_all", {}), ("all_to_all", {"pieces": "uneven"}), ("all_to_all_single", {"pieces": "uneven"}),
         ("broadcast", {"src": 1})]


@pytest.mark.parametrize("mode", ["pynative", "jit"])
@multi_rank(4)
def test_native_collectives_on_npu(mode):
    from hyper_parallel_ms.comm import select_path
    from hyper_parallel_ms.mesh import init_device_mesh
    from hyper_parallel_ms.testing.collective_check import check_collective

    mesh = init_device_mesh("npu", (2, 2), mesh_dim_names=("dp", "tp"))
    for kind, options in CASES:
        assert select_path("Ascend", kind) == "native"
        for dim_name in ("dp", "tp"):
            check_collective(kind, mesh, dim_name, mode=mode, **options)
