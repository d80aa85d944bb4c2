"""FSDPParamGroup: the parameters of one unit moved by one collective per direction (FSDP2's
``FSDPParamGroup``), and the two differentiable steps that move them.

A group holds parameters of one data-parallel mesh, one dtype, all cut on dim 0 (``sharded``)
or all kept whole. The forward all-gathers pieces over the shard mesh dim in ``param_dtype``
(kept whole: passed through); every backward reduces with :func:`._sync.reduce_gradient` (its two
steps, :func:`._sync.reduce_over_shard` and :func:`._sync.reduce_over_replicas`, apart while the
HSDP all-reduce is deferred).

- PyNative: the unit's hooks call :meth:`FSDPParamGroup.gathered`: one :class:`GroupGather`
  call packs the group's pieces into one flat buffer (:mod:`._flat`), all-gathers it and cuts
  the values from it, one autodiff node for the whole group (a chain of views per parameter
  cost about ten nodes per unit in MindSpore's backward, measured); its backward folds the
  values' gradients into one buffer: one reduce-scatter; with gradient sync off it adds the
  unreduced gradient to a local accumulator instead.
- Compiled (``ms.jit`` / GRAPH_MODE): each read of a parameter calls, on its piece, the
  :class:`SharedGather` its :class:`ParamGather` names (one Cell per :class:`GatherSpec`, shared
  by the parameters of one shape and layout): one all-gather forward and one reduce-scatter
  backward per parameter. A graph
  has no place where a unit's reads could share one gather: each Cell reads its parameters
  through its own property, and MindSpore 2.10 merges no copies (measured: two reads packing the
  same Parameters and calling one gathering Cell compile to two gathers and two reductions, also
  with ``no_eliminate`` lifted from ``AllReduce``, also for plain ``Erf`` ops; MindSpore's comm
  fusion with ``set_auto_parallel_context(comm_fusion=...)`` fails kernel selection of the
  fused graph on CPU, "Select CPU operator[Concat] fail"). Each read keeps the order the graph
  gives it.

Example::

    group = FSDPParamGroup(params, True, mesh, SyncState(), None, "reduce_scatter", unit)
    flat, values = group.gathered()          # PyNative: every parameter's full value
"""
from __future__ import annotations

from typing import Any, Dict, List, NamedTuple, Sequence, Tuple

from mindspore import mint, nn, ops

from .. import comm
from .._mindspore import cell_per_call_site, constant_id, constant_of, graph_of_its_own, run_in_python
from ..comm._tensor import front_perms, owned_copy, pad_dim
from ._flat import FlatLayout, fold, pack, split, unpack
from ._mesh import dp_mesh_dims
from ._param import FSDPParam
from ._sync import SyncState, cast_to, reduce_gradient, reduce_over_replicas, reduce_over_shard

# the compiled gather of a parameter calls a function object of its own: MindSpore 2.10 fails to
# compile a graph that calls one function both here (a custom-bprop Cell's forward) and in a
# redistribution's backward (sequence-parallel conversions; seam: graph_of_its_own)
_compiled_all_gather = graph_of_its_own(comm.all_gather)

__all__ = ["FSDPParamGroup", "GroupGather", "ParamGather", "GatherSpec", "SharedGather", "shared_gather"]


@run_in_python
def _check_compiled(unit) -> bool:
    """Run while MindSpore compiles a read of the unit's parameters: refuse what a graph cannot do."""
    unit.check_compilable()
    return True


class FSDPParamGroup:
    """Parameters of one unit moved by one collective per direction.

    Args:
        params: the :class:`FSDPParam` records (one mesh, one dtype, all sharded or all whole).
        sharded: cut on dim 0 (all-gather forward) or kept whole (gradient all-reduced).
        mesh: the data-parallel mesh.
        sync: the unit's :class:`SyncState`.
        param_dtype: the dtype the forward computes in (``None``: the pieces').
        reduce: ``"reduce_scatter"`` or ``"all_reduce"`` (ZeRO-1) for a sharded group.
        unit: the unit's state (its ``check_compilable`` runs when a read is compiled).
    """

    def __init__(self, params: Sequence[FSDPParam], sharded: bool, mesh, sync: SyncState, param_dtype: Any,
                 reduce: str, unit: Any) -> None:
        if reduce not in ("reduce_scatter", "all_reduce"):
            raise ValueError(f"reduce must be 'reduce_scatter' or 'all_reduce', got {reduce!r}")
        self.params: List[FSDPParam] = list(params)
        self.sharded, self.mesh, self.sync, self.param_dtype, self.unit = sharded, mesh, sync, param_dtype, unit
        for p in params:
            p.unit = unit
        self.shard_dim, self.replicate_dim = dp_mesh_dims(mesh)
        self.reduce = reduce if sharded else "replicated"
        self.layout = FlatLayout([p.chunks for p in self.params])
        self.readers: List[ParamGather] = []   # the compiled reads' Cells (:meth:`reader`)
        self.gather = GroupGather(self)
        self.post_forward_mesh = None      # reshard_after_forward=k: this rank's k ranks of the shard dim

    @property
    def nbytes(self) -> int:
        """Bytes of the group's full (gathered) parameters."""
        return sum(p.nbytes for p in self.params)

    def pieces(self) -> Tuple:
        return tuple(p.piece for p in self.params)

    def gathered(self, reuse: Any = None, owned: bool = False) -> Tuple[Any, list]:
        """The group's gathered flat buffer and every parameter's full value cut from it;
        ``reuse``: a buffer gathered earlier from the same pieces, used instead of a collective
        (the backward still reduces); ``owned``: each value a tensor owning its memory (needed
        where the unit's saved-tensor hooks free the values after the forward), else views."""
        gather = self.gather
        gather.reused, gather.owned = reuse, owned
        try:
            values = gather(*self.pieces())
            flat = gather.flat
        finally:
            gather.reused, gather.owned, gather.flat = None, False, None
        return flat, list(values)

    def reader(self, index: int) -> "ParamGather":
        """The Cell a compiled read of parameter ``index`` calls on its piece."""
        reader = ParamGather(self, index)
        self.readers.append(reader)
        return reader

    def rescale(self) -> None:
        """Give every backward of the group the scale and reduce op of its :class:`SyncState` (after a
        change of the divide factor or of force_sum; a compiled graph keeps those it was compiled with)."""
        scale, op = self.sync.scale_for(self.mesh), self.sync.reduce_op
        self.gather.grad_scale, self.gather.reduce_op = scale, op
        for reader in self.readers:
            reader.rescale()

    def clear(self) -> None:
        """Drop the gradients accumulated without sync or without the all-reduce over replicas."""
        self.gather.pending = None
        self.gather.partial = None


def _padded_rows(x, rows: int, uneven: bool):
    """``x`` with ``rows`` zero rows appended (``x`` has rows), concatenated whenever the parameter
    is cut unevenly (``uneven``), ``rows`` 0 included: every rank's graph then has the same ops in
    the same order (a rank whose graph skipped the pad ordered its collectives differently from
    the others, and MCCL failed or mixed them; MindSpore's ``pad`` has no bfloat16 CPU kernel
    when compiled, ``cat`` has). ``ParamGather`` uses this and not
    ``pad_dim`` / ``cast_to``: with their branches folded away inside a custom-bprop Cell's forward,
    MindSpore failed to differentiate the compiled graph from PyNative ("The pointer
    [func_graph->get_return()] is null")."""
    if not uneven:
        return x
    return mint.cat((x, ops.zeros((rows,) + x.shape[1:], x.dtype)), 0)


def _reduction_constants(group: FSDPParamGroup, rows: int) -> Dict[str, Any]:
    """What a gathering step of ``group`` keeps for its backward's reduction (``rows``: this rank's
    rows of what it reduces)."""
    return dict(mesh=group.mesh, shard_dim=group.shard_dim, replicate_dim=group.replicate_dim, reduce=group.reduce,
                gather_dim=group.shard_dim if group.sharded else None, param_dtype=group.param_dtype,
                reduce_dtype=group.sync.reduce_dtype, grad_scale=group.sync.scale_for(group.mesh),
                reduce_op=group.sync.reduce_op, rows=rows, start=group.mesh.get_local_rank(group.shard_dim) * rows)


class _Reducing(nn.Cell):
    """What both steps keep as plain attributes (constants when compiled: a value reached through
    another Python object is not folded, and shapes computed from it fail to compile), and
    their backward's reduction."""

    def _take(self, constants: Dict[str, Any]) -> None:
        for name, value in constants.items():
            setattr(self, name, value)

    def _reduced(self, g, like):
        return reduce_gradient(cast_to(g, self.reduce_dtype), like, self.mesh, self.shard_dim, self.replicate_dim,
                               self.grad_scale, self.reduce, self.rows, self.start, self.reduce_op)


class GroupGather(_Reducing):
    """PyNative: a group's pieces packed into one flat buffer, all-gathered over the shard dim (kept
    whole: cast only) and cut into every parameter's full value, as one autodiff node; backward:
    the values' gradients folded into one buffer and reduced at once, then given to the unit's
    all-reduce hook if one is set (or, with gradient sync off, accumulated locally; with the HSDP
    all-reduce off, reduced over the shard dim and this part accumulated locally), and cut into
    the pieces' gradients.

    Args:
        group: the :class:`FSDPParamGroup`.

    Example::

        values = group.gather(*group.pieces())       # every parameter's full value
    """

    def __init__(self, group: FSDPParamGroup) -> None:
        super().__init__()
        object.__setattr__(self, "_hpms_group", group)
        self._take(_reduction_constants(group, group.layout.length))
        self.pending = None         # the unreduced gradient summed over backward passes without sync
        self.partial = None         # this rank's part summed over backward passes without the all-reduce
        self.reused = None          # a buffer gathered earlier, used instead of gathering
        self.owned = False          # the values as tensors owning their memory (see FSDPParamGroup.gathered)
        self.flat = None            # the last call's gathered buffer, taken by FSDPParamGroup.gathered

    def construct(self, *pieces):
        layout = self._hpms_group.layout
        flat = self.reused
        if flat is None:
            flat = cast_to(pack(layout, pieces), self.param_dtype)
            if self.gather_dim is not None:
                flat = comm.all_gather(flat, self.mesh, self.gather_dim, dim=0)
        self.flat = flat
        # owned: MindSpore's autodiff keeps a contiguous copy of a view an op reads (one per read, which
        # the unit's saved-tensor hooks cannot recognise and free), and the value itself when it owns its
        # memory (measured); views otherwise
        values = unpack(layout, flat)
        return tuple(owned_copy(v) for v in values) if self.owned else tuple(values)

    def bprop(self, *args):
        pieces, dout = args[:-2], args[-1]
        if not isinstance(dout, (tuple, list)):        # MindSpore hands a one-value output's gradient bare
            dout = (dout,)
        group = self._hpms_group
        group.unit.note_backward()
        sync = group.sync
        g = cast_to(fold(group.layout, dout), self.reduce_dtype)
        if self.pending is not None:
            g = self.pending + g
        if not sync.sync:
            self.pending = g
            return tuple(ops.zeros_like(p) for p in pieces)
        self.pending = None
        return self._reduce_sum(g, pieces)

    def reduce_pending(self):
        """The pieces' gradients of what backward passes without sync accumulated, reduced now as a
        synchronised backward would reduce them (one collective; a pipeline's REDUCE_GRAD action);
        ``None`` where nothing accumulated.

        Example::

            grads = group.gather.reduce_pending()      # after micro-batch backwards with sync off
        """
        g, self.pending = self.pending, None
        return None if g is None else self._reduce_sum(g, self._hpms_group.pieces())

    def _reduce_sum(self, g, pieces):
        """The pieces' gradients of ``g`` (the unreduced flat gradient, in the reduce dtype): reduced and
        hooked, or this rank's part kept while the HSDP all-reduce is off (zeros returned)."""
        group, sync = self._hpms_group, self._hpms_group.sync
        like = pieces[0]
        if self.replicate_dim is None or (sync.all_reduce and self.partial is None):
            return tuple(split(group.layout, sync.hooked(self._reduced(g, like))))
        part = reduce_over_shard(g, self.mesh, self.shard_dim, self.reduce, self.rows, self.start, self.reduce_op)
        if self.partial is not None:
            part = self.partial + part
        if not sync.all_reduce:
            self.partial = part
            return tuple(ops.zeros_like(p) for p in pieces)
        self.partial = None
        return tuple(split(group.layout, sync.hooked(reduce_over_replicas(part, like, self.mesh, self.replicate_dim,
                                                                          self.grad_scale, self.reduce_op))))


class ParamGather(nn.Cell):
    """Compiled: how parameter ``index`` of ``group`` is read. :attr:`spec_id` names its
    :class:`GatherSpec`, whose :class:`SharedGather` (:func:`shared_gather`) the read calls on the
    piece; PyNative reads go through :meth:`read_eagerly`. While compiling, :meth:`check` refuses
    what a graph cannot do (:meth:`._state.FSDPState.check_compilable`).

    Args:
        group: the :class:`FSDPParamGroup`.
        index: the parameter's position in the group.

    Example::

        reader = group.reader(0)
        full_weight = shared_gather(reader.spec_id)(piece)     # inside a compiled graph
    """

    def __init__(self, group: FSDPParamGroup, index: int) -> None:
        super().__init__()
        object.__setattr__(self, "_hpms_group", group)
        self.index = index
        self.spec_id = self._spec_id()

    def _spec_id(self) -> int:
        group = self._hpms_group
        chunks = group.layout.chunks[self.index]
        # a parameter cut on another dim is gathered with that dim in front (permutations: constants)
        to_front, from_front = front_perms(len(chunks.shape), chunks.dim) if chunks.dim else (None, None)
        spec = GatherSpec(**_reduction_constants(group, chunks.rows),
                          length=chunks.front_shape[0] if chunks.shape else 1, padded=chunks.padded,
                          padding=chunks.padding, local=chunks.local, to_front=to_front, from_front=from_front,
                          shape=chunks.shape)
        return constant_id(spec)

    def rescale(self) -> None:
        """Take the group's current scale and reduce op (a compiled graph keeps those it was compiled with)."""
        self.spec_id = self._spec_id()

    def read_eagerly(self, held):
        """PyNative: what a read of the parameter returns, given what its Cell holds (see
        :meth:`._state.FSDPState.read_outside_forward`)."""
        group = self._hpms_group
        return group.unit.read_outside_forward(group, self.index, held)

    def check(self) -> bool:
        """Compiled: refuse what a graph cannot do with the unit (run while MindSpore compiles)."""
        return _check_compiled(self._hpms_group.unit)


class GatherSpec(NamedTuple):
    """Everything a compiled read of a parameter computes with: the reduction's constants
    (:func:`_reduction_constants`), the gathered rows (``length`` of ``padded``, ``padding`` added
    on this rank, ``local`` kept), the permutations bringing the cut dim to the front, and the
    shape."""

    mesh: Any
    shard_dim: Any
    replicate_dim: Any
    reduce: str
    gather_dim: Any
    param_dtype: Any
    reduce_dtype: Any
    grad_scale: float
    reduce_op: str
    rows: int
    start: int
    length: int
    padded: int
    padding: int
    local: int
    to_front: Any
    from_front: Any
    shape: Tuple[int, ...]


@cell_per_call_site
def shared_gather(spec: int) -> "SharedGather":
    """The :class:`SharedGather` of the spec numbered ``spec`` (:attr:`ParamGather.spec_id`): one Cell
    for every read of that spec in a whole-step graph (MindSpore compiles each custom-bprop Cell
    instance apart: 8 fully_shard blocks compiled in 16.0 s with one Cell per parameter, 4.4 s
    shared, 2 CPU ranks, ``scripts/bench_fsdp.py --sections compile``), one per call site in a graph PyNative differentiates (see
    :func:`~hyper_parallel_ms._mindspore.cell_per_call_site`)."""
    return SharedGather(constant_of(spec))


class SharedGather(_Reducing):
    """Compiled: a parameter's full value from this rank's piece (padded to the group's rows,
    all-gathered, trimmed); backward: its gradient reduced to the piece.

    Args:
        spec: the :class:`GatherSpec` of the parameters it reads.

    Example::

        full_weight = SharedGather(spec)(piece)       # inside a compiled graph
    """

    def __init__(self, spec: GatherSpec) -> None:
        super().__init__()
        self._take(spec._asdict())
        self.uneven = spec.padded != spec.length         # some rank pads: every rank runs the same ops

    def construct(self, piece):
        if self.gather_dim is None:
            # kept whole: a value computed from the piece, also where the cast is to the piece's own
            # dtype (a shared Cell returning its input unchanged gave every read the first one's value,
            # MindSpore 2.10: seam contract test)
            return (piece if self.param_dtype is None else piece.astype(self.param_dtype)) * 1
        value = piece if self.param_dtype is None else piece.astype(self.param_dtype)
        if self.to_front is not None:
            value = ops.transpose(value, self.to_front)
        full = _compiled_all_gather(_padded_rows(value, self.padding, self.uneven), self.mesh, self.gather_dim,
                                    dim=0)
        full = mint.narrow(full, 0, 0, self.length) if self.uneven else full
        return full if self.from_front is None else ops.transpose(full, self.from_front)

    def bprop(self, piece, out, dout):
        if self.gather_dim is None:
            return (self._reduced(dout, piece),)
        g = dout if self.to_front is None else ops.transpose(dout, self.to_front)
        g = pad_dim(g, 0, 0, self.padded - self.length) if self.uneven else g
        g = self._reduced(g, piece)
        g = mint.narrow(g, 0, 0, self.local) if self.uneven else g
        return (g if self.from_front is None else ops.transpose(g, self.from_front),)
