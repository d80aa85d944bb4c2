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
- ``exec_order``: each pp rank's steps (``MetaStep`` s), for logging;
- ``ScheduleInterleaved1F1B(..., overlap_b_f=True)`` pairs each steady-state backward with the
  forward after it (HyperParallel's ``OVERLAP_B_F`` steps; the pairs' transfers come before and
  after them). A pair runs one half after the other unless a callback is registered:
  ``register_custom_function(MetaStepType.OVERLAP_B_F, fn)`` calls ``fn(step, ctx)`` with the
  step (``step.sub_steps``: the backward's and the forward's ``MetaStep``) and a
  ``PipelineContext``; ``fn`` runs both halves through ``ctx.schedule._stage_dict[index]``'s
  ``backward_one_chunk(micro)`` and ``forward_one_chunk(micro, args, kwargs)`` (e.g. on two threads
  with ``CommComputeOverlap.run``), checked: a half left out or run twice fails the step;
- a new micro-batch count between steps (MindFormers' dynamic batch): set ``micro_batch_num``, give
  ``split_micro_batch`` a splitter of that count, then ``build_exec_order()`` (on every pp rank, which
  agree on the count) rebuilds the action lists; a run before that, or with a splitter of another
  count, raises naming the fix.

Example::

    enable_mindspore_backward_compat()
    schedule = Schedule1F1B([stage], 4)
    outputs = schedule.run(input_ids=ids, labels=labels)     # every rank: the same keywords
    grads = [p.grad for p in stage.submodule.trainable_params()]
"""
from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional, Sequence, Union

from .._mindspore.tensor_backward import backward_compat_enabled
from ..pipelining import PipelineStage
from ..pipelining import _schedules as pytorch_schedules
from ..pipelining._action import I, Action
from ..pipelining._pairing import pair_positions
from ..pipelining._runtime import Runtime
from ._pipeline import MetaStep, MetaStepType, MicroBatch, PipelineContext

__all__ = ["Schedule1F1B", "ScheduleGPipe", "ScheduleInterleaved1F1B"]


class StageChunks:
    """A stage as an ``OVERLAP_B_F`` callback drives it (``schedule._stage_dict[index]``,
    HyperParallel's ``forward_one_chunk`` / ``backward_one_chunk`` / ``recompute_one_chunk``); the
    stage's other attributes read through.

    Args:
        stage: the :class:`~hyper_parallel_ms.pipelining.PipelineStage`.
        runtime: the schedule's runtime, running the step's pair.

    Example::

        chunks = schedule._stage_dict[2]
        chunks.backward_one_chunk(0)          # inside an OVERLAP_B_F callback
    """

    def __init__(self, stage: PipelineStage, runtime: Runtime) -> None:
        self._stage, self._runtime = stage, runtime

    def forward_one_chunk(self, micro_index: int, args: Any = None, kwargs: Any = None) -> Any:
        """The stage's forward of ``micro_index`` on the schedule's own split of the step's inputs
        (``ctx.arg_mbs`` / ``ctx.kwarg_mbs``; other inputs are refused; a later stage reads the activation
        it received, not ``args``); returns its output (the loss on the last stage)."""
        return self._runtime.run_forward(self._stage.stage_index, micro_index, args, kwargs)

    def backward_one_chunk(self, micro_index: int, loss: Any = None, full_backward: bool = True,
                           last_backward: bool = False) -> None:
        """The stage's backward of ``micro_index``: the half the schedule pairs, a full backward or, under
        ``enable_dxdw_split``, its input gradient (a ``BWD_INPUT`` sub-step: the weight gradient is the
        schedule's ``BWD_WEIGHT`` step after the pair, whatever ``full_backward`` says); ``full_backward=False``
        for a full backward's half is refused (no weight-gradient step follows it)."""
        kind = self._runtime.run_backward(self._stage.stage_index, micro_index)
        if not full_backward and kind is not I:
            raise ValueError(f"backward_one_chunk({micro_index}, full_backward=False) of stage "
                             f"{self._stage.stage_index}: its pair's backward is whole (no BWD_WEIGHT step follows "
                             f"it; enable_dxdw_split splits the pairs of stages after the first)")

    def recompute_one_chunk(self, micro_index: int) -> None:
        """HyperParallel's forward re-run of a checkpointed chunk ahead of its backward: nothing to do
        here (a checkpointed Cell recomputes inside its own backward)."""
        del micro_index

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stage, name)


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
        self._args_batch_dim, self._kwargs_batch_dim = args_batch_dim, kwargs_batch_dim
        self._micro_batch_num = self.n_microbatches
        self.split_micro_batch = MicroBatch(self.n_microbatches, args_batch_dim, kwargs_batch_dim)
        self._custom_functions: Dict[MetaStepType, Callable] = {}

    def register_custom_function(self, step_type: MetaStepType, fn: Callable[[MetaStep, PipelineContext], None]
                                 ) -> None:
        """HyperParallel's: ``fn(step, ctx)`` runs each ``OVERLAP_B_F`` step (see the module's text);
        other step types take no callback here (raises)."""
        if step_type is not MetaStepType.OVERLAP_B_F:
            raise NotImplementedError(f"{type(self).__name__}.register_custom_function({step_type}): only "
                                      f"MetaStepType.OVERLAP_B_F steps take a callback here")
        if not callable(fn):
            raise TypeError(f"{type(self).__name__}.register_custom_function: fn must be callable fn(step, ctx), "
                            f"got {fn!r}")
        self._custom_functions[step_type] = fn

    @property
    def _stage_dict(self) -> Dict[int, StageChunks]:
        """This rank's stages by index, as a callback drives them (:class:`StageChunks`)."""
        return {stage.stage_index: StageChunks(stage, self._runtime) for stage in self.stages}

    def wait_fwd_recv(self, stage_index: int, micro_index: int) -> None:
        """HyperParallel's wait for a pair's forward input: received before the pair here (nothing to wait on)."""
        del stage_index, micro_index

    def wait_bwd_recv(self, stage_index: int, micro_index: int) -> None:
        """HyperParallel's wait for a pair's output gradient: received before the pair here (nothing to wait on)."""
        del stage_index, micro_index

    def update_losses(self, stage: Any, output: Any, losses: list) -> None:
        """HyperParallel's: the last stage's output of a forward a callback ran, appended to ``losses``."""
        if stage.is_last:
            losses.append(output)

    def _pair_runner(self, batches: Optional[list]) -> Optional[Callable[[Action, Action], None]]:
        fn = self._custom_functions.get(MetaStepType.OVERLAP_B_F)
        if fn is None:
            return None
        n = self.n_microbatches
        ctx = PipelineContext(self, [list(a) for a, _ in batches] if batches else [[] for _ in range(n)],
                              [dict(k) for _, k in batches] if batches else [{} for _ in range(n)], [])

        def run_pair(backward: Action, forward: Action) -> None:
            fn(MetaStep.pair(backward, forward), ctx)
        return run_pair

    @property
    def micro_batch_num(self) -> int:
        """Micro-batches per step; a new value takes effect at :meth:`build_exec_order`."""
        return self._micro_batch_num

    @micro_batch_num.setter
    def micro_batch_num(self, value: int) -> None:
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{type(self).__name__}.micro_batch_num must be a positive int, got {value!r}")
        self._micro_batch_num = value

    def build_exec_order(self) -> None:
        """HyperParallel's: the action lists rebuilt for :attr:`micro_batch_num` (called on every pp
        rank, which must agree on the count: checked)."""
        n = self._micro_batch_num
        self.plan = self._agreed_plan(self.stages, n, self.loss_fn)
        self._runtime.plan = self.plan
        self.n_microbatches = n

    def _check_micro_batch_count(self) -> None:
        if self._micro_batch_num != self.n_microbatches:
            raise RuntimeError(f"{type(self).__name__}.run: micro_batch_num is {self._micro_batch_num} but the action "
                               f"lists are built for {self.n_microbatches}; call build_exec_order() after setting it")
        splits = getattr(self.split_micro_batch, "micro_batch_num", self.n_microbatches)
        if splits != self.n_microbatches:
            raise RuntimeError(f"{type(self).__name__}.run: split_micro_batch splits into {splits} micro-batches but "
                               f"the schedule runs {self.n_microbatches}; give it _MicroBatch({self.n_microbatches}, "
                               f"...) as well")

    @property
    def exec_order(self) -> Dict[int, List[MetaStep]]:
        """Each pp rank's steps in order (HyperParallel's ``exec_order``: ``MetaStep`` s, a backward/forward pair
        one ``OVERLAP_B_F`` step)."""
        order: Dict[int, List[MetaStep]] = {}
        for rank, actions in enumerate(self.plan.actions):
            pairs = pair_positions(actions, self.plan.paired)
            order[rank] = [MetaStep.pair(action, pairs[at]) if at in pairs else MetaStep.of(action)
                           for at, action in enumerate(actions) if at - 1 not in pairs]
        return order

    def run(self, *args: Any, **kwargs: Any) -> list:
        """One step (see the module's text): the last stage's outputs per micro-batch on its rank,
        the gradients added into ``param.grad``."""
        if self.has_backward and not backward_compat_enabled():
            raise RuntimeError(f"{type(self).__name__}.run (HyperParallel's) adds the gradients into param.grad: call "
                               f"enable_mindspore_backward_compat() first (MindFormers' Trainer does), or use "
                               f"hyper_parallel_ms.pipelining's schedules and their gradients()")
        self._check_micro_batch_count()
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
