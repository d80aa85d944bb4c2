"""Pipeline parallelism: schedules as data (per-rank action lists), checked before they run.

A schedule (GPipe, 1F1B, Interleaved1F1B, LoopedBFS, ZBVZeroBubble, InterleavedZeroBubble,
DualPipeV) lowers to one list of actions per pipeline rank: forward / backward / input-gradient /
weight-gradient of a stage on a micro-batch, and the SEND / RECV between ranks, in an order that
cannot deadlock with blocking point-to-point calls; over fully_shard stages the lists also gather
each stage's parameters once per step and reduce its gradients once (UNSHARD / RESHARD /
REDUCE_GRAD, ``build_plan(..., fsdp=True)``). :func:`validate` checks any such lists without
processes. The runtime (:class:`PipelineStage`, :func:`split_blocks` and the schedules
``ScheduleGPipe``, ``Schedule1F1B``, ``ScheduleInterleaved1F1B``, ``ScheduleLoopedBFS``,
``ScheduleZBVZeroBubble``, ``ScheduleInterleavedZeroBubble``, ``ScheduleDualPipeV``) executes those
lists with ``comm.send`` / ``recv`` (``PipelineStage(..., jit=True)`` compiles a stage's forward and
backward); an action failing on one rank ends the step on every rank with the cause
(:class:`PipelineError`). :class:`CommComputeOverlap` runs a forward and a backward on two threads
taking turns at sync hooks (:func:`sync_hook`, :class:`HookCoordinator`), HyperParallel's overlap of
expert-parallel all-to-alls. Its names load MindSpore on first use, so importing this package and
building plans loads no MindSpore.

Example:
    >>> plan = build_plan("ZBVZeroBubble", pp=2, n_microbatches=4)
    >>> plan.placement, plan.stages_of(0)
    ((0, 1, 1, 0), (0, 3))
    >>> plan.bubble_fraction() < build_plan("1F1B", pp=2, n_microbatches=4).bubble_fraction()
    True
"""
from __future__ import annotations

from ._action import (B, F, I, RECV_B, RECV_F, REDUCE_GRAD, RESHARD, SEND_B, SEND_F, UNSHARD, W, Action, ActionKind,
                      PipelineError, ScheduleError, TransferFailed)
from ._comms import add_comms, time_compute
from ._lowering import add_reduce_grad, add_unshard_reshard, lower_fsdp
from ._placement import stage_to_rank, stages_of_rank
from ._plan import SCHEDULES, PipelinePlan, build_plan, format_table
from ._validate import Timeline, validate

__all__ = ["Action", "ActionKind", "ScheduleError", "PipelineError", "TransferFailed", "F", "B", "I", "W", "SEND_F", "RECV_F", "SEND_B",
           "RECV_B", "UNSHARD", "RESHARD", "REDUCE_GRAD", "add_unshard_reshard", "add_reduce_grad", "lower_fsdp",
           "PipelinePlan", "build_plan", "SCHEDULES", "validate", "Timeline", "add_comms",
           "time_compute", "stage_to_rank", "stages_of_rank", "format_table",
           "PipelineStage", "split_blocks", "PipelineSchedule", "ScheduleGPipe", "Schedule1F1B",
           "ScheduleInterleaved1F1B", "ScheduleLoopedBFS", "ScheduleZBVZeroBubble", "ScheduleInterleavedZeroBubble",
           "ScheduleDualPipeV", "TensorChunkSpec", "BatchDimSpec",
           "PipelineScheduleSingle",
           "PipelineScheduleMulti", "get_schedule_class", "split_args_kwargs_into_chunks", "merge_chunks",
           "HookRole", "HookCoordinator", "CommComputeOverlap", "sync_hook"]

_RUNTIME = ("PipelineStage", "split_blocks", "PipelineSchedule", "ScheduleGPipe", "Schedule1F1B",
            "ScheduleInterleaved1F1B", "ScheduleLoopedBFS", "ScheduleZBVZeroBubble", "ScheduleInterleavedZeroBubble",
            "ScheduleDualPipeV", "PipelineScheduleSingle",
            "PipelineScheduleMulti",
            "get_schedule_class")
_MICROBATCH = ("TensorChunkSpec", "BatchDimSpec", "split_args_kwargs_into_chunks", "merge_chunks")
_OVERLAP = ("HookRole", "HookCoordinator", "CommComputeOverlap", "sync_hook")


def __getattr__(name: str):
    """The runtime's names, imported on first use (they load MindSpore)."""
    if name in ("PipelineStage", "split_blocks"):
        from . import _stage
        return getattr(_stage, name)
    if name in _RUNTIME:
        from . import _schedules
        return getattr(_schedules, name)
    if name in _MICROBATCH:
        from . import _microbatch
        return getattr(_microbatch, name)
    if name in _OVERLAP:
        from . import _overlap
        return getattr(_overlap, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
