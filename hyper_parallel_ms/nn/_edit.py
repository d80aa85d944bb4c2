"""The one description of what sharding does to a Cell, and the one function applying it.

A parallel style, a :class:`ShardingPlan` and a ``distribute_module`` call each turn into a
list of :class:`ModuleEdit` (new parameters, attributes, a class swap, input / output
conversions with their gradient layouts, PyNative forward hooks, a user's own ``apply``),
prepared without touching the Cells or communicating. :func:`apply_edits` makes them through one
:class:`~._adapter.CellChanges`, so a failure leaves every Cell as it was.

Conversions are described by :class:`ConversionSpec` and built only when applied, so that
:func:`drop_enclosed_reductions` can first drop a gradient reduction an enclosing
conversion already performs (see :func:`~hyper_parallel_ms.redistribute.reduction_taken_over`).

Example::

    edit = ModuleEdit("up", model.up, inputs=InputSpec({0: ConversionSpec(mesh, (Replicate(),), (Replicate(),),
                                                                          grad=(Partial(),))}))
    apply_edits([edit], "parallelize_module")
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Callable, Dict, List, Optional, Tuple

from mindspore import Parameter, nn

from .._deferred import unrecorded_notice
from ..dtensor import DTensor
from ..placement import Placement, Replicate, Shard
from ..redistribute._gradient import reduction_taken_over
from ._adapter import CellChanges, named_cells, own_parameters, restore_parameters, snapshot_parameters
from ._foreign import GUARD_ATTR, READERS_ATTR, guarded_class
from ._hooks import SUMMED_PREFIX, Conversion, GradientSum, InputHook, KwargInputHook, OutputHook, summing_class
from ._parameter import REPLACED_BY, ParameterPlacement
from ._targets import DATA_PARALLEL, check_not_fully_sharded, mark_done
from ._tied import check_tied, parameter_holders, retie

__all__ = ["ConversionSpec", "InputSpec", "OutputSpec", "ModuleEdit", "apply_edits", "drop_enclosed_reductions"]

Placements = Tuple[Placement, ...]


@dataclass(frozen=True)
class ConversionSpec:
    """One tensor moved from ``src`` to ``dst`` placements on ``mesh``; its gradient arrives
    as ``grad`` (``None``: ``dst``'s own gradient layout). ``takes_enclosed_reductions``: the
    Cell's users of this input hand back unreduced gradients (``defer_colwise_grads``);
    ``reads_deferred``: an inner conversion whose reduction such a Cell took over.
    The other fields are those of :class:`~._hooks.Conversion`."""

    mesh: Any
    src: Placements
    dst: Placements
    grad: Optional[Placements] = None
    to_dtensor: bool = False
    dim_sizes: Tuple[Tuple[int, int], ...] = ()
    where: str = ""
    takes_enclosed_reductions: bool = False
    reads_deferred: bool = False

    def build(self) -> Conversion:
        return Conversion(self.mesh, self.src, self.dst, self.grad, to_dtensor=self.to_dtensor,
                          dim_sizes=dict(self.dim_sizes), where=self.where,
                          marks_deferred=self.takes_enclosed_reductions, reads_deferred=self.reads_deferred)


@dataclass
class InputSpec:
    """The positional inputs converted inside ``construct`` (see :class:`~._hooks.InputHook`)."""

    conversions: Dict[int, ConversionSpec]
    max_inputs: int = -1
    min_ndim: int = 0
    where: str = ""

    def build(self) -> InputHook:
        return InputHook({i: c.build() for i, c in self.conversions.items()}, self.max_inputs, self.min_ndim,
                         self.where)


@dataclass
class OutputSpec:
    """The outputs converted inside ``construct`` (see :class:`~._hooks.OutputHook`); ``bias_sum``:
    the mesh over which the gradient of a bias added to sharded outputs is summed."""

    conversions: Dict[int, ConversionSpec]
    add_bias: bool = False
    bias_sum: Any = None          # the tp mesh over which the bias's gradient is summed (None: not)

    def build(self) -> OutputHook:
        return OutputHook({i: c.build() for i, c in self.conversions.items()}, add_bias=self.add_bias,
                          bias_sum=None if self.bias_sum is None else GradientSum(self.bias_sum))


@dataclass
class ModuleEdit:
    """What one entry point does to one Cell, prepared without changing it.

    ``parameters``: how each parameter (by attribute name) is cut; ``inputs`` / ``outputs`` /
    ``kwarg_inputs``: conversions run inside ``construct`` (keyword ones: a PyNative forward
    pre-hook); ``forward_pre_hooks`` / ``forward_hooks``: plain PyNative forward hooks (the
    DTensor path); ``kwargs_pre_hooks``: forward pre-hooks taking and returning ``(args, kwargs)``;
    ``restoring_hooks``: forward hooks run even when the forward raises (they put
    the Cell back); ``custom_apply``: a user's code changing the Cell itself (run after every
    other edit's changes); ``replicate_rest``: a mesh on which every parameter under the Cell
    that is not a DTensor afterwards becomes a replicated one; ``marks_done``: record that
    ``engine`` sharded this Cell (:func:`~._rules.check_not_done`); ``object_attributes``:
    ``(object, name, value)`` marks on other objects (the parameters a unit replaced);
    ``summed_reads``: parameters (by attribute) read through a :class:`~._hooks.GradientSum` over
    the given mesh (:func:`~._hooks.summing_class`); ``guarded_by``: the style whose cut parameters
    other Cells' forwards may not use (``"<Style> on '<path>'"``, see :mod:`._foreign`; ``""``: no
    guard), ``read_by``: the other Cells whose own code reads them by design. An attribute given as a
    :class:`ConversionSpec` is built when applied."""

    path: str
    cell: nn.Cell
    parameters: Dict[str, ParameterPlacement] = field(default_factory=dict)
    attributes: Dict[str, Any] = field(default_factory=dict)
    swap_class: Optional[type] = None
    inputs: Optional[InputSpec] = None
    outputs: Optional[OutputSpec] = None
    kwarg_inputs: Dict[str, ConversionSpec] = field(default_factory=dict)
    forward_pre_hooks: List[Callable] = field(default_factory=list)
    forward_hooks: List[Callable] = field(default_factory=list)
    kwargs_pre_hooks: List[Callable] = field(default_factory=list)
    restoring_hooks: List[Callable] = field(default_factory=list)
    custom_apply: Optional[Callable[[], Any]] = None
    replicate_rest: Any = None
    marks_done: bool = False
    object_attributes: List[Tuple[Any, str, Any]] = field(default_factory=list)
    summed_reads: Dict[str, Any] = field(default_factory=dict)
    guarded_by: str = ""
    read_by: Tuple[nn.Cell, ...] = ()

    def cut_parameters(self) -> List[str]:
        """The parameters (attribute names) this edit cuts into pieces (plain Parameters, the styles')."""
        return [name for name, pl in self.parameters.items()
                if isinstance(pl, ParameterPlacement) and not pl.as_dtensor and pl.mesh.size() > 1
                and any(isinstance(p, Shard) for p in pl.placements)]


def _encloses(outer: ModuleEdit, inner: ModuleEdit) -> bool:
    return inner is not outer and (outer.path == "" or inner.path.startswith(outer.path + "."))


def drop_enclosed_reductions(edits: List[ModuleEdit]) -> None:
    """Drop the gradient reduction of every input conversion that an enclosing Cell's input
    conversion already performs (a ``PrepareModuleInput(defer_colwise_grads=True)`` reduces
    the summed gradient of the Colwise layers inside it once), see
    :func:`~hyper_parallel_ms.redistribute.reduction_taken_over`."""
    for outer in edits:
        takers = [c for c in (outer.inputs.conversions.values() if outer.inputs else ())
                  if c.takes_enclosed_reductions]
        if not takers:
            continue
        dropped = 0
        for inner in (e for e in edits if e.inputs is not None and _encloses(outer, e)):
            for i, conv in inner.inputs.conversions.items():
                if any(t.mesh == conv.mesh and reduction_taken_over(t.dst, t.grad, conv.src, conv.grad)
                       for t in takers):
                    inner.inputs.conversions[i] = replace(conv, grad=None, reads_deferred=True)
                    dropped += 1
        if not dropped:
            raise ValueError(f"PrepareModuleInput(defer_colwise_grads=True) on '{outer.path}': no ColwiseParallel "
                             "layer with replicated input inside it takes its input")


def _kwargs_in_graph(edit: ModuleEdit) -> str:
    if not edit.kwarg_inputs:
        return ""
    where = f"'{edit.path}'" if edit.path else "the root Cell"
    return (f"PrepareModuleInput on {where} converts keyword inputs (input_kwarg_layouts), which runs in PyNative "
            "only: ms.jit / GRAPH_MODE do not run keyword forward hooks. Pass those inputs positionally "
            "(input_layouts) to compile this Cell")


Made = Dict[int, Tuple[Parameter, Parameter]]          # id(original): (original, its new Parameter)


def _made(changes: CellChanges, made: Made, param: Parameter, placement: ParameterPlacement) -> Parameter:
    """``param`` cut by ``placement``, once: a parameter shared by several Cells (tied) gets one
    new Parameter, put into each of them (their placements agree, :func:`~._tied.check_tied`);
    ``param`` is marked replaced (an optimizer built on it before is refused)."""
    known = made.get(id(param))
    if known is None or known[0] is not param:
        known = made[id(param)] = (param, placement.make(param))
        if known[1] is not param:
            changes.set_attribute(param, REPLACED_BY, "a parallel style (parallelize_module / shard_module / "
                                                      "distribute_module)")
    return known[1]


def _replicate_rest(changes: CellChanges, root: nn.Cell, mesh, made: Made) -> None:
    replicated = ParameterPlacement(mesh, (Replicate(),) * mesh.ndim, as_dtensor=True)
    for cell in named_cells(root).values():
        for name, p in own_parameters(cell).items():
            if not isinstance(p, DTensor):
                changes.set_parameter(cell, name, _made(changes, made, p, replicated))


def _apply_own(changes: CellChanges, edit: ModuleEdit, made: Made) -> None:
    for name, placement in edit.parameters.items():
        changes.set_parameter(edit.cell, name, _made(changes, made, own_parameters(edit.cell)[name], placement))
    for name, value in edit.attributes.items():
        changes.set_attribute(edit.cell, name, value.build() if isinstance(value, ConversionSpec) else value)
    for name, mesh in edit.summed_reads.items():
        changes.set_attribute(edit.cell, SUMMED_PREFIX + name, GradientSum(mesh))
    cls = edit.swap_class
    if edit.summed_reads:
        cls = summing_class(cls or type(edit.cell), list(edit.summed_reads))
    guarded = edit.cut_parameters() if edit.guarded_by else []
    if guarded:
        changes.set_attribute(edit.cell, GUARD_ATTR, edit.guarded_by)
        changes.set_attribute(edit.cell, READERS_ATTR, frozenset(id(c) for c in edit.read_by))
        cls = guarded_class(cls or type(edit.cell), guarded)
    if cls is not None:
        changes.swap_class(edit.cell, cls)
    changes.add_construct_hooks(edit.cell, pre=[edit.inputs.build()] if edit.inputs else [],
                                post=[edit.outputs.build()] if edit.outputs else [],
                                graph_error=_kwargs_in_graph(edit))
    if edit.kwarg_inputs:
        hook = KwargInputHook({k: c.build() for k, c in edit.kwarg_inputs.items()})
        changes.add_forward_pre_hook(edit.cell, hook.pre, with_kwargs=True)
    for fn in edit.forward_pre_hooks:
        changes.add_forward_pre_hook(edit.cell, fn)
    for fn in edit.forward_hooks:
        changes.add_forward_hook(edit.cell, fn)
    for fn in edit.kwargs_pre_hooks:
        changes.add_forward_pre_hook(edit.cell, fn, with_kwargs=True)
    for fn in edit.restoring_hooks:
        changes.add_forward_hook(edit.cell, fn, always_call=True)
    for obj, name, value in edit.object_attributes:
        changes.set_attribute(obj, name, value)


def _check_no_empty_pieces(edits: List[ModuleEdit], engine: str) -> None:
    """Refuse, before any change, a parameter whose piece would be empty on some rank: MindSpore's
    optimizers cannot hold state for an empty Parameter, so that rank alone would fail its first
    step while the others wait in their next collective."""
    for edit in edits:
        for attr, placement in edit.parameters.items():
            if not isinstance(placement, ParameterPlacement):
                continue
            param = edit.cell._params.get(attr)
            smallest = None if param is None else placement.empty_piece(tuple(param.shape))
            if smallest is not None:
                where = f"{edit.path}.{attr}" if edit.path else attr
                raise ValueError(
                    f"{engine}: parameter '{where}' of shape {tuple(param.shape)} cut by {tuple(placement.placements)} "
                    f"over the mesh {placement.mesh.shape} leaves the last rank an empty piece {smallest} (torch.chunk "
                    "pieces), which MindSpore's optimizers cannot hold (that rank alone would fail its step). Use a "
                    "size that gives every rank at least one slice (a multiple of the mesh size), a smaller mesh, or "
                    "leave this parameter replicated")


def _scope(edits: List[ModuleEdit], root: Optional[nn.Cell]) -> List[nn.Cell]:
    """``root``, or by default the edited Cells (each once)."""
    return [root] if root is not None else list({id(e.cell): e.cell for e in edits}.values())


def _check_tied(edits: List[ModuleEdit], root: Optional[nn.Cell], engine: str) -> None:
    """Refuse, before any change, a parameter shared by several Cells under ``root`` (default:
    under the edited Cells) that the edits would place differently in them."""
    roots = _scope(edits, root)
    holders: Dict[int, list] = {}
    for cell in roots:
        for key, users in parameter_holders(cell).items():
            known = holders.setdefault(key, [])
            known.extend(u for u in users if not any(u[1] is k[1] and u[2] == k[2] for k in known))
    planned = {(id(e.cell), name): placement for e in edits for name, placement in e.parameters.items()}
    check_tied(holders, planned, engine)


def apply_edits(edits: List[ModuleEdit], engine: str, root: Optional[nn.Cell] = None) -> None:
    """Make ``edits`` in order: each one's own changes, then the user code (``custom_apply``),
    then the replicated rest, then the done-markers of ``engine``. If anything fails, undo
    every change (and put back parameters user code replaced) and re-raise.

    A parameter shared by several Cells under ``root`` (tied weights) is cut once and the one new
    Parameter put into every Cell using it; edits placing it differently (or one Cell leaving it
    whole) are refused before anything changes. A shared parameter that user code replaced in one
    Cell gets that replacement in the others too. A Cell under ``root`` (default: the edited Cells)
    already sharded by ``fully_shard`` / ``hsdp`` is refused before anything changes, except by those
    (their units nest)."""
    if engine not in DATA_PARALLEL:
        for cell in _scope(edits, root):
            check_not_fully_sharded(cell, engine)
    _check_tied(edits, root, engine)
    _check_no_empty_pieces(edits, engine)
    touched = [e for e in edits if e.custom_apply is not None or e.replicate_rest is not None]
    snapshots = [(e.cell, snapshot_parameters(e.cell)) for e in touched]
    made: Made = {}
    try:
        with unrecorded_notice("when cut by the plan, in its order"), CellChanges() as changes:
            for edit in edits:
                _apply_own(changes, edit, made)
            for edit in edits:
                if edit.custom_apply is not None:
                    edit.custom_apply()
            for cell, snapshot in snapshots:
                retie(changes, cell, snapshot, engine)
            for edit in edits:
                if edit.replicate_rest is not None:
                    _replicate_rest(changes, edit.cell, edit.replicate_rest, made)
            for edit in edits:
                if edit.marks_done:
                    mark_done(changes, edit.cell, engine)
    except BaseException:
        for cell, snapshot in reversed(snapshots):
            restore_parameters(cell, snapshot)
        raise
