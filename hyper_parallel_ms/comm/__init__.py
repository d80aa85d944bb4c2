"""Differentiable collectives on plain MindSpore tensors over one dimension of a DeviceMesh.

Each collective runs in PyNative and inside ``ms.jit`` and has the SPMD backward (the
global loss is the sum of every rank's loss):

=================  ==========================================  ================================
collective         forward                                     backward
=================  ==========================================  ================================
all_gather         concatenate the pieces along ``dim``        reduce-scatter (sum)
reduce_scatter     reduce, keep this rank's chunk of ``dim``   all-gather (sum and avg)
all_reduce         element-wise sum / avg / max / min          all-reduce sum (max/min: to the
                                                               rank(s) holding the extreme)
all_to_all         chunk ``split_dim``, concat ``concat_dim``  the inverse all-to-all
all_to_all_single  uneven row blocks of dim 0 to each rank     the same with the splits swapped
broadcast          the tensor of group rank ``src``            sum of gradients onto ``src``
=================  ==========================================  ================================

Pieces may be uneven (``torch.chunk`` sizes, or any ``sizes`` for all_gather). The path
(native primitive or composed from all-reduce) is chosen by MindSpore's device target from
:mod:`.capability`. A mesh dimension of size 1 returns the input: nothing is sent.
Every dtype goes through exactly: on CPU integers, bool and float64 travel in float32 form
(:mod:`._exact`); ``op="avg"`` on integers or bool raises ``TypeError``.

``send`` / ``recv`` (:mod:`._p2p`) move one tensor between two ranks of a mesh dimension, in
PyNative only and without a backward (pipeline schedules send gradients as actions of their own).

On a cluster every call made in PyNative is counted for the communication watchdog
(:mod:`._watchdog`): a rank waiting for a peer that stopped answering (``HPMS_COMM_TIMEOUT``
seconds, default 20 on CPU ranks and HCCL's execution timeout on NPUs; ``0`` turns it off) or whose process is gone ends, naming the peer and the call.

Every call goes through the mesh's exchange (:mod:`._exchange`): on a simulated mesh
(``init_device_mesh(..., simulate=...)``) nothing runs: each call is checked and recorded exactly
as on the cluster (the record ``CommDebugMode`` gets, with the path of the simulated device) and
returns a placeholder of the output's shape and dtype (zeros, or what a simulation's exchange makes).

Example::

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    y = all_gather(x, mesh, "tp", dim=0)          # pieces of the tp group, stacked on dim 0
    z = all_reduce(y, mesh, "dp", op="avg")
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Optional, Sequence, Tuple

import mindspore as ms

from .._mindspore import cached_in_python, cell_per_call_site, is_compiling, run_in_python
from ..layout import chunk_offsets, chunk_sizes
from ..placement import REDUCE_OPS
from . import _composed, _exact, _lean, _native, _traffic
from ._alltoallv import all_to_all_by_matrix, all_to_all_single
from ._broadcast import broadcast as _broadcast
from ._p2p import recv, send
from .capability import CAPABILITIES, COLLECTIVES, POINT_TO_POINT, force_path, select_path, table
from .debug import CommDebugMode, CommRecord, record

__all__ = ["all_gather", "all_reduce", "reduce_scatter", "all_to_all", "all_to_all_single", "all_to_all_by_matrix",
           "broadcast", "send", "recv", "CommDebugMode",
           "CommRecord", "CAPABILITIES", "COLLECTIVES", "POINT_TO_POINT", "force_path", "select_path", "table"]


@dataclass(frozen=True)
class _Call:
    """One resolved collective: the group, the path, normalised arguments, its debug record."""

    group: object
    native: bool
    dim: int
    sizes: Tuple[int, ...]
    record: Optional[CommRecord]
    empty_output: bool     # some rank's output piece is empty (reduce_scatter / all_to_all chunks)
    on_cpu: bool = False   # native on MindSpore's CPU backend (MCCL: world group, composed backward)
    kept: Tuple[int, int] = (0, 0)   # reduce_scatter / all_to_all: this rank's chunk (offset, length), plain ints
    moves: bool = True     # the exchange's collectives send data

    @property
    def runs(self) -> bool:
        """Whether anything is sent: a group of several ranks, over an exchange that moves data."""
        return self.group.size > 1 and self.moves


def _norm_dim(dim: int, ndim: int, what: str) -> int:
    if isinstance(dim, bool) or not isinstance(dim, int) or not -ndim <= dim < ndim:
        raise ValueError(f"{what} {dim!r} is out of range for a {ndim}-D tensor; valid dims are [{-ndim}, {ndim - 1}]")
    return dim % ndim


def _check_op(op: str) -> None:
    if op not in REDUCE_OPS:
        raise ValueError(f"reduce op must be one of {REDUCE_OPS}, got {op!r}")


def _check_sizes(sizes: Sequence[int], group, shape: Tuple[int, ...], dim: int, what: str) -> Tuple[int, ...]:
    sizes = tuple(sizes)
    if len(sizes) != group.size or any(isinstance(s, bool) or not isinstance(s, int) or s < 0 for s in sizes):
        raise ValueError(f"{what} must give {group.size} non-negative ints (one per rank of the group), got {sizes}")
    if sizes[group.rank] != shape[dim]:
        raise ValueError(f"{what}[{group.rank}] = {sizes[group.rank]} but this rank's tensor has {shape[dim]} "
                         f"along dim {dim} (shape {shape})")
    return sizes


def _check_op_dtype(op: str, dtype) -> None:
    if op == "avg" and (dtype == ms.bool_ or dtype in _exact.INTEGER_DTYPES):
        raise TypeError(f"reduce op 'avg' is not defined for {dtype} tensors (an integer mean would be "
                        "truncated; PyTorch refuses avg on bool too); reduce with 'sum' and divide, or cast "
                        "to a float dtype first")


def _wire_form(path: str, kind: str, dtype, itemsize: int, n: int, op: str,
               compiled: bool) -> Tuple[Optional[int], bool]:
    """(bytes per element the primitives carry, whether a reduction gathers every piece)."""
    reduces = kind in ("all_reduce", "reduce_scatter")
    if path == "composed":
        gathered = reduces and (op in ("max", "min") or dtype == ms.float64)
        return _exact.wire_itemsize(dtype, itemsize, n, compiled), gathered
    if dtype == ms.bool_:
        return (4 if reduces else 1), False            # reductions as int32, movement as uint8
    if dtype == ms.uint8 and reduces:
        return 4, False
    return itemsize, reduces and dtype == ms.float64


@cached_in_python
def _plan(kind: str, mesh, mesh_dim, shape: Tuple[int, ...], dtype, itemsize: int, dim: int = 0,
          sizes: Optional[Tuple[int, ...]] = None, op: str = "sum", split_dim: int = 0, src: int = 0,
          compiled: bool = False, eager: bool = True) -> _Call:
    group = mesh.comm_group(mesh_dim)
    # MCCL's AllGather: no empty piece; compiled, only equal pieces gathered on dim 0 (the primitive
    # alone: padding or cutting inside its Cell failed to compile, see _composed.world_all_gather)
    world = group.is_world and 0 not in (sizes if sizes is not None else shape) and (
        eager or (kind == "all_gather" and dim % max(len(shape), 1) == 0 and (sizes is None or len(set(sizes)) == 1)))
    path = select_path(mesh.device_target, kind, world_group=world, dtype=dtype)
    n = group.size
    if path == "composed" and n > 1:
        _composed.check_dtype(dtype)
    wire = _wire_form(path, kind, dtype, itemsize, n, op, compiled)
    if kind in ("all_reduce", "reduce_scatter"):
        _check_op(op)
        _check_op_dtype(op, dtype)
    if kind == "all_reduce":
        traffic = _traffic.all_reduce_bytes(path, n, shape, itemsize, op, *wire)
    elif kind == "reduce_scatter":
        dim = _norm_dim(dim, len(shape), "reduce_scatter dim")
        traffic = _traffic.reduce_scatter_bytes(path, n, shape, itemsize, dim, group.rank, op, *wire)
    elif kind == "broadcast":
        if isinstance(src, bool) or not isinstance(src, int) or not 0 <= src < n:
            raise ValueError(f"broadcast src must be a rank index in [0, {n}) along mesh dim {mesh_dim!r}, got {src!r}")
        traffic = _traffic.broadcast_bytes(path, n, shape, itemsize, wire[0])
    else:
        what = "all_gather dim" if kind == "all_gather" else "all_to_all concat_dim"
        dim = _norm_dim(dim, len(shape), what)
        sizes = (shape[dim],) * n if sizes is None else _check_sizes(
            sizes, group, shape, dim, "sizes" if kind == "all_gather" else "concat_sizes")
        if kind == "all_gather":
            traffic = _traffic.all_gather_bytes(path, n, shape, itemsize, dim, sizes, wire[0])
        else:
            split_dim = _norm_dim(split_dim, len(shape), "all_to_all split_dim")
            if split_dim == dim:
                raise ValueError(f"all_to_all needs different split_dim and concat_dim, got {dim} for both")
            traffic = _traffic.all_to_all_bytes(path, n, shape, itemsize, split_dim, dim, sizes, group.rank, wire[0])
    names = mesh.mesh_dim_names
    index = mesh.dim_index(mesh_dim)
    rec = CommRecord(kind, names[index] if names else str(index), n, path, traffic[0], traffic[1], shape,
                     str(dtype), group=group.ranks) if n > 1 else None
    kept, empty_output = (0, 0), False
    if kind in ("reduce_scatter", "all_to_all"):
        size = shape[dim if kind == "reduce_scatter" else split_dim]
        lengths = chunk_sizes(size, n)
        kept, empty_output = (chunk_offsets(size, n)[group.rank], lengths[group.rank]), 0 in lengths
    return _Call(group, path == "native", dim, sizes or (), rec, empty_output, mesh.device_target == "CPU", kept,
                 mesh.exchange.moves)


@run_in_python
def _resolve(kind: str, mesh, mesh_dim, shape: Tuple[int, ...], dtype, itemsize: int, **options) -> _Call:
    """The planned call, checked for graph compilation, and counted by active CommDebugModes
    (inside ms.jit once, when the graph is compiled)."""
    compiling = is_compiling()
    call = _plan(kind, mesh, mesh_dim, shape, dtype, itemsize, compiled=dtype == ms.float64 and compiling,
                 eager=not compiling, **options)
    if call.empty_output and call.runs and compiling:
        raise NotImplementedError(
            f"{kind} over mesh dim {mesh_dim!r} would leave some rank an empty output piece (tensor shape "
            f"{shape}, options {options}); inside ms.jit that rank's loss no longer depends on its input, "
            "graph mode prunes its backward collective and the other ranks wait for it forever. Run it in "
            "PyNative, or use a size along the scattered dim that gives every rank at least one slice")
    if call.record is not None:
        record(call.record)
        if not compiling:
            mesh.exchange.count(kind, call.group, call.record.mesh_dim)
    return call


def _placeholder(x, mesh, call: _Call, lengths: Optional[Dict[int, int]] = None):
    """What a call that sends nothing returns: ``x`` for a one-rank group; else the exchange's
    placeholder of ``x``'s shape (with ``lengths[d]`` along dim ``d``) and dtype."""
    if call.group.size == 1:
        return x
    shape = list(x.shape)
    for d, length in (lengths or {}).items():
        shape[d] = length
    return mesh.exchange.placeholder(x, tuple(shape))


def all_gather(x, mesh, mesh_dim=0, *, dim: int = 0, sizes: Optional[Sequence[int]] = None):
    """Concatenate the pieces of the ranks along ``mesh_dim`` on tensor dim ``dim``.

    ``sizes`` gives every rank's length along ``dim`` (default: all equal to this rank's).

    Args:
        x: this rank's piece (a plain Tensor).
        mesh: the :class:`DeviceMesh`.
        mesh_dim: the name or index of the mesh dim whose ranks gather (default 0).
        dim: the tensor dim the pieces are concatenated on.
        sizes: every rank's length along ``dim``, in group order (default: all equal to this rank's).

    Example::

        y = all_gather(x, mesh, "tp", dim=1, sizes=(3, 2))   # uneven pieces, width 5
    """
    call = _resolve("all_gather", mesh, mesh_dim, x.shape, x.dtype, x.itemsize, dim=dim,
                 sizes=None if sizes is None else tuple(sizes))
    if not call.runs:
        return _placeholder(x, mesh, call, {call.dim: sum(call.sizes)})
    if call.native:
        if call.on_cpu:
            return _composed.world_all_gather(x, call.dim, call.sizes, call.group)
        return _native.all_gather(x, call.dim, call.sizes, call.group)
    return _composed.all_gather(x, call.dim, call.sizes, call.group)


def all_reduce(x, mesh, mesh_dim=0, *, op: str = "sum"):
    """Element-wise reduction (``sum``, ``avg``, ``max``, ``min``) over the ranks along ``mesh_dim``.

    Args:
        x: this rank's tensor.
        mesh: the :class:`DeviceMesh`.
        mesh_dim: the name or index of the mesh dim whose ranks reduce (default 0).
        op: ``"sum"`` (default), ``"avg"``, ``"max"`` or ``"min"``.

    Example::

        total = all_reduce(partial_sums, mesh, "tp")
    """
    call = _resolve("all_reduce", mesh, mesh_dim, x.shape, x.dtype, x.itemsize, op=op)
    if not call.runs:
        return _placeholder(x, mesh, call)
    if call.native:
        return _native.all_reduce(x, op, call.group)
    return _composed.all_reduce(x, op, call.group)


def reduce_scatter(x, mesh, mesh_dim=0, *, dim: int = 0, op: str = "sum"):
    """Reduce over the ranks along ``mesh_dim``; each keeps its ``torch.chunk`` piece of ``dim``.

    Args:
        x: this rank's whole tensor.
        mesh: the :class:`DeviceMesh`.
        mesh_dim: the name or index of the mesh dim (default 0).
        dim: the tensor dim cut into ``torch.chunk`` pieces after the reduction.
        op: ``"sum"`` (default), ``"avg"``, ``"max"`` or ``"min"``.

    Example::

        piece = reduce_scatter(partial, mesh, "tp", dim=0)
    """
    call = _resolve("reduce_scatter", mesh, mesh_dim, x.shape, x.dtype, x.itemsize, dim=dim, op=op)
    if not call.runs:
        return _placeholder(x, mesh, call, {call.dim: call.kept[1]})
    if call.native:
        return _native.reduce_scatter(x, call.dim, op, call.group, call.kept)
    return _composed.reduce_scatter(x, call.dim, op, call.group, call.kept)


def all_to_all(x, mesh, mesh_dim=0, *, split_dim: int, concat_dim: int,
               concat_sizes: Optional[Sequence[int]] = None):
    """Chunk ``split_dim`` (``torch.chunk`` sizes), send chunk ``j`` to rank ``j`` along
    ``mesh_dim``, and concatenate what arrives along ``concat_dim``.

    ``concat_sizes`` gives every rank's length along ``concat_dim`` (default: all equal).

    Args:
        x: this rank's tensor.
        mesh: the :class:`DeviceMesh`.
        mesh_dim: the name or index of the mesh dim (default 0).
        split_dim: the tensor dim chunked and sent out.
        concat_dim: the tensor dim the received chunks are concatenated on.
        concat_sizes: every rank's length along ``concat_dim`` (default: all equal).

    Example::

        y = all_to_all(x, mesh, "tp", split_dim=1, concat_dim=0)   # S(0) -> S(1)
    """
    call = _resolve("all_to_all", mesh, mesh_dim, x.shape, x.dtype, x.itemsize, dim=concat_dim,
                 sizes=None if concat_sizes is None else tuple(concat_sizes), split_dim=split_dim)
    split = split_dim % x.ndim
    if not call.runs:
        if _lean.chunked_evenly(call.sizes) and _lean.simulated(x.dtype, call.group.size, mesh.exchange):
            return _lean_all_to_all(mesh, mesh_dim, split, call.dim, call.sizes, call.kept, x.shape[split],
                                    True).move(x)
        return _placeholder(x, mesh, call, {split: call.kept[1], call.dim: sum(call.sizes)})
    if call.native:
        return _native.all_to_all(x, split, call.dim, call.sizes, call.group, call.kept)
    if _lean.chunked_evenly(call.sizes) and _lean.applies(x.dtype):
        return _lean_all_to_all(mesh, mesh_dim, split, call.dim, call.sizes, call.kept, x.shape[split]).move(x)
    return _composed.all_to_all(x, split, call.dim, call.sizes, call.group, call.kept)


@cell_per_call_site
def _lean_all_to_all(mesh, mesh_dim, split: int, concat: int, sizes: Tuple[int, ...], kept: Tuple[int, int],
                     split_length: int, simulated: bool = False) -> _lean.LeanAllToAll:
    """The composed all-to-all as one node keeping nothing (:mod:`._lean`); its backward is the
    inverse :func:`all_to_all` (recorded by CommDebugMode as the forward is). ``simulated``: on a
    simulated rank, the exchange's placeholder in its place (the backward issued all the same, as
    the cluster's; both paths' backwards read only the gradient)."""
    group = mesh.comm_group(mesh_dim)
    back_sizes = chunk_sizes(split_length, group.size)

    def forward(x):
        if simulated:
            shape = list(x.shape)
            shape[split], shape[concat] = kept[1], sum(sizes)
            return mesh.exchange.placeholder(x, tuple(shape))
        return _composed.all_to_all(x, split, concat, sizes, group, kept)

    def inverse(dout):
        return all_to_all(dout, mesh, mesh_dim, split_dim=concat, concat_dim=split, concat_sizes=back_sizes)
    return _lean.LeanAllToAll(forward, inverse)


def broadcast(x, mesh, mesh_dim=0, *, src: int = 0):
    """Every rank along ``mesh_dim`` receives the tensor of the rank at index ``src`` there.

    Args:
        x: the tensor (the same shape and dtype on every rank).
        mesh: the :class:`DeviceMesh`.
        mesh_dim: the name or index of the mesh dim (default 0).
        src: the index, along ``mesh_dim``, of the rank whose tensor everyone receives.

    Example::

        weights = broadcast(weights, mesh, "dp", src=0)
    """
    call = _resolve("broadcast", mesh, mesh_dim, x.shape, x.dtype, x.itemsize, src=src)
    if not call.runs:
        return _placeholder(x, mesh, call)
    return _broadcast(x, src, call.group, call.native)
