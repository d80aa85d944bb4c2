"""The input and output conversions of the parallel styles, as small Cells with a ``pre`` /
``post`` method that the Cell runs inside its ``construct`` (see ``CellChanges.add_construct_hooks``;
keyword inputs use a PyNative forward pre-hook).

A :class:`Conversion` moves one tensor between layouts on the local pieces with a
:class:`~hyper_parallel_ms.redistribute.LocalRedistribute` (planned for the shape it meets,
in PyNative and while ms.jit compiles). In PyNative a DTensor argument is first brought to
the conversion's source layout and unwrapped, and an output may be wrapped as a DTensor
(``use_local_output=False``); inside graphs tensors stay local.

Example::

    f = Conversion(mesh, (Replicate(),), (Replicate(),), grad=(Partial(),))   # Megatron's f
    CellChanges().add_construct_hooks(dense, pre=[InputHook({0: f})])
"""
from __future__ import annotations

from typing import Dict, Optional

from mindspore import Tensor, nn, ops

from .. import comm
from .._mindspore import (as_subclass, cell_per_call_site, cell_subclass, constant_id, constant_of, is_compiling, plain_view,
                          reading_class, run_in_python, running_eagerly, tensor_hook)
from ..dtensor import DTensor
from ..layout import Layout
from ..redistribute import LocalRedistribute, plan_global_shape, plan_layouts

__all__ = ["Conversion", "InputHook", "KwargInputHook", "OutputHook", "masked_rows_class", "unflattened_dense_class",
           "summing_class",
           "SUMMED_PREFIX", "GradientSum", "DeferredInput", "DeferredDTensorInput"]

@run_in_python
def _in_graph() -> bool:
    return is_compiling()


# ------------------------------------------------ the defer_colwise_grads promise (PyNative)
def _refuse_deferred(func, where: str):
    raise ValueError(
        f"PrepareModuleInput(defer_colwise_grads=True) on {where}: the input it hands the Cell reached the op "
        f"'{getattr(func, 'name', func)}' inside the Cell, but with defer_colwise_grads only ColwiseParallel layers "
        "may read it (the Cell reduces its gradient once, from the layers' unreduced shares, so the gradient of any "
        "other use would be counted once per rank). Set defer_colwise_grads=False, or compute that use outside the "
        "Cell")


def _refusing_hook(self, func, args=(), kwargs=None):
    """The tensor hook of a deferred input: every op reaching it raises, naming the Cell."""
    return tensor_hook(lambda f, a, k: _refuse_deferred(f, self.hpms_deferred_at))(self, func, args, kwargs)


def _refused_reflected(name: str):
    """``plain OP deferred``: Python asks the subclass first, which refuses with the cause."""
    def reflected(self, other):
        _refuse_deferred(name, self.hpms_deferred_at)
    return reflected


_REFUSING = {"hpms_deferred_at": "", "__fallback__": _refusing_hook,
             **{f"__r{op}__": _refused_reflected(op) for op in ("add", "sub", "mul", "truediv", "matmul", "pow")}}

# A local tensor that a ``PrepareModuleInput(defer_colwise_grads=True)`` hands its Cell in
# PyNative: any op on it raises (only the conversions of the ColwiseParallel layers inside,
# whose gradient reduction the Cell took over, read it). ``hpms_deferred_at`` names the Cell.
DeferredInput = type("DeferredInput", (Tensor,), dict(_REFUSING, __module__=__name__))
# The same for a Cell handed DTensors (``use_local_output=False``).
DeferredDTensorInput = type("DeferredDTensorInput", (DTensor,), dict(_REFUSING, __module__=__name__))


def _marked(y, where: str):
    """PyNative: ``y`` as a deferred input of the Cell ``where`` (a new object sharing its
    storage and autodiff node: ``y`` may be the caller's own tensor, which stays as it is)."""
    if _in_graph():
        return y
    marked = as_subclass(DeferredDTensorInput if isinstance(y, DTensor) else DeferredInput, y)
    if isinstance(y, DTensor):
        marked._dt_spec = y._dt_spec        # pylint: disable=protected-access
    marked.hpms_deferred_at = where
    return marked


def _unmarked(x, reads_deferred: bool, where: str):
    """A deferred input as the tensor it marks (sharing its autodiff node), for a conversion
    whose gradient reduction the enclosing Cell took over; any other conversion raises."""
    if not isinstance(x, (DeferredInput, DeferredDTensorInput)):
        return x
    if not reads_deferred:
        raise ValueError(f"PrepareModuleInput(defer_colwise_grads=True) on {x.hpms_deferred_at}: the input it hands "
                         f"the Cell reached the conversion in {where}, which reduces that input's gradient itself, so "
                         "it would be reduced twice. Set defer_colwise_grads=False, or give that layer another input")
    if isinstance(x, DTensor):
        view = as_subclass(DTensor, x)
        view._dt_spec = x._dt_spec          # pylint: disable=protected-access
        return view
    return plain_view(x)


def _unwrap(x, plan_id: int):
    """PyNative: a DTensor arrives as its piece in the conversion's source layout."""
    if isinstance(x, DTensor):
        mesh, src, _ = plan_layouts(plan_id)
        return x.redistribute(mesh, src.normalized(x.ndim)).to_local()
    return x


def _wrap(x, plan_id: int, source_shape):
    """PyNative: the piece as a DTensor in the conversion's target layout, its global shape
    taken from the source piece's (graphs keep it local)."""
    if _in_graph():
        return x
    mesh, _, dst = plan_layouts(plan_id)
    return DTensor.from_local(x, mesh, dst.normalized(x.ndim), shape=plan_global_shape(plan_id, tuple(source_shape)))


def _layout(mesh, placements) -> Layout:
    return Layout(mesh.shape, tuple(placements), mesh_dim_names=mesh.mesh_dim_names)


class Conversion(nn.Cell):
    """One tensor: ``src`` placements to ``dst`` placements (the gradient arrives as ``grad``
    placements, default ``dst`` with Partial as Replicate); ``to_dtensor`` wraps the result.
    ``dim_sizes``: {dim: global size} of dims that may be split unevenly (a layer's features);
    ``where``: the Cell named in error messages. ``marks_deferred``: the result is the input of a
    ``PrepareModuleInput(defer_colwise_grads=True)`` Cell, handed on as a :class:`DeferredInput`
    in PyNative; ``reads_deferred``: a conversion whose gradient reduction such a Cell took over,
    the one kind of reader a deferred input accepts."""

    def __init__(self, mesh, src, dst, grad=None, to_dtensor: bool = False, dim_sizes=None, where: str = "",
                 marks_deferred: bool = False, reads_deferred: bool = False) -> None:
        super().__init__()
        self.move = LocalRedistribute(mesh, _layout(mesh, src), _layout(mesh, dst),
                                      None if grad is None else _layout(mesh, grad), dim_sizes, where, to_dtensor)
        self.to_dtensor = to_dtensor
        self.where = where
        self.marks_deferred = marks_deferred
        self.reads_deferred = reads_deferred

    def construct(self, x):
        if not _in_graph():
            x = _unmarked(x, self.reads_deferred, self.where)
        x = _unwrap(x, self.move.plan_id)
        return self.finish(self.move(x), x.shape)

    def finish(self, y, source_shape):
        """``y`` (already moved) as the result: wrapped as a DTensor if asked, marked as a
        deferred input if asked; ``source_shape`` is the local shape before the move."""
        if self.to_dtensor:
            y = _wrap(y, self.move.plan_id, source_shape)
        if self.marks_deferred:
            y = _marked(y, self.where)
        return y


class _PositionalConversions(nn.Cell):
    """Conversions of some positions of a tuple (position -> Conversion); the others pass."""

    def __init__(self, conversions: Dict[int, Conversion]) -> None:
        super().__init__()
        positions = sorted(conversions)
        self.convs = nn.CellList([conversions[i] for i in positions])
        self.slots = tuple(positions.index(i) if i in positions else -1 for i in range((positions or [-1])[-1] + 1))

    def convert_tuple(self, values):
        new = ()
        for i, x in enumerate(values):
            if i < len(self.slots):
                if self.slots[i] >= 0:
                    x = self.convs[self.slots[i]](x)
            new = new + (x,)
        return new


class InputHook(_PositionalConversions):
    """Forward pre-hook converting the positional inputs named in ``conversions`` (position ->
    Conversion); the other inputs pass unchanged. ``max_inputs``: more positional inputs raise
    (PrepareModuleInput, as PyTorch); ``min_ndim``: a first input with fewer dims raises
    (SequenceParallel: the sequence dim must not be the feature dim); ``where`` names the Cell."""

    def __init__(self, conversions: Dict[int, Conversion], max_inputs: int = -1, min_ndim: int = 0,
                 where: str = "") -> None:
        super().__init__(conversions)
        self.max_inputs = max_inputs
        self.min_ndim = min_ndim
        self.where = where
        self.inputs_read = max(len(self.slots), 1 if min_ndim > 0 else 0)   # given by keyword: moved to args

    def pre(self, cell, args):
        if self.max_inputs >= 0 and len(args) > self.max_inputs:
            raise ValueError(f"{self.where} got {len(args)} positional inputs but its PrepareModuleInput names "
                             f"{self.max_inputs} input_layouts: give one layout per input (None to leave one alone)")
        if self.min_ndim > 0 and args[0].ndim < self.min_ndim:
            raise ValueError(f"SequenceParallel on {self.where} needs inputs with a sequence dim before the feature "
                             f"dim ({self.min_ndim} dims or more), got {args[0].ndim} dims")
        return self.convert_tuple(args)


class KwargInputHook(nn.Cell):
    """Forward pre-hook (with kwargs, PyNative) converting the keyword inputs named in ``conversions``."""

    def __init__(self, conversions: Dict[str, Conversion]) -> None:
        super().__init__()
        self.names = tuple(conversions)
        self.convs = nn.CellList([conversions[n] for n in self.names])

    def pre(self, cell, args, kwargs):
        kwargs = dict(kwargs)
        for name, conv in zip(self.names, self.convs):
            if name in kwargs and kwargs[name] is not None:
                kwargs[name] = conv(kwargs[name])
        return args, kwargs


class OutputHook(_PositionalConversions):
    """Forward hook converting the outputs named in ``conversions`` (index -> Conversion; a
    single output is index 0). ``add_bias``: the Cell's ``bias`` (read by the Cell, see
    ``ConstructHooks``) was added on every rank to a Partial result; it is taken out before the
    reduction and added once after it."""

    def __init__(self, conversions: Dict[int, Conversion], add_bias: bool = False,
                 bias_sum: Optional[GradientSum] = None) -> None:
        super().__init__(conversions)
        self.add_bias = self.reads_bias = add_bias
        self.sums_bias = bias_sum is not None
        self.bias_sum = bias_sum if bias_sum is not None else nn.Identity()

    def post(self, cell, args, output, bias):
        if isinstance(output, tuple):
            return self.convert_tuple(output)
        if self.add_bias:
            conv = self.convs[0]
            # the bias added after the reduction meets this rank's piece only: its gradient is this
            # rank's share, summed by ``bias_sum`` (the two other uses cancel exactly, locally)
            added = self.bias_sum(bias) if self.sums_bias else bias
            return conv.finish(conv.move(output - bias) + added, output.shape)
        return self.convs[0](output)


SUMMED_PREFIX = "_hpms_summed_"


class GradientSum(nn.Cell):
    """The identity, whose backward sums the gradient over ``mesh`` (1-D): a replicated parameter
    that each rank uses on its piece of the activations gets the whole gradient on every rank.
    One per use (an attribute of the Cell reading the parameter); it runs the :class:`_SummedGradient`
    of its mesh, one Cell for every use in a whole-step graph (MindSpore compiles each custom-bprop
    Cell instance apart: 4 sequence-parallel blocks compiled in 31.6 s with one per parameter, 17.9 s
    shared, 2 CPU ranks, ``scripts/bench_compile.py``), one per call site in a graph PyNative differentiates
    (:func:`~hyper_parallel_ms._mindspore.cell_per_call_site`).

    Args:
        mesh: the tensor-parallel :class:`DeviceMesh`.

    Example::

        weight = GradientSum(mesh)(norm_weight)
    """

    def __init__(self, mesh) -> None:
        super().__init__()
        self.mesh = mesh
        self.mesh_id = constant_id(mesh)

    def construct(self, x):
        return _summed_gradient(self.mesh_id)(x)


class _SummedGradient(nn.Cell):
    """``x`` (times 1), its gradient summed over ``mesh``. Not the bare identity: MindSpore 2.10
    compiles two property reads of Parameters through one shared identity custom-bprop Cell as
    the first read, and a product compiles right (both in the seam's contract test)."""

    def __init__(self, mesh) -> None:
        super().__init__()
        self.mesh = mesh

    def construct(self, x):
        return x * 1

    def bprop(self, x, out, dout):
        return (comm.all_reduce(dout, self.mesh, 0, op="sum"),)


@cell_per_call_site
def _summed_gradient(mesh_id: int) -> _SummedGradient:
    return _SummedGradient(constant_of(mesh_id))


def _summed(attr: str) -> property:
    summer = SUMMED_PREFIX + attr

    def read(self):
        return getattr(self, summer)(self._params[attr])
    read.__name__ = attr
    return property(read, doc=f"``{attr}``: the parameter, its gradient summed over the ranks that share it")


def summing_class(base: type, attrs) -> type:
    """A subclass of the Cell class ``base`` in which each parameter of ``attrs`` is read through the
    instance's :class:`GradientSum` ``SUMMED_PREFIX + attr`` (the parameter is replicated but each
    rank uses it on its piece of the activations, as ``SequenceParallel`` Cells do), in PyNative
    and compiled code alike.

    Example::

        norm.__class__ = summing_class(type(norm), ["gamma", "beta"])
    """
    attrs = tuple(sorted(attrs))
    return reading_class(_SUMMING, base, attrs, _summed,
                         _hpms_summed=tuple(getattr(base, "_hpms_summed", ())) + attrs)


_SUMMING: Dict[tuple, type] = {}


def masked_rows_class(base: type) -> type:
    """A subclass of the embedding Cell ``base`` whose lookup serves only the rows
    ``[hpms_row_start, hpms_row_start + hpms_rows)`` held here: other ids give zeros (a
    Partial(sum) over the ranks holding the other rows)."""
    cached = _MASKED.get(base)
    if cached is not None:
        return cached

    def construct(self, ids):
        local = ids - self.hpms_row_start
        outside = ops.logical_or(local < 0, local >= self.hpms_rows)
        safe = ops.select(outside, ops.zeros_like(local), local)
        out = self._hpms_masked_construct(safe)
        return out * ops.expand_dims(ops.logical_not(outside), -1).astype(out.dtype)
    cls = cell_subclass(f"RowSharded{base.__name__}", (base,),
                        {"construct": construct, "_hpms_masked_construct": base.construct, "__module__": __name__})
    _MASKED[base] = cls
    return cls


_MASKED: Dict[type, type] = {}


def unflattened_dense_class(base: type) -> type:
    """A subclass of ``nn.Dense`` (or of a subclass of it) whose PyNative forward computes on its
    input as it is (MindSpore's ``Dense`` primitive takes ``(..., in)``) instead of reshaping it to
    2-D first: ``nn.Dense``'s ``MatMul`` receives the reshaped view as a contiguous copy and keeps that
    copy for its backward, beside the input that the op before usually keeps too (three q / k / v
    projections kept three copies of one input; measured, MindSpore 2.10: ``tests/test_activation_memory.py``).
    Same values and gradients; compiled graphs run the Cell's own ``construct``."""
    cached = _UNFLATTENED.get(base)
    if cached is not None:
        return cached

    def construct(self, x):
        if running_eagerly() and x.ndim > 2:
            out = ops.dense(x, self.weight, self.bias if self.has_bias else None)
            return self.activation(out) if self.activation_flag else out
        return self._hpms_dense_construct(x)
    cls = cell_subclass(base.__name__, (base,), {"construct": construct, "_hpms_dense_construct": base.construct,
                                                 "__module__": base.__module__, "__qualname__": base.__qualname__})
    _UNFLATTENED[base] = cls
    return cls


_UNFLATTENED: Dict[type, type] = {}
