"""The one runtime: executes a rank's checked action list (``PipelinePlan.actions[rank]``).

Each forward ``F`` runs the stage's forward once (:func:`._stage.stage_forward`: the Cell, with
the loss on the last stage, under ``ms.jit`` for a compiled stage), recording its autodiff
tape (:func:`~hyper_parallel_ms._mindspore.taped_call`, which also serves Cells with a custom
``bprop``: tensor-parallel styles, fully_shard); ``B`` differentiates that tape for the stage's
inputs and parameters; the zero-bubble pair ``I`` / ``W`` differentiates it twice, inputs
first (keeping the tape), parameters later (a compiled stage's backward answers one call:
its ``I`` computes both and ``W`` adds the weight gradients). No forward runs again.
``SEND`` / ``RECV`` move activations and gradients as messages of :mod:`._channel` (a header
naming the action and the shapes, then the tensors); stages on one rank hand over directly.
A backward the plan pairs with the forward after it (``plan.paired``, HyperParallel's
``OVERLAP_B_F``) runs with that forward through ``pair_runner`` when one is given (which must run
both, e.g. on two threads: :meth:`Runtime.run_forward` / :meth:`Runtime.run_backward`), else
the two run one after the other.
``UNSHARD`` / ``RESHARD`` / ``REDUCE_GRAD`` act on a fully_shard stage's units
(:mod:`._fsdp_actions`): gathered once per step, the backwards' gradients accumulated unreduced
and reduced once, at ``REDUCE_GRAD``. A failed action ends the step on every rank (:mod:`._failure`).

Example::

    runtime = Runtime(stages, plan, loss_fn)
    runtime.run(plan.actions[rank], microbatches, targets, losses, scales=[0.25] * 4)   # 4 micro-batches, averaged
    runtime.gradients()            # tuple aligned with runtime.parameters()
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Set, Tuple

import mindspore as ms
import numpy as np
from mindspore import Tensor, ops

from .._mindspore import discard_tapes, no_grad, tape_backward, taped_call
from ..comm._exchange import NotReady
from . import _fsdp_actions
from ._action import (B, F, I, RECV_B, RECV_F, REDUCE_GRAD, RESHARD, SEND_B, SEND_F, UNSHARD, W, Action, ActionKind,
                      ScheduleError)
from ._channel import Channel
from ._failure import end_step
from ._microbatch import is_float, stage_outputs
from ._pairing import pair_positions
from ._plan import PipelinePlan
from ._stage import PipelineStage, check_shapes, stage_forward
from ._stage_errors import check_loss, forward_failure, input_origin

__all__ = ["Runtime", "StepStats"]

Key = Tuple[int, int]     # (stage, micro-batch)


@dataclass(frozen=True)
class StepStats:
    """What one step cost on this rank.

    Args:
        seconds: the step's wall time (the action list, transfers included).
        compute_seconds: wall time inside F / B / I / W actions (with ``profile`` on, each waited
            for its kernels; otherwise PyNative's asynchronous queue may move time into transfers).
        peak_live_forwards: the most micro-batch forwards whose autodiff tape (activations) this
            rank held at once.

    Example::

        schedule.step(x, target=y)
        stats = schedule.step_stats            # StepStats(seconds=..., compute_seconds=..., peak_live_forwards=4)
        idle = 1 - stats.compute_seconds / stats.seconds
    """

    seconds: float
    compute_seconds: float
    peak_live_forwards: int


def _with_keywords(forward: Callable, kwargs: dict) -> Callable:
    """``forward`` with stage 0's keyword inputs of one micro-batch bound (a named function: the
    PyNative executor names its top graph after it)."""
    def forward_with_keywords(*args):
        return forward(*args, **kwargs)
    return forward_with_keywords


class Runtime:
    """Executes action lists for this rank's ``stages`` of ``plan``, accumulating gradients."""

    def __init__(self, stages: Sequence[PipelineStage], plan: PipelinePlan, loss_fn: Optional[Callable]) -> None:
        self.stages: Dict[int, PipelineStage] = {s.stage_index: s for s in stages}
        self.plan = plan
        self.loss_fn = loss_fn
        self.mesh = stages[0].mesh
        self._params: Dict[int, List[ms.Parameter]] = {s: self.stages[s].parameters() for s in sorted(self.stages)}
        self._forwards: Dict[int, Callable] = {s: stage_forward(st, loss_fn) for s, st in self.stages.items()}
        self._plain: Dict[int, Callable] = {}          # last stage without the loss (built when first needed)
        self._grads: Dict[int, List[Optional[Tensor]]] = {}
        self._channel = Channel(self.mesh)
        self.forward_calls = 0
        self.profile = False               # wait for each compute action's kernels (exact compute times)
        self.stats = StepStats(0.0, 0.0, 0)
        self.failed = False                # a step failed: messages may be in flight, no more steps
        self._pair: Optional[Tuple[Set[Action], Set[Action]]] = None    # (the pair running, its halves run)

    def parameters(self) -> List[ms.Parameter]:
        """This rank's stages' trainable parameters, stage by stage (a Parameter two stages share: once)."""
        seen, out = set(), []
        for s in sorted(self._params):
            for p in self._params[s]:
                if id(p) not in seen:
                    seen.add(id(p))
                    out.append(p)
        return out

    def gradients(self) -> Tuple[Tensor, ...]:
        """Gradients accumulated by the last :meth:`run`, aligned with :meth:`parameters` (zeros if
        unreached; a Parameter of several stages gets the sum of their gradients)."""
        total: Dict[int, Tensor] = {}
        for s in sorted(self._params):
            for p, g in zip(self._params[s], self._grads.get(s, [None] * len(self._params[s]))):
                if g is not None:
                    total[id(p)] = g if id(p) not in total else total[id(p)] + g
        return tuple(total.get(id(p), ops.zeros(p.shape, p.dtype)) for p in self.parameters())

    # --------------------------------------------------------------- one step
    def run(self, actions: Sequence[Action], microbatches: Optional[Sequence[Tuple[tuple, dict]]],
            targets: Optional[Sequence[Tensor]], losses: Optional[list], forward_only: bool = False,
            scales: Sequence[float] = (), merge: Optional[Callable[[list], Any]] = None,
            stage_kwargs: Optional[Sequence[dict]] = None,
            pair_runner: Optional[Callable[[Action, Action], None]] = None) -> Any:
        """Run ``actions`` (this rank's list); returns the last stage's outputs per micro-batch (if held
        here), or what ``merge`` makes of them (run inside the step: its error is the step's, on every rank).
        ``microbatches``: stage 0's ``(args, kwargs)`` per micro-batch (on its rank). ``scales``: the
        weight of each micro-batch's loss in the gradients (read on the last stage's rank).
        ``stage_kwargs``: the keyword inputs of every later stage per micro-batch (HyperParallel's schedules
        give each stage the step's keyword inputs; default: none).
        ``forward_only``: only the forwards and their transfers run, nothing recorded for a backward
        (the last stage's losses only where ``targets`` are given; the gradients of the last
        training step are kept).
        ``pair_runner(backward, forward)``: runs each pair of ``plan.paired`` (both halves, checked);
        default: one after the other.

        Ends with the pp ranks' agreement on the step's outcome (:mod:`._failure`): if an action
        fails on any rank, every rank raises (the failed one its own error)."""
        if not forward_only:
            self._grads = {s: [None] * len(ps) for s, ps in self._params.items()}
        self._inputs: Dict[Key, Tuple[Tensor, ...]] = {}
        self._tape: Dict[Key, Tuple[Tuple[Tensor, ...], Tuple[Tensor, ...]]] = {}   # (outputs, sens)
        self._outs: Dict[Key, Tuple[Tensor, ...]] = {}
        self._out_grads: Dict[Key, Tuple[Tensor, ...]] = {}
        self._weight_grads: Dict[Key, Tuple[Optional[Tensor], ...]] = {}     # compiled stages: from I to W
        self._results: Dict[int, Tensor] = {}
        self._batches, self._targets, self._losses, self._scales = microbatches, targets, losses, scales
        self._stage_kwargs = stage_kwargs
        self._forward_only = forward_only
        if forward_only:
            actions = [a for a in actions if a.kind in (F, SEND_F, RECV_F, UNSHARD, RESHARD)]
        self._channel.new_step()
        for stage in self.stages.values():
            stage.bwd_cache.clear()
        handlers = {F: self._forward, B: self._backward, I: self._backward_input, W: self._backward_weight,
                    SEND_F: self._send_f, RECV_F: self._recv_f, SEND_B: self._send_b, RECV_B: self._recv_b,
                    UNSHARD: self._unshard, RESHARD: self._reshard, REDUCE_GRAD: self._reduce_grad}
        last_weight_grad = {a.stage: i for i, a in enumerate(actions) if a.kind in (B, W)}
        reducing = {a.stage for a in actions if a.kind is REDUCE_GRAD}     # stages reducing at REDUCE_GRAD
        self._gathered: Set[int] = set()
        began, compute, live = time.perf_counter(), 0.0, 0
        at, error = None, None
        try:
            for s in reducing:          # every backward accumulates unreduced gradients
                self.stages[s].set_requires_gradient_sync(False)
            pairs = {} if forward_only or pair_runner is None else pair_positions(actions, self.plan.paired)
            skip = -1
            for at, action in enumerate(actions):
                if at == skip:                    # a pair's forward, run with its backward
                    continue
                if action.kind in (B, W) and action.stage not in reducing:
                    # fully_shard units reduce the gradient summed over the micro-batches once per step
                    self.stages[action.stage].set_requires_gradient_sync(at == last_weight_grad[action.stage])
                if not action.kind.is_compute:
                    handlers[action.kind](action.stage, action.microbatch)
                    continue
                start = time.perf_counter()
                if at in pairs:
                    self._run_pair(pair_runner, action, pairs[at])
                    skip = at + 1
                else:
                    handlers[action.kind](action.stage, action.microbatch)
                if self.profile:
                    ms.runtime.synchronize()
                compute += time.perf_counter() - start
                live = max(live, len(self._tape))
            results = [self._results[m] for m in sorted(self._results)]
            if merge is not None and results:
                results = merge(results)
        except NotReady:
            raise                  # not a failure: the step runs again once the sender has run
        except BaseException as exc:  # noqa: BLE001  (end_step raises it once every rank knows)
            error = exc
        finally:
            for s in sorted(self._gathered):         # a step that ended early: the pieces back in place
                self._reshard(s, None)
            for stage in self.stages.values():
                stage.set_requires_gradient_sync(True)
                stage.bwd_cache.clear()
            self._inputs = self._tape = self._outs = self._out_grads = self._weight_grads = {}
        self.failed = error is not None
        if self.failed:
            discard_tapes()       # the step's records and a failed forward's open one: later ops must not be taped
        end_step(self._channel, self.plan, actions, at, error)
        if self.profile:
            ms.runtime.synchronize()
        self.stats = StepStats(time.perf_counter() - began, compute, live)
        return results

    # --------------------------------------------------------------- compute
    def _run_pair(self, pair_runner: Callable[[Action, Action], None], backward: Action, forward: Action) -> None:
        """``pair_runner(backward, forward)``, checked to have run both halves, once each."""
        self._pair = ({backward, forward}, set())
        try:
            pair_runner(backward, forward)
            missing = [str(a) for a in (backward, forward) if a not in self._pair[1]]
        finally:
            self._pair = None
        if missing:
            raise ScheduleError(f"the pair runner of {backward} and {forward} did not run {', '.join(missing)} (each "
                                f"half must run once, e.g. through the stages' backward_one_chunk / "
                                f"forward_one_chunk)")

    def run_forward(self, s: int, m: int, args: Optional[Sequence[Any]] = None,
                    kwargs: Optional[Mapping[str, Any]] = None) -> Any:
        """Stage ``s``'s forward of micro-batch ``m`` as a pair runner runs it (any thread); returns
        the stage's output (the loss on the last stage). ``args`` (read by the first stage) and ``kwargs``,
        when given, must be the step's own split of micro-batch ``m`` (the stage runs on that: checked)."""
        self._check_own_inputs(s, m, args, kwargs)
        self._pair_half(Action(s, F, m))
        self._forward(s, m)
        return self._results.get(m) if self.stages[s].is_last else self._latest_output(s, m)

    def run_backward(self, s: int, m: int) -> ActionKind:
        """Stage ``s``'s backward of micro-batch ``m`` as a pair runner runs it (any thread; the
        caller's thread must have PyNative's gradient flags on): the half the plan pairs, a full
        backward (B) or its input gradient (I, the weight gradient being the plan's W after the
        pair); returns which."""
        pair = self._pair
        kind = I if pair is not None and Action(s, I, m) in pair[0] else B
        self._pair_half(Action(s, kind, m))
        (self._backward_input if kind is I else self._backward)(s, m)
        return kind

    def _check_own_inputs(self, s: int, m: int, args: Optional[Sequence[Any]],
                          kwargs: Optional[Mapping[str, Any]]) -> None:
        """Refuse inputs for stage ``s``'s forward of ``m`` other than the step's own split of them."""
        if s == 0:
            own_args, own_kwargs = self._batches[m]
        else:                   # a later stage reads the activation it received: its args are not used
            own_args, own_kwargs = args, {} if self._stage_kwargs is None else self._stage_kwargs[m]
        same_args = args is None or (len(args) == len(own_args) and all(a is b for a, b in zip(args, own_args)))
        same_kwargs = kwargs is None or (set(kwargs) == set(own_kwargs) and all(kwargs[k] is own_kwargs[k]
                                                                               for k in kwargs))
        if not (same_args and same_kwargs):
            raise ScheduleError(f"{Action(s, F, m)}: the inputs given are not the step's own micro-batch {m}; a pair "
                                f"runner's forward runs on the schedule's split of the step's inputs (ctx.arg_mbs / "
                                f"ctx.kwarg_mbs)")

    def _pair_half(self, action: Action) -> None:
        pair = self._pair
        if pair is None or action not in pair[0]:
            running = "no pair is running" if pair is None else f"the pair running is {sorted(map(str, pair[0]))}"
            raise ScheduleError(f"{action} cannot run now: {running} (a pair runner runs its own two halves)")
        if action in pair[1]:
            raise ScheduleError(f"{action} ran twice in one pair")
        pair[1].add(action)

    def _latest_output(self, s: int, m: int) -> Any:
        """What stage ``s``'s forward of ``m`` handed on (to the next stage here, or to its SEND)."""
        if (s, m) in self._outs:
            return self._outs[s, m]
        return self._inputs.get((s + 1, m))

    def _forward(self, s: int, m: int) -> None:
        stage = self.stages[s]
        args, kwargs = self._batches[m] if s == 0 else (
            self._inputs[s, m], {} if self._stage_kwargs is None else self._stage_kwargs[m])
        forward = _with_keywords(self._forwards[s], kwargs) if kwargs else self._forwards[s]
        self.forward_calls += 1
        check_shapes(stage, args, stage.input_shapes, "inputs")
        if self._forward_only:
            with no_grad():
                if stage.is_last and self._targets is not None:
                    target = self._targets[m]
                    out, loss = self._call(s, m, lambda: forward(*args, target), args, kwargs, target)
                    check_loss(loss, s)
                    if self._losses is not None:
                        self._losses.append(loss)
                else:
                    plain = self._plain_forward(s, kwargs) if stage.is_last else forward
                    out = self._call(s, m, lambda: plain(*args), args, kwargs, None)
            check_shapes(stage, out, stage.output_shapes, "outputs")
            if stage.is_last:
                self._results[m] = out
            elif self.plan.placement[s + 1] == self.plan.placement[s]:
                self._inputs[s + 1, m] = stage_outputs(out, s)
            else:
                self._outs[s, m] = stage_outputs(out, s)
            return
        if stage.is_last:
            target = self._targets[m]
            out, loss = self._call(s, m, lambda: taped_call(forward, *args, target), args, kwargs, target)
            check_loss(loss, s)
            self._results[m] = out
        else:
            out = self._call(s, m, lambda: taped_call(forward, *args), args, kwargs, None)
        check_shapes(stage, out, stage.output_shapes, "outputs")
        if stage.is_last:
            if self._losses is not None:
                self._losses.append(loss)
            self._tape[s, m] = ((loss,), (self._last_sens(stage, loss, m),))
            return
        outs = stage_outputs(out, s)
        self._tape[s, m] = (tuple(o for o in outs if is_float(o)), None)
        if self.plan.placement[s + 1] == self.plan.placement[s]:
            self._take_inputs(s + 1, m, tuple(ops.stop_gradient(o) for o in outs))
        else:
            self._outs[s, m] = outs

    def _last_sens(self, stage: PipelineStage, loss: Tensor, m: int) -> Tensor:
        """The backward seed of micro-batch ``m``'s loss: the stage's ``get_last_stage_sens`` times the
        micro-batch's weight."""
        seed = stage.get_last_stage_sens(loss)
        if isinstance(seed, (list, tuple)) and len(seed) == 1:
            seed = seed[0]
        if not isinstance(seed, Tensor) or tuple(seed.shape) != tuple(loss.shape):
            raise ScheduleError(f"stage {stage.stage_index}: get_last_stage_sens returned {type(seed).__name__} "
                                f"{getattr(seed, 'shape', '')}; it must return one Tensor shaped like the loss "
                                f"{tuple(loss.shape)}")
        seed = seed.astype(loss.dtype) if seed.dtype != loss.dtype else seed
        scale = self._scales[m]
        return seed if scale == 1 else seed * Tensor(np.full(loss.shape, scale), loss.dtype)

    def _call(self, s: int, m: int, call: Callable[[], Any], args: tuple, kwargs: dict, target: Any) -> Any:
        """``call()``, stage ``s``'s forward of micro-batch ``m``; its error re-raised as PyTorch's
        stages do (a ``RuntimeError`` from it), naming the stage and its inputs' shapes and origin."""
        try:
            return call()
        except NotReady:
            raise
        except Exception as exc:  # noqa: BLE001  (any error of the user's Cell or loss_fn)
            origin = input_origin(s, m, self.plan.placement)
            raise RuntimeError(forward_failure(s, m, args, kwargs, origin, target, exc)) from exc

    def _plain_forward(self, s: int, kwargs: dict) -> Callable:
        """The last stage's forward without its loss (a forward-only step without targets)."""
        if self.loss_fn is None:
            forward = self._forwards[s]
        else:
            if s not in self._plain:
                self._plain[s] = stage_forward(self.stages[s], None)
            forward = self._plain[s]
        return _with_keywords(forward, kwargs) if kwargs else forward

    def _take_inputs(self, s: int, m: int, tensors: Tuple[Tensor, ...]) -> None:
        for t in tensors:
            if is_float(t):
                t.requires_grad_()
        self._inputs[s, m] = tensors

    def _sens(self, s: int, m: int) -> Tuple[Tuple[Tensor, ...], Tuple[Tensor, ...]]:
        outputs, sens = self._tape[s, m]
        return outputs, (self._out_grads.pop((s, m)) if sens is None else sens)

    def _grad_inputs(self, s: int, m: int) -> List[Tensor]:
        return [] if s == 0 else [t for t in self._inputs[s, m] if is_float(t)]

    def _backward(self, s: int, m: int) -> None:
        outputs, sens = self._sens(s, m)
        del self._tape[s, m]
        inputs = self._grad_inputs(s, m)
        grads = tape_backward(outputs, sens, inputs + self._params[s])
        self._give_input_grads(s, m, inputs, grads[:len(inputs)])
        self._accumulate(s, grads[len(inputs):])
        self._inputs.pop((s, m), None)

    def _backward_input(self, s: int, m: int) -> None:
        outputs, sens = self._sens(s, m)
        inputs = self._grad_inputs(s, m)
        if self.stages[s].jit:
            # a compiled forward's backward graph answers one call only (a second one, after
            # keep_graph, returns None for what the first left out): I computes the weight
            # gradients too and W adds them
            self._tape[s, m] = ((), ())
            grads = tape_backward(outputs, sens, inputs + self._params[s])
            self._weight_grads[s, m] = grads[len(inputs):]
            if inputs:
                self._give_input_grads(s, m, inputs, grads[:len(inputs)])
            return
        self._tape[s, m] = (outputs, sens)           # kept for W
        if inputs:
            self._give_input_grads(s, m, inputs, tape_backward(outputs, sens, inputs, keep_graph=True))

    def _backward_weight(self, s: int, m: int) -> None:
        outputs, sens = self._tape.pop((s, m))
        if self.stages[s].jit:
            self._accumulate(s, self._weight_grads.pop((s, m)))
        elif self._params[s]:
            self._accumulate(s, tape_backward(outputs, sens, self._params[s]))
        self._inputs.pop((s, m), None)

    def _give_input_grads(self, s: int, m: int, inputs: List[Tensor], grads: Sequence[Optional[Tensor]]) -> None:
        grads = tuple(ops.zeros(x.shape, x.dtype) if g is None else g for x, g in zip(inputs, grads))
        if self.plan.placement[s - 1] == self.plan.placement[s]:
            self._out_grads[s - 1, m] = grads
        else:
            self.stages[s].bwd_cache[m] = grads       # sent by SEND_B through the stage's bwd_send_specs

    # --------------------------------------------------------------- parameter actions (fully_shard stages)
    def _unshard(self, s: int, _: None) -> None:
        _fsdp_actions.unshard(self.stages[s])
        self._gathered.add(s)

    def _reshard(self, s: int, _: None) -> None:
        self._gathered.discard(s)
        _fsdp_actions.reshard(self.stages[s])

    def _reduce_grad(self, s: int, _: None) -> None:
        reduced = _fsdp_actions.reduce_gradients(self.stages[s])
        self.stages[s].set_requires_gradient_sync(True)
        self._accumulate(s, [reduced.get(id(p)) for p in self._params[s]])

    def _accumulate(self, s: int, grads: Sequence[Optional[Tensor]]) -> None:
        acc = self._grads[s]
        for i, g in enumerate(grads):
            if g is not None:
                acc[i] = g if acc[i] is None else acc[i] + g

    # --------------------------------------------------------------- transfers
    def _peer(self, stage: int) -> int:
        return self.plan.placement[stage]

    def _send_f(self, s: int, m: int) -> None:
        self._channel.send(Action(s, SEND_F, m), self._outs.pop((s, m)), self._peer(s + 1))

    def _recv_f(self, s: int, m: int) -> None:
        self._take_inputs(s, m, self._channel.recv(Action(s, RECV_F, m), self._peer(s - 1)))

    def _send_b(self, s: int, m: int) -> None:
        grads = self.stages[s].bwd_send_specs(m)
        if not isinstance(grads, (list, tuple)) or not all(isinstance(g, Tensor) for g in grads):
            raise ScheduleError(f"stage {s}: bwd_send_specs({m}) returned {grads!r}; it must return the list of input "
                                f"gradients to send back")
        self._channel.send(Action(s, SEND_B, m), tuple(grads), self._peer(s - 1))

    def _recv_b(self, s: int, m: int) -> None:
        outputs = self._tape[s, m][0]
        grads = self._channel.recv(Action(s, RECV_B, m), self._peer(s + 1), outputs)
        if [(g.shape, g.dtype) for g in grads] != [(o.shape, o.dtype) for o in outputs]:
            raise ScheduleError(f"{Action(s, RECV_B, m)}: the gradients received ({[g.shape for g in grads]}) do not "
                                f"match the stage's outputs ({[o.shape for o in outputs]})")
        self._out_grads[s, m] = grads
