"""HyperParallel 1.0's pipeline data types that MindFormers imports: ``MetaStepType``, ``MetaStep``
and ``PipelineContext`` (``hyper_parallel.core.pipeline_parallel.scheduler``: a schedule step, and
what an ``OVERLAP_B_F`` callback is given) and ``_MicroBatch``
(``hyper_parallel.platform.mindspore.pipeline_parallel._utils``), on this library's pipelining.

Example::

    alias_hyper_parallel()
    from hyper_parallel.platform.mindspore.pipeline_parallel._utils import _MicroBatch
    args_split, kwargs_split = _MicroBatch(4)((x,), {"labels": y})
"""
from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence, Tuple

from ..pipelining._action import (B, F, I, RECV_B, RECV_F, REDUCE_GRAD, RESHARD, SEND_B, SEND_F, UNSHARD, W, Action,
                                  ActionKind)
from ..pipelining._microbatch import TensorChunkSpec, split_args_kwargs_into_chunks

__all__ = ["MetaStepType", "MetaStep", "PipelineContext", "MicroBatch"]


class MetaStepType(enum.Enum):
    """HyperParallel's kinds of schedule step; :attr:`action_kind` is the action of this
    library's schedules that each one is (``FWD``: ``F``, ``BWD``: ``B``, ``BWD_INPUT``: ``I``,
    ``BWD_WEIGHT``: ``W``, the transfers, ``FSDP_UNSHARD`` / ``FSDP_RESHARD`` / ``FSDP_REDUCE_GRAD``:
    the parameter actions of fully_shard stages). ``OVERLAP_B_F`` is a backward and the forward after
    it, paired by ``ScheduleInterleaved1F1B(overlap_b_f=True)`` (its ``sub_steps``; no action of its
    own), the one step a callback can be registered for (``register_custom_function``);
    ``OVERLAP_F_B`` (a forward, then a backward) is a kind no schedule here makes. HyperParallel's
    swap steps are not members (the activation swap between micro-batches is not built).

    Args:
        value: a member's value, as any ``Enum`` takes it (use the members by name).

    >>> MetaStepType.BWD_SEND.action_kind.name
    'SEND_B'
    """

    FWD = 1
    BWD = 2
    FWD_RECV = 3
    FWD_SEND = 4
    BWD_RECV = 5
    BWD_SEND = 6
    OVERLAP_B_F = 7
    BWD_INPUT = 8
    BWD_WEIGHT = 9
    OVERLAP_F_B = 10
    FSDP_UNSHARD = 11
    FSDP_RESHARD = 12
    FSDP_REDUCE_GRAD = 13

    @property
    def action_kind(self) -> ActionKind:
        """The kind of action of this library's schedules this step is (a composite kind, two actions: raises)."""
        if self not in _ACTION_KINDS:
            raise ValueError(f"MetaStepType.{self.name} is two actions, its sub_steps'")
        return _ACTION_KINDS[self]


_ACTION_KINDS = {MetaStepType.FWD: F, MetaStepType.BWD: B, MetaStepType.BWD_INPUT: I, MetaStepType.BWD_WEIGHT: W,
                 MetaStepType.FWD_RECV: RECV_F, MetaStepType.FWD_SEND: SEND_F, MetaStepType.BWD_RECV: RECV_B,
                 MetaStepType.BWD_SEND: SEND_B, MetaStepType.FSDP_UNSHARD: UNSHARD,
                 MetaStepType.FSDP_RESHARD: RESHARD, MetaStepType.FSDP_REDUCE_GRAD: REDUCE_GRAD}
_STEP_TYPES = {kind: step for step, kind in _ACTION_KINDS.items()}


@dataclass(frozen=True)
class MetaStep:
    """One step of HyperParallel's schedules: ``type`` of stage ``stage_index`` on micro-batch
    ``micro_index``; an ``OVERLAP_B_F`` step has neither and holds its ``(backward, forward)`` in
    ``sub_steps``.

    Args:
        micro_index: the micro-batch (``None`` for a composite step).
        type: the :class:`MetaStepType`.
        stage_index: the stage (``None`` for a composite step).
        sub_steps: a composite step's steps, in HyperParallel's order (backward, forward).

    >>> step = MetaStep(None, MetaStepType.OVERLAP_B_F, None, sub_steps=(MetaStep(0, MetaStepType.BWD, 2),
    ...                                                                   MetaStep(1, MetaStepType.FWD, 2)))
    >>> [(s.type.name, s.stage_index, s.micro_index) for s in step.sub_steps]
    [('BWD', 2, 0), ('FWD', 2, 1)]
    """

    micro_index: Optional[int]
    type: MetaStepType
    stage_index: Optional[int]
    sub_steps: Tuple["MetaStep", ...] = ()

    @staticmethod
    def of(action: Action) -> "MetaStep":
        """The step an action of this library's plans is.

        >>> MetaStep.of(Action.parse("1RECV_F0"))
        MetaStep(micro_index=0, type=<MetaStepType.FWD_RECV: 3>, stage_index=1, sub_steps=())
        """
        return MetaStep(action.microbatch, _STEP_TYPES[action.kind], action.stage)

    @staticmethod
    def pair(backward: Action, forward: Action) -> "MetaStep":
        """The ``OVERLAP_B_F`` step of a backward and the forward paired with it."""
        return MetaStep(None, MetaStepType.OVERLAP_B_F, None, sub_steps=(MetaStep.of(backward), MetaStep.of(forward)))


class PipelineContext:
    """What an ``OVERLAP_B_F`` callback is given with its step (HyperParallel's): the schedule, the
    step's micro-batches and a list for losses. The transfers of this library's plans come before
    and after a pair, so ``fwd_recv_ops`` / ``bwd_recv_ops`` / ``send_handles`` stay empty (no
    handles to wait on).

    Args:
        schedule: the schedule running the step.
        arg_mbs: per micro-batch, the first stage's positional inputs (empty lists on other ranks).
        kwarg_mbs: per micro-batch, the keyword inputs.
        losses: a list the callback's ``schedule.update_losses`` appends the last stage's outputs to
            (the schedule's ``run`` returns its own record of them).

    Example::

        def callback(step, ctx):
            bwd, fwd = step.sub_steps
            ctx.schedule._stage_dict[bwd.stage_index].backward_one_chunk(bwd.micro_index)
            out = ctx.schedule._stage_dict[fwd.stage_index].forward_one_chunk(
                fwd.micro_index, ctx.arg_mbs[fwd.micro_index], ctx.kwarg_mbs[fwd.micro_index])
    """

    def __init__(self, schedule: Any, arg_mbs: List[list], kwarg_mbs: List[dict], losses: list) -> None:
        self.schedule = schedule
        self.arg_mbs = arg_mbs
        self.kwarg_mbs = kwarg_mbs
        self.losses = losses
        self.send_handles: list = []
        self.fwd_recv_ops: dict = {}
        self.bwd_recv_ops: dict = {}


def _spec(batch_dim: Any) -> Any:
    """HyperParallel's per-input batch dim (a ``BatchDimSpec``, an int, or ``-1`` / ``None``:
    not split) as this library's chunk spec."""
    dim = getattr(batch_dim, "batch_dim", batch_dim)
    if dim is None or dim == -1:
        return None
    return TensorChunkSpec(dim)


class MicroBatch:
    """HyperParallel's ``_MicroBatch``: splits one step's inputs into ``micro_batch_num``
    micro-batches along their batch dims (:func:`~hyper_parallel_ms.pipelining.split_args_kwargs_into_chunks`).
    Rows that do not divide evenly make chunks one row apart (``tensor_split``'s sizes; HyperParallel
    drops the remainder rows). A DTensor input splits as a Tensor of its local shape.

    Args:
        micro_batch_num: the number of micro-batches.
        args_batch_dim: per positional input, its batch dim (a ``BatchDimSpec`` or an int;
            ``-1`` or ``None``: given whole to every micro-batch); default dim 0.
        kwargs_batch_dim: per keyword input, as ``args_batch_dim``; default dim 0.

    Example::

        args_split, kwargs_split = MicroBatch(2, kwargs_batch_dim={"mask": BatchDimSpec(1)})((x,), {"mask": m})
    """

    def __init__(self, micro_batch_num: int, args_batch_dim: Optional[Sequence[Any]] = None,
                 kwargs_batch_dim: Optional[Dict[str, Any]] = None) -> None:
        if isinstance(micro_batch_num, bool) or not isinstance(micro_batch_num, int) or micro_batch_num < 1:
            raise ValueError(f"_MicroBatch micro_batch_num must be a positive int, got {micro_batch_num!r}")
        self.micro_batch_num = micro_batch_num
        self.args_batch_dim = args_batch_dim
        self.kwargs_batch_dim = kwargs_batch_dim

    def __call__(self, args: Sequence[Any], kwargs: Optional[Dict[str, Any]] = None
                 ) -> Tuple[List[List[Any]], List[Dict[str, Any]]]:
        args = tuple(args)
        kwargs = dict(kwargs or {})
        args_spec = None if self.args_batch_dim is None else tuple(_spec(d) for d in self.args_batch_dim)
        kwargs_spec = None
        if self.kwargs_batch_dim is not None:
            kwargs_spec = {k: _spec(self.kwargs_batch_dim[k]) if k in self.kwargs_batch_dim else _spec(0)
                           for k in kwargs}
        split_args, split_kwargs = split_args_kwargs_into_chunks(args, kwargs, self.micro_batch_num,
                                                                 args_spec, kwargs_spec)
        return [list(a) for a in split_args], split_kwargs

    construct = __call__
