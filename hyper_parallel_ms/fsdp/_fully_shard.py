"""``fully_shard``: FSDP2's per-Cell parameter sharding over data parallelism: the plan of a unit
(its FSDPParam records and groups) and the Cell edits that install it; the methods the sharded
Cell gains are :mod:`._module`'s ``FSDPModule``.

Example::

    for block in model.layers:
        fully_shard(block, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
    optimizer = nn.SGD(model.trainable_params(), learning_rate=0.1)   # steps on the pieces
"""
from __future__ import annotations

import warnings
from math import prod
from typing import Any, Callable, Dict, List, Optional, Tuple, Union

import mindspore as ms
from mindspore import Parameter, nn

from .._cluster import device_target
from .._mindspore import cell_subclass, check_compiled_calls
from ..dtensor import DTensor
from ..placement import Shard
from ..nn._adapter import named_cells, own_parameters
from ..nn._parameter import REPLACED_BY
from ..nn._consistency import agreed
from ..nn._edit import ModuleEdit, apply_edits
from ._chunks import Chunks, cut_dim
from ._compiled import READER_PREFIX, gathering_class
from ._coverage import warn_parameters_outside_units
from ._dparams import local_parameter
from ._group import FSDPParamGroup
from ._mesh import default_mesh, dp_mesh_dims
from ._module import STATE, FSDPModule, check_reshard, fsdp_state, set_reshard
from ._param import FSDPParam, is_piece
from ._pieces import TAKEN_BY, chunks_of
from ._policy import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy
from ._state import FSDPState, cast_keyword_inputs, eager_hooks, pieces_check
from ._sync import SyncState

__all__ = ["fully_shard", "shard_cell"]

_CLASSES: Dict[Tuple[type, type], type] = {}


def _extended_class(cls: type, mixin: type, prefix: str) -> type:
    if issubclass(cls, mixin):
        return cls
    key = (cls, mixin)
    if key not in _CLASSES:
        _CLASSES[key] = cell_subclass(f"{prefix}{cls.__name__}", (mixin, cls), {"__module__": cls.__module__})
    return _CLASSES[key]


def _own_slots(cell: nn.Cell, ignored: frozenset = frozenset()) -> List[Tuple[Parameter, List[Tuple[nn.Cell, str]]]]:
    """Parameters under ``cell`` not yet taken by a unit, each with every (cell, attr) holding it
    (a parameter shared by several of them is one record: one piece, gathered once). A parameter
    an earlier unit took (its piece replaced it there) but still held here is refused. Parameters
    with ``requires_grad=False`` and those whose ``id`` is in ``ignored`` are left alone (see
    :func:`fully_shard`)."""
    found: Dict[int, Tuple[Parameter, List[Tuple[nn.Cell, str]]]] = {}
    for path, sub in named_cells(cell).items():
        for attr, p in own_parameters(sub).items():
            if is_piece(p) or not p.requires_grad or id(p) in ignored:
                continue
            taken = getattr(p, TAKEN_BY, None)
            if taken is not None:
                unit, use = taken
                here = f"{path}.{attr}" if path else attr
                raise ValueError(
                    f"fully_shard({type(cell).__name__}): the parameter {p.name!r} is shared (tied): "
                    f"{type(sub).__name__} '{here}' here uses it, and the earlier fully_shard({unit}) took it as "
                    f"its own '{use}'. A shared parameter belongs to one unit, the lowest Cell holding every use "
                    "(as in FSDP2): apply fully_shard to their common parent (or the root) and not to a Cell "
                    "holding only one of the uses")
            found.setdefault(id(p), (p, []))[1].append((sub, attr))
    return list(found.values())


def _refuse_below_a_unit(cell: nn.Cell) -> None:
    """A Cell whose parameters an enclosing unit already took (fully_shard applied top-down) would own
    nothing: refused, naming the fix (bottom-up, as FSDP2)."""
    cells = list(named_cells(cell).values())
    owned = {id(record.piece) for sub in cells if fsdp_state(sub) is not None for record in fsdp_state(sub).params}
    taken = list(dict.fromkeys(p.name for sub in cells for p in own_parameters(sub).values()
                               if is_piece(p) and id(p) not in owned))
    if taken:
        raise ValueError(
            f"fully_shard({type(cell).__name__}): its parameters {taken[:4]} already belong to an enclosing "
            "fully_shard unit (applied to a parent first). Apply fully_shard bottom-up: each block first, then "
            "the root")


def _shardable(p: Parameter, mesh, threshold_bytes: int, dim: int) -> bool:
    shape = tuple(p.shape)
    if not shape or chunks_of(shape, mesh, dim).any_empty():
        return False        # MindSpore's optimizers reject empty pieces: keep such a parameter whole
    return prod(shape) * p.itemsize >= threshold_bytes


def _buckets(params: List[FSDPParam], bucket_bytes: Optional[int]) -> List[List[FSDPParam]]:
    """``params`` grouped into buckets by full (gathered) size: ``None`` one bucket, ``0`` one per
    parameter, else greedily up to ``bucket_bytes``."""
    if not params:
        return []
    if bucket_bytes is None:
        return [params]
    out, size = [[]], 0
    for param in params:
        if out[-1] and (bucket_bytes == 0 or size + param.nbytes > bucket_bytes):
            out.append([])
            size = 0
        out[-1].append(param)
        size += param.nbytes
    return out


def _unit_slots(cells: List[nn.Cell], ignored: frozenset) -> List[Tuple[Parameter, List[Tuple[nn.Cell, str]]]]:
    """:func:`_own_slots` of every Cell of a unit, a parameter several of them hold once."""
    found: Dict[int, Tuple[Parameter, List[Tuple[nn.Cell, str]]]] = {}
    for cell in cells:
        for p, holders in _own_slots(cell, ignored):
            found.setdefault(id(p), (p, []))[1].extend(holders)
    return list(found.values())


def _plan(cells: List[nn.Cell], mesh, state: FSDPState, *, threshold_bytes: int, bucket_bytes: Optional[int],
          reduce: str, dtensor_mesh: Optional[Callable[[Parameter], Any]], call: str, ignored: frozenset,
          shard_placement_fn: Optional[Callable], replicated: frozenset = frozenset()) -> FSDPState:
    """``state`` with its records and groups: the pieces made, no Cell changed, nothing sent."""
    kinds: Dict[Tuple[bool, Any, Any], List[FSDPParam]] = {}
    for p, holders in _unit_slots(cells, ignored):
        unit_mesh = dtensor_mesh(p) if isinstance(p, DTensor) and dtensor_mesh is not None else mesh
        local, placed = local_parameter(p, call, unit_mesh)
        dim = _placement_dim(shard_placement_fn, p, local, call)
        sharded = id(p) not in replicated and _shardable(local, unit_mesh, threshold_bytes, dim)
        chunks = chunks_of(local.shape, unit_mesh, dim) if sharded else Chunks(tuple(local.shape), 1, 0, dim)
        record = FSDPParam(p, local, holders, unit_mesh, sharded, chunks, placed)
        record.make(p)
        kinds.setdefault((not sharded, unit_mesh, local.dtype), []).append(record)
    for key in sorted(kinds, key=lambda k: k[0]):            # sharded groups first
        for bucket in _buckets(kinds[key], bucket_bytes):
            state.groups.append(FSDPParamGroup(bucket, not key[0], key[1], state.sync, state.policy.param_dtype,
                                               reduce, state))
    return state


def _placement_dim(shard_placement_fn: Optional[Callable], p: Parameter, local: Parameter, call: str) -> int:
    """The dim FSDP2's ``shard_placement_fn(param) -> Shard | None`` cuts ``p`` on (``None``: 0;
    a negative dim counts from the end of ``local``, the values this rank holds); anything but a
    ``Shard`` of an existing dim is refused, naming the parameter."""
    placement = None if shard_placement_fn is None else shard_placement_fn(p)
    if placement is None:
        return 0
    refusal = ValueError(f"{call}: shard_placement_fn gives {placement!r} for {p.name!r} of shape "
                         f"{tuple(local.shape)}; it must return None or Shard(dim) with a dim of the parameter")
    if not isinstance(placement, Shard):
        raise refusal
    try:
        return cut_dim(tuple(local.shape), placement.dim)
    except ValueError as out_of_range:
        raise refusal from out_of_range


def _described(state: FSDPState) -> List[Tuple[str, str]]:
    """What every rank of the data-parallel mesh must agree on: each record, its group and options."""
    entries = [("options", f"reshard_after_forward={state.reshard_after_forward} {state.policy}")]
    for g, group in enumerate(state.groups):
        for p in group.params:
            how = f"{'shard' if p.sharded else 'whole'} dim {p.chunks.dim}"
            entries.append((p.name, f"{p.shape} {p.local.dtype} {how} mesh {group.mesh.shape} group {g}"))
    return entries


def _edits(cells: List[nn.Cell], state: FSDPState, mixin: type, prefix: str) -> List[ModuleEdit]:
    """The changes of one unit, one :class:`ModuleEdit` per Cell: each holder gets its pieces, its
    compiled readers and the gathering class; each Cell of the unit its state, hooks and
    ``FSDPModule`` class."""
    several = len(cells) > 1
    paths = {}
    for i, root in enumerate(cells):
        for path, sub in named_cells(root).items():
            prefix_path = f"[{i}]" if several else ""
            paths.setdefault(id(sub), ".".join(x for x in (prefix_path, path) if x))
    edits: Dict[int, ModuleEdit] = {}

    def edit_of(c: nn.Cell) -> ModuleEdit:
        return edits.setdefault(id(c), ModuleEdit(paths[id(c)], c, marks_done=True))

    name = "[" + ", ".join(type(c).__name__ for c in cells) + "]" if several else type(cells[0]).__name__
    taken = []
    for group in state.groups:
        for i, record in enumerate(group.params):
            reader = group.reader(i)
            for holder, attr in record.holders:
                edit = edit_of(holder)
                edit.parameters[attr] = record
                edit.attributes[READER_PREFIX + attr] = reader
            holder, attr = record.holders[0]
            use = f"{paths[id(holder)]}.{attr}" if paths[id(holder)] else attr
            taken.append((record.original, TAKEN_BY, (name, use)))
            taken.append((record.original, REPLACED_BY, f"fully_shard({name})"))
    for edit in edits.values():
        edit.swap_class = gathering_class(type(edit.cell), list(edit.parameters))
    inner: Dict[int, List[Tuple[str, FSDPParam]]] = {}      # Cells below the unit holding pieces
    for group in state.groups:
        for record in group.params if group.sharded else ():
            for holder, attr in record.holders:
                if all(holder is not c for c in cells):
                    inner.setdefault(id(holder), []).append((attr, record))
    for key, slots in inner.items():
        edits[key].forward_pre_hooks.append(pieces_check(name, slots))
    pre, post = eager_hooks(state)
    for cell in cells:
        unit = edit_of(cell)
        unit.attributes[STATE] = state
        unit.forward_pre_hooks.append(pre)
        cast = cast_keyword_inputs(state)
        if cast is not None:
            unit.kwargs_pre_hooks.append(cast)
        unit.restoring_hooks.append(post)
        unit.swap_class = _extended_class(unit.swap_class or type(cell), mixin, prefix)
    edit_of(cells[0]).object_attributes.extend(taken)
    return list(edits.values())


def _unit_cells(module: Any) -> List[nn.Cell]:
    """The Cells of one unit: ``module``, or FSDP2's list of Cells sharded as one group (none inside
    another, none twice)."""
    if isinstance(module, nn.Cell):
        return [module]
    if not isinstance(module, (list, tuple)) or not module or not all(isinstance(m, nn.Cell) for m in module):
        raise TypeError(f"fully_shard needs an nn.Cell or a non-empty list of them, got {module!r:.200}")
    cells = list(module)
    if len({id(c) for c in cells}) != len(cells):
        raise ValueError("fully_shard: a Cell appears twice in the list")
    for outer in cells:
        inside = {id(c) for c in named_cells(outer).values()} - {id(outer)}
        nested = [type(c).__name__ for c in cells if id(c) in inside]
        if nested:
            raise ValueError(f"fully_shard: {nested} lie inside {type(outer).__name__} in the same list; shard the "
                             "inner Cells first (their own call), then the list of the outer ones")
    return cells


def shard_cell(cell: nn.Cell, mesh, *, reshard_after_forward: Any = True,
               mp_policy: Optional[MixedPrecisionPolicy] = None, threshold_bytes: int = 0,
               bucket_bytes: Optional[int] = None, reduce: str = "reduce_scatter", grad_scale: float = 1.0,
               reduce_dtype: Any = None, mixin: type = FSDPModule, prefix: str = "FSDP", engine: str = "fully_shard",
               dtensor_mesh: Optional[Callable[[Parameter], Any]] = None, ignored_params: Optional[Any] = None,
               shard_placement_fn: Optional[Callable] = None, replicate_params: Optional[Any] = None):
    """The engine of :func:`fully_shard` and ``hsdp``: shard ``cell``'s own parameters over ``mesh``
    (a ``Parameter(DTensor)``: its local piece, over ``dtensor_mesh(param)`` if given, see :mod:`._dparams`).
    The plan is made without changing anything, agreed by every rank of ``mesh`` (a rank whose plan
    or error differs fails every rank) and applied through ``nn``'s edit engine (a failure leaves
    every Cell as it was); ``engine`` names the call in the done-marker that the parallel styles check."""
    cells = _unit_cells(cell)
    for c in cells:
        if fsdp_state(c) is not None:
            raise ValueError(f"{type(c).__name__} is already sharded by fully_shard; apply it once per Cell")
        _refuse_below_a_unit(c)
    mesh = default_mesh() if mesh is None else mesh
    dp_mesh_dims(mesh)                          # a 1-D or 2-D mesh
    check_reshard(reshard_after_forward)
    policy = mp_policy or MixedPrecisionPolicy()
    if not isinstance(policy, MixedPrecisionPolicy):
        raise TypeError(f"mp_policy must be a MixedPrecisionPolicy, got {type(policy).__name__}")
    sync = SyncState(reduce_dtype=reduce_dtype if reduce_dtype is not None else policy.reduce_dtype,
                     grad_scale=grad_scale)
    names = ", ".join(type(c).__name__ for c in cells)
    call = f"{prefix.lower()}({names if len(cells) == 1 else '[' + names + ']'})"   # names this call in errors
    ignored = _ignored_ids(ignored_params, call)
    replicated = _ignored_ids(replicate_params, call, "replicate_params")
    if policy.apply_grad_on_fp32_main_grad:
        _check_fp32_pieces(cells, ignored, call)

    def prepare() -> FSDPState:
        state = FSDPState(cells[0], mesh, sync, policy, reshard_after_forward)
        state.cells = cells
        state = _plan(cells, mesh, state, threshold_bytes=threshold_bytes, bucket_bytes=bucket_bytes,
                      reduce=reduce, dtensor_mesh=dtensor_mesh, call=call, ignored=ignored,
                      shard_placement_fn=shard_placement_fn, replicated=replicated)
        check_reshard(reshard_after_forward, state.groups, names)
        return state
    state = agreed(prepare, _described, mesh, call)
    set_reshard(state, reshard_after_forward)
    apply_edits(_edits(cells, state, mixin, prefix), engine)
    check_compiled_calls(warn_parameters_outside_units)     # an optimizer over units and other parameters
    _warn_kept_whole(state, call)
    return cell


def _warn_kept_whole(state: FSDPState, call: str) -> None:
    """Warn once, naming the parameters left whole because some rank's piece would have no rows."""
    whole = [(p.name, tuple(p.local.shape), g.mesh, p.chunks.dim) for g in state.groups if not g.sharded
             for p in g.params if p.local.shape and chunks_of(tuple(p.local.shape), g.mesh, p.chunks.dim).any_empty()]
    if not whole:
        return
    ranks = whole[0][2].size(dp_mesh_dims(whole[0][2])[0])
    shown = ", ".join(f"{name} {shape} (dim {dim})" for name, shape, _, dim in whole[:5]) + (
        f", ... ({len(whole) - 5} more)" if len(whole) > 5 else "")
    warnings.warn(f"{call}: {len(whole)} parameters have fewer slices on their cut dim than the {ranks} ranks they "
                  "would be cut "
                  f"over and stay whole on every rank (their gradients all-reduced), costing their full size on each: "
                  f"{shown}; FSDP2 would give some ranks empty pieces (MindSpore's optimizers refuse them)",
                  UserWarning, stacklevel=4)


def _ignored_ids(ignored_params: Optional[Any], call: str, what: str = "ignored_params") -> frozenset:
    if ignored_params is None:
        return frozenset()
    params = list(ignored_params)
    if not all(isinstance(p, Parameter) for p in params):
        raise TypeError(f"{call}: {what} must be a collection of Parameters, got {ignored_params!r}")
    return frozenset(id(p) for p in params)


def _check_fp32_pieces(cells: List[nn.Cell], ignored: frozenset, call: str) -> None:
    """``apply_grad_on_fp32_main_grad``: the gradients handed back must be fp32; they have the pieces'
    dtype, so every piece must be fp32 (a lower-precision piece would need a separate fp32 buffer)."""
    low = [(p.name, p.dtype) for p, _ in _unit_slots(cells, ignored) if p.requires_grad and p.dtype != ms.float32]
    if low:
        raise NotImplementedError(
            f"{call}: MixedPrecisionPolicy(apply_grad_on_fp32_main_grad=True) with parameters not in float32 "
            f"{low[:4]}: gradients come back in each parameter's dtype here (functional autodiff, no separate "
            "main_grad buffer). Keep the parameters in float32 (params_dtype float32, param_dtype for the "
            "compute dtype): their gradients are then float32, as the option asks")


def _check_offload(offload_policy: Optional[OffloadPolicy]) -> None:
    if offload_policy is None:
        return
    if not isinstance(offload_policy, OffloadPolicy):
        raise TypeError(f"offload_policy must be an OffloadPolicy, got {type(offload_policy).__name__}")
    if isinstance(offload_policy, CPUOffloadPolicy) and device_target() != "CPU":
        raise NotImplementedError(
            f"CPUOffloadPolicy on {device_target()}: offloading pieces, gradients and optimizer state to the host "
            "is not built; use OffloadPolicy() (keep them on the device)")


def fully_shard(module: Union[nn.Cell, List[nn.Cell]], *, mesh=None, reshard_after_forward: Optional[Any] = None,
                shard_placement_fn: Optional[Callable[[Parameter], Optional[Shard]]] = None,
                mp_policy: Optional[MixedPrecisionPolicy] = None, offload_policy: Optional[OffloadPolicy] = None,
                ignored_params: Optional[Any] = None, replicate_params: Optional[Any] = None,
                comm_fusion: Optional[bool] = None) -> Union[nn.Cell, List[nn.Cell]]:
    """Shard ``module``'s parameters (those not taken by an earlier call on a sub-Cell) on dim 0 (or the dim
    ``shard_placement_fn`` gives) over ``mesh`` (1-D: FSDP; 2-D (replicate, shard): HSDP); returns ``module``,
    now an :class:`FSDPModule`. A list of Cells (none inside another) is one unit, as in FSDP2: their
    parameters are gathered together when the first of them runs its forward and put back when every one of
    them has run its own (a Cell running again before that starts a new round). Apply bottom-up: each block,
    then the root. A parameter shared by several Cells (tied) belongs to the lowest Cell holding every use:
    one piece, gathered once; a call finding it already taken by another unit raises.

    Args:
        module: the Cell whose parameters are sharded (returned, changed in place), or a list of Cells
            sharded as one unit.
        mesh: a 1-D :class:`DeviceMesh` (FSDP) or a 2-D ``(replicate, shard)`` one (HSDP); default: every
            rank on one dim. For a TP model, the dp mesh (``mesh["dp"]``): TP parameters get a joint
            (dp, tp) layout.
        reshard_after_forward: ``None`` (default, as FSDP2): ``True``, and ``False`` for the root unit
            (found at the first forward; :meth:`FSDPModule.set_reshard_after_forward` before it overrides
            that), whose parameters the backward needs first. ``True``: in PyNative the gathered parameters
            are freed when the forward ends and all-gathered again in the backward; an int ``k`` dividing
            the shard dim's size: ``1/k`` of them is kept and the backward all-gathers over ``k`` ranks;
            ``False``: kept until the backward, one all-gather per step. Compiled graphs keep them
            (:mod:`._compiled`).
        shard_placement_fn: FSDP2's ``param -> Shard(dim) | None``: the dim each parameter is cut on
            (``None``: dim 0; a negative dim counts from the end); its pieces are ``torch.chunk`` pieces
            of that dim, padded to equal size for the gathers, and its state-dict entry is ``Shard(dim)``.
        mp_policy: a :class:`MixedPrecisionPolicy`: the dtype parameters are gathered in, gradients
            reduced in, outputs cast to (default: none, the pieces' dtype).
        offload_policy: :class:`OffloadPolicy` (default) or :class:`CPUOffloadPolicy` (CPU ranks: the
            memory is host memory already; refused on Ascend).
        ignored_params: Parameters this unit leaves alone (not sharded, gradients not reduced), as FSDP2.
            Parameters with ``requires_grad=False`` are always left whole and in place (MindSpore's
            module state such as BatchNorm statistics lives in them; see docs/fsdp.md, Frozen parameters).
        replicate_params: Parameters of the unit kept whole on every rank of ``mesh`` and not cut,
            their gradients all-reduced (averaged) over it (HyperParallel's; e.g. parameters whose dim 0
            does not divide the shard size).
        comm_fusion: HyperParallel's switch: ``None`` (default, FSDP2) or ``True``: one all-gather and
            one reduction per unit and dtype; ``False``: one per parameter.

    Example::

        fully_shard(model.layers[0], mesh=mesh)
        fully_shard(model, mesh=mesh)
    """
    _check_offload(offload_policy)
    if comm_fusion is not None and not isinstance(comm_fusion, bool):
        raise TypeError(f"fully_shard: comm_fusion must be None or a bool, got {comm_fusion!r}")
    shard_cell(module, mesh, reshard_after_forward=True if reshard_after_forward is None else reshard_after_forward,
               mp_policy=mp_policy, ignored_params=ignored_params, shard_placement_fn=shard_placement_fn,
               replicate_params=replicate_params, bucket_bytes=0 if comm_fusion is False else None)
    if reshard_after_forward is None:
        fsdp_state(_unit_cells(module)[0]).on_first_forward = _root_keeps_gathered
    return module


def _root_keeps_gathered(state: FSDPState, outermost: bool) -> None:
    """``reshard_after_forward=None`` (FSDP2): True, except for the root (the unit whose forward no other
    unit's encloses, found at the first forward), whose parameters the backward needs first."""
    if outermost:
        set_reshard(state, False)
