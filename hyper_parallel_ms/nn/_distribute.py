"""``distribute_module`` and ``ShardingPlan`` + ``shard_module``: the DTensor path for Cells.

Parameters become ``Parameter(DTensor)`` and the Cell computes through the ops dispatcher
in PyNative, so any placement of any parameter is computed exactly. (The parallel styles of
:func:`parallelize_module` keep plain local parameters and also run in graph mode.)

Example::

    plan = ShardingPlan(plan={"weight": (Replicate(), Shard(0))},
                        input_plan={"input": (Shard(0), Replicate())},
                        output_plan={"output": (Shard(0), Replicate())},
                        return_local_tensor=[""])
    shard_module(net, mesh, plan)
"""
from __future__ import annotations

import inspect
import warnings
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import mindspore as ms
from mindspore import Tensor, nn

from .._mindspore import refuse_while_compiling
from ..dtensor import DTensor
from ..dtensor._spec import to_layout
from ..layout import Layout
from ..mesh import DeviceMesh
from ..placement import Placement
from ._adapter import named_cells, own_parameters
from ._consistency import agreed
from ._edit import ModuleEdit, apply_edits
from ._parameter import ParameterPlacement
from ._targets import check_mesh, check_not_done, match_path, near_names

__all__ = ["distribute_module", "ShardingPlan", "shard_module"]


def _check_pynative(what: str) -> None:
    if ms.get_context("mode") == ms.GRAPH_MODE:
        raise RuntimeError(f"{what} gives the Cell DTensor parameters, which GRAPH_MODE cannot compile (MindSpore fails "
                           "with \"init_data() got an unexpected keyword argument 'set_sliced'\"), and the ops "
                           "between them are laid out by the DTensor dispatcher, in Python. Local parameters cannot "
                           "stand in: a plan names parameter placements only, and the ops between sharded layers "
                           "would compute on local pieces with nothing converting them. Run it in PyNative (ms.jit "
                           "works there), or use parallelize_module, whose styles place the conversions between "
                           "layers and compile in GRAPH_MODE")


def _marked_edits(module: nn.Cell) -> List[ModuleEdit]:
    """An edit marking each Cell holding parameters (all of them DTensors afterwards), and
    ``module`` itself, as done, by path."""
    return [ModuleEdit(path, cell, marks_done=True) for path, cell in named_cells(module).items()
            if cell is module or own_parameters(cell)]


def _module_entries(module: nn.Cell, *fns) -> List[Tuple[str, str]]:
    """What the ranks must agree on before ``distribute_module`` runs the functions: every
    parameter's name and shape, and which functions are given."""
    entries = [(f"{path}.{name}" if path else name, str(tuple(p.shape)))
               for path, cell in named_cells(module).items() for name, p in own_parameters(cell).items()]
    return entries + [("functions", repr([getattr(fn, "__qualname__", None) for fn in fns]))]


def _takes_module(fn: Callable, what: str) -> bool:
    """Whether ``fn`` is the three-argument form ``fn(module, values, mesh)``; the two-argument form
    ``fn(values, mesh)`` (deprecated in PyTorch) is accepted with a ``FutureWarning``, as there."""
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return True
    kinds = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    if any(p.kind == inspect.Parameter.VAR_POSITIONAL for p in params):
        return True
    if sum(1 for p in params if p.kind in kinds) == 2:
        warnings.warn(f"distribute_module: {what} with two arguments ({what}(values, device_mesh)) is deprecated, as "
                      f"in PyTorch; take the module first: {what}(module, values, device_mesh)", FutureWarning,
                      stacklevel=4)
        return False
    return True


def distribute_module(module: nn.Cell, device_mesh: Optional[DeviceMesh] = None,
                      partition_fn: Optional[Callable] = None, input_fn: Optional[Callable] = None,
                      output_fn: Optional[Callable] = None) -> nn.Cell:
    """``partition_fn(name, cell, mesh)`` for every sub-Cell (it replaces parameters with
    ``Parameter(distribute_tensor(...))``), the other parameters replicated, then
    ``input_fn(module, inputs, mesh)`` / ``output_fn(module, outputs, mesh)`` registered as
    forward pre / post hooks. A second call on the same module is refused; a failure
    leaves the module as it was. PyNative. A parameter shared by several Cells (tied) that
    ``partition_fn`` replaces in one of them gets the same replacement in the others.

    Args:
        module: the Cell (returned, changed in place).
        device_mesh: the :class:`DeviceMesh` handed to the functions.
        partition_fn: ``partition_fn(name, cell, mesh)``, called for every sub-Cell (``None``:
            every parameter replicated).
        input_fn: ``input_fn(module, inputs, mesh)`` -> new inputs, a forward pre-hook
            (``input_fn(inputs, mesh)`` also, with PyTorch's deprecation warning).
        output_fn: ``output_fn(module, outputs, mesh)`` -> new outputs, a forward hook (likewise).

    Example::

        def shard_fc(name, cell, mesh):
            if name == "fc":
                cell.weight = Parameter(distribute_tensor(cell.weight, mesh, [Shard(0)]), name=cell.weight.name)
        distribute_module(model, mesh, shard_fc)
    """
    if not isinstance(module, nn.Cell):
        raise TypeError(f"distribute_module needs an nn.Cell, got {type(module).__name__}")
    _check_pynative("distribute_module")
    check_mesh(device_mesh, "distribute_module")
    for what, fn in (("partition_fn", partition_fn), ("input_fn", input_fn), ("output_fn", output_fn)):
        if fn is not None and not callable(fn):
            raise TypeError(f"{what} must be callable, got {fn!r}")
    check_not_done(module, "distribute_module")
    agreed(lambda: _module_entries(module, partition_fn, input_fn, output_fn), list, device_mesh, "distribute_module")
    def partition():
        for name, cell in named_cells(module).items():
            partition_fn(name, cell, device_mesh)

    with_module = {what: _takes_module(fn, what) for what, fn in (("input_fn", input_fn), ("output_fn", output_fn))
                   if fn is not None}

    def pre(cell, args):
        return input_fn(cell, args, device_mesh) if with_module["input_fn"] else input_fn(args, device_mesh)

    def post(cell, args, output):
        return output_fn(cell, output, device_mesh) if with_module["output_fn"] else output_fn(output, device_mesh)
    root = ModuleEdit("", module, custom_apply=partition if partition_fn is not None else None,
                      replicate_rest=device_mesh, forward_pre_hooks=[pre] if input_fn is not None else [],
                      forward_hooks=[post] if output_fn is not None else [])
    apply_edits([root] + _marked_edits(module), "distribute_module", module)
    return module


Placements = Sequence


@dataclass
class ShardingPlan:
    """How to shard a Cell (for :func:`shard_module`).

    Args:
        plan: parameter names (dotted, ``fnmatch`` wildcards per segment as in
            ``parallelize_module``: ``"layers.*.weight"``) -> placements or alias layouts.
        input_plan: ``"input"`` (the Cell itself) or ``"<path>.input"`` -> the placements of the
            first tensor input (or a tuple of them, one per position, ``None`` to skip; or a dict
            naming ``construct``'s arguments, HyperParallel's form, which reaches keyword arguments
            too): a DTensor is redistributed to them, a plain Tensor is read as this rank's local
            piece in them (``DTensor.from_local``, as in PyTorch: e.g. each rank feeds its own batch rows).
        output_plan: ``"output"`` or ``"<path>.output"`` -> placements, as ``input_plan``.
        return_local_tensor: Cell paths (``""``: the Cell itself) whose outputs become local
            tensors after their output plan.

    ``None`` for any of them means none (PyTorch's ``ShardingPlan(plan, output_plan=None)``).

    Example::

        ShardingPlan(plan={"dense.weight": (Shard(0),)}, output_plan={"output": (Replicate(),)},
                     return_local_tensor=[""])
    """

    plan: Optional[Dict[str, Placements]] = field(default_factory=dict)
    input_plan: Optional[Dict[str, Placements]] = field(default_factory=dict)
    output_plan: Optional[Dict[str, Placements]] = field(default_factory=dict)
    return_local_tensor: Optional[List[str]] = field(default_factory=list)


def _positions(value, key: str, mesh) -> Tuple[Optional[tuple], ...]:
    """One placements entry per position (a single entry: the first tensor); a :class:`Layout`
    (HyperParallel's ``layout("dp", "None")``) is one entry."""
    if isinstance(value, Layout):
        return (value,)
    if not isinstance(value, (tuple, list)) or not value:
        raise TypeError(f"plan entry '{key}' must be a non-empty tuple of placements, got {value!r}")
    single = all(isinstance(v, (Placement, str)) or (isinstance(v, tuple) and v and all(isinstance(x, str) for x in v))
                 for v in value)
    entries = (tuple(value),) if single else \
        tuple(v if v is None or isinstance(v, Layout) else tuple(v) for v in value)
    for e in entries:
        if isinstance(e, tuple) and all(isinstance(p, Placement) for p in e) and len(e) != mesh.ndim:
            raise ValueError(f"plan entry '{key}': {len(e)} placements for the {mesh.ndim}-D mesh {mesh.shape}")
    return entries


def _named_positions(value: dict, key: str, mesh, cell: nn.Cell) -> Tuple[Dict[str, Optional[tuple]], Tuple[str, ...]]:
    """A dict input plan (``construct``'s argument names -> placements or ``None``) checked against
    ``cell``: (the plan, the names of ``construct``'s positional arguments in order)."""
    parameters = inspect.signature(cell.construct).parameters
    names = [n for n, q in parameters.items() if q.kind not in (q.VAR_POSITIONAL, q.VAR_KEYWORD)]
    takes_any = any(q.kind == q.VAR_KEYWORD for q in parameters.values())
    named = {}
    for name, placements in value.items():
        if not isinstance(name, str) or (name not in names and not takes_any):
            raise ValueError(f"input_plan '{key}': {name!r} is not an argument of {type(cell).__name__}.construct; "
                             f"its arguments are {names}")
        named[name] = None if placements is None else _positions(placements, f"{key}[{name!r}]", mesh)[0]
    positional = tuple(n for n, q in parameters.items() if q.kind in (q.POSITIONAL_ONLY, q.POSITIONAL_OR_KEYWORD))
    return named, positional


def _input_entries(value, key: str, mesh, cell: nn.Cell) -> tuple:
    """(per-position entries or ``None``, per-name entries or ``None``, positional argument names)."""
    if isinstance(value, dict):
        named, positional = _named_positions(value, key, mesh, cell)
        return None, named, positional
    return _positions(value, key, mesh), None, ()


def _convert(x, mesh, placements):
    """``x`` in ``placements``: a DTensor is redistributed; a plain Tensor is this rank's local
    piece in ``placements`` (``DTensor.from_local``, even pieces), as in PyTorch."""
    if placements is None or not isinstance(x, Tensor):
        return x
    layout = to_layout(mesh, placements, x.ndim)
    if isinstance(x, DTensor):
        return x if x.layout == layout else x.redistribute(mesh, layout)
    return DTensor.from_local(x, mesh, layout)


def _convert_all(values, mesh, entries):
    single = not isinstance(values, tuple)
    items = (values,) if single else values
    out = tuple(_convert(v, mesh, entries[i]) if i < len(entries) else v for i, v in enumerate(items))
    return out[0] if single else out


def _to_local(values):
    if isinstance(values, tuple):
        return tuple(v.to_local() if isinstance(v, DTensor) else v for v in values)
    return values.to_local() if isinstance(values, DTensor) else values


def _cell_for(key: str, suffix: str, cells: Dict[str, nn.Cell]) -> str:
    if key == suffix:
        return ""
    if not key.endswith("." + suffix):
        raise ValueError(f"{suffix}_plan key '{key}' must be '{suffix}' or '<cell path>.{suffix}'")
    path = key[:-len(suffix) - 1]
    if path not in cells:
        near = near_names(path, list(cells))
        raise ValueError(f"{suffix}_plan key '{key}': no sub-Cell '{path}'; near names: {near}")
    return path


def _entries(sharding_plan: ShardingPlan, name: str) -> dict:
    value = getattr(sharding_plan, name)
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise TypeError(f"ShardingPlan.{name} must be a dict (or None), got {type(value).__name__}")
    return value


def _checked(model: nn.Cell, device_mesh, sharding_plan: ShardingPlan) -> tuple:
    """Every key and placement of ``sharding_plan`` checked against ``model`` (no change):
    (cells, params, new placements, input plans, output plans, local paths)."""
    cells = named_cells(model)
    params = {f"{path}.{name}" if path else name: (cell, name, p)
              for path, cell in cells.items() for name, p in own_parameters(cell).items()}
    new_params = {}
    for key, placements in _entries(sharding_plan, 'plan').items():
        if not isinstance(key, str):
            raise TypeError(f"plan keys must be parameter names, got {key!r}")
        found = [n for n in params if match_path(key, n)]
        if not found:
            near = near_names(key, list(params))
            raise ValueError(f"plan key '{key}' matches no parameter; near names: {near}")
        for n in found:
            cell, name, p = params[n]
            if isinstance(p, DTensor):
                raise ValueError(f"plan key '{key}': the parameter '{n}' is a DTensor {p.placements} already (an "
                                 "earlier shard_module on a sub-Cell placed it); a sub-Cell's parameters are placed "
                                 "by its own plan: drop the key, or place it there")
            layout = to_layout(device_mesh, placements, p.ndim)   # raises for a bad count / dim / name
            if any(q.is_partial() for q in layout.placements):
                raise ValueError(f"plan['{key}']: a parameter cannot be Partial, got {placements}")
            new_params[n] = placements
    _tie_planned(params, new_params, device_mesh)
    inputs = {}
    for k, v in _entries(sharding_plan, 'input_plan').items():
        path = _cell_for(k, "input", cells)
        inputs[path] = _input_entries(v, k, device_mesh, cells[path])
    outputs = {_cell_for(k, "output", cells): _positions(v, k, device_mesh)
               for k, v in _entries(sharding_plan, 'output_plan').items()}
    local = []
    local_paths = sharding_plan.return_local_tensor or ()
    if not isinstance(local_paths, (list, tuple)):
        raise TypeError(f"ShardingPlan.return_local_tensor must be a list of Cell paths ('' is the model), got "
                        f"{type(local_paths).__name__} {local_paths!r}: write [{local_paths!r}]"
                        if isinstance(local_paths, str) else
                        f"ShardingPlan.return_local_tensor must be a list of Cell paths ('' is the model), got "
                        f"{type(local_paths).__name__}")
    for path in local_paths:
        if not isinstance(path, str) or path not in cells:
            near = near_names(str(path), list(cells))
            raise ValueError(f"return_local_tensor entry {path!r} is not a sub-Cell path ('' is the model); "
                             f"near names: {near}")
        local.append(path)
    return cells, params, new_params, inputs, outputs, local


def _tie_planned(params: Dict[str, tuple], new_params: Dict[str, Placements], mesh) -> None:
    """A parameter shared by several Cells (tied) is one tensor with one placement: the plan's
    entry for one of its names places every use; two entries placing it differently are refused."""
    names: Dict[int, List[str]] = {}
    for n, (_, _, p) in params.items():
        names.setdefault(id(p), []).append(n)
    for tied in (ns for ns in names.values() if len(ns) > 1):
        planned = [n for n in tied if n in new_params]
        if not planned:
            continue
        first, p = planned[0], params[planned[0]][2]
        for other in planned[1:]:
            if to_layout(mesh, new_params[other], p.ndim) != to_layout(mesh, new_params[first], p.ndim):
                raise ValueError(f"shard_module: the parameter {p.name!r} is shared (tied) by '{first}' and '{other}', "
                                 f"which the plan places differently: {new_params[first]} and {new_params[other]}. "
                                 "A shared parameter is one tensor cut one way: give one placement (naming one of "
                                 "its uses places them all), or untie it")
        for n in tied:
            new_params[n] = new_params[first]


def _plan_entries(checked: tuple) -> List[Tuple[str, str]]:
    """What the ranks must agree on: each parameter's shape and placements, the input and
    output plans and the local outputs."""
    _, params, new_params, inputs, outputs, local = checked
    entries = [(n, f"{tuple(p.shape)} {new_params.get(n, 'replicated')}") for n, (_, _, p) in params.items()]
    entries += [(f"{path}.input", repr(v)) for path, v in inputs.items()]
    entries += [(f"{path}.output", repr(v)) for path, v in outputs.items()]
    return entries + [("return_local_tensor", repr(local))]


def shard_module(model: nn.Cell, device_mesh: DeviceMesh, sharding_plan: ShardingPlan) -> nn.Cell:
    """Apply a :class:`ShardingPlan` (see there); unplanned parameters are replicated. Every key
    and placement is checked before anything changes. PyNative. A parameter shared by several
    Cells (tied) is placed by the entry of any of its names, for every use (one DTensor parameter).
    A sub-Cell may get a plan of its own too (HyperParallel's child plans), before or after its
    parent's: the conversions run as the Cells nest, so the parent's ``input_plan`` /
    ``output_plan`` / ``return_local_tensor`` for the sub-Cell decide what the parent hands it and
    gets back, and the child's what its own code sees.

    Args:
        model: the Cell; its parameters become ``Parameter(DTensor)`` (returned, changed in place).
        device_mesh: the :class:`DeviceMesh` of the placements.
        sharding_plan: the :class:`ShardingPlan`.

    Example::

        shard_module(net, mesh, ShardingPlan(plan={"weight": (Shard(0), Replicate())}))
    """
    if not isinstance(model, nn.Cell):
        raise TypeError(f"shard_module needs an nn.Cell, got {type(model).__name__}")
    _check_pynative("shard_module")
    check_mesh(device_mesh, "shard_module")
    if not isinstance(sharding_plan, ShardingPlan):
        raise TypeError(f"shard_module needs a ShardingPlan, got {type(sharding_plan).__name__}")
    check_not_done(model, "shard_module", nested_ok="shard_module")
    cells, params, new_params, inputs, outputs, local = agreed(
        lambda: _checked(model, device_mesh, sharding_plan), _plan_entries, device_mesh, "shard_module")
    edits = {path: ModuleEdit(path, cell) for path, cell in cells.items()}
    for n, placements in new_params.items():
        _, name, _ = params[n]
        edits[n.rpartition(".")[0]].parameters[name] = ParameterPlacement(device_mesh, placements, as_dtensor=True)
    edits[""].replicate_rest = device_mesh
    for path in set(inputs) | set(outputs) | set(local):
        by_position, by_name, names = inputs.get(path, (None, None, ()))
        _add_plan_step(edits[path], _PlanStep(path.count(".") + 1 if path else 0, device_mesh, by_position,
                                              outputs.get(path), path in local, by_name, names))
    apply_edits(list(edits.values()) + _marked_edits(model), "shard_module", model)
    return model


_PLAN_STEPS = "_hpms_plan_steps"     # on a Cell: the _PlanSteps of every shard_module call reaching it
_PLAN_GRAPH_ERROR = "_hpms_plan_graph_error"     # on a Cell with plan steps: why ms.jit / GRAPH_MODE refuse it


def _plan_graph_error(path: str) -> str:
    where = f"'{path}'" if path else "the root Cell"
    return (f"shard_module's input / output plan on {where} makes DTensors of the Cell's inputs or outputs (or "
            "local tensors of its outputs), which runs in PyNative only: a compiled graph holds no DTensor, and "
            "MindSpore's ms.jit / GRAPH_MODE do not run keyword forward hooks. Call the Cell in PyNative, or "
            "compile the code inside it on local tensors, or use parallelize_module with PrepareModuleInput / "
            "PrepareModuleOutput, whose conversions compile")


@dataclass(frozen=True)
class _PlanStep:
    """What one plan converts at one Cell: ``depth`` is the number of path segments from the plan's
    root to the Cell (0: a plan applied to the Cell itself)."""

    depth: int
    mesh: DeviceMesh
    inputs: Optional[tuple]
    outputs: Optional[tuple]
    local: bool
    named_inputs: Optional[Dict[str, Optional[tuple]]] = None    # a dict input plan: argument name -> placements
    input_names: Tuple[str, ...] = ()                             # construct's positional argument names


def _add_plan_step(edit: ModuleEdit, step: _PlanStep) -> None:
    """Add ``step`` to the Cell's plan steps; the Cell's first step registers the two hooks running them all.

    Several plans may reach one Cell (a parent's ``"relu.output"`` and ``return_local_tensor=["relu"]``,
    then a plan applied to ``relu`` itself, in either order). Whatever the order of the calls, they
    run as the Cells nest: inputs from the outermost plan inwards (each plan converts what its
    Cell's caller hands on), outputs from the Cell's own plan outwards, so the output a parent
    receives, local or DTensor, is the one its own plan says."""
    steps = edit.cell.__dict__.get(_PLAN_STEPS, ())
    edit.attributes[_PLAN_STEPS] = steps + (step,)
    edit.attributes[_PLAN_GRAPH_ERROR] = _plan_graph_error(edit.path)
    if not steps:
        edit.forward_pre_hooks.append(_run_input_steps)
        edit.forward_hooks.append(_run_output_steps)
    if step.named_inputs is not None and all(s.named_inputs is None for s in steps):
        edit.kwargs_pre_hooks.append(_run_named_input_steps)     # PyNative only, as keyword hooks are


def _run_input_steps(cell, args):
    # compiled, the refusal's constant result guards the steps: MindSpore evaluates it before it
    # parses them (their Python would fail to compile, naming nothing)
    if refuse_while_compiling(getattr(cell, _PLAN_GRAPH_ERROR)):
        return _input_steps(cell, args)
    return args


def _run_named_input_steps(cell, args, kwargs=None):
    # ``kwargs`` has a default: a compiled graph calls keyword hooks without it, and is refused first
    if refuse_while_compiling(getattr(cell, _PLAN_GRAPH_ERROR)):
        return _named_input_steps(cell, args, kwargs)
    return args, kwargs


def _run_output_steps(cell, args, output):
    if refuse_while_compiling(getattr(cell, _PLAN_GRAPH_ERROR)):
        return _output_steps(cell, output)
    return output


def _input_steps(cell, args):
    for step in sorted(cell.__dict__[_PLAN_STEPS], key=lambda s: -s.depth):
        if step.inputs is not None:
            args = _convert_all(tuple(args), step.mesh, step.inputs)
    return args


def _named_input_steps(cell, args, kwargs):
    """The dict input plans (HyperParallel's): positional and keyword arguments converted by name."""
    for step in sorted(cell.__dict__[_PLAN_STEPS], key=lambda s: -s.depth):
        if step.named_inputs is not None:
            plan, names = step.named_inputs, step.input_names
            args = tuple(_convert(a, step.mesh, plan.get(names[i])) if i < len(names) else a
                         for i, a in enumerate(args))
            kwargs = {k: _convert(v, step.mesh, plan.get(k)) for k, v in kwargs.items()}
    return tuple(args), kwargs


def _output_steps(cell, output):
    for step in sorted(cell.__dict__[_PLAN_STEPS], key=lambda s: s.depth):
        if step.outputs is not None:
            output = _convert_all(output, step.mesh, step.outputs)
        if step.local:
            output = _to_local(output)
    return output
