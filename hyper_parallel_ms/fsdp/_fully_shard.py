"""``fully_shard``: FSDP2's per-Cell parameter sharding over data parallelism, and the
``FSDPModule`` methods the sharded Cell gains.

Example::

    for block in model.layers:
        fully_shard(block, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
    optimizer = nn.SGD(model.trainable_params(), learning_rate=0.1)   # steps on the pieces
"""
from __future__ import annotations

from math import prod
from typing import Any, Callable, Dict, List, Optional, Tuple

from mindspore import Parameter, nn

from .._mindspore import cell_subclass
from ..nn._adapter import CellChanges, named_cells, own_parameters
from ..nn._rules import mark_done
from ._mesh import default_mesh, dp_mesh_dims
from ._dparams import local_parameter
from ._pieces import TAKEN_BY, chunks_of, is_piece, make_piece
from ._policy import MixedPrecisionPolicy
from ._compiled import GATHER_PREFIX, GatherParameter, PassReplicated, gathering_class
from ._state import FSDPState, Group, Slot, eager_hooks
from ._sync import SyncState

__all__ = ["fully_shard", "FSDPModule", "shard_cell", "fsdp_state"]

_STATE = "_hpms_fsdp_state"
_CLASSES: Dict[Tuple[type, type], type] = {}


def fsdp_state(cell: nn.Cell) -> Optional[FSDPState]:
    """The :class:`FSDPState` a fully_shard / hsdp call left on ``cell`` (None: not sharded)."""
    return cell.__dict__.get(_STATE)


class FSDPModule:
    """Methods of a Cell sharded by :func:`fully_shard` (its class becomes ``FSDP<Name>``).

    Example::

        fully_shard(model, mesh=mesh)
        model.set_requires_gradient_sync(False)    # micro-steps accumulate locally
        model.unshard(); model.reshard()
    """

    def _fsdp_states(self, recurse: bool = True) -> List[FSDPState]:
        cells = [c for _, c in self.cells_and_names()] if recurse else [self]
        return [state for state in map(fsdp_state, cells) if state is not None]

    def unshard(self) -> None:
        """Gather this Cell's parameters and keep them in the Cell until :meth:`reshard`."""
        self.__dict__[_STATE].unshard()

    def reshard(self) -> None:
        """Put this Cell's pieces back (frees the gathered parameters)."""
        self.__dict__[_STATE].reshard()

    def set_requires_gradient_sync(self, requires_gradient_sync: bool, *, recurse: bool = True) -> None:
        """With ``False`` the backward accumulates unreduced gradients locally and sends nothing;
        the next backward with ``True`` reduces the sum once (gradient accumulation)."""
        if not isinstance(requires_gradient_sync, bool):
            raise TypeError(f"requires_gradient_sync must be a bool, got {requires_gradient_sync!r}")
        states = self._fsdp_states(recurse)
        if not requires_gradient_sync and any(state.compiled for state in states):
            raise NotImplementedError(
                f"{type(self).__name__} was compiled by ms.jit / GRAPH_MODE, where every backward reduces the "
                "gradients, so turning sync off would not take effect there: keep sync on and add up the returned "
                "gradients of the micro-steps (the same sum as one big batch)")
        for state in states:
            state.sync.sync = requires_gradient_sync

    def set_reshard_after_forward(self, reshard_after_forward: bool, *, recurse: bool = True) -> None:
        """``True`` (or an int): PyNative frees the gathered parameters after the forward and gathers
        them again in the backward; ``False``: kept until the backward (takes effect at the next forward)."""
        _check_reshard(reshard_after_forward)
        for state in self._fsdp_states(recurse):
            state.reshard_after_forward = reshard_after_forward

    def set_reshard_after_backward(self, reshard_after_backward: bool, *, recurse: bool = True) -> None:
        """Recorded; after the backward this engine holds only pieces in any case."""
        if not isinstance(reshard_after_backward, bool):
            raise TypeError(f"reshard_after_backward must be a bool, got {reshard_after_backward!r}")
        for state in self._fsdp_states(recurse):
            state.reshard_after_backward = reshard_after_backward

    def zero_accumulated_grads(self, *, recurse: bool = True) -> None:
        """Drop gradients accumulated by backward passes without sync."""
        for state in self._fsdp_states(recurse):
            state.clear_pending()


def _check_reshard(value: Any) -> None:
    if isinstance(value, bool):
        return
    if isinstance(value, int) and value >= 1:
        return
    raise ValueError(f"reshard_after_forward must be a bool or a positive int, got {value!r}")


def _extended_class(cls: type, mixin: type, prefix: str) -> type:
    if issubclass(cls, mixin):
        return cls
    key = (cls, mixin)
    if key not in _CLASSES:
        _CLASSES[key] = cell_subclass(f"{prefix}{cls.__name__}", (mixin, cls), {"__module__": cls.__module__})
    return _CLASSES[key]


def _own_slots(cell: nn.Cell) -> List[Tuple[Parameter, List[Tuple[nn.Cell, str]]]]:
    """Parameters under ``cell`` not yet taken by a unit, each with every (cell, attr) holding it
    (a parameter shared by several of them is one slot: one piece, gathered once). A parameter
    an earlier unit took (its piece replaced it there) but still held here is refused."""
    found: Dict[int, Tuple[Parameter, List[Tuple[nn.Cell, str]]]] = {}
    for path, sub in named_cells(cell).items():
        for attr, p in own_parameters(sub).items():
            if is_piece(p):
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


def _holder_paths(cell: nn.Cell) -> Dict[int, str]:
    return {id(sub): path for path, sub in named_cells(cell).items()}


def _shardable(p: Parameter, mesh, threshold_bytes: int) -> bool:
    shape = tuple(p.shape)
    if not shape or chunks_of(shape, mesh).any_empty():
        return False        # MindSpore's optimizers reject empty pieces: keep such a parameter whole
    return prod(shape) * p.itemsize >= threshold_bytes


def _buckets(slots: List[Slot], bucket_bytes: Optional[int]) -> List[List[int]]:
    """Indices grouped into buckets by full (gathered) size: ``None`` one bucket, ``0`` one per
    parameter, else greedily up to ``bucket_bytes``."""
    if not slots:
        return []
    if bucket_bytes is None:
        return [list(range(len(slots)))]
    out, size = [[]], 0
    for i, slot in enumerate(slots):
        nbytes = prod(slot.shape) * slot.piece.itemsize
        if out[-1] and (bucket_bytes == 0 or size + nbytes > bucket_bytes):
            out.append([])
            size = 0
        out[-1].append(i)
        size += nbytes
    return out


def _gather_when_compiled(changes: CellChanges, state: FSDPState, slots: List[Slot], reduce: str) -> None:
    """Give every Cell holding one of ``slots`` the compiled read path of :mod:`._compiled`."""
    dtype = state.policy.param_dtype
    attrs: Dict[int, Tuple[nn.Cell, List[str]]] = {}
    for slot in slots:
        mesh = slot.mesh
        shard_dim, rep_dim = dp_mesh_dims(mesh)
        rep_dim = rep_dim if rep_dim is not None and mesh.size(rep_dim) > 1 else None
        for holder, attr in slot.holders:
            if slot.sharded:
                reader = GatherParameter(state, mesh, shard_dim, rep_dim, slot.chunks, dtype, reduce)
            else:
                reader = PassReplicated(state, mesh, shard_dim if mesh.size(shard_dim) > 1 else None, rep_dim, dtype)
            changes.set_attribute(holder, GATHER_PREFIX + attr, reader)
            attrs.setdefault(id(holder), (holder, []))[1].append(attr)
    for holder, names in attrs.values():
        changes.swap_class(holder, gathering_class(type(holder), names))


def shard_cell(cell: nn.Cell, mesh, *, reshard_after_forward: Any = True,
               mp_policy: Optional[MixedPrecisionPolicy] = None, threshold_bytes: int = 0,
               bucket_bytes: Optional[int] = None, reduce: str = "reduce_scatter", grad_scale: float = 1.0,
               reduce_dtype: Any = None, mixin: type = FSDPModule, prefix: str = "FSDP", engine: str = "fully_shard",
               dtensor_mesh: Optional[Callable[[Parameter], Any]] = None):
    """The engine of :func:`fully_shard` and ``hsdp``: shard ``cell``'s own parameters over ``mesh``
    (a ``Parameter(DTensor)``: its local piece, over ``dtensor_mesh(param)`` if given, see :mod:`._dparams`);
    ``engine`` names the call in the done-marker that the parallel styles check."""
    if not isinstance(cell, nn.Cell):
        raise TypeError(f"fully_shard needs an nn.Cell, got {type(cell).__name__}")
    if fsdp_state(cell) is not None:
        raise ValueError(f"{type(cell).__name__} is already sharded by fully_shard; apply it once per Cell")
    mesh = default_mesh() if mesh is None else mesh
    dp_mesh_dims(mesh)                          # a 1-D or 2-D mesh
    _check_reshard(reshard_after_forward)
    policy = mp_policy or MixedPrecisionPolicy()
    if not isinstance(policy, MixedPrecisionPolicy):
        raise TypeError(f"mp_policy must be a MixedPrecisionPolicy, got {type(policy).__name__}")
    sync = SyncState(reduce_dtype=reduce_dtype if reduce_dtype is not None else policy.reduce_dtype,
                     grad_scale=grad_scale)
    call = f"{prefix.lower()}({type(cell).__name__})"          # names this call in local_parameter's errors
    owned = [(p, holders, local_parameter(p, call)) for p, holders in _own_slots(cell)]
    paths = _holder_paths(cell)
    with CellChanges() as changes:
        state = FSDPState(cell, mesh, [], sync, policy, reshard_after_forward)
        slots: Dict[Tuple[bool, Any], List[Slot]] = {(True, mesh): [], (False, mesh): []}
        for p, holders, (local, placed) in owned:
            unit_mesh = dtensor_mesh(p) if placed is not None and dtensor_mesh is not None else mesh
            sharded = _shardable(local, unit_mesh, threshold_bytes)
            piece = make_piece(local, unit_mesh, sharded, state)
            for holder, attr in holders:
                changes.set_parameter(holder, attr, piece)
                mark_done(changes, holder, engine)
            path = paths[id(holders[0][0])]
            changes.set_attribute(p, TAKEN_BY, (type(cell).__name__, f"{path}.{holders[0][1]}" if path else
                                                holders[0][1]))
            slots.setdefault((sharded, unit_mesh), []).append(
                Slot(holders, piece, tuple(local.shape), sharded, unit_mesh, placed,
                     chunks_of(local.shape, unit_mesh) if sharded else None))
        for sharded in (True, False):
            for (kind, unit_mesh), group_slots in slots.items():
                if kind != sharded:
                    continue
                for bucket in _buckets(group_slots, bucket_bytes):
                    state.groups.append(Group([group_slots[i] for i in bucket], sharded, unit_mesh, sync,
                                              policy.param_dtype, reduce))
        _gather_when_compiled(changes, state, [s for g in state.groups for s in g.slots], reduce)
        changes.set_attribute(cell, _STATE, state)
        mark_done(changes, cell, engine)
        pre, post = eager_hooks(state)
        changes.add_forward_pre_hook(cell, pre)
        changes.add_forward_hook(cell, post)
        changes.swap_class(cell, _extended_class(type(cell), mixin, prefix))
    return cell


def fully_shard(module: nn.Cell, *, mesh=None, reshard_after_forward: Any = True,
                mp_policy: Optional[MixedPrecisionPolicy] = None) -> nn.Cell:
    """Shard ``module``'s parameters (those not taken by an earlier call on a sub-Cell) on dim 0
    over ``mesh`` (1-D: FSDP; 2-D (replicate, shard): HSDP); returns ``module``, now an
    :class:`FSDPModule`. Apply bottom-up: each block, then the root. A parameter shared by
    several Cells (tied) belongs to the lowest Cell holding every use: one piece, gathered once;
    a call finding it already taken by another unit raises.

    Args:
        module: the Cell whose parameters are sharded (returned, changed in place).
        mesh: a 1-D :class:`DeviceMesh` (FSDP) or a 2-D ``(replicate, shard)`` one (HSDP); default: every
            rank on one dim. For a TP model, the dp mesh (``mesh["dp"]``): TP parameters get a joint
            (dp, tp) layout.
        reshard_after_forward: ``True`` (default) or a positive int: in PyNative the gathered parameters are
            freed when the forward ends and all-gathered again in the backward (an int as ``True``: the
            whole shard group); ``False``: kept until the backward, one all-gather per step. Compiled
            graphs decide this themselves (:mod:`._compiled`).
        mp_policy: a :class:`MixedPrecisionPolicy`: the dtype parameters are gathered in, gradients
            reduced in, outputs cast to (default: none, the pieces' dtype).

    Example::

        fully_shard(model.layers[0], mesh=mesh)
        fully_shard(model, mesh=mesh)
    """
    return shard_cell(module, mesh, reshard_after_forward=reshard_after_forward, mp_policy=mp_policy)
