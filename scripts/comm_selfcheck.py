"""Collective self-check: every collective on every mesh dim, PyNative and ms.jit, against numpy.

Run on every rank of a job (``scripts/run_selfcheck.sh`` launches it with msrun). Each
rank checks forward values and gradients of all_gather, all_reduce (sum/avg/max/min),
reduce_scatter, all_to_all and broadcast, with even and uneven pieces, on a 1-D mesh of
all ranks and (for an even world of 4 or more) a 2-D ("dp", "tp") mesh.

Example::

    bash scripts/msrun.sh --worker_num=4 --local_worker_num=4 --join=True scripts/comm_selfcheck.py --device CPU
"""
from __future__ import annotations

import argparse
import sys
import time
import traceback

import mindspore as ms
from mindspore import communication

from hyper_parallel_ms.comm import select_path
from hyper_parallel_ms.mesh import init_device_mesh
from hyper_parallel_ms.testing.collective_check import check_collective

CASES = [  # (collective, options)
    ("all_gather", {}), ("all_gather", {"pieces": "uneven"}), ("all_gather", {"pieces": "uneven", "dim": 1}),
    ("all_reduce", {"op": "sum"}), ("all_reduce", {"op": "avg"}), ("all_reduce", {"op": "max"}),
    ("all_reduce", {"op": "min"}), ("reduce_scatter", {}), ("reduce_scatter", {"pieces": "uneven", "dim": 1}),
    ("reduce_scatter", {"op": "max"}), ("all_to_all", {}), ("all_to_all", {"pieces": "uneven"}),
    ("broadcast", {"src": 0}), ("broadcast", {"src": 1}),
]


def _meshes(device_type: str, world: int):
    yield init_device_mesh(device_type, (world,), mesh_dim_names=("world",))
    if world >= 4 and world % 2 == 0:
        yield init_device_mesh(device_type, (world // 2, 2), mesh_dim_names=("dp", "tp"))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="CPU", choices=["CPU", "Ascend"])
    parser.add_argument("--modes", default="pynative,jit")
    args = parser.parse_args()
    ms.set_device(args.device)
    communication.init()
    rank, world = communication.get_rank(), communication.get_group_size()
    device_type = "cpu" if args.device == "CPU" else "npu"
    began, passed, failed = time.perf_counter(), 0, 0
    checks = [(mesh, name, mode, kind, options) for mesh in _meshes(device_type, world)
              for name in mesh.mesh_dim_names for mode in args.modes.split(",") for kind, options in CASES]
    for mesh, name, mode, kind, options in checks:
        label = f"{kind:<15}{name:<6}{mode:<9}{options}"
        try:
            shape = check_collective(kind, mesh, name, mode=mode, **options)
        except Exception:  # stop: after a failure the ranks' collectives no longer pair up
            failed = 1
            print(f"rank {rank} FAIL {label}\n{traceback.format_exc()}", flush=True)
            break
        passed += 1
        print(f"rank {rank} PASS {label} -> {shape} [{select_path(args.device, kind)}]", flush=True)
    seconds = time.perf_counter() - began
    print(f"selfcheck: rank {rank} of {world} on {args.device}: {passed} passed, {failed} failed "
          f"in {seconds:.1f} s", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
