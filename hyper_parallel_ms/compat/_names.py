"""The HyperParallel 1.0 module paths MindFormers 2.1.0's PyNative stack imports, and for each
name the object of this library that serves it (``"module:attr"`` under ``hyper_parallel_ms``),
or ``None``: the name is HyperParallel's but not provided here yet (using it raises
:class:`~hyper_parallel_ms.compat.NotProvidedError`).

Example:
    >>> HYPER_PARALLEL_NAMES["hyper_parallel.core.fully_shard.api"]["HSDPModule"]
    'fsdp:FSDPModule'
"""
from __future__ import annotations

from functools import lru_cache
from typing import Dict, Optional

__all__ = ["HYPER_PARALLEL_NAMES", "alias_packages"]

# HyperParallel's schedules: no loss_fn (the last stage's output is the loss), keyword inputs to every
# stage, gradients into param.grad (compat._schedules)
_PIPELINE = {"PipelineStage": "pipelining:PipelineStage", "ScheduleGPipe": "compat._schedules:ScheduleGPipe",
             "Schedule1F1B": "compat._schedules:Schedule1F1B",
             "ScheduleInterleaved1F1B": "compat._schedules:ScheduleInterleaved1F1B",
             "MetaStepType": "compat._pipeline:MetaStepType", "MetaStep": "compat._pipeline:MetaStep",
             "PipelineContext": "compat._pipeline:PipelineContext",
             "CommComputeOverlap": "pipelining:CommComputeOverlap", "HookCoordinator": "pipelining:HookCoordinator",
             "HookRole": "pipelining:HookRole"}
_DTENSOR = {"DTensor": "dtensor:DTensor", "distribute_tensor": "dtensor:distribute_tensor"}
_PLACEMENTS = {"Placement": "placement:Placement", "Shard": "placement:Shard", "Replicate": "placement:Replicate",
               "Partial": "placement:Partial"}

# HyperParallel module path -> {name: "module:attr" of hyper_parallel_ms, or None: not provided yet}
HYPER_PARALLEL_NAMES: Dict[str, Dict[str, Optional[str]]] = {
    "hyper_parallel": {
        **_DTENSOR, **_PLACEMENTS, **_PIPELINE, "DeviceMesh": "mesh:DeviceMesh",
        "init_device_mesh": "mesh:init_device_mesh", "SkipDTensorDispatch": "dtensor:SkipDTensorDispatch",
        "shard_module": "nn:shard_module", "ShardingPlan": "nn:ShardingPlan", "fully_shard": "compat._fsdp:fully_shard",
        "Layout": "layout:Layout",
    },
    "hyper_parallel.core.dtensor": dict(_DTENSOR),
    "hyper_parallel.core.dtensor.dtensor": dict(_DTENSOR),
    "hyper_parallel.core.dtensor.placement_types": dict(_PLACEMENTS),
    # the tensor-map helpers of MindFormers' Muon optimizer (its P2P gather / scatter of 2-D weights)
    "hyper_parallel.core.dtensor.layout": {
        "Layout": "layout:Layout", "_infer_slice_area_by_rank": "compat._redistribute_infer:infer_slice_area_by_rank"},
    "hyper_parallel.core.dtensor.redistribute_infer": {
        "DevMat": "compat._redistribute_infer:DevMat",
        "RedistributionOperatorInfer": "compat._redistribute_infer:RedistributionOperatorInfer"},
    "hyper_parallel.core.shard.sharding_plan": {"ShardingPlan": "nn:ShardingPlan"},
    "hyper_parallel.core.fully_shard.api": {
        "fully_shard": "compat._fsdp:fully_shard", "HSDPModule": "fsdp:FSDPModule",
        "MixedPrecisionPolicy": "fsdp:MixedPrecisionPolicy"},
    "hyper_parallel.core.fully_shard.utils": {"OffloadPolicy": "fsdp:OffloadPolicy",
                                              "CPUOffloadPolicy": "fsdp:CPUOffloadPolicy"},
    "hyper_parallel.core.pipeline_parallel": dict(_PIPELINE),
    "hyper_parallel.core.pipeline_parallel.scheduler": {
        "MetaStepType": "compat._pipeline:MetaStepType", "MetaStep": "compat._pipeline:MetaStep",
        "PipelineContext": "compat._pipeline:PipelineContext"},
    # the two-thread overlap of expert-parallel all-to-alls (driven by the OVERLAP_B_F callbacks)
    "hyper_parallel.core.pipeline_parallel.hook_coordinator": {"HookCoordinator": "pipelining:HookCoordinator",
                                                               "HookRole": "pipelining:HookRole"},
    "hyper_parallel.core.pipeline_parallel.comm_compute_overlap": {"CommComputeOverlap": "pipelining:CommComputeOverlap"},
    # HyperParallel's face on training.checkpoint_wrapper / swap_wrapper / checkpoint_exclude_wrapper
    "hyper_parallel.core.activation_checkpoint": {
        "CheckpointPolicy": "compat._activation:CheckpointPolicy", "SwapManager": "compat._activation:SwapManager",
        "checkpoint_exclude_wrapper": "training:checkpoint_exclude_wrapper",
        "checkpoint_wrapper": "compat._activation:checkpoint_wrapper",
        "swap_wrapper": "compat._activation:swap_wrapper"},
    "hyper_parallel.core.context_parallel.context_parallel": {"ContextParallel": "nn:ContextParallel"},
    "hyper_parallel.core.context_parallel.async_context_parallel": {"AsyncContextParallel": "nn:AsyncContextParallel"},
    # DeepSeek sparse attention's boundary styles (colossal: query side sharded, key side all-gathered)
    "hyper_parallel.core.context_parallel.dsa_context_parallel": {
        name: f"nn:{name}" for name in ("DSAIndexerContextParallel", "DSAIndexerLossContextParallel",
                                        "DSASequenceReplicateCache", "DSASparseAttentionContextParallel")},
    "hyper_parallel.core.context_parallel.async_dsa_context_parallel": {
        name: f"nn:{name}" for name in ("AsyncDSAIndexerContextParallel", "AsyncDSAIndexerLossContextParallel",
                                        "AsyncDSASparseAttentionContextParallel")},
    "hyper_parallel.custom_ops.experimental": dict.fromkeys((
        "npu_dense_lightning_indexer_grad_kl_loss", "npu_dense_lightning_indexer_softmax_lse",
        "npu_lightning_indexer", "npu_mhc_post", "npu_mhc_pre_sinkhorn", "npu_sparse_flash_mla",
        "npu_sparse_flash_mla_grad", "npu_sparse_lightning_indexer_grad_kl_loss",
        "npu_sparse_lightning_indexer_kl_loss_grad")),
    "hyper_parallel.core.distributed_checkpoint": {
        "get_current_layout": "compat._layouts:get_current_layout",
        "get_global_layout": "compat._layouts:get_global_layout"},
    "hyper_parallel.platform": {"get_platform": "compat._platform:get_platform"},
    "hyper_parallel.platform.mindspore.autograd_compat": {
        "enable_mindspore_backward_compat": "training:enable_mindspore_backward_compat"},
    "hyper_parallel.platform.mindspore.pipeline_parallel._utils": {"_MicroBatch": "compat._pipeline:MicroBatch"},
}


@lru_cache(maxsize=None)
def alias_packages() -> frozenset:
    """Every module path the alias serves: the table's and their parent packages.

    Example:
        >>> "hyper_parallel.core" in alias_packages()
        True
    """
    paths = set()
    for path in HYPER_PARALLEL_NAMES:
        parts = path.split(".")
        paths.update(".".join(parts[:i]) for i in range(1, len(parts) + 1))
    return frozenset(paths)
