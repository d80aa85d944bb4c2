"""The base of the pipeline schedules: build the plan, check on every rank, run steps.

Every check whose cause only some ranks can see (a batch that does not split, a last stage
without ``loss_fn``, a stage on the wrong rank) is agreed over the pp mesh first (one small
all-reduce), so that every rank raises the same error instead of some waiting forever.

Example::

    schedule = Schedule1F1B(stage, n_microbatches=4, loss_fn=loss_fn)
    opt = nn.AdamWeightDecay(schedule.parameters())
    losses = []
    schedule.step(x, target=y, losses=losses)        # x on stage 0's rank, y on the last stage's
    opt(schedule.gradients())
"""
from __future__ import annotations

import inspect
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import mindspore as ms
import numpy as np
from mindspore import Tensor

from ..comm._agreement import extremes
from ._action import PipelineError, ScheduleError
from ._batch import (BAD_SPEC, TARGET_WITHOUT_LOSS, batch_message, batch_problem, check_chunk_specs,
                     microbatch_weights)
from ._compat import SCHEDULE_ARGS_DOC, refuse_unbuilt, schedule_arguments
from ._microbatch import merge_chunks, split_dims, split_microbatches
from ._plan import PipelinePlan, build_plan
from ._runtime import Runtime, StepStats
from ._shared import SharedParameters, SharedSpec, check_names_unshared
from ._stage import STAGE_MESH, PipelineStage, stage_cells

__all__ = ["PipelineSchedule", "shared_args", "first_argument_renamed"]


# the arguments every schedule takes after its own, written once: each schedule's docstring
# holds a ``{shared_args}`` line that :func:`shared_args` replaces with them
_SHARED_ARGS = """\
        args_chunk_spec: PyTorch's: per positional input of stage 0, how it splits: a
            :class:`TensorChunkSpec` (its dim), ``None`` (given whole to every micro-batch) or a
            structure of them like a nested input's; default: every Tensor along dim 0.
        kwargs_chunk_spec: as ``args_chunk_spec``, a dict per keyword input (unnamed ones: dim 0).
        output_merge_spec: how the last stage's outputs are merged: a :class:`TensorChunkSpec`, or a
            tuple of them for a tuple output (``None`` entries: a list over the micro-batches);
            default: concatenated along dim 0.
        scale_grads: average the gradients over micro-batches (default ``True``: one step equals
            the full-batch step when ``loss_fn`` is a mean over the batch; micro-batch ``m`` of
            ``rows_m`` rows weighs ``rows_m / rows``, which is PyTorch's ``1 / n_microbatches`` when
            the batch splits evenly); ``False`` sums them.
        shared_parameters: names (or tuples of names) of parameters several stages hold, e.g. an
            embedding tied to the head on the last stage: their gradients are summed over the stages
            holding them (one all-reduce per parameter and step over exactly the ranks holding it).
""" + SCHEDULE_ARGS_DOC


def first_argument_renamed(init: Callable, name: str, annotation: str) -> inspect.Signature:
    """``init``'s signature with its first argument after ``self`` called ``name``: the schedules'
    bases forward ``*args, **kwargs`` to :class:`PipelineSchedule`, whose signature is the one written
    out, and show it (``help()``, ``inspect.signature``) under their own first argument (PyTorch's
    ``stage`` or ``stages``)."""
    signature = inspect.signature(init)
    params = list(signature.parameters.values())
    params[1] = params[1].replace(name=name, annotation=annotation)
    return signature.replace(parameters=params)


def shared_args(cls: type) -> type:
    """Put the schedules' common arguments into ``cls``'s docstring (its ``{shared_args}`` line)."""
    if cls.__doc__:
        cls.__doc__ = cls.__doc__.replace("        {shared_args}\n", _SHARED_ARGS)
    return cls


@shared_args
class PipelineSchedule:
    """Base of the schedules: this rank's stages, the checked plan, and the runtime.

    Args:
        stages: this rank's :class:`PipelineStage` objects.
        n_microbatches: micro-batches per step (the batch splits along dim 0).
        loss_fn: ``loss_fn(output, target_microbatch)``; needed on the rank of the last stage to train
            (without it there the schedule runs forward only, as PyTorch's: :meth:`step` returns the
            outputs, :meth:`gradients` raises).
        {shared_args}

    Example::

        schedule = ScheduleGPipe(stage, 4, loss_fn)
        schedule.step(x, target=y)
    """

    schedule_name = ""
    # HyperParallel's schedules (hyper_parallel_ms.compat): every stage gets the step's keyword inputs, and
    # the last stage's output is the loss (no target)
    keywords_to_every_stage = False
    output_is_loss = False
    pairs = False                  # overlap_b_f=True builds backward/forward pairs (interleaved 1F1B)

    def __init__(self, stages: Sequence[PipelineStage], n_microbatches: Optional[int] = None,
                 loss_fn: Optional[Callable] = None, args_chunk_spec: Optional[Sequence[Any]] = None,
                 kwargs_chunk_spec: Optional[Dict[str, Any]] = None, output_merge_spec: Any = None, *,
                 scale_grads: bool = True, micro_batch_num: Optional[int] = None,
                 shared_parameters: Optional[SharedSpec] = None, args_batch_dim: Optional[Sequence[Any]] = None,
                 kwargs_batch_dim: Optional[Dict[str, Any]] = None, output_concat_dim: Any = None,
                 overlap_p2p: bool = False, overlap_b_f: bool = False, enable_dxdw_split: bool = False,
                 p2p_transport: str = "plain", swap: bool = False) -> None:
        name = type(self).__name__
        refuse_unbuilt(name, overlap_b_f=overlap_b_f, enable_dxdw_split=enable_dxdw_split, pairs=self.pairs,
                       p2p_transport=p2p_transport, swap=swap)
        n, args_chunk_spec, kwargs_chunk_spec, output_merge_spec = schedule_arguments(
            name, n_microbatches, args_chunk_spec, kwargs_chunk_spec, output_merge_spec,
            micro_batch_num=micro_batch_num, args_batch_dim=args_batch_dim, kwargs_batch_dim=kwargs_batch_dim,
            output_concat_dim=output_concat_dim, overlap_p2p=overlap_p2p)
        check_chunk_specs(args_chunk_spec, kwargs_chunk_spec, output_merge_spec, name)
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ScheduleError(f"n_microbatches must be a positive int, got {n!r}")
        stages = list(stages)
        problem = stage_cells(stages)
        if problem:
            raise TypeError(f"{type(self).__name__}: {problem}")
        stages.sort(key=lambda st: st.stage_index)
        self.stages = stages
        self.n_microbatches = n
        self.loss_fn = loss_fn
        self.args_chunk_spec, self.kwargs_chunk_spec = args_chunk_spec, kwargs_chunk_spec
        self.output_merge_spec = output_merge_spec
        self.scale_grads = scale_grads
        self.overlap_b_f, self.dxdw_split = overlap_b_f, enable_dxdw_split
        self.mesh = stages[0].mesh
        self.plan = self._agreed_plan(stages, n, loss_fn)
        self._shared = SharedParameters(shared_parameters, stages, self.mesh, type(self).__name__)
        check_names_unshared(stages, self.mesh, shared_parameters, type(self).__name__)
        for stage in stages:              # a norm of these alone is not the model's (TotalGradNorm checks)
            for p in stage.parameters():
                object.__setattr__(p, STAGE_MESH, self.mesh)
        self._runtime = Runtime(stages, self.plan, loss_fn)
        self._grads: Optional[Tuple[Tensor, ...]] = None

    # --------------------------------------------------------------- construction checks
    def _agreed_plan(self, stages: List[PipelineStage], n: int, loss_fn) -> PipelinePlan:
        mesh, name = self.mesh, type(self).__name__
        pp, me = mesh.size(), mesh.get_local_rank()
        mine = np.array([stages[0].num_stages, n, len(stages)], np.float32)
        high, low = extremes(mine, mesh)
        if (high != low).any():
            raise ScheduleError(f"{name}: the pp ranks disagree on (num_stages, n_microbatches, stages per rank): "
                                f"from {tuple(int(v) for v in low)} to {tuple(int(v) for v in high)}; build the same "
                                f"schedule on every rank")
        num_stages, v = stages[0].num_stages, len(stages)
        if num_stages != pp * v:
            raise ScheduleError(f"{name}: {num_stages} stages do not fit the pp mesh of {pp} ranks with {v} stage(s) "
                                f"per rank; use num_stages = {pp * v} or a pp mesh of {num_stages // v or 1} ranks")
        plan = build_plan(self.schedule_name, pp, n, stages_per_rank=v, overlap_b_f=self.overlap_b_f,
                          dxdw_split=self.dxdw_split)
        flags = np.zeros((pp, 5), np.float32)
        flags[me] = (tuple(st.stage_index for st in stages) != plan.stages_of(me),
                     plan.stages_of(me)[-1] == num_stages - 1 and loss_fn is None,
                     not all(st.has_backward for st in stages),
                     loss_fn is not None and not callable(loss_fn),
                     any(st.sharded_units() for st in stages))
        high, _ = extremes(flags.ravel(), mesh)
        high = high.reshape(pp, 5)
        if high[:, 3].any():               # on every rank, not only where it was given
            got = f"got {loss_fn!r}" if high[me, 3] else f"pp rank(s) {[r for r in range(pp) if high[r, 3]]} got one"
            raise TypeError(f"{name}: loss_fn must be callable, loss_fn(output, target) -> a scalar loss Tensor "
                            f"(e.g. a function or an nn.Cell such as nn.MSELoss()), or None; {got}")
        wrong = [f"rank {r} must hold stages {plan.stages_of(r)} ({self.schedule_name} placement)"
                 for r in range(pp) if high[r, 0]]
        if wrong:
            raise ScheduleError(f"{name}: " + "; ".join(wrong))
        # the last stage without loss_fn: forward only (PyTorch's schedules without a loss), on every rank
        self.forward_only = bool(high[:, 1].any())
        # a stage built with has_backward=False (HyperParallel's): every step runs as eval, on every rank
        self.has_backward = not high[:, 2].any()
        if high[:, 4].any():      # fully_shard stages: gathered once per step, gradients reduced once (PyTorch's)
            plan = build_plan(self.schedule_name, pp, n, stages_per_rank=v, fsdp=True, overlap_b_f=self.overlap_b_f,
                              dxdw_split=self.dxdw_split)
        return plan

    # --------------------------------------------------------------- one step
    def step(self, *args: object, target: Optional[Tensor] = None, losses: Optional[list] = None,
             return_outputs: bool = True, **kwargs: object):
        """Run one step on the whole batch; gradients from zero (see :meth:`gradients`).

        Args:
            args: the batch's inputs of stage 0 (read on the rank holding it). Tensors split along
                dim 0 as ``torch.tensor_split`` does (a batch of 10 rows into 4 micro-batches: 3, 3,
                2, 2 rows), inside nested tuples, lists and dicts too; other values go to every
                micro-batch unchanged.
            target: the batch's target (read on the rank holding the last stage; split as ``args``).
            losses: a list that receives each micro-batch's loss, in order, on the last stage's rank:
                cleared first (PyTorch's), so after the step it holds this step's ``n_microbatches``
                losses, e.g. ``sum(losses)``; a step that fails leaves it as it was. Other ranks leave it alone.
            return_outputs: ``False``: return ``None`` (no merge of the last stage's outputs).
            kwargs: keyword inputs of stage 0's Cell, split as ``args``.

        Returns:
            On the rank of the last stage, its outputs of the whole batch (concatenated along dim 0, or
            as ``output_merge_spec`` says; a tuple output element by element); ``None`` elsewhere.

        Raises:
            ValueError: a batch that does not split (fewer rows than micro-batches, an uneven split
                of Tensors with different rows, no target where a loss_fn needs one), on every rank.
            PipelineError: an action failed on another pp rank during the step (the rank where it
                failed raises that action's own error; :class:`TransferFailed` where a peer was
                lost). Every rank raises; the schedule then refuses further steps.

        Example::

            losses = []
            schedule.step(x, target=y, losses=losses)
        """
        return self._step(args, kwargs, target, losses, self.forward_only or not self.has_backward, return_outputs)

    def eval(self, *args: object, target: Optional[Tensor] = None, losses: Optional[list] = None,
             **kwargs: object):
        """PyTorch's forward-only step: the forwards of the whole batch, no backward, gradients of the
        last :meth:`step` kept; with a ``target`` (and the schedule's ``loss_fn``) each micro-batch's
        loss goes to ``losses``.

        Args:
            args: as :meth:`step`.
            target: the batch's target (optional).
            losses: as :meth:`step` (cleared first; without a target it is left empty).
            kwargs: as :meth:`step`.

        Returns:
            As :meth:`step`: the last stage's merged outputs on its rank, ``None`` elsewhere.

        Example::

            val_losses = []
            schedule.eval(x_val, target=y_val, losses=val_losses)
        """
        return self._step(args, kwargs, target, losses, True, True)

    def _step(self, args: tuple, kwargs: dict, target: Optional[Tensor], losses: Optional[list],
              forward_only: bool, return_outputs: Any) -> Any:
        """One step (``forward_only``: forwards only); the last stage's merged outputs on its rank
        with ``return_outputs`` (merged inside the step: a spec that does not fit fails it on every
        rank), its outputs per micro-batch (``[]`` elsewhere) with ``return_outputs="microbatches"``,
        else ``None``."""
        first, last = self.stages[0].is_first, self.stages[-1].is_last
        n = self.n_microbatches
        if self._runtime.failed:           # on every rank: a failed step raised on every rank
            raise PipelineError(f"{type(self).__name__}.step: an earlier step failed, and messages may be left in "
                                f"flight between the pp ranks; build the pipeline again in a new job")
        inputs = args + tuple(kwargs.values())
        none = (0,) * 6
        fcode, batches, spec_error = none, None, None
        if first or self.keywords_to_every_stage:   # split before the ranks agree: a failure is then agreed
            try:
                dims = split_dims(args, kwargs, self.args_chunk_spec, self.kwargs_chunk_spec)
                fcode = batch_problem(inputs, n, dims)
                if not fcode[0]:
                    batches = [(mb[:len(args)], dict(zip(kwargs, mb[len(args):])))
                               for mb in split_microbatches(inputs, n, dims)]
            except (ValueError, TypeError) as exc:
                spec_error, fcode = exc, (BAD_SPEC,) + none[1:]
        if self.forward_only:
            lcode = (TARGET_WITHOUT_LOSS,) + none[1:] if last and target is not None else none
        elif self.output_is_loss:
            lcode = none
        elif forward_only:               # eval: a target is optional
            lcode = batch_problem((target,), n) if last and target is not None else none
        else:
            lcode = batch_problem(None if target is None else (target,), n) if last else none
        high, _ = extremes(np.array(fcode + lcode, np.float32), self.mesh)
        if spec_error is not None:
            raise ValueError(f"{type(self).__name__}.step: {spec_error}") from spec_error
        for what, (code, index, size) in (("first", high[0:3]), ("last", high[6:9])):
            if code:
                raise ValueError(f"{type(self).__name__}.step: " + batch_message(
                    what, int(code), int(index), int(size), n))
        scales = microbatch_weights(high[3:6], high[9:12], n, self.scale_grads, type(self).__name__)
        targets = None
        if last and not self.forward_only and target is not None:
            targets = [t[0] for t in split_microbatches((target,), n)]
        elif last and self.output_is_loss and not forward_only:
            targets = [None] * n
        if not forward_only:
            self._grads = None
        per_microbatch = return_outputs == "microbatches"
        merge = (lambda outs: merge_chunks(outs, self.output_merge_spec)) if (
            last and return_outputs and not per_microbatch) else None
        got: Optional[list] = None if losses is None else []
        stage_kwargs = [kw for _, kw in batches] if self.keywords_to_every_stage and batches else None
        outs = self._runtime.run(self.plan.actions[self.mesh.get_local_rank()], batches if first else None, targets,
                                 got, forward_only=forward_only, scales=scales, merge=merge, stage_kwargs=stage_kwargs,
                                 pair_runner=self._pair_runner(batches))
        if last and losses is not None:        # PyTorch's: the list holds this step's losses only
            losses[:] = got
        if not forward_only:
            self._grads = self._shared.reduce(self._runtime.parameters(), self._runtime.gradients())
        if per_microbatch:
            return list(outs) if last else []
        return outs if merge is not None else None


    def _pair_runner(self, batches: Optional[list]) -> Optional[Callable]:
        """What runs the plan's backward/forward pairs (HyperParallel's schedules: a registered
        ``OVERLAP_B_F`` callback); ``None``: one after the other."""
        return None

    def run(self, *args: object, target: Optional[Tensor] = None, losses: Optional[list] = None,
            **kwargs: object) -> list:
        """HyperParallel's step: as :meth:`step`, returning HyperParallel's list, one entry per
        micro-batch on the rank of the last stage (``[]`` elsewhere): each micro-batch's loss with a
        ``loss_fn`` (the step trains), else the last stage's output of each micro-batch (the step
        runs forward only, see docs/pipelining.md: HyperParallel trains there with the output as the loss).

        Args:
            args: as :meth:`step`.
            target: as :meth:`step`.
            losses: a list to fill instead of a new one (cleared first, as :meth:`step`).
            kwargs: as :meth:`step`.

        Example::

            losses = schedule.run(x, target=y)        # [loss of micro-batch 0, ...] on the last stage's rank
        """
        got = [] if losses is None else losses
        got.clear()
        if self.forward_only:
            got.extend(self._step(args, kwargs, target, None, True, "microbatches"))
        else:
            self._step(args, kwargs, target, got, not self.has_backward, False)
        return got

    def parameters(self) -> List[ms.Parameter]:
        """This rank's stages' trainable parameters (stage order), for an optimizer.

        Example::

            opt = nn.AdamWeightDecay(schedule.parameters())
        """
        return self._runtime.parameters()

    @property
    def replica_parameters(self) -> Tuple[ms.Parameter, ...]:
        """This rank's shared parameters (``shared_parameters``) that a lower pp rank holds too: a
        sum over the pp ranks (a global gradient norm) counts each of them once, there.

        Example::

            skip = {id(p) for p in schedule.replica_parameters}
        """
        return tuple(self._shared.counted_elsewhere)

    def gradients(self) -> Tuple[Tensor, ...]:
        """The gradients of the last step, aligned with :meth:`parameters` (zeros where none reached).

        Example::

            opt(schedule.gradients())
        """
        if self.forward_only:
            raise ScheduleError(f"{type(self).__name__} has no loss_fn on its last stage and runs forward only: no "
                                "gradients; pass loss_fn=... when building the schedule to train")
        if not self.has_backward:
            raise ScheduleError(f"{type(self).__name__} holds a stage built with has_backward=False (on some pp rank) "
                                "and runs forwards only: no gradients; build every stage with has_backward=True to "
                                "train")
        return self._runtime.gradients() if self._grads is None else self._grads

    @property
    def step_stats(self) -> StepStats:
        """Wall time, time in compute actions and the most micro-batch forwards (activations) held at once, in
        the last :meth:`step` on this rank; set ``schedule.profile = True`` for exact compute times."""
        return self._runtime.stats

    @property
    def profile(self) -> bool:
        """Whether each compute action waits for its kernels (exact :attr:`step_stats`; slower)."""
        return self._runtime.profile

    @profile.setter
    def profile(self, value: bool) -> None:
        self._runtime.profile = bool(value)

    @property
    def forward_calls(self) -> int:
        """How many stage forwards this rank ran since the schedule was made (one per stage and micro-batch)."""
        return self._runtime.forward_calls

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.plan.num_stages} stages, {self.n_microbatches} micro-batches)"
