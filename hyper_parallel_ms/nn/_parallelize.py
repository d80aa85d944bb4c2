"""``parallelize_module``: apply parallel styles to the Cells of a model by dotted path.

The plan is a style (for the module itself) or a dict whose keys are dotted paths matched
by the rule of :mod:`._rules` (``fnmatch`` wildcards per segment: ``"layers.*.attn.q"``), ``""``
for the module itself, and whose values are styles or nested dicts (paths relative to the
matched Cell). Every key and style is checked first; only then is anything changed, and a failure while changing undoes
it all, so a failed call leaves the model as it was.

Example::

    parallelize_module(model, mesh["tp"], {
        "layers.*.mlp.up": ColwiseParallel(),
        "layers.*.mlp.down": RowwiseParallel(),
    })
"""
from __future__ import annotations

import sys
import warnings
from typing import Dict, List, Optional, Set, Tuple, Union

from mindspore import nn

from ..mesh import DeviceMesh, current_mesh
from ._adapter import named_cells, own_parameters, stands_in
from ._consistency import agreed
from ._dropout import check_dropouts_seeded
from ._edit import ModuleEdit, apply_edits, drop_enclosed_reductions
from ._foreign import check_known_readers
from ._targets import check_mesh, check_not_done, check_not_fully_sharded, match_path, near_names

__all__ = ["ParallelStyle", "parallelize_module"]


class ParallelStyle:
    """Base of the styles. The built-in styles implement :meth:`plan` (a :class:`ModuleEdit`
    prepared without touching the Cell, so a whole plan is checked before anything changes).
    A user's style may instead implement :meth:`apply` (PyTorch's ``_apply``): it is called
    with the matched Cell and the mesh when ``parallelize_module`` applies the plan, after the
    built-in styles, with ``self.src_data_rank`` set.

    Example::

        class Doubled(ParallelStyle):
            def apply(self, module, device_mesh):
                module.register_forward_hook(lambda cell, args, out: out * 2)
                return module
    """

    src_data_rank: Optional[int] = 0

    def plan(self, path: str, cell: nn.Cell, mesh,
             src_data_rank: Optional[int] = 0) -> Union[ModuleEdit, List[ModuleEdit]]:
        """The :class:`ModuleEdit` of this style for ``cell`` (at ``path``), without changing it (or a
        list, the first for ``cell``, when the style also places parameters of Cells inside it)."""
        raise NotImplementedError(f"{type(self).__name__} implements neither plan() nor apply(module, device_mesh)")

    def apply(self, module: nn.Cell, device_mesh) -> nn.Cell:
        """Apply this style to ``module`` itself: ``parallelize_module(module, device_mesh, self)``."""
        return parallelize_module(module, device_mesh, self, src_data_rank=self.src_data_rank)

    @classmethod
    def _custom_apply(cls) -> bool:
        """Whether this style is applied by its own :meth:`apply` rather than planned."""
        return cls.plan is ParallelStyle.plan and cls.apply is not ParallelStyle.apply

    def __repr__(self) -> str:
        fields = ", ".join(f"{k}={v!r}" for k, v in vars(self).items())
        return f"{type(self).__name__}({fields})"


Plan = Union[ParallelStyle, Dict[str, Union[ParallelStyle, dict]]]


def _matches(root: nn.Cell, key: str) -> Dict[str, nn.Cell]:
    return {path: cell for path, cell in named_cells(root).items() if match_path(key, path)}


def _warn_no_match(root: nn.Cell, key: str, prefix: str, mesh: DeviceMesh) -> None:
    """A plan key naming no sub-Cell is skipped with a warning, as PyTorch does (it changes nothing);
    rank 0 also writes it to its stderr once, whatever the warning filters (under ``msrun --join``,
    the console it was launched from), where each rank's warning goes to its own log."""
    names = [p for p in named_cells(root) if p]
    near = near_names(key, names) or names[:8]
    where = f"under '{prefix}'" if prefix else "in the module"
    message = f"parallelize_plan key '{key}' matches no sub-Cell {where} and is skipped; near names: {near}"
    warnings.warn(message, UserWarning, stacklevel=4)
    if mesh.get_rank() == 0 and message not in _PRINTED:
        _PRINTED.add(message)
        print(f"hyper_parallel_ms: parallelize_module: {message}", file=sys.stderr, flush=True)


_PRINTED: Set[str] = set()      # the messages rank 0 has written to stderr (each once per process)


Target = Tuple[str, nn.Cell, ParallelStyle]


def _targets(root: nn.Cell, plan: Plan, prefix: str, out: List[Target], mesh: DeviceMesh) -> None:
    """(path, Cell, style) for every Cell the plan names, in plan order (no change, no communication)."""
    if isinstance(plan, ParallelStyle):
        out.append((prefix, root, plan))
        return
    if not isinstance(plan, dict):
        raise TypeError(f"parallelize_plan must be a ParallelStyle or a dict of them, got {type(plan).__name__}")
    for key, value in plan.items():
        if not isinstance(key, str):
            raise TypeError(f"parallelize_plan keys must be dotted-path strings, got {key!r}")
        if not isinstance(value, (ParallelStyle, dict)):
            raise TypeError(f"parallelize_plan['{key}'] must be a ParallelStyle or a dict, got {value!r}")
        found = _matches(root, key)
        elsewhere = [path for path, cell in found.items() if stands_in(cell)]    # another pipeline stage's layers
        found = {path: cell for path, cell in found.items() if path not in elsewhere}
        if not found and not elsewhere:
            _warn_no_match(root, key, prefix, mesh)
        for path, cell in found.items():
            _targets(cell, value, ".".join(p for p in (prefix, path) if p), out, mesh)


def _described(targets: List[Target]) -> List[Tuple[str, str]]:
    """(Cell path, what the plan does to it): what the ranks must agree on."""
    return [(path or "<root>", f"{type(cell).__name__} {style!r} " +
             " ".join(f"{n}{tuple(p.shape)}" for n, p in own_parameters(cell).items()))
            for path, cell, style in targets]


def _edits(path: str, cell: nn.Cell, style: ParallelStyle, mesh, src_data_rank) -> List[ModuleEdit]:
    if type(style)._custom_apply():
        def custom():
            style.src_data_rank = src_data_rank
            return style.apply(cell, mesh)
        return [ModuleEdit(path, cell, custom_apply=custom)]
    planned = style.plan(path, cell, mesh, src_data_rank)
    edits = list(planned) if isinstance(planned, (list, tuple)) else [planned]
    for edit in edits:
        edit.marks_done = bool(edit.parameters)
        edit.guarded_by = edit.guarded_by or f"{type(style).__name__} on '{edit.path or '<root>'}'"
    return edits


def _check_conflicts(edits: List[ModuleEdit]) -> None:
    owners: Dict[int, str] = {}
    for edit in edits:
        if edit.parameters:
            check_not_done(edit.cell, "parallelize_module", edit.path)
            if id(edit.cell) in owners:
                raise ValueError(f"two styles of the plan shard the parameters of '{edit.path}'")
            owners[id(edit.cell)] = edit.path


def parallelize_module(module: nn.Cell, device_mesh: Optional[DeviceMesh] = None,
                       parallelize_plan: Optional[Plan] = None, *, src_data_rank: Optional[int] = 0) -> nn.Cell:
    """Apply ``parallelize_plan`` to ``module`` over the 1-D ``device_mesh`` (default: the
    current mesh, ``with mesh:``) and return it.

    A key matching no Cell is skipped with a ``UserWarning`` naming near keys (as PyTorch does;
    rank 0 also writes it to its stderr); every key and style is checked before anything changes,
    and a failure leaves ``module`` as it was. A Cell whose parameters were already sharded (by this
    function, ``shard_module`` or ``distribute_module``) is refused, and so is a model with a Cell
    already sharded by ``fully_shard`` / ``hsdp`` (apply them after the parallel styles). A user's style implementing
    ``apply(module, device_mesh)`` is called after the built-in ones.
    A parameter shared by several Cells (tied weights) is cut once and stays one Parameter; every
    Cell using it must be styled in this call and place it alike, else the call is refused.
    An ``nn.Dropout`` in ``module`` built before any ``ms.set_seed`` (or on Ascend, where its
    primitive ignores seeds) is refused: ranks holding one activation would draw different masks.

    Args:
        module: the Cell to parallelize (returned, changed in place).
        device_mesh: a 1-D :class:`DeviceMesh` (``mesh["tp"]``); default: the current mesh.
        parallelize_plan: a :class:`ParallelStyle` (applied to ``module`` itself) or a dict
            ``{path: style or dict}``. A path is dotted and matched one segment at a time with
            ``fnmatch`` wildcards (``*`` never crosses a dot: ``"layers.*.attn.w[qkv]"`` matches
            ``layers.0.attn.wq``); ``""`` is ``module`` itself; a nested dict's paths are relative
            to the Cell its key matched (``{"layers.*": {"attn.q": ColwiseParallel()}}``).
        src_data_rank: the rank whose initial parameter values are cut into pieces (``None``:
            every rank cuts its own values, which must then agree).

    Example::

        parallelize_module(model, mesh["tp"], {"attn.q": ColwiseParallel(), "attn.o": RowwiseParallel()})
    """
    if not isinstance(module, nn.Cell):
        raise TypeError(f"parallelize_module needs an nn.Cell, got {type(module).__name__}")
    if device_mesh is None:
        device_mesh = current_mesh()
        if device_mesh is None:
            raise ValueError("parallelize_module got no device_mesh and no mesh is current: pass device_mesh=, "
                             "or call it inside `with mesh:`")
    check_mesh(device_mesh, "parallelize_module")
    check_not_fully_sharded(module, "parallelize_module")
    check_dropouts_seeded(module, "parallelize_module")
    if parallelize_plan is None:
        warnings.warn("parallelize_module got no parallelize_plan (a ParallelStyle or a dict of them): the module "
                      "is returned unchanged", UserWarning, stacklevel=2)
        return module
    if src_data_rank is not None and (isinstance(src_data_rank, bool) or not isinstance(src_data_rank, int)
                                      or not 0 <= src_data_rank < device_mesh.size()):
        raise ValueError(f"src_data_rank must be None or a rank index in [0, {device_mesh.size()}), "
                         f"got {src_data_rank!r}")

    def edits_of_plan() -> Tuple[List[Target], List[ModuleEdit]]:
        targets: List[Target] = []
        _targets(module, parallelize_plan, "", targets, device_mesh)
        edits = [e for path, cell, style in targets for e in _edits(path, cell, style, device_mesh, src_data_rank)]
        check_known_readers(named_cells(module), [(e.path, e.guarded_by, e.read_by) for e in edits
                                                  if e.cut_parameters()])
        drop_enclosed_reductions(edits)
        return targets, edits
    targets, edits = agreed(edits_of_plan, lambda prepared: _described(prepared[0]), device_mesh,
                            "parallelize_module")
    _check_conflicts(edits)
    apply_edits(edits, "parallelize_module", module)
    return module
