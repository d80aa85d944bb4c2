"""Pipeline schedules with PyTorch's names (GPipe, 1F1B, interleaved 1F1B, looped BFS, zero-bubble V,
interleaved zero bubble, DualPipeV)
on the common base :class:`._schedule_base.PipelineSchedule`, and PyTorch's lookup by name.

Example::

    schedule = get_schedule_class("1F1B")(stage, n_microbatches=4, loss_fn=loss_fn)
    schedule.step(x, target=y)
"""
from __future__ import annotations

from typing import Any, Sequence, Union

from ._schedule_base import PipelineSchedule, first_argument_renamed, shared_args
from ._stage import PipelineStage

__all__ = ["PipelineSchedule", "PipelineScheduleSingle", "PipelineScheduleMulti", "ScheduleGPipe", "Schedule1F1B",
           "ScheduleInterleaved1F1B", "ScheduleLoopedBFS", "ScheduleZBVZeroBubble", "ScheduleInterleavedZeroBubble",
           "ScheduleDualPipeV", "get_schedule_class"]


@shared_args
class PipelineScheduleSingle(PipelineSchedule):
    """PyTorch's base of the schedules running one stage per rank (:class:`ScheduleGPipe`,
    :class:`Schedule1F1B`): they take the stage itself.

    Args:
        stage: this rank's :class:`PipelineStage`.
        n_microbatches: micro-batches per step.
        loss_fn: ``loss_fn(output, target_microbatch)`` (needed on the last stage's rank to train).
        {shared_args}

    Example::

        isinstance(ScheduleGPipe(stage, 4, loss_fn), PipelineScheduleSingle)     # True
    """

    def __init__(self, stage: PipelineStage, *args: Any, **kwargs: Any) -> None:
        if not isinstance(stage, PipelineStage):
            raise TypeError(f"{type(self).__name__} runs one PipelineStage per rank, got {type(stage).__name__}; "
                            f"use ScheduleInterleaved1F1B for several")
        super().__init__([stage], *args, **kwargs)

    __init__.__signature__ = first_argument_renamed(PipelineSchedule.__init__, "stage", "PipelineStage")


@shared_args
class ScheduleGPipe(PipelineScheduleSingle):
    """GPipe: every forward, then every backward; one stage per rank (stage s on rank s).

    Args:
        stage: this rank's :class:`PipelineStage`.
        n_microbatches: micro-batches per step.
        loss_fn: ``loss_fn(output, target_microbatch)`` (needed on the last stage's rank to train; without it: forward only).
        {shared_args}

    Example::

        schedule = ScheduleGPipe(stage, 4, loss_fn)
        schedule.step(x, target=y)
    """

    schedule_name = "GPipe"


@shared_args
class Schedule1F1B(PipelineScheduleSingle):
    """1F1B: warm-up forwards, then one forward and one backward in turn; at most ``num_stages``
    micro-batches' activations per stage. Needs ``n_microbatches >= num_stages``.

    Args:
        stage: this rank's :class:`PipelineStage`.
        n_microbatches: micro-batches per step (at least the number of stages).
        loss_fn: ``loss_fn(output, target_microbatch)`` (needed on the last stage's rank to train; without it: forward only).
        {shared_args}

    Example::

        schedule = Schedule1F1B(stage, 4, loss_fn)
    """

    schedule_name = "1F1B"


@shared_args
class PipelineScheduleMulti(PipelineSchedule):
    """PyTorch's base of the schedules running several stages per rank
    (:class:`ScheduleInterleaved1F1B`, :class:`ScheduleLoopedBFS`, :class:`ScheduleZBVZeroBubble`): they take this rank's
    stages (a single stage is taken as a list of one; the looped schedules then run their one-stage forms, as
    PyTorch's).

    Args:
        stages: this rank's stages.
        n_microbatches: micro-batches per step.
        loss_fn: ``loss_fn(output, target_microbatch)`` (needed on the last stage's rank to train).
        {shared_args}

    Example::

        isinstance(ScheduleZBVZeroBubble([stage_r, stage_mirror], 4, loss_fn), PipelineScheduleMulti)   # True
    """

    def __init__(self, stages: Union[Sequence[PipelineStage], PipelineStage], *args: Any, **kwargs: Any) -> None:
        super().__init__([stages] if isinstance(stages, PipelineStage) else stages, *args, **kwargs)

    __init__.__signature__ = first_argument_renamed(PipelineSchedule.__init__, "stages",
                                                    "Union[Sequence[PipelineStage], PipelineStage]")


@shared_args
class ScheduleInterleaved1F1B(PipelineScheduleMulti):
    """Interleaved 1F1B: several stages per rank, looped (stage s on rank s % pp); with one stage per rank
    it is 1F1B with ``2 (pp - 1 - rank)`` warm-up forwards (PyTorch's too). With ``overlap_b_f=True``
    (HyperParallel's) each steady-state backward is paired with the forward after it
    (``plan.paired``): the pair's transfers go before and after it, and it runs one half after the
    other unless HyperParallel's schedule is given an ``OVERLAP_B_F`` callback (the same values).

    Args:
        stages: this rank's stages (e.g. stages r and r + pp; one stage: stage r).
        n_microbatches: micro-batches per step (any number).
        loss_fn: ``loss_fn(output, target_microbatch)`` (needed on the last stage's rank to train; without it: forward only).
        {shared_args}

    Example::

        schedule = ScheduleInterleaved1F1B([stage_r, stage_r_plus_pp], 4, loss_fn)
    """

    schedule_name = "Interleaved1F1B"
    pairs = True


@shared_args
class ScheduleLoopedBFS(PipelineScheduleMulti):
    """Looped breadth first (PyTorch's ``ScheduleLoopedBFS``): several stages per rank, looped
    (stage s on rank s % pp); every micro-batch through a rank's stage before its next stage, the
    backwards in reverse (one stage per rank: GPipe, its backwards from the last micro-batch).

    Args:
        stages: this rank's looped stages, in stage order (one or more).
        n_microbatches: micro-batches per step; any number works.
        loss_fn: the last stage's ``loss_fn(output, target_microbatch)``; without one the step runs forward only.
        {shared_args}

    Example::

        schedule = ScheduleLoopedBFS([stage_r, stage_r_plus_pp], 4, loss_fn)
    """

    schedule_name = "LoopedBFS"


@shared_args
class ScheduleZBVZeroBubble(ScheduleInterleaved1F1B):
    """Zero-bubble V: rank r holds stages r and 2 pp - 1 - r; each backward is split into an
    input gradient (sent at once) and a weight gradient run later, in what would be bubbles.

    Args:
        stages: this rank's two stages (r and 2 pp - 1 - r).
        n_microbatches: micro-batches per step (any number).
        loss_fn: ``loss_fn(output, target_microbatch)`` (needed on rank 0, which holds the last stage, to train; without it: forward only).
        {shared_args}

    Example::

        schedule = ScheduleZBVZeroBubble([stage_r, stage_mirror], 4, loss_fn)
    """

    schedule_name = "ZBVZeroBubble"


@shared_args
class ScheduleInterleavedZeroBubble(PipelineScheduleMulti):
    """Interleaved zero bubble (PyTorch's ``ScheduleInterleavedZeroBubble``): the looped stages of
    :class:`ScheduleInterleaved1F1B`, each backward split into an input gradient (sent at once)
    and a weight gradient run later, in what would be bubbles (also with one stage per rank).

    Args:
        stages: this rank's looped stages, in stage order (e.g. stages r and r + pp; or stage r alone).
        n_microbatches: micro-batches per step (any number).
        loss_fn: the last stage's ``loss_fn(output, target_microbatch)`` (without it: forward only).
        {shared_args}

    Example::

        schedule = ScheduleInterleavedZeroBubble([stage_r, stage_r_plus_pp], 4, loss_fn)
    """

    schedule_name = "InterleavedZeroBubble"


@shared_args
class ScheduleDualPipeV(PipelineScheduleMulti):
    """DualPipeV (PyTorch's ``ScheduleDualPipeV``, after DeepSeek's DualPipe): the V placement of
    :class:`ScheduleZBVZeroBubble`; in its steady phase a forward of one of the rank's stages and a
    full backward of the other follow each other (PyTorch runs such a pair as one overlapped action;
    here they run one after the other, same results), and the last backwards are split into input
    and weight gradients. Needs at least as many micro-batches as stages (``2 pp``), as PyTorch.

    Args:
        stages: this rank's two stages (r and 2 pp - 1 - r).
        n_microbatches: micro-batches per step (at least ``2 pp``).
        loss_fn: ``loss_fn(output, target_microbatch)`` (needed on rank 0, which holds the last stage, to train; without it: forward only).
        {shared_args}

    Example::

        schedule = ScheduleDualPipeV([stage_r, stage_mirror], 4, loss_fn)
    """

    schedule_name = "DualPipeV"


def get_schedule_class(schedule_name: str) -> type:
    """PyTorch's lookup of a schedule class by name, case-insensitive (``"GPipe"``, ``"1F1B"``,
    ``"Interleaved1F1B"``, ``"LoopedBFS"``, ``"ZBVZeroBubble"``, ``"InterleavedZeroBubble"``, ``"DualPipeV"``, and
    the bases ``"PipelineScheduleSingle"`` / ``"PipelineScheduleMulti"``, as PyTorch); another name raises
    ``ValueError`` listing these.

    Args:
        schedule_name: the schedule's name.

    Example::

        get_schedule_class("1f1b")           # Schedule1F1B
    """
    named = {cls.schedule_name: cls for cls in (ScheduleGPipe, Schedule1F1B, ScheduleInterleaved1F1B,
                                                ScheduleLoopedBFS, ScheduleZBVZeroBubble,
                                                ScheduleInterleavedZeroBubble, ScheduleDualPipeV)}
    named.update({cls.__name__: cls for cls in (PipelineScheduleSingle, PipelineScheduleMulti)})
    found = {name.lower(): cls for name, cls in named.items()}.get(str(schedule_name).lower())
    if found is None:
        raise ValueError(f"unknown pipeline schedule {schedule_name!r}; the schedules are {list(named)}")
    return found
