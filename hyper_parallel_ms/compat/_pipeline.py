"""HyperParallel 1.0's pipeline data types that MindFormers imports: ``MetaStepType``
(``hyper_parallel.core.pipeline_parallel.scheduler``) and ``_MicroBatch``
(``hyper_parallel.platform.mindspore.pipeline_parallel._utils``), on this library's pipelining.

Example::

    alias_hyper_parallel()
    from hyper_parallel.platform.mindspore.pipeline_parallel._utils import _MicroBatch
    args_split, kwargs_split = _MicroBatch(4)((x,), {"labels": y})
"""
from __future__ import annotations

import enum
from typing import Any, Dict, List, Optional, Sequence, Tuple

from ..pipelining._action import B, F, RECV_B, RECV_F, SEND_B, SEND_F, ActionKind
from ..pipelining._microbatch import TensorChunkSpec, split_args_kwargs_into_chunks

__all__ = ["MetaStepType", "MicroBatch"]


class MetaStepType(enum.Enum):
    """HyperParallel's kinds of schedule step; :attr:`action_kind` is the action of this
    library's schedules that each one is (``F``, ``B``, ``RECV_F``, ``SEND_F``, ``RECV_B``,
    ``SEND_B``). HyperParallel's overlap steps (``OVERLAP_B_F`` and its kin) are not members: the
    schedules refuse ``overlap_b_f=True`` (the two-thread overlap itself is
    :class:`~hyper_parallel_ms.pipelining.CommComputeOverlap`).

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

    @property
    def action_kind(self) -> ActionKind:
        """The kind of action of this library's schedules this step is."""
        return {MetaStepType.FWD: F, MetaStepType.BWD: B, MetaStepType.FWD_RECV: RECV_F,
                MetaStepType.FWD_SEND: SEND_F, MetaStepType.BWD_RECV: RECV_B, MetaStepType.BWD_SEND: SEND_B}[self]


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
