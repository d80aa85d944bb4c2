"""hyper_parallel_ms: distributed tensors for MindSpore on Ascend, testable on CPU.

Device meshes, placements, DTensor with redistribution, and differentiable collectives in
the vocabulary of ``torch.distributed.tensor``. Names are imported on first use, so that
``import hyper_parallel_ms.placement`` (or ``.layout``) loads no MindSpore.

Example::

    from hyper_parallel_ms import init_device_mesh, distribute_tensor, Shard, Replicate
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    dt = distribute_tensor(x, mesh, [Shard(0), Replicate()])
    y = dt.redistribute(mesh, [Replicate(), Shard(1)]).full_tensor()
"""
from __future__ import annotations

import importlib
from importlib import metadata as _metadata
from typing import Any, Dict, Tuple

__version__ = "0.1.0"

SUPPORTED_MINDSPORE = ((2, 8), (2, 10))   # oldest and newest supported releases, (major, minor)

# Each public name and the submodule that defines it.
_EXPORTS: Dict[str, str] = {
    "comm": "", "ops": "", "nn": "", "checkpoint": "", "fsdp": "", "training": "",
    "Placement": "placement", "Shard": "placement", "Replicate": "placement", "Partial": "placement",
    "Layout": "layout",
    "DeviceMesh": "mesh", "init_device_mesh": "mesh", "current_mesh": "mesh", "get_current_mesh": "mesh",
    "DTensor": "dtensor", "distribute_tensor": "dtensor", "zeros": "dtensor", "ones": "dtensor",
    "empty": "dtensor", "full": "dtensor", "rand": "dtensor", "randn": "dtensor", "manual_seed": "dtensor",
    "visualize_sharding": "dtensor", "sharding_table": "dtensor", "SkipDTensorDispatch": "dtensor",
    "grad": "dtensor", "value_and_grad": "dtensor", "parallelize_value_and_grad": "dtensor",
    "ColwiseParallel": "nn", "RowwiseParallel": "nn", "SequenceParallel": "nn", "PrepareModuleInput": "nn",
    "MultiheadAttentionParallel": "nn",
    "PrepareModuleOutput": "nn", "PrepareModuleInputOutput": "nn", "parallelize_module": "nn",
    "distribute_module": "nn", "ShardingPlan": "nn", "shard_module": "nn", "GradientReducer": "nn",
    "ParallelStyle": "nn", "parameter_sharding": "nn", "as_dtensor": "nn",
    "loss_parallel": "nn", "ParallelCrossEntropy": "nn",
    "context_parallel": "nn", "context_parallel_unshard": "nn", "set_rotate_method": "nn", "ContextParallel": "nn",
    "AsyncContextParallel": "nn",
    "fully_shard": "fsdp", "FSDPModule": "fsdp", "MixedPrecisionPolicy": "fsdp", "hsdp": "fsdp",
    "OffloadPolicy": "fsdp", "CPUOffloadPolicy": "fsdp", "register_fsdp_forward_method": "fsdp",
    "hsdp_sync_stream": "fsdp", "hsdp_wait_grad_handle": "fsdp", "UnshardHandle": "fsdp",
    "HSDPCell": "fsdp", "init_parameters": "fsdp", "no_init_parameters": "nn", "init_empty_weights": "nn", "init_on_device": "nn",
    "local_map": "ops", "custom_shard": "ops",
    "clip_grad_norm": "training", "TotalGradNorm": "training", "all_finite": "training",
    "checkpoint_wrapper": "training", "apply_activation_checkpointing": "training", "offload_wrapper": "training",
    "pipelining": "", "PipelineStage": "pipelining", "split_blocks": "pipelining",
    "ScheduleGPipe": "pipelining", "Schedule1F1B": "pipelining", "ScheduleInterleaved1F1B": "pipelining",
    "ScheduleLoopedBFS": "pipelining", "ScheduleZBVZeroBubble": "pipelining",
    "ScheduleInterleavedZeroBubble": "pipelining", "ScheduleDualPipeV": "pipelining", "BatchDimSpec": "pipelining",
    "dryrun": "", "simulate": "dryrun",
    "moe": "", "MoE": "moe", "ExpertParallel": "moe", "ExpertTensorParallel": "moe",
    "plan": "",     # deprecated: hyper_parallel_ms.dryrun (warns on import; not in __all__)
    "process_group": "", "init_process_group": "process_group", "destroy_process_group": "process_group",
    "get_process_group_ranks": "process_group", "get_backend": "process_group", "split_group": "process_group",
    "get_group_local_rank": "process_group", "mark_created_groups": "process_group",
}
# renamed modules, still importable for one release (each warns): documented on docs/differences.md
_DEPRECATED_MODULES = ("plan",)
__all__ = [name for name in _EXPORTS if name not in _DEPRECATED_MODULES]


def _release(version: str) -> Tuple[int, int]:
    """``(major, minor)`` of a version string.

    >>> _release("2.10.0rc1")
    (2, 10)
    """
    parts = version.split(".")
    return int(parts[0]), int("".join(c for c in parts[1] if c.isdigit()) or 0)


def _check_mindspore(version: str) -> None:
    """Raise if the installed MindSpore release is not supported.

    >>> _check_mindspore("2.9.0")
    >>> _check_mindspore("2.7.2")
    Traceback (most recent call last):
    ...
    ImportError: hyper_parallel_ms needs MindSpore 2.8 to 2.10, found 2.7.2: ...
    """
    low, high = SUPPORTED_MINDSPORE
    if not low <= _release(version) <= high:
        raise ImportError(
            f"hyper_parallel_ms needs MindSpore {low[0]}.{low[1]} to {high[0]}.{high[1]}, found {version}: "
            "releases before 2.8 have no per-tensor op hook (Tensor.__fallback__) and no Tensor._make_subclass. "
            "Install a supported release, e.g. pip install 'mindspore>=2.8,<2.11'")


try:
    _check_mindspore(_metadata.version("mindspore"))
except _metadata.PackageNotFoundError:  # a source build without metadata: mindspore.__version__ is checked
    pass                                # when the seam module imports it


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'hyper_parallel_ms' has no attribute '{name}'")
    value = importlib.import_module(f"{__name__}.{name}" if module == "" else f"{__name__}.{module}")
    if module:
        value = getattr(value, name)
    globals()[name] = value
    return value


def __dir__():
    # the public names only (not the typing names this module imports)
    return sorted(set(__all__) | {"__version__", "SUPPORTED_MINDSPORE"})
