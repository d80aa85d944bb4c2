"""HyperParallel's context-parallel styles for DeepSeek sparse attention (DSA): boundary hooks on the
Cells that call DSA's kernels (its lightning indexer, its sparse flash attention, its indexer loss),
colossal mode only: the query-side tensors of the boundary become DTensors sharded on the sequence,
the key-side ones are all-gathered (Replicate), and each kernel computes by its sharding rule; outputs
come back as this rank's pieces (``use_local_output=True``) or stay DTensors.

==========================================  =========================================================
style (boundary Cell's arguments)           query side (Shard(seq))       key side (all-gathered)
==========================================  =========================================================
``DSAIndexerContextParallel``               query 0, weights 2            key 1
  ``(query, key, weights, ...)``
``DSASparseAttentionContextParallel``       query 0, topk 3, query_rope   key 1, value 2, key_rope
  ``(query, key, value, topk, q_rope, k_rope)``  4                        5
``DSAIndexerLossContextParallel``           query 0, query_index 2,       key 1, key_index 3,
  ``(query, key, query_index, key_index,``  weights 4, topk 5, query_rope  key_rope 9
  ``weights, topk, s_max, s_sum, q_rope,``  8; softmax max / sum where
  ``k_rope, s_max_index, s_sum_index)``     given (MindFormers: 6, 7)
==========================================  =========================================================

The sequence dim is 1 for ``layout="BSND"`` and 0 for ``"TND"``. A :class:`DSASequenceReplicateCache`
given to the sparse-attention style (``share_key_value=True``) and to the indexer-loss style lets the
loss reuse the gathered key and key_rope of the same tensors (by identity) instead of gathering them
again; the loss's boundary empties it when it returns.
The ``Async*`` forms (:mod:`._dsa_async`) start the gathers at the Cells handing the key side over
(``key_handoff`` ...), whose outputs must reach the boundary unchanged.

An argument that is a DTensor of another parallelism (tensor parallelism's heads over ``mesh["tp"]``, a
slice of the same mesh as the cp mesh) enters on the mesh of both with its placements kept, and the
outputs go back to its mesh (:mod:`._compose`).

DSA's kernels are Ascend kernels: on CPU the boundary Cells of MindFormers' DSA raise naming them
(``hyper_parallel.custom_ops.experimental``); a boundary computing with ops that have sharding rules
runs anywhere. PyNative only (DTensors).

Example::

    style = DSASparseAttentionContextParallel(layout="BSND", use_local_output=True)
    style.apply(core_attention.sparse_flash_attention, mesh["cp"])
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional, Tuple

from mindspore import Tensor, nn

from .._mindspore import refuse_while_compiling
from ..dtensor import DTensor
from ..mesh import DeviceMesh
from ..nn._parallelize import ParallelStyle
from ..placement import Replicate, Shard
from ._compose import enter_cp, holds_cp, leave_cp, place_cp

__all__ = ["DSAIndexerContextParallel", "DSASparseAttentionContextParallel", "DSAIndexerLossContextParallel",
           "DSASequenceReplicateCache"]

_SEQ_DIM = {"BSND": 1, "TND": 0}
_COMPILED = ("the DSA context-parallel styles convert the boundary's tensors to DTensors in PyNative forward hooks; "
             "a compiled (ms.jit / GRAPH_MODE) boundary Cell cannot hold them: run the model in PyNative")
_Slot = Tuple[str, Optional[int], Optional[str]]        # (role, position, keyword)


class DSASequenceReplicateCache:
    """The key-side tensors one boundary all-gathered, kept for the next boundary of the same layer that
    takes the same tensors (MindFormers: the sparse attention's key and key_rope, reused by the indexer
    loss). An entry is used only for the very tensor it was gathered from; :meth:`clear` drops them all.

    Example::

        cache = DSASequenceReplicateCache()
        DSASparseAttentionContextParallel(shared_replicate_cache=cache, share_key_value=True).apply(sfa, cp)
        DSAIndexerLossContextParallel(shared_replicate_cache=cache).apply(loss_boundary, cp)
    """

    def __init__(self) -> None:
        self._entries: Dict[str, Tuple[Any, DTensor]] = {}

    def put(self, role: str, source: Any, gathered: DTensor) -> None:
        """Keep ``gathered``, the all-gather of ``source``, under ``role`` ("key", "key_rope", ...)."""
        self._entries[role] = (source, gathered)

    def get(self, role: str, source: Any) -> Optional[DTensor]:
        """The gathered tensor kept under ``role`` if it was gathered from ``source`` itself, else None."""
        entry = self._entries.get(role)
        return entry[1] if entry is not None and entry[0] is source else None

    def clear(self) -> None:
        """Drop every entry (the autodiff tape keeps what a backward needs)."""
        self._entries.clear()

    def __len__(self) -> int:
        return len(self._entries)


class _DSABoundary(ParallelStyle):
    """The shared machinery: a table of query-side and key-side argument slots, the hooks, the outputs."""

    _QUERY_SIDE: Tuple[str, ...] = ()
    _KEY_SIDE: Tuple[str, ...] = ()

    def __init__(self, layout: str, mode: str, slots: Dict[str, Tuple[Optional[int], Optional[str]]],
                 use_local_output: bool, shared_replicate_cache: Optional[DSASequenceReplicateCache] = None) -> None:
        name = type(self).__name__
        if not isinstance(layout, str) or layout.upper() not in _SEQ_DIM:
            raise ValueError(f"{name}: layout must be one of {tuple(_SEQ_DIM)}, got {layout!r}")
        if mode != "colossal":
            raise ValueError(f"{name}: only mode='colossal' is provided (DSA's kernels keep the heads, the head dim "
                             f"and the top-k whole, so no Ulysses head split), got mode={mode!r}")
        for role, (index, key) in slots.items():
            if index is not None and (isinstance(index, bool) or not isinstance(index, int) or index < 0):
                raise ValueError(f"{name}: {role}_index must be None or an argument position, got {index!r}")
            if key is not None and not isinstance(key, str):
                raise TypeError(f"{name}: {role}_kwarg_name must be None or a str, got {key!r}")
        if shared_replicate_cache is not None and not isinstance(shared_replicate_cache, DSASequenceReplicateCache):
            raise TypeError(f"{name}: shared_replicate_cache must be a DSASequenceReplicateCache, got "
                            f"{type(shared_replicate_cache).__name__}")
        self.layout, self.mode = layout.upper(), mode
        self.seq_dim = _SEQ_DIM[self.layout]
        self.use_local_output = bool(use_local_output)
        self.shared_replicate_cache = shared_replicate_cache
        for role, (index, key) in slots.items():
            setattr(self, f"{role}_index", index)
            setattr(self, f"{role}_kwarg_name", key)

    def __repr__(self) -> str:
        return (f"{type(self).__name__}(layout={self.layout!r}, mode={self.mode!r}, "
                f"use_local_output={self.use_local_output})")

    def _slots(self, roles: Tuple[str, ...]) -> List[_Slot]:
        return [(role, getattr(self, f"{role}_index"), getattr(self, f"{role}_kwarg_name")) for role in roles]

    # ------------------------------------------------------------------ conversions
    @staticmethod
    def _mesh(name: str, device_mesh: DeviceMesh) -> DeviceMesh:
        if not isinstance(device_mesh, DeviceMesh) or device_mesh.ndim != 1:
            raise TypeError(f"{name}.apply needs the 1-D cp DeviceMesh, got {device_mesh!r}")
        return device_mesh

    def _on_cp(self, x: Any, mesh: DeviceMesh, placement) -> Any:
        """An argument, this rank's sequence piece, as a DTensor with ``placement`` on the cp dim:
        ``Shard(seq_dim)`` for the query side, ``Replicate()`` (all-gathered) for the key side."""
        if isinstance(x, DTensor):
            return self._placed(x, mesh, placement)
        if not isinstance(x, Tensor):
            return x
        piece = DTensor.from_local(x, mesh, (Shard(self.seq_dim),))
        return piece if placement == Shard(self.seq_dim) else piece.redistribute(mesh, (placement,))

    def _placed(self, x: DTensor, mesh: DeviceMesh, placement) -> DTensor:
        """A DTensor argument: on a mesh holding the cp dim, placed there; on another parallelism's mesh
        (tensor parallelism's), its sequence piece entered on the mesh of both."""
        try:
            if holds_cp(x.device_mesh, mesh):
                return place_cp(x, mesh, placement)
            return enter_cp(x, mesh, self.seq_dim, placement)
        except ValueError as error:
            raise ValueError(f"{type(self).__name__}: {error}") from None

    def _key_side(self, role: str, x: Any, mesh: DeviceMesh, started: Dict[str, Tuple[Any, Any]]) -> Any:
        """The gathered ``x``: started at its handoff Cell, kept by the shared cache, or gathered now."""
        made = started.pop(role, None)
        if made is not None:
            if made[0] is not x:
                raise ValueError(f"{type(self).__name__}: the boundary's {role} is not what its handoff Cell returned "
                                 "(an op runs between them); pass the Cell whose output reaches the boundary unchanged")
            return made[1]
        cache = self.shared_replicate_cache
        kept = cache.get(role, x) if cache is not None else None
        if kept is not None:
            return kept
        gathered = self._on_cp(x, mesh, Replicate())
        if cache is not None and role in self._cached_roles and isinstance(gathered, DTensor):
            cache.put(role, x, gathered)
        return gathered

    _cached_roles: Tuple[str, ...] = ()     # the key-side roles this boundary leaves in the shared cache

    def _outer(self, args: tuple, kwargs: dict, mesh: DeviceMesh) -> Optional[DeviceMesh]:
        """The mesh of the query when it comes as a DTensor of another parallelism (its outputs go back there)."""
        _, index, key = self._slots(("query",))[0]
        query = args[index] if index is not None and index < len(args) else kwargs.get(key) if key else None
        if isinstance(query, DTensor) and not holds_cp(query.device_mesh, mesh):
            return query.device_mesh
        return None

    def _convert(self, args: tuple, kwargs: dict, mesh: DeviceMesh, started: Dict[str, Tuple[Any, Any]]
                 ) -> Tuple[tuple, dict]:
        refuse_while_compiling(_COMPILED)
        args, kwargs = list(args), dict(kwargs)

        def one(role: str, x: Any) -> Any:
            if role in self._QUERY_SIDE:
                return self._on_cp(x, mesh, Shard(self.seq_dim))
            return self._key_side(role, x, mesh, started)
        for role, index, key in self._slots(self._QUERY_SIDE + self._KEY_SIDE):
            if index is not None and index < len(args):
                args[index] = one(role, args[index])
            elif key is not None and key in kwargs:
                kwargs[key] = one(role, kwargs[key])
        if started:
            raise ValueError(f"{type(self).__name__}: the handoff Cell(s) of {sorted(started)} ran but the boundary "
                             "received no such argument; check the handoff Cells given to apply")
        return tuple(args), kwargs

    def _local(self, out: Any, mesh: DeviceMesh) -> Any:
        """An output DTensor as this rank's piece: a Partial one summed first."""
        if not isinstance(out, DTensor):
            return out
        if any(p.is_partial() for p in out.placements):
            out = out.redistribute(out.device_mesh, tuple(Replicate() if p.is_partial() else p for p in out.placements))
        return out.to_local()

    def _outputs(self, output: Any, mesh: DeviceMesh, outer: Optional[DeviceMesh] = None) -> Any:
        """``use_local_output``: each DTensor output as this rank's piece; else kept, or, when the query came
        on ``outer`` (another parallelism's mesh), back on ``outer`` with its cp piece as its local part."""
        if not self.use_local_output and outer is None:
            return output

        def one(o: Any) -> Any:
            if self.use_local_output:
                return self._local(o, mesh)
            return leave_cp(o, mesh, self.seq_dim, outer) if isinstance(o, DTensor) else o
        if isinstance(output, (tuple, list)):
            return type(output)(one(o) for o in output)
        return one(output)

    # ------------------------------------------------------------------ applying
    def _register(self, module: nn.Cell, mesh: DeviceMesh, handoffs: Dict[str, Optional[nn.Cell]]) -> nn.Cell:
        if not isinstance(module, nn.Cell):
            raise TypeError(f"{type(self).__name__}.apply needs the boundary Cell, got {type(module).__name__}")
        started: Dict[str, Tuple[Any, Any]] = {}

        def handoff_hook(role: str):
            def hook(cell, args, output):
                started[role] = (output, self._on_cp(output, mesh, Replicate()))
                return output
            return hook
        for role, cell in handoffs.items():
            if cell is not None:
                if not isinstance(cell, nn.Cell):
                    raise TypeError(f"{type(self).__name__}: {role}_handoff must be an nn.Cell, got "
                                    f"{type(cell).__name__}")
                cell.register_forward_hook(handoff_hook(role))

        def refuse_compiled(cell, args):        # compiled first: a compiled boundary raises naming the cause
            refuse_while_compiling(_COMPILED)

        outers: List[Optional[DeviceMesh]] = []       # per forward (a re-entered boundary pops its own)

        def convert(cell, args, kwargs):
            outer = self._outer(args, kwargs, mesh)
            converted = self._convert(args, kwargs, mesh, started)
            outers.append(outer)            # only once converted: a refused call leaves nothing behind
            return converted

        def outputs(cell, args, kwargs, output):
            return self._outputs(output, mesh, outers.pop() if outers else None)
        module.register_forward_pre_hook(refuse_compiled)
        module.register_forward_pre_hook(convert, with_kwargs=True)
        module.register_forward_hook(outputs, with_kwargs=True)
        return module

    def apply(self, module: nn.Cell, device_mesh: DeviceMesh) -> nn.Cell:
        """Register the boundary hooks on ``module`` and return it.

        Args:
            module: the boundary Cell (the one calling DSA's kernel).
            device_mesh: the 1-D cp mesh.

        Example::

            DSAIndexerContextParallel().apply(indexer.compute_sparse_indices, mesh["cp"])
        """
        return self._register(module, self._mesh(type(self).__name__, device_mesh), {})

    _apply = apply          # PyTorch's and MindFormers' name of a style's entry point


class DSAIndexerContextParallel(_DSABoundary):
    """The boundary of DSA's lightning indexer, ``(query, key, weights, ...)``: query and weights sharded on
    the sequence, key all-gathered.

    Args:
        layout: ``"BSND"`` (sequence dim 1) or ``"TND"`` (0).
        mode: ``"colossal"`` (the only mode: DSA's kernels keep the heads whole).
        query_index: the position of the query (``query_kwarg_name``: its keyword); likewise key, weights.
        key_index: see ``query_index``.
        weights_index: see ``query_index``.
        query_kwarg_name: the query's keyword name, where it comes as a keyword.
        key_kwarg_name: see ``query_kwarg_name``.
        weights_kwarg_name: see ``query_kwarg_name``.
        use_local_output: return DTensor outputs as this rank's pieces (Partial ones summed first).

    Example::

        DSAIndexerContextParallel(layout="BSND").apply(indexer.compute_sparse_indices, mesh["cp"])
    """

    _QUERY_SIDE = ("query", "weights")
    _KEY_SIDE = ("key",)

    def __init__(self, *, layout: str = "BSND", mode: str = "colossal", query_index: Optional[int] = 0,
                 key_index: Optional[int] = 1, weights_index: Optional[int] = 2, query_kwarg_name: Optional[str] = None,
                 key_kwarg_name: Optional[str] = None, weights_kwarg_name: Optional[str] = None,
                 use_local_output: bool = False) -> None:
        super().__init__(layout, mode, {"query": (query_index, query_kwarg_name), "key": (key_index, key_kwarg_name),
                                        "weights": (weights_index, weights_kwarg_name)}, use_local_output)


class DSASparseAttentionContextParallel(_DSABoundary):
    """The boundary of DSA's sparse flash attention, ``(query, key, value, topk_indices, query_rope,
    key_rope, ...)``: query, top-k indices and query_rope sharded on the sequence; key, value and key_rope
    all-gathered (the top-k indices are positions in the whole sequence).

    Args:
        layout: ``"BSND"`` or ``"TND"``.
        mode: ``"colossal"``.
        query_index: the query's position (``query_kwarg_name``: its keyword); likewise the others.
        key_index: see ``query_index``.
        value_index: see ``query_index``.
        topk_index: see ``query_index``.
        query_kwarg_name: the query's keyword name.
        key_kwarg_name: see ``query_kwarg_name``.
        value_kwarg_name: see ``query_kwarg_name``.
        topk_kwarg_name: see ``query_kwarg_name``.
        query_rope_index: see ``query_index``.
        key_rope_index: see ``query_index``.
        query_rope_kwarg_name: see ``query_kwarg_name`` (default ``"query_rope"``).
        key_rope_kwarg_name: see ``query_kwarg_name`` (default ``"key_rope"``).
        use_local_output: return DTensor outputs as this rank's pieces.
        shared_replicate_cache: a :class:`DSASequenceReplicateCache` this boundary fills with its gathered
            key and key_rope (with ``share_key_value``) for the indexer loss.
        share_key_value: fill ``shared_replicate_cache``.

    Example::

        DSASparseAttentionContextParallel(use_local_output=True).apply(core.sparse_flash_attention, mesh["cp"])
    """

    _QUERY_SIDE = ("query", "topk", "query_rope")
    _KEY_SIDE = ("key", "value", "key_rope")

    def __init__(self, *, layout: str = "BSND", mode: str = "colossal", query_index: Optional[int] = 0,
                 key_index: Optional[int] = 1, value_index: Optional[int] = 2, topk_index: Optional[int] = 3,
                 query_kwarg_name: Optional[str] = None, key_kwarg_name: Optional[str] = None,
                 value_kwarg_name: Optional[str] = None, topk_kwarg_name: Optional[str] = None,
                 query_rope_index: Optional[int] = 4, key_rope_index: Optional[int] = 5,
                 query_rope_kwarg_name: Optional[str] = "query_rope", key_rope_kwarg_name: Optional[str] = "key_rope",
                 use_local_output: bool = False, shared_replicate_cache: Optional[DSASequenceReplicateCache] = None,
                 share_key_value: bool = False) -> None:
        super().__init__(layout, mode, {
            "query": (query_index, query_kwarg_name), "key": (key_index, key_kwarg_name),
            "value": (value_index, value_kwarg_name), "topk": (topk_index, topk_kwarg_name),
            "query_rope": (query_rope_index, query_rope_kwarg_name), "key_rope": (key_rope_index, key_rope_kwarg_name)},
            use_local_output, shared_replicate_cache)
        if share_key_value and shared_replicate_cache is None:
            raise ValueError("DSASparseAttentionContextParallel: share_key_value=True needs a shared_replicate_cache")
        self.share_key_value = bool(share_key_value)
        self._cached_roles = ("key", "key_rope") if self.share_key_value else ()     # what the indexer loss takes


class DSAIndexerLossContextParallel(_DSABoundary):
    """The boundary of DSA's indexer-loss kernel, ``(query, key, query_index, key_index, weights,
    topk_indices, softmax_max, softmax_sum, query_rope, key_rope, softmax_max_index, softmax_sum_index)``:
    the query side (query, query_index, weights, top-k, query_rope, and the softmax statistics whose
    positions or keywords are given: none by default, as HyperParallel's; MindFormers gives 6 and 7, and 10
    and 11 for its dense stage) sharded on the sequence; key, key_index and key_rope all-gathered (or taken
    from ``shared_replicate_cache``). With
    ``use_local_output``, a Partial output is summed before its piece is taken, and of HyperParallel's
    fused form ``(d_query_index, d_key_index, d_weights, loss)`` the key-index gradient comes back as this
    rank's sequence piece (summed over the ranks whose queries reached it).

    Args:
        layout: ``"BSND"`` or ``"TND"``.
        mode: ``"colossal"``.
        query_index: the query's position (``query_kwarg_name``: its keyword); likewise the others.
        key_index: see ``query_index``.
        query_indexer_index: the indexer query's position.
        key_indexer_index: the indexer key's position.
        weights_index: see ``query_index``.
        topk_index: see ``query_index`` (None for the dense stage).
        softmax_max_index: the attention softmax max's position (None: left as given).
        softmax_sum_index: the attention softmax sum's position (None: left as given).
        query_rope_index: see ``query_index``.
        key_rope_index: see ``query_index``.
        softmax_max_indexer_index: the indexer softmax max's position (dense stage).
        softmax_sum_indexer_index: the indexer softmax sum's position (dense stage).
        query_kwarg_name: keyword names, where the arguments come as keywords (each role has one).
        key_kwarg_name: see ``query_kwarg_name``.
        query_indexer_kwarg_name: see ``query_kwarg_name``.
        key_indexer_kwarg_name: see ``query_kwarg_name``.
        weights_kwarg_name: see ``query_kwarg_name``.
        topk_kwarg_name: see ``query_kwarg_name``.
        softmax_max_kwarg_name: see ``query_kwarg_name``.
        softmax_sum_kwarg_name: see ``query_kwarg_name``.
        query_rope_kwarg_name: see ``query_kwarg_name``.
        key_rope_kwarg_name: see ``query_kwarg_name``.
        softmax_max_indexer_kwarg_name: see ``query_kwarg_name``.
        softmax_sum_indexer_kwarg_name: see ``query_kwarg_name``.
        use_local_output: return DTensor outputs as this rank's pieces.
        shared_replicate_cache: the cache a sparse-attention boundary of the same layer filled (emptied
            when this boundary returns).

    Example::

        DSAIndexerLossContextParallel(softmax_max_index=6, softmax_sum_index=7, use_local_output=True).apply(
            loss.compute_indexer_loss, mesh["cp"])
    """

    _QUERY_SIDE = ("query", "query_indexer", "weights", "topk", "softmax_max", "softmax_sum", "query_rope",
                   "softmax_max_indexer", "softmax_sum_indexer")
    _KEY_SIDE = ("key", "key_indexer", "key_rope")

    def __init__(self, *, layout: str = "BSND", mode: str = "colossal", query_index: Optional[int] = 0,
                 key_index: Optional[int] = 1, query_indexer_index: Optional[int] = 2,
                 key_indexer_index: Optional[int] = 3, weights_index: Optional[int] = 4,
                 topk_index: Optional[int] = 5, softmax_max_index: Optional[int] = None,
                 softmax_sum_index: Optional[int] = None, query_rope_index: Optional[int] = 8,
                 key_rope_index: Optional[int] = 9, softmax_max_indexer_index: Optional[int] = None,
                 softmax_sum_indexer_index: Optional[int] = None, query_kwarg_name: Optional[str] = None,
                 key_kwarg_name: Optional[str] = None, query_indexer_kwarg_name: Optional[str] = None,
                 key_indexer_kwarg_name: Optional[str] = None, weights_kwarg_name: Optional[str] = None,
                 topk_kwarg_name: Optional[str] = None, softmax_max_kwarg_name: Optional[str] = None,
                 softmax_sum_kwarg_name: Optional[str] = None, query_rope_kwarg_name: Optional[str] = None,
                 key_rope_kwarg_name: Optional[str] = None,
                 softmax_max_indexer_kwarg_name: Optional[str] = None,
                 softmax_sum_indexer_kwarg_name: Optional[str] = None,
                 use_local_output: bool = False,
                 shared_replicate_cache: Optional[DSASequenceReplicateCache] = None) -> None:
        super().__init__(layout, mode, {
            "query": (query_index, query_kwarg_name), "key": (key_index, key_kwarg_name),
            "query_indexer": (query_indexer_index, query_indexer_kwarg_name),
            "key_indexer": (key_indexer_index, key_indexer_kwarg_name), "weights": (weights_index, weights_kwarg_name),
            "topk": (topk_index, topk_kwarg_name), "softmax_max": (softmax_max_index, softmax_max_kwarg_name),
            "softmax_sum": (softmax_sum_index, softmax_sum_kwarg_name),
            "query_rope": (query_rope_index, query_rope_kwarg_name), "key_rope": (key_rope_index, key_rope_kwarg_name),
            "softmax_max_indexer": (softmax_max_indexer_index, softmax_max_indexer_kwarg_name),
            "softmax_sum_indexer": (softmax_sum_indexer_index, softmax_sum_indexer_kwarg_name)},
            use_local_output, shared_replicate_cache)

    def _outputs(self, output: Any, mesh: DeviceMesh, outer: Optional[DeviceMesh] = None) -> Any:
        if self.shared_replicate_cache is not None:      # the layer's last use of the gathered key side
            self.shared_replicate_cache.clear()
        if not (self.use_local_output and isinstance(output, (tuple, list)) and len(output) >= 4):
            return super()._outputs(output, mesh, outer)
        outs = [self._local(o, mesh) for o in output]
        key_grad = output[1]
        if isinstance(key_grad, DTensor) and holds_cp(key_grad.device_mesh, mesh):   # the key-index gradient:
            outs[1] = self._local(place_cp(key_grad, mesh, Shard(self.seq_dim)), mesh)  # this rank's piece of the sum
        return type(output)(outs)
