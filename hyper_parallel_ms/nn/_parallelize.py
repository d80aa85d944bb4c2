"""``parallelize_module``: apply parallel styles to the Cells of a model by dotted path.

The plan is a style (for the module itself) or a dict whose keys are dotted paths with
``fnmatch`` wildcards per segment (``"layers.*.attn.q"``), ``""`` for the module itself, and
whose values are styles or nested dicts (paths relative to the matched Cell). Every key and
style is checked first; only then is anything changed, and a failure while changing undoes
it all, so a failed call leaves the model as it was.

Example::

    parallelize_module(model, mesh["tp"], {
        "layers.*.mlp.up": ColwiseParallel(),
        "layers.*.mlp.down": RowwiseParallel(),
    })
"""
from __future__ import annotations

import difflib
from fnmatch import fnmatchcase
from typing import Dict, List, Optional, Union

from mindspore import nn

from ..mesh import DeviceMesh
from ._adapter import CellChanges, named_cells
from ._styles import ModuleEdit, ParallelStyle

__all__ = ["parallelize_module", "apply_edits"]

Plan = Union[ParallelStyle, Dict[str, Union[ParallelStyle, dict]]]
_MARK = "_hpms_parallelized"


def _matches(root: nn.Cell, key: str) -> Dict[str, nn.Cell]:
    cells = named_cells(root)
    if key == "":
        return {"": root}
    parts = key.split(".")
    return {path: cell for path, cell in cells.items()
            if path and len(path.split(".")) == len(parts)
            and all(fnmatchcase(seg, pat) for seg, pat in zip(path.split("."), parts))}


def _no_match(root: nn.Cell, key: str, prefix: str) -> ValueError:
    names = [p for p in named_cells(root) if p]
    near = difflib.get_close_matches(key, names, n=5, cutoff=0.5) or names[:8]
    where = f"under '{prefix}'" if prefix else "in the module"
    return ValueError(f"parallelize_plan key '{key}' matches no sub-Cell {where}; near names: {near}")


def _collect(root: nn.Cell, mesh, plan: Plan, prefix: str, src_data_rank, out: List[ModuleEdit]) -> None:
    if isinstance(plan, ParallelStyle):
        out.append(plan.plan(prefix, root, mesh, src_data_rank))
        return
    if not isinstance(plan, dict):
        raise TypeError(f"parallelize_plan must be a ParallelStyle or a dict of them, got {type(plan).__name__}")
    for key, value in plan.items():
        if not isinstance(key, str):
            raise TypeError(f"parallelize_plan keys must be dotted-path strings, got {key!r}")
        if not isinstance(value, (ParallelStyle, dict)):
            raise TypeError(f"parallelize_plan['{key}'] must be a ParallelStyle or a dict, got {value!r}")
        found = _matches(root, key)
        if not found:
            raise _no_match(root, key, prefix)
        for path, cell in found.items():
            full = ".".join(p for p in (prefix, path) if p)
            _collect(cell, mesh, value, full, src_data_rank, out)


def _defer_colwise_grads(edits: List[ModuleEdit]) -> None:
    """Leave out the input-gradient all-reduce of the Colwise layers inside a Cell whose
    PrepareModuleInput reduces their summed input gradient once (their hooks keep the rest)."""
    for outer in (e for e in edits if e.defers_colwise_grads):
        inner = [e for e in edits if e.input_grad_reduction and (outer.path == "" or
                                                                  e.path.startswith(outer.path + "."))]
        if not inner:
            raise ValueError(f"PrepareModuleInput(defer_colwise_grads=True) on '{outer.path}': no ColwiseParallel "
                             "layer with replicated input inside it takes its input")
        for edit in inner:
            edit.input_grad_reduction = edit.without_grad_reduction


def _check_conflicts(edits: List[ModuleEdit]) -> None:
    owners: Dict[int, str] = {}
    for edit in edits:
        if getattr(edit.cell, _MARK, False) and edit.parameters:
            raise ValueError(f"'{edit.path}' was already parallelized; its parameters are pieces already")
        if edit.parameters:
            if id(edit.cell) in owners:
                raise ValueError(f"two styles of the plan shard the parameters of '{edit.path}'")
            owners[id(edit.cell)] = edit.path


def apply_edits(edits: List[ModuleEdit]) -> None:
    """Make the prepared changes; if any fails, undo those already made and re-raise."""
    with CellChanges() as changes:
        for edit in edits:
            for name, param in edit.parameters.items():
                changes.set_parameter(edit.cell, name, param)
            for name, value in edit.attributes.items():
                changes.set_attribute(edit.cell, name, value)
            if edit.swap_class is not None:
                changes.swap_class(edit.cell, edit.swap_class)
            changes.add_construct_hooks(edit.cell, pre=edit.pre_hooks + edit.input_grad_reduction,
                                        post=edit.post_hooks)
            for hook in edit.kwarg_hooks:
                changes.add_forward_pre_hook(edit.cell, hook.pre, with_kwargs=True)
            if edit.parameters:
                changes.set_attribute(edit.cell, _MARK, True)


def parallelize_module(module: nn.Cell, device_mesh: Optional[DeviceMesh] = None,
                       parallelize_plan: Optional[Plan] = None, *, src_data_rank: Optional[int] = 0) -> nn.Cell:
    """Apply ``parallelize_plan`` to ``module`` over the 1-D ``device_mesh`` and return it.

    ``src_data_rank``: the rank whose initial parameter values are cut into pieces
    (``None``: every rank cuts its own values, which must then agree).

    Example::

        parallelize_module(model, mesh["tp"], {"attn.q": ColwiseParallel(), "attn.o": RowwiseParallel()})
    """
    if not isinstance(module, nn.Cell):
        raise TypeError(f"parallelize_module needs an nn.Cell, got {type(module).__name__}")
    if not isinstance(device_mesh, DeviceMesh):
        raise TypeError(f"parallelize_module needs a DeviceMesh (e.g. init_device_mesh(...)['tp']), got "
                        f"{device_mesh!r}")
    if parallelize_plan is None:
        raise ValueError("parallelize_module needs a parallelize_plan: a ParallelStyle or a dict of them")
    if src_data_rank is not None and (isinstance(src_data_rank, bool) or not isinstance(src_data_rank, int)
                                      or not 0 <= src_data_rank < device_mesh.size()):
        raise ValueError(f"src_data_rank must be None or a rank index in [0, {device_mesh.size()}), "
                         f"got {src_data_rank!r}")
    edits: List[ModuleEdit] = []
    _collect(module, device_mesh, parallelize_plan, "", src_data_rank, edits)
    _check_conflicts(edits)
    _defer_colwise_grads(edits)
    apply_edits(edits)
    return module
