"""Autodiff of a shape-only run: a tape of what the forward did, replayed backward without values.

MindSpore's autodiff needs values, so while a simulated step runs (:func:`~.._mindspore.abstract_run`)
this class stands in for it. The forward records, in order, the ops that need a gradient and
the Cells with a custom ``bprop`` (the project's collectives: redistributions, fully_shard's
gathers), whose insides are not recorded, as MindSpore's custom bprop replaces them. The
backward walks the tape in reverse from the outputs, visits the nodes they depend on, hands
the tensors each node keeps (an op's by :func:`saved_tensors`, a custom-``bprop`` Cell's inputs
and output; packed by the saved-tensor hooks in the forward) to the hooks' ``unpack`` (fully_shard
re-gathers a unit's parameters there, where a matmul reads a gathered weight, as measured on real
ranks; :meth:`AbstractAutodiff.tensor_address` tells the hooks which data a shape-only tensor
is), and calls each Cell's
``bprop(*inputs, out, dout)`` with shape-only gradients: every collective a
backward issues in Python is issued, and recorded, exactly as on the cluster. Collectives
MindSpore differentiates by itself (a primitive's own backward) are not recorded, on the
cluster either. Gradients come back as shape-only tensors of the inputs' and weights' shapes;
optimizers do not step (they communicate nothing); activation recomputation runs the forward
again in the backward, as MindSpore does. Matmul FLOPs are counted as the step runs: a matmul
on the tape three times (its forward and the two matmuls of its backward), one run without
gradient once (a recomputed forward, then again on the tape in the backward).

Activation memory: each op keeps for its backward the activations its gradient needs (by op
family, :func:`saved_activations`: a matmul keeps its activation inputs, a softmax its output,
an addition or a view nothing; a custom-``bprop`` Cell its inputs and output); tensors made
from parameters only (gathered weights) are not activations. The live total rises as forwards
are recorded (several micro-batches of a pipeline overlap as their schedule orders them) and
falls as their backwards run; the estimate is its peak. It is checked against what MindSpore's
autodiff keeps on real ranks (``tests/test_plan_real.py``). Temporary buffers (an op's output
and the gradients being computed, about twice :attr:`AbstractAutodiff.largest_activation` at
a time) come on top of it.

Example::

    run = AbstractAutodiff()
    with abstract_run(run), observing_ops(run.on_op):
        loss, grads = ms.value_and_grad(net, None, params)(x)      # shapes only
    run.activation_peak()
"""
from __future__ import annotations

import contextlib
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Set, Tuple

from mindspore import Parameter, Tensor, nn

from .._mindspore import ONE_NODE, has_custom_bprop, in_one_autodiff_node
from ._abstract import (AbstractTensor, abstract_like, abstract_view, flags_of, infer, reads_abstract, storage_key,
                        tensor_bytes, viewed)
from ._op_costs import MATMULS, is_activation, matmul_flops, saved_activations, saved_tensors

__all__ = ["AbstractAutodiff", "saved_activations", "saved_tensors", "matmul_flops"]

def _tensors(value: Any) -> Tuple[Tensor, ...]:
    if isinstance(value, Tensor):
        return (value,)
    if isinstance(value, (tuple, list)):
        return tuple(t for v in value for t in _tensors(v))
    return ()


def _key(t: Tensor) -> int:
    """What links a tensor to the nodes that read it: the shape-only tensor it views (views made by
    any code share it), else the object."""
    return storage_key(t)


def _needs_grad(t: Any) -> bool:
    return isinstance(t, Tensor) and flags_of(t)[0]


class _Node:
    """One recorded step of a forward: an op (``cell`` is None) or a custom-``bprop`` Cell call."""

    __slots__ = ("cell", "args", "inputs", "outputs", "out", "packs", "where", "backward")

    def __init__(self, cell: Optional[nn.Cell], args: tuple, out: Any, where: str = "",
                 backward: Optional[Callable] = None) -> None:
        self.cell, self.args, self.out, self.where = cell, args, out, where
        self.inputs = _tensors(args)
        self.outputs = _tensors(out)
        self.packs: List[Tuple[Callable, Any]] = []
        self.backward = backward        # identity_with_gradient's gradient function


class _Recompute:
    """A forward run under activation recomputation: run again (and recorded) in the backward."""

    __slots__ = ("fn", "args", "kwargs", "again", "inputs", "outputs", "out", "where", "packs")

    def __init__(self, fn: Callable, args: tuple, kwargs: dict, again: Any, out: Any, where: str = "") -> None:
        self.fn, self.args, self.kwargs, self.again, self.out, self.where = fn, args, kwargs, again, out, where
        self.inputs = _tensors(args)
        self.outputs = _tensors(out)
        self.packs: List[Tuple[Callable, Any]] = []


class _Tape:
    """The nodes of one differentiated forward and the activation bytes it keeps."""

    def __init__(self) -> None:
        self.nodes: List[Any] = []
        self.saved: Set[int] = set()
        self.saved_bytes = 0
        self.split = False          # its backward runs in passes (a zero-bubble input pass kept it)

    def derived(self, sources: Sequence[Tensor]) -> Set[int]:
        """The keys of the tensors computed from ``sources`` (in forward order); a recomputed block
        counts as computed from them (the parameters it reads are not its recorded inputs)."""
        derived = {_key(t) for t in sources}
        for node in self.nodes:
            if isinstance(node, _Recompute) or any(_key(t) in derived for t in node.inputs):
                derived.update(_key(t) for t in node.outputs)
        return derived


class AbstractAutodiff:
    """The autodiff of a shape-only run (see the module docstring); the methods named in
    :func:`~hyper_parallel_ms._mindspore.abstract_run` are its entry points.

    Example::

        run = AbstractAutodiff()
        with abstract_run(run), observing_ops(run.on_op):
            step()
        run.optimizer_steps, run.activation_peak()
    """

    infer = staticmethod(infer)
    reads_abstract = staticmethod(reads_abstract)
    plain_view = staticmethod(abstract_view)
    viewed = staticmethod(viewed)

    def __init__(self) -> None:
        self.unhooked = 0
        self._recording: List[Optional[_Tape]] = []
        self._hooks: List[Tuple[Callable, Callable]] = []
        self._dropping = 0              # inside keeping_nothing(): nothing is kept
        self._op_logs: List[list] = []  # (name, outputs) of the ops of selective recomputes' forwards
        self._pending: Dict[int, _Tape] = {}         # taped_call outputs -> their tape
        self._calls: List[nn.Cell] = []              # the Cells being called, innermost last
        self._names: Dict[int, str] = {}             # id of a model's Cell -> its path
        self._replaying: List[str] = []              # the Cell whose backward runs
        self.live_bytes = 0
        self.peak_bytes = 0
        self.largest_activation = 0
        self.optimizer_steps = 0
        self.flops = 0

    # ------------------------------------------------------------------ estimates
    def begin_step(self) -> None:
        """Start the estimates afresh (what the model's construction ran is not the step's)."""
        self.live_bytes = self.peak_bytes = self.largest_activation = self.optimizer_steps = self.flops = 0

    def activation_peak(self) -> int:
        """Estimated peak bytes of the activations kept for the backward (see the module docstring)."""
        return self.peak_bytes

    # ------------------------------------------------------------------ where calls happen
    def name_cells(self, cells: Sequence[nn.Cell]) -> None:
        """Name the Cells of the model(s) (paths from ``cells_and_names``) for :meth:`where`."""
        for top in cells:
            for name, cell in top.cells_and_names():
                self._names.setdefault(id(cell), name or type(top).__name__)

    def where(self) -> str:
        """The innermost named Cell running now (in the backward: the one whose gradient runs)."""
        if self._replaying and self._replaying[-1]:
            return self._replaying[-1]
        for cell in reversed(self._calls):
            name = self._names.get(id(cell))
            if name is not None:
                return name
        return "(outside the model)"

    # ------------------------------------------------------------------ recording
    def _tape(self) -> Optional[_Tape]:
        return self._recording[-1] if self._recording else None

    @contextlib.contextmanager
    def _recorded_into(self, tape: Optional[_Tape]) -> Iterator[None]:
        self._recording.append(tape)
        try:
            yield
        finally:
            self._recording.pop()

    def _keep(self, tape: _Tape, node: Any, tensors: Sequence[Tensor], activations: Sequence[Tensor]) -> None:
        """Hand ``tensors`` to the saved-tensor hooks (if any) and count ``activations``."""
        if self._dropping:
            return
        if self._hooks:
            pack, unpack = self._hooks[-1]
            node.packs.extend((unpack, pack(t)) for t in tensors)
        for t in activations:
            if _key(t) not in tape.saved:
                tape.saved.add(_key(t))
                tape.saved_bytes += tensor_bytes(t)
        self.peak_bytes = max(self.peak_bytes, self.live_bytes + tape.saved_bytes)

    def on_op(self, name: str, inputs: Sequence[Tensor], outputs: Sequence[AbstractTensor]) -> None:
        """An op ran on shape-only tensors (the observer of :func:`._abstract.observing_ops`)."""
        if self._op_logs:
            log = self._op_logs[-1]
            if not in_one_autodiff_node():
                log.append((name, tuple(outputs)))
            elif not log or log[-1][0] != ONE_NODE:      # a custom-bprop Cell's forward: one mark (training's)
                log.append((ONE_NODE, ()))
        for o in outputs:
            if flags_of(o)[1]:
                self.largest_activation = max(self.largest_activation, tensor_bytes(o))
        tape = self._tape()
        differentiated = tape is not None and any(flags_of(o)[0] for o in outputs)
        if name in MATMULS and inputs and outputs:
            self.flops += matmul_flops(inputs[0], outputs[0]) * (3 if differentiated else 1)
        if not differentiated:
            return
        node = _Node(None, tuple(inputs), tuple(outputs))
        kept = saved_tensors(name, inputs, outputs)
        self._keep(tape, node, kept, [t for t in kept if is_activation(t)])
        tape.nodes.append(node)

    def cell_call(self, cell: nn.Cell, call: Callable, args: tuple, kwargs: dict) -> Any:
        """A Cell call: optimizers do not step; a custom-``bprop`` Cell is one node, its inside unrecorded."""
        if isinstance(cell, nn.Optimizer):
            self.optimizer_steps += 1
            return None
        self._calls.append(cell)
        try:
            tape = self._tape()
            if tape is None or not has_custom_bprop(cell):
                return call(*args, **kwargs)
            with self._recorded_into(None):
                out = call(*args, **kwargs)
        finally:
            self._calls.pop()
        if any(_needs_grad(t) for t in _tensors(args)):
            node = _Node(cell, args, out, self.where())
            self._keep(tape, node, node.inputs + node.outputs, [t for t in node.inputs + node.outputs
                                                                 if is_activation(t)])
            tape.nodes.append(node)
        return out

    def identity_with_gradient(self, x: Tensor, backward: Callable) -> Any:
        """``identity_with_gradient`` of a shape-only run: ``x - 0`` unrecorded, one node that keeps
        nothing and whose backward runs ``backward`` (its collectives recorded)."""
        tape = self._tape()
        with self._recorded_into(None):
            out = x - 0
        if tape is not None and _needs_grad(x):
            tape.nodes.append(_Node(None, (x,), out, self.where(), backward))
        return out

    @contextlib.contextmanager
    def unhooking(self) -> Iterator[None]:
        """``no_hook()`` of a shape-only run: tensor hooks reached inside compute shapes only."""
        self.unhooked += 1
        try:
            yield
        finally:
            self.unhooked -= 1

    @staticmethod
    def tensor_address(t: Tensor) -> int:
        """``tensor_address`` of a shape-only run: what identifies the data (views share it, a copy has its own)."""
        return _key(t)

    def parameter_op(self, func: Any, args: tuple, kwargs: dict) -> Any:
        """An op with a Parameter argument: shapes only (parameters have no values here)."""
        return infer(func, args, kwargs)

    def refuse_initialisation(self, param: Parameter) -> None:
        raise RuntimeError(f"parameter {param.name!r} (shape {tuple(param.shape)}) would be given values, but a simulated "
                           "rank never materialises parameters; build the model under no_init_parameters() and leave "
                           "init_parameters / init_parameters_data to the real run")

    # ------------------------------------------------------------------ MindSpore's autodiff
    def value_and_grad(self, fn: Callable, grad_position: Any = 0, weights: Any = None, has_aux: bool = False,
                       return_ids: bool = False) -> Callable:
        """``mindspore.value_and_grad`` on shapes: ``(value, gradients)`` of shape-only tensors."""
        return self._differentiating(fn, grad_position, weights, has_aux, return_ids, with_value=True)

    def grad(self, fn: Callable, grad_position: Any = 0, weights: Any = None, has_aux: bool = False,
             return_ids: bool = False) -> Callable:
        """``mindspore.grad`` on shapes: the gradients (with ``has_aux``: and the auxiliary outputs)."""
        return self._differentiating(fn, grad_position, weights, has_aux, return_ids, with_value=False)

    def _differentiating(self, fn: Callable, grad_position: Any, weights: Any, has_aux: bool, return_ids: bool,
                         with_value: bool) -> Callable:
        if return_ids:
            raise NotImplementedError("a shape-only run does not return gradient ids (return_ids=True)")
        positions = (grad_position,) if isinstance(grad_position, int) else tuple(grad_position or ())
        listed = [] if weights is None else ([weights] if isinstance(weights, Parameter) else list(weights))

        def run(*args, **kwargs):
            args = tuple(abstract_like(a, needs_grad=True) if i in positions and isinstance(a, Tensor) else a
                         for i, a in enumerate(args))
            tape = _Tape()
            with self._recorded_into(tape):
                out = fn(*args, **kwargs)
            differentiated = out[0] if has_aux else out
            self._forward_done(tape)
            self._backward(tape, _tensors(differentiated))
            grads = _grads_form([abstract_like(args[i], needs_grad=False, from_data=False) for i in positions],
                                [abstract_like(w, needs_grad=False, from_data=False) for w in listed],
                                grad_position, weights)
            if with_value:
                return out, grads
            return (grads, tuple(out[1:])) if has_aux else grads
        return run

    # ------------------------------------------------------------------ the project's tape functions
    def taped_call(self, top: Callable, *args: Any) -> Any:
        """A forward kept for :meth:`tape_backward` (a pipeline stage's micro-batch)."""
        tape = _Tape()
        with self._recorded_into(tape):
            out = top(*args)
        self._forward_done(tape)
        for t in _tensors(out):
            self._pending[_key(t)] = tape
        return out

    def tape_backward(self, outputs: Sequence[Tensor], sens: Sequence[Tensor], inputs: Sequence[Tensor],
                      keep_graph: bool = False) -> Tuple[Optional[Tensor], ...]:
        """Gradients of ``inputs`` (``None`` where unreached) of a forward kept by :meth:`taped_call`;
        ``keep_graph=True`` keeps it for another pass. A backward split into passes (zero-bubble
        schedules: the input gradients, then the weight gradients) replays in each pass only the
        nodes computed from that pass's ``inputs``, as MindSpore does (measured: a tensor-parallel
        input gradient's all-reduce runs in the input pass only, fully_shard's reduce-scatter in
        the weight pass only); a recomputed block reached by both passes runs in both."""
        tapes = {id(self._pending[_key(o)]): self._pending[_key(o)] for o in outputs if _key(o) in self._pending}
        if len(tapes) != 1:
            raise RuntimeError("tape_backward: the outputs do not belong to one forward kept by taped_call")
        tape = next(iter(tapes.values()))
        if not keep_graph:
            self._pending = {k: v for k, v in self._pending.items() if v is not tape}
        tape.split = tape.split or keep_graph
        reached = self._backward(tape, tuple(outputs), toward=inputs if tape.split else None, release=not keep_graph)
        return tuple(abstract_like(x, needs_grad=False, from_data=not isinstance(x, Parameter))
                     if _key(x) in reached else None for x in inputs)

    @contextlib.contextmanager
    def keeping_nothing(self) -> Iterator[None]:
        """Inside, nodes keep nothing (``keeping_nothing`` of the PyNative code)."""
        self._dropping += 1
        try:
            yield
        finally:
            self._dropping -= 1

    @contextlib.contextmanager
    def saved_tensors_hooks(self, pack: Callable, unpack: Callable) -> Iterator[None]:
        """Inside, tensors kept for the backward go through ``pack`` / ``unpack``."""
        self._hooks.append((pack, unpack))
        try:
            yield
        finally:
            self._hooks.remove((pack, unpack))

    @contextlib.contextmanager
    def no_grad(self) -> Iterator[None]:
        """Inside, nothing is recorded."""
        with self._recorded_into(None):
            yield

    def recompute(self, fn: Callable, args: tuple, kwargs: dict, context_fn: Optional[Callable]) -> Any:
        """``fn`` under activation recomputation: its forward keeps nothing; the backward runs it again."""
        tape = self._tape()
        forward_ctx, again_ctx = context_fn() if context_fn is not None else (contextlib.nullcontext(),
                                                                                contextlib.nullcontext())
        keeps = getattr(forward_ctx, "keeps", None)     # a selective policy: the op outputs it keeps
        self._op_logs.append([])
        try:
            with forward_ctx, self._recorded_into(None if tape is None else _Tape()):
                out = fn(*args, **kwargs)
        finally:
            ops = self._op_logs.pop()
        if tape is not None:
            node = _Recompute(fn, args, kwargs, again_ctx, out, self.where())
            kept = [t for t in node.inputs if is_activation(t)]                          # its inputs are kept
            if keeps is not None:
                flags = keeps([name for name, _ in ops], [tuple(o[0].shape) if o else None for _, o in ops])
                kept += [t for (_, outs), keep in zip(ops, flags) if keep for t in outs if is_activation(t)]
            self._keep(tape, node, (), kept)
            tape.nodes.append(node)
        return out

    # ------------------------------------------------------------------ backward
    def _forward_done(self, tape: _Tape) -> None:
        self.live_bytes += tape.saved_bytes
        self.peak_bytes = max(self.peak_bytes, self.live_bytes)

    def _backward(self, tape: _Tape, outputs: Sequence[Tensor], toward: Optional[Sequence[Tensor]] = None,
                  release: bool = True) -> Set[int]:
        """Replay ``tape`` backward from ``outputs`` (only the nodes computed from ``toward``, when
        given); the keys (:func:`_key`) of the tensors reached. ``release``: the tape's kept
        activations are freed."""
        reached = {_key(o) for o in outputs}
        relevant = None if toward is None else tape.derived(toward)
        with self._recorded_into(None):
            for node in reversed(tape.nodes):
                if not any(_key(o) in reached for o in node.outputs):
                    continue
                if relevant is not None and not any(_key(o) in relevant for o in node.outputs):
                    continue
                reached.update(_key(t) for t in node.inputs)
                self._replaying.append(node.where)
                try:
                    if isinstance(node, _Recompute):
                        self._recomputed(node)
                        continue
                    for unpack, packed in node.packs:     # the saved tensors are read (fully_shard re-gathers)
                        unpack(packed)
                    if node.cell is not None:
                        node.cell.bprop(*node.args, node.out, _like(node.out))
                    elif node.backward is not None:
                        node.backward(_like(node.out))
                finally:
                    self._replaying.pop()
        if release:
            self.live_bytes -= tape.saved_bytes
        return reached

    def _recomputed(self, node: _Recompute) -> None:
        """The forward of a recomputed block again (recorded: its collectives run again), then its backward."""
        again = _Tape()
        self._replaying.append("")                # the recompute's own Cells name its calls
        try:
            with node.again, self._recorded_into(again):
                out = node.fn(*node.args, **node.kwargs)
        finally:
            self._replaying.pop()
        self._forward_done(again)
        self._backward(again, _tensors(out))


def _like(out: Any) -> Any:
    """A shape-only gradient of ``out`` (a tensor or a tuple of them)."""
    if isinstance(out, Tensor):
        return abstract_like(out, needs_grad=False)
    return tuple(_like(o) for o in out)


def _grads_form(positional: List[Tensor], weighted: List[Tensor], grad_position: Any, weights: Any) -> Any:
    """Gradients shaped as MindSpore returns them for ``grad_position`` and ``weights``."""
    pos = positional[0] if isinstance(grad_position, int) else tuple(positional)
    if weights is None:
        return pos
    wts = weighted[0] if isinstance(weights, Parameter) else tuple(weighted)
    return wts if grad_position is None else (pos, wts)
