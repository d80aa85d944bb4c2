"""``all_to_all_single``: the all-to-all of uneven row blocks (PyTorch's ``all_to_all_single``), differentiable.

Rank ``i`` of the group sends rows ``[sum(in_i[:j]), sum(in_i[:j + 1]))`` of its input (dim 0) to rank ``j``;
each rank concatenates what arrives in rank order. ``S[i][j]`` (rows rank ``i`` sends to rank ``j``) is the
*split matrix*: a rank's ``input_split_sizes`` is its row, its ``output_split_sizes`` its column. The
backward is the same exchange with the matrix transposed (the splits swapped).

Paths, chosen by device (:mod:`.capability`):

- native (Ascend): ``ops.AlltoAllV`` on the flattened rows, in a Cell whose ``bprop`` is the swapped one.
- composed (CPU), PyNative: the ranks first exchange their splits (one all-reduce of ``n x 2n`` counts, which
  also checks that every rank's ``output_split_sizes`` agrees with what the others send); every rank then
  writes its rows into its slot of a buffer holding every rank's rows, all-reduces it and keeps the blocks
  sent to it (a Cell whose ``bprop`` is the transposed exchange, so that a rank with nothing to send or
  receive still joins the backward; under autodiff it keeps nothing and its backward is recorded,
  :mod:`._lean`).
- composed (CPU), inside ``ms.jit``: the split sizes must be Python ints (they are graph constants) and every
  rank's input must have as many rows (the gathered buffer has one shape on every rank; MCCL fails on
  mismatched shapes). The inputs are all-gathered whole, the splits travel as data in the same graph, and
  each rank gathers its blocks at offsets computed in the graph; autodiff gives the adjoint.
- composed (CPU), the whole split matrix given (:func:`all_to_all_by_matrix`): no count exchange; the
  buffer of every rank's rows as in PyNative, any row counts; inside ``ms.jit`` without the custom
  ``bprop`` (autodiff of the all-reduce is the transposed exchange).

Example (two ranks; rank 0 sends 1 row to itself and 2 to rank 1, rank 1 sends 3 to rank 0 and none to itself)::

    y = all_to_all_single(x, (1, 3), (1, 2), mesh, "ep")      # rank 0: 4 rows; rank 1: (2, 0) -> 2 rows
"""
from __future__ import annotations

from dataclasses import dataclass
from math import prod
from typing import Optional, Sequence, Tuple

import mindspore as ms
import numpy as np
from mindspore import Tensor, nn, ops

from .._mindspore import call_keeping_nothing, cell_per_call_site, is_compiling, run_in_python
from . import _composed, _traffic
from ._exact import place_over, wire_itemsize
from ._lean import LeanAllToAll
from ._lean import applies as lean_applies
from ._tensor import narrow, pad_slot
from .capability import select_path
from .debug import CommRecord, record, unrecorded

__all__ = ["all_to_all_single", "all_to_all_by_matrix", "split_matrix_of"]

Matrix = Tuple[Tuple[int, ...], ...]


def _check_splits(value, n: int, what: str) -> Optional[Tuple[int, ...]]:
    if value is None:
        return None
    try:
        sizes = tuple(value)
    except TypeError:
        sizes = None
    if sizes is None or len(sizes) != n or any(isinstance(s, bool) or not isinstance(s, (int, np.integer))
                                               or s < 0 for s in sizes):
        raise ValueError(f"all_to_all_single {what} must give {n} non-negative ints (one per rank of the group, "
                         f"as Python ints: inside ms.jit they are graph constants), got {value!r}")
    return tuple(int(s) for s in sizes)


def split_matrix_of(rows: Sequence[Sequence[int]]) -> Matrix:
    """The split matrix as a tuple of tuples of ints (``rows[i][j]``: rows rank ``i`` sends to rank ``j``),
    checked square.

    >>> split_matrix_of([[1, 2], [3, 0]])
    ((1, 2), (3, 0))
    """
    matrix = tuple(tuple(int(v) for v in row) for row in rows)
    if any(len(row) != len(matrix) for row in matrix) or any(v < 0 for row in matrix for v in row):
        raise ValueError(f"a split matrix is square with non-negative entries, got {matrix}")
    return matrix


def _transposed(matrix: Matrix) -> Matrix:
    return tuple(zip(*matrix)) if matrix else ()


@dataclass(frozen=True)
class _VCall:
    """One resolved ``all_to_all_single``: the group, the path, the splits (``matrix``: every rank's, when known)."""

    group: object
    native: bool
    inputs: Tuple[int, ...]
    outputs: Optional[Tuple[int, ...]]
    moves: bool
    compiled: bool
    matrix: Optional[Matrix] = None

    @property
    def runs(self) -> bool:
        return self.group.size > 1 and self.moves


@run_in_python
def _resolve(mesh, mesh_dim, shape: Tuple[int, ...], dtype, output_split_sizes, input_split_sizes,
             matrix: Optional[Matrix] = None) -> _VCall:
    group = mesh.comm_group(mesh_dim)
    n = group.size
    if len(shape) == 0:
        raise ValueError("all_to_all_single splits dim 0 of its input, got a 0-d tensor")
    if matrix is not None:
        matrix = split_matrix_of(matrix)
        if len(matrix) != n:
            raise ValueError(f"a split matrix over {n} ranks is {n} x {n}, got {len(matrix)} rows")
        input_split_sizes, output_split_sizes = matrix[group.rank], tuple(row[group.rank] for row in matrix)
    inputs = _check_splits(input_split_sizes, n, "input_split_sizes")
    if inputs is None:
        if shape[0] % n:
            raise ValueError(f"all_to_all_single without input_split_sizes splits dim 0 evenly, as PyTorch: "
                             f"{shape[0]} rows do not divide over {n} ranks; pass input_split_sizes")
        inputs = (shape[0] // n,) * n
    if sum(inputs) != shape[0]:
        raise ValueError(f"all_to_all_single input_split_sizes {inputs} sum to {sum(inputs)}, but the input has "
                         f"{shape[0]} rows along dim 0 (shape {shape})")
    outputs = _check_splits(output_split_sizes, n, "output_split_sizes")
    compiling = is_compiling()
    path = select_path(mesh.device_target, "all_to_all_single", dtype=dtype)
    if path == "composed" and n > 1:
        _composed.check_dtype(dtype)
    if compiling and n > 1 and mesh.exchange.moves:
        if outputs is None:
            raise NotImplementedError(
                "all_to_all_single inside ms.jit needs output_split_sizes as Python ints: the output's shape is a "
                "graph constant, and the ranks cannot exchange their counts while the graph compiles. Pass "
                "output_split_sizes, or call it in PyNative, where the counts are exchanged first")
        if sum(outputs) == 0 or shape[0] == 0:
            raise NotImplementedError(
                f"all_to_all_single over mesh dim {mesh_dim!r} inside ms.jit with an empty input or output on this "
                f"rank (inputs {inputs}, outputs {outputs}): graph mode would prune that rank's backward "
                "collective and the other ranks would wait for it. Run it in PyNative")
    return _VCall(group, path == "native", inputs, outputs, mesh.exchange.moves, compiling, matrix)


def _dim_name(mesh, mesh_dim) -> str:
    names, index = mesh.mesh_dim_names, mesh.dim_index(mesh_dim)
    return names[index] if names else str(index)


def _record(mesh, mesh_dim, call: _VCall, shape, dtype, itemsize: int, gathered_rows: int, counts: int) -> None:
    """Record the call for CommDebugMode (textbook: the rows sent to the other ranks)."""
    group = call.group
    wire_item = itemsize if call.native else wire_itemsize(dtype, itemsize, group.size, call.compiled)
    traffic = _traffic.all_to_all_single_bytes("native" if call.native else "composed", group.size, shape, itemsize,
                                               call.inputs, group.rank, gathered_rows, counts, wire_item)
    record(CommRecord("all_to_all_single", _dim_name(mesh, mesh_dim), group.size,
                      "native" if call.native else "composed", traffic[0], traffic[1], tuple(shape), str(dtype),
                      group=group.ranks))


def _exchange_splits(call: _VCall) -> Matrix:
    """PyNative: every rank's (input splits, output splits) over the group (float32, exact below 2**24), one
    all-gather; a rank's ``output_split_sizes`` that disagrees with what the others send raises on every rank."""
    group, n = call.group, call.group.size
    mine = np.array([list(call.inputs) + list(call.outputs if call.outputs is not None else (-1,) * n)], np.float32)
    with unrecorded():
        every = _composed.all_gather(Tensor(mine), 0, (1,) * n, group).asnumpy().astype(np.int64)
    matrix = split_matrix_of(every[:, :n].tolist())
    for j in range(n):
        told = tuple(int(v) for v in every[j, n:])
        column = tuple(matrix[i][j] for i in range(n))
        if told[0] >= 0 and told != column:
            raise ValueError(f"all_to_all_single: rank {j} of the group (global rank {group.ranks[j]}) expects "
                             f"output_split_sizes {told}, but the ranks send it {column} (their input_split_sizes)")
    return matrix


def _layout(matrix: Matrix, me: int) -> Tuple[int, int, Tuple[Tuple[int, int], ...]]:
    """(rows before this rank's slot, rows after it, the (start, length) of each block sent to this rank) in
    the buffer of every rank's rows."""
    lengths = [sum(row) for row in matrix]
    starts = [sum(lengths[:i]) + sum(matrix[i][:me]) for i in range(len(matrix))]
    pieces = tuple((starts[i], matrix[i][me]) for i in range(len(matrix)) if matrix[i][me] > 0)
    return sum(lengths[:me]), sum(lengths[me + 1:]), pieces


def _known_exchange(x, matrix: Matrix, group):
    """This rank's rows in its slot of the buffer of every rank's rows, all-reduced; the blocks sent to this
    rank kept, in rank order."""
    before, after, pieces = _layout(matrix, group.rank)
    buffer = place_over(pad_slot(x, 0, before, after), group)
    if not pieces:
        return narrow(buffer, 0, 0, 0)
    parts = [narrow(buffer, 0, start, length) for start, length in pieces]
    return parts[0] if len(parts) == 1 else ops.cat(parts, 0)


@cell_per_call_site
def _composed_cell(matrix: Matrix, mesh, mesh_dim) -> LeanAllToAll:
    """Known split matrix, PyNative: :func:`_known_exchange` as one autodiff node whose backward is the
    exchange with the matrix transposed (recorded, and run on every rank, also one that sends and
    receives nothing)."""
    group = mesh.comm_group(mesh_dim)

    def forward(x):
        return _known_exchange(x, matrix, group)

    def inverse(dout):
        return all_to_all_by_matrix(dout, _transposed(matrix), mesh, mesh_dim)
    return LeanAllToAll(forward, inverse)


def _graph_exchange(x, outputs: Tuple[int, ...], inputs: Tuple[int, ...], group):
    """Inside ms.jit (composed): every rank's input gathered whole (equal row counts), the splits gathered as
    data, this rank's blocks picked at offsets computed in the graph. Every rank runs the same ops (only
    constants differ) and the two all-reduces are ordered by a dependency: a compiled graph may otherwise
    order independent collectives differently on each rank, and the ranks would pair different ones."""
    n, me, length = group.size, group.rank, x.shape[0]
    mine = Tensor(np.array([inputs], np.float32))
    every = ops.stop_gradient(_composed.all_gather(mine, 0, (1,) * n, group))          # (n, n) split matrix
    rows = _composed.all_gather(ops.depend(x, every), 0, (length,) * n, group)
    before = Tensor((np.arange(n) < me).astype(np.float32))                          # the columns before mine
    starts = (every * before).sum(1)
    base = np.concatenate([i * length + np.arange(outputs[i]) for i in range(n)]).astype(np.int32)
    owner = np.concatenate([np.full(outputs[i], i) for i in range(n)]).astype(np.int32)
    index = Tensor(base) + ops.gather(starts, Tensor(owner), 0).astype(ms.int32)
    return ops.gather(rows, index, 0)


class _NativeV(nn.Cell):
    """``ops.AlltoAllV`` on the flattened rows; ``bprop``: the same with the splits swapped."""

    def __init__(self, outputs: Tuple[int, ...], inputs: Tuple[int, ...], row_shape: Tuple[int, ...], group) -> None:
        super().__init__()
        self.outputs, self.inputs, self.row_shape, self.group = outputs, inputs, row_shape, group
        self.exchange = ops.AlltoAllV(group.name, max(prod(row_shape), 1))

    def construct(self, x):
        wire = x.astype(ms.uint8) if x.dtype == ms.bool_ else x
        received = sum(self.outputs)
        out = self.exchange(wire.reshape(-1), self.inputs, self.outputs)
        if received == 0:       # AlltoAllV returns a 0-d placeholder for an empty result
            out = ops.depend(ops.zeros((0,) + self.row_shape, wire.dtype), out)
        else:
            out = out.reshape((received,) + self.row_shape)
        return out.astype(ms.bool_) if x.dtype == ms.bool_ else out

    def bprop(self, x, out, dout):
        return (_native_cell(self.inputs, self.outputs, self.row_shape, self.group)(dout),)


@cell_per_call_site
def _native_cell(outputs: Tuple[int, ...], inputs: Tuple[int, ...], row_shape: Tuple[int, ...], group) -> _NativeV:
    return _NativeV(outputs, inputs, row_shape, group)


@run_in_python
def _prepared(mesh, mesh_dim, call: _VCall, shape: Tuple[int, ...], dtype, itemsize: int):
    """What runs: ``(kind, arguments)`` with ``kind`` one of ``native`` / ``known`` / ``graph``; counts first
    exchanged in PyNative where needed, the call recorded."""
    n = call.group.size
    counts = 2 * n * n          # the exchanged (input, output) splits of every rank
    if not call.compiled:       # counted for the watchdog before anything is issued (the count exchange too)
        mesh.exchange.count("all_to_all_single", call.group, _dim_name(mesh, mesh_dim))
    if call.native:
        outputs = call.outputs
        if outputs is None:
            outputs = tuple(row[call.group.rank] for row in _exchange_splits(call))
        _record(mesh, mesh_dim, call, shape, dtype, itemsize, sum(outputs), 0 if call.outputs else counts)
        return "native", (outputs, call.inputs, tuple(shape[1:]))
    if call.matrix is not None:
        _record(mesh, mesh_dim, call, shape, dtype, itemsize, sum(map(sum, call.matrix)), 0)
        return "known", (call.matrix,)
    if call.compiled:
        _record(mesh, mesh_dim, call, shape, dtype, itemsize, n * shape[0], n * n)
        return "graph", (call.outputs, call.inputs)
    matrix = _exchange_splits(call)
    _record(mesh, mesh_dim, call, shape, dtype, itemsize, sum(map(sum, matrix)), counts)
    return "known", (matrix,)


def all_to_all_single(x, output_split_sizes: Optional[Sequence[int]] = None,
                      input_split_sizes: Optional[Sequence[int]] = None, mesh=None, mesh_dim=0):
    """Send rows of ``x`` (dim 0) to the ranks along ``mesh_dim``: ``input_split_sizes[j]`` consecutive rows to
    rank ``j``; return the rows received, ``output_split_sizes[i]`` from rank ``i``, in rank order. Differentiable:
    the backward is the same exchange with the splits swapped (PyTorch's ``all_to_all_single_autograd``).

    Args:
        x: this rank's rows (a plain Tensor; dims after 0 alike on every rank).
        output_split_sizes: rows received from each rank of the group (Python ints); ``None``: the ranks
            exchange their counts first (PyNative only).
        input_split_sizes: rows sent to each rank (Python ints); ``None``: ``x``'s rows split evenly.
        mesh: the :class:`DeviceMesh`.
        mesh_dim: the name or index of the mesh dim whose ranks exchange (default 0).

    In ``ms.jit`` both split sizes must be Python ints (graph constants); on CPU every rank's ``x`` must also
    have as many rows (the composed exchange gathers the inputs whole). A one-rank group returns ``x``.

    Example::

        y = all_to_all_single(x, output_split_sizes=(3, 1), input_split_sizes=(2, 2), mesh=mesh, mesh_dim="ep")
    """
    if mesh is None:
        raise TypeError("all_to_all_single needs mesh= (the DeviceMesh whose mesh_dim's ranks exchange rows)")
    call = _resolve(mesh, mesh_dim, x.shape, x.dtype, None if output_split_sizes is None else tuple(output_split_sizes),
                    None if input_split_sizes is None else tuple(input_split_sizes))
    return _run(x, mesh, mesh_dim, call)


def all_to_all_by_matrix(x, matrix: Matrix, mesh, mesh_dim=0):
    """:func:`all_to_all_single` where every rank knows the whole split matrix (``matrix[i][j]``: rows rank ``i``
    sends to rank ``j``, the same on every rank, e.g. from token counts the ranks gathered): no count exchange,
    and inside ``ms.jit`` (the matrix a constant) the exact buffer layout, without the equal-rows condition.

    Example::

        y = all_to_all_by_matrix(x, ((1, 2), (3, 0)), mesh, "ep")

    Args:
        x: this rank's rows.
        matrix: the split matrix, a tuple of tuples of ints, the same on every rank of the group.
        mesh: the :class:`DeviceMesh`.
        mesh_dim: the name or index of the mesh dim whose ranks exchange (default 0).
    """
    return _run(x, mesh, mesh_dim, _resolve(mesh, mesh_dim, x.shape, x.dtype, None, None, matrix))


class _SimulatedV(nn.Cell):
    """A simulated rank's exchange of a known split matrix (the exchange moves nothing): recorded as on the
    cluster, the received rows a placeholder; ``bprop``: the transposed exchange, issued (and recorded) as
    the cluster's backward sends it. Kept for the backward as the cluster's path keeps it: the native
    Cell's input and output, nothing for the composed one (:mod:`._lean`)."""

    def __init__(self, matrix: Matrix, mesh, mesh_dim) -> None:
        super().__init__()
        self.matrix, self.mesh, self.mesh_dim = matrix, mesh, mesh_dim

    def construct(self, x):
        me = self.mesh.comm_group(self.mesh_dim).rank
        rows = sum(row[me] for row in self.matrix)
        return self.mesh.exchange.placeholder(x, (rows,) + tuple(x.shape[1:]))

    def bprop(self, x, out, dout):
        return (all_to_all_by_matrix(dout, _transposed(self.matrix), self.mesh, self.mesh_dim),)


def _simulated_exchange(x, mesh, mesh_dim, call: _VCall):
    """A simulated rank's exchange (PyNative only: a ``with`` block, which graph parsing refuses in
    :func:`_run`), keeping for the backward what the cluster's path keeps (the native Cell its input
    and output, the composed one nothing)."""
    _prepared(mesh, mesh_dim, call, x.shape, x.dtype, x.itemsize)
    cell = _SimulatedV(call.matrix, mesh, mesh_dim)
    if call.native:
        return cell(x)
    return call_keeping_nothing(cell, x)


def _run(x, mesh, mesh_dim, call: _VCall):
    if call.group.size == 1:
        return x
    if not call.moves:
        if call.matrix is not None and not call.compiled:      # a simulated rank knowing every rank's splits
            return _simulated_exchange(x, mesh, mesh_dim, call)
        rows = sum(call.outputs) if call.outputs is not None else x.shape[0]
        return mesh.exchange.placeholder(x, (rows,) + tuple(x.shape[1:]))
    kind, args = _prepared(mesh, mesh_dim, call, x.shape, x.dtype, x.itemsize)
    if kind == "native":
        return _native_cell(args[0], args[1], args[2], call.group)(x)
    if kind == "graph":
        return _graph_exchange(x, args[0], args[1], call.group)
    if call.compiled:       # autodiff of the all-reduce gives the transposed exchange (no empty side: refused)
        return _known_exchange(x, args[0], call.group)
    cell = _composed_cell(args[0], mesh, mesh_dim)
    return cell.move(x) if lean_applies(x.dtype) else cell(x)
