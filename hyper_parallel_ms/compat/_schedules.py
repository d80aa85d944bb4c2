"""HyperParallel 1.0's pipeline schedules (``hyper_parallel.core.pipeline_parallel.Schedule1F1B``,
``ScheduleGPipe``, ``ScheduleInterleaved1F1B``), which MindFormers' pipeline trainer builds and runs,
on this library's schedules. What differs from PyTorch's (``hyper_parallel_ms.pipelining``):

- ``Schedule(stages, micro_batch_num, args_batch_dim=None, kwargs_batch_dim=None,
  output_concat_dim=None, overlap_p2p=False, ...)``: the one-stage schedules take a list of one stage
  too, and there is no ``loss_fn``: **the last stage's output is the loss** (a tuple's first element),
  its backward seeded by the stage's ``get_last_stage_sens`` and summed over the micro-batches (no
  ``1 / n`` weight: MindFormers' ``loss_scale`` carries it);
- ``run(*args, **kwargs)``: positional inputs go to the first stage, **keyword inputs to every stage**
  (each rank splits them: MindFormers gives every pp rank the batch, and its last stage reads
  ``labels``); it returns the last stage's outputs per micro-batch (``[]`` on other ranks) and **adds
  the gradients into each parameter's** ``grad`` (``enable_mindspore_backward_compat()`` must be on, as
  MindFormers' trainer turns it on); stages built with ``has_backward=False`` run forwards only;
- ``exec_order``: each pp rank's actions, for logging.

Example::

    enable_mindspore_backward_compat()
    schedule = Schedule1F1B([stage], 4)
    outputs = schedule.run(input_ids=ids, labels=labels)     # every rank: the same keywords
    grads = [p.grad for p in stage.submodule.trainable_params()]
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence, Union

from .._mindspore.tensor_backward import backward_compat_enabled
from ..pipelining import PipelineStage
from ..pipelining import _schedules as pytorch_schedules

__all__ = ["Schedule1F1B", "ScheduleGPipe", "ScheduleInterleaved1F1B"]


def _output_as_loss(output: Any, _target: Any) -> Any:
    """HyperParallel's last stage: its output is the loss (the first element of a tuple or list)."""
    return output[0] if isinstance(output, (tuple, list)) else output


class _HyperParallelSchedule:
    """What HyperParallel's schedules add to this library's (see the module's text)."""

    keywords_to_every_stage = True
    output_is_loss = True
    one_stage_per_rank = False

    def __init__(self, stages: Union[PipelineStage, Sequence[PipelineStage]], micro_batch_num: int,
                 args_batch_dim: Optional[Sequence[Any]] = None, kwargs_batch_dim: Optional[Dict[str, Any]] = None,
                 output_concat_dim: Any = None, overlap_p2p: bool = False, overlap_b_f: bool = False,
                 enable_dxdw_split: bool = False, p2p_transport: str = "plain", swap: bool = False) -> None:
        if self.one_stage_per_rank and isinstance(stages, (list, tuple)):
            if len(stages) != 1:
                raise TypeError(f"{type(self).__name__} runs one PipelineStage per rank, got {len(stages)}; use "
                                f"ScheduleInterleaved1F1B for several")
            stages = stages[0]
        super().__init__(stages, micro_batch_num, _output_as_loss, scale_grads=False,
                         args_batch_dim=args_batch_dim, kwargs_batch_dim=kwargs_batch_dim,
                         output_concat_dim=output_concat_dim, overlap_p2p=overlap_p2p, overlap_b_f=overlap_b_f,
                         enable_dxdw_split=enable_dxdw_split, p2p_transport=p2p_transport, swap=swap)

    @property
    def micro_batch_num(self) -> int:
        return self.n_microbatches

    @property
    def exec_order(self) -> Dict[int, List[str]]:
        """Each pp rank's actions in order (HyperParallel's ``exec_order``, printable)."""
        return {rank: [str(a) for a in actions] for rank, actions in enumerate(self.plan.actions)}

    def run(self, *args: Any, **kwargs: Any) -> list:
        """One step (see the module's text): the last stage's outputs per micro-batch on its rank,
        the gradients added into ``param.grad``."""
        if self.has_backward and not backward_compat_enabled():
            raise RuntimeError(f"{type(self).__name__}.run (HyperParallel's) adds the gradients into param.grad: call "
                               f"enable_mindspore_backward_compat() first (MindFormers' Trainer does), or use "
                               f"hyper_parallel_ms.pipelining's schedules and their gradients()")
        outputs = self._step(args, kwargs, None, None, not self.has_backward, "microbatches")
        if self.has_backward:
            for param, grad in zip(self.parameters(), self.gradients()):
                param._grad = grad if param._grad is None else param._grad + grad
        return outputs


class ScheduleGPipe(_HyperParallelSchedule, pytorch_schedules.ScheduleGPipe):
    """HyperParallel's GPipe (see the module's text).

    Example::

        ScheduleGPipe([stage], 4).run(input_ids=ids, labels=labels)
    """

    one_stage_per_rank = True


class Schedule1F1B(_HyperParallelSchedule, pytorch_schedules.Schedule1F1B):
    """HyperParallel's 1F1B (see the module's text).

    Example::

        Schedule1F1B([stage], 4).run(input_ids=ids, labels=labels)
    """

    one_stage_per_rank = True


class ScheduleInterleaved1F1B(_HyperParallelSchedule, pytorch_schedules.ScheduleInterleaved1F1B):
    """HyperParallel's interleaved 1F1B (see the module's text).

    Example::

        ScheduleInterleaved1F1B([stage_r, stage_r_plus_pp], 4).run(input_ids=ids, labels=labels)
    """
