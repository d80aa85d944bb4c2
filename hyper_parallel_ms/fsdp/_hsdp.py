"""HyperParallel's ``hsdp`` and ``HSDPCell`` on the fully_shard engine.

``optimizer_level``: ``"level1"`` shards the optimizer state (gradients all-reduced whole,
each rank keeps its slot), ``"level2"`` also the gradients (reduce-scatter), ``"level3"``
also the parameters. On this engine every level holds parameter pieces between steps and
gathers them in the forward (the optimizer steps on pieces at every level); the levels
differ in the gradient collective, and level3 alone frees the gathered parameters after the
forward and gathers them again in the backward (``reshard_after_forward=True``; level1 / level2
keep them until the backward). The data-parallel ranks are every rank or, when the
Cell's parameters were placed by parallel styles on a tensor-parallel mesh (FSDP x TP:
``parallelize_module`` first), the ranks at this rank's place in the other tensor-parallel
groups (``mesh["dp"]`` of a ``(dp, tp)`` mesh). ``shard_size`` groups them into shard groups
of that size (HSDP: reduce-scatter within, all-reduce across); parameters under ``threshold``
KB stay replicated (a warning names them); ``comm_fusion`` fuses each Cell's parameters into one collective, or into
buckets of ``bucket_size`` KB, and without it each parameter has its own.

Example::

    for block in model.layers:
        hsdp(block, shard_size=2, threshold=0, optimizer_level="level3")
    hsdp(model, shard_size=2, threshold=0, optimizer_level="level3")
    model.set_requires_grad_sync(False)        # micro-steps without gradient communication
"""
from __future__ import annotations

import warnings
from typing import Any, Dict, List, Optional, Sequence, Tuple

import mindspore as ms
from mindspore import nn

from .. import _cluster
from ..dtensor import DTensor
from ..mesh import DeviceMesh, mesh_world
from ..nn._adapter import named_cells, own_parameters
from ..nn._parameter import parameter_sharding
from ._dparams import replicated_dp_mesh
from ._fully_shard import shard_cell
from ._module import FSDPModule, fsdp_state
from ._mesh import FSDP_X_TP, complement_ranks
from ._param import is_piece

__all__ = ["hsdp", "HSDPCell", "hsdp_wait_grad_handle", "hsdp_sync_stream"]

_LEVELS = {"level1": "all_reduce", "level2": "reduce_scatter", "level3": "reduce_scatter"}
_DTYPES = (ms.float16, ms.bfloat16, ms.float32, ms.float64)


class HSDPCell(FSDPModule):
    """Methods of a Cell given to :func:`hsdp` (its class becomes ``HSDP<Name>``).

    Example::

        hsdp(model, enable_grad_accumulation=True)
        model.set_requires_grad_sync(False)         # accumulate, then sync on the last micro-step
    """

    def set_requires_grad_sync(self, requires_grad_sync: bool) -> None:
        """``False``: backward passes accumulate locally, without communication, until ``True``
        (whatever ``enable_grad_accumulation``, as HyperParallel's current releases accept it)."""
        if not isinstance(requires_grad_sync, bool):
            raise ValueError(f"requires_grad_sync must be bool but got {requires_grad_sync!r}")
        self.set_requires_gradient_sync(requires_grad_sync)

    def set_reduce_op_type(self, reduce_op_type: str) -> None:
        """HyperParallel's: ``"avg"`` (the default) averages the reduced gradients over the data-parallel
        ranks, ``"sum"`` sums them (:meth:`FSDPModule.set_gradient_divide_factor` with ``1.0``). Set it
        before a graph gathering the Cell is compiled.

        Example::

            model.set_reduce_op_type("sum")
        """
        ops = {"avg": None, "sum": 1.0}
        key = reduce_op_type.lower().strip() if isinstance(reduce_op_type, str) else None
        if key not in ops:
            raise ValueError(f"Unsupported reduce op type {reduce_op_type!r}, supported types are {sorted(ops)}")
        self._set_reduction_scaling("divide_factor", ops[key], "its reduce op", "the reduce op type")

    def zero_grads(self) -> None:
        """Drop gradients accumulated without sync."""
        self.zero_accumulated_grads()

    def set_forward_prefetch_cells(self, hsdp_cell_list: Sequence["HSDPCell"]) -> None:
        """Gather these Cells' parameters ahead of their forward, in this Cell's
        (:meth:`FSDPModule.set_modules_to_forward_prefetch`)."""
        self.set_modules_to_forward_prefetch(_check_cells(hsdp_cell_list))

    def set_backward_prefetch_cells(self, hsdp_cell_list: Sequence["HSDPCell"]) -> None:
        """Gather these Cells' freed parameters when this Cell's backward gathers its own
        (:meth:`FSDPModule.set_modules_to_backward_prefetch`; level3 only: the others gather nothing
        in the backward)."""
        self.set_modules_to_backward_prefetch(_check_cells(hsdp_cell_list))


def _check_cells(cells: Sequence[Any]) -> List[HSDPCell]:
    if not isinstance(cells, (tuple, list)):
        raise ValueError(f"hsdp_cell_list must be a list of HSDPCell, got {type(cells).__name__}")
    for cell in cells:
        if not isinstance(cell, HSDPCell):
            raise ValueError(f"hsdp_cell_list must hold HSDPCell objects, got {type(cell).__name__}")
    return list(cells)


def _tp_mesh(cell: nn.Cell) -> Optional[DeviceMesh]:
    """The mesh the parallel styles placed ``cell``'s parameters on (None: no such parameter);
    raise if they used several. DTensor parameters (``shard_module``) are sharded over their own
    replicated mesh dims (:func:`._dparams.replicated_dp_mesh`), not counted here."""
    meshes: Dict[Tuple[int, ...], Tuple[DeviceMesh, str]] = {}
    for sub in named_cells(cell).values():
        for p in own_parameters(sub).values():
            sharding = None if is_piece(p) or isinstance(p, DTensor) else parameter_sharding(p)
            if sharding is not None:
                meshes.setdefault(tuple(sharding.spec.mesh.rank_list), (sharding.spec.mesh, p.name))
    if len(meshes) > 1:
        named = "; ".join(f"{name!r} on {mesh!r}" for mesh, name in meshes.values())
        raise ValueError(f"hsdp({type(cell).__name__}): the parallel styles placed its parameters on several meshes "
                         f"({named}), so hsdp cannot tell its data-parallel ranks; {FSDP_X_TP}")
    return next(iter(meshes.values()))[0] if meshes else None


def _mesh(shard_size: int, cell: nn.Cell, dp_mesh: Optional[DeviceMesh] = None) -> DeviceMesh:
    """The ranks of ``dp_mesh`` (a 1-D data-parallel mesh) or, without it, every rank, or with
    parameters placed by parallel styles on a tp mesh the ranks at this rank's place in the other
    tp groups; split in shard groups of ``shard_size``."""
    tp = None
    if dp_mesh is not None:
        if not isinstance(dp_mesh, DeviceMesh) or dp_mesh.ndim != 1:
            raise ValueError(f"hsdp({type(cell).__name__}) mesh must be a 1-D DeviceMesh of the data-parallel ranks "
                             f"(e.g. mesh['dp']), got {dp_mesh!r}")
        place = mesh_world(dp_mesh)
        ranks, what = list(dp_mesh.rank_list), f"the size {dp_mesh.size()} of {dp_mesh!r}"
    else:
        tp = _tp_mesh(cell)
        place = _cluster.current_world() if tp is None else mesh_world(tp)
        ranks, what = list(range(place.size)), f"the number of ranks {place.size}"
    world, me, device = place.size, place.rank, place.device_type
    if tp is not None:
        try:
            ranks = complement_ranks(tp.rank_list, me, world)
        except ValueError as err:
            raise ValueError(f"hsdp({type(cell).__name__}): its parameters are placed by parallel styles on {tp!r}; "
                             f"{err}; {FSDP_X_TP}") from None
        what = f"the number of data-parallel ranks {len(ranks)} (ranks / tensor-parallel {tp.size()})"
    if shard_size == -1 or shard_size == len(ranks):
        return DeviceMesh(device, ranks, mesh_dim_names=("dp_shard",), _world=place)
    if len(ranks) % shard_size:
        raise ValueError(f"shard_size {shard_size} must divide {what}")
    return DeviceMesh(device, [ranks[i:i + shard_size] for i in range(0, len(ranks), shard_size)],
                      mesh_dim_names=("dp_replicate", "dp_shard"), _world=place)


def _warn_replicated(cell: nn.Cell, name: str, threshold: int) -> None:
    """Warn once, naming what ``hsdp(name)`` kept replicated because it is under ``threshold`` KB."""
    small = [(p.name, p.nbytes) for p in fsdp_state(cell).params if not p.sharded and p.nbytes < threshold * 1024]
    if not small:
        return
    shown = ", ".join(p for p, _ in small[:5]) + (f", ... ({len(small) - 5} more)" if len(small) > 5 else "")
    warnings.warn(f"hsdp({name}): {len(small)} parameters ({sum(n for _, n in small)} bytes in all) stay "
                  f"replicated, not sharded, because each is under threshold={threshold} KB: {shown}; "
                  "pass threshold=0 to shard everything", UserWarning, stacklevel=3)


def hsdp(cell: nn.Cell, shard_size: int = -1, threshold: int = 64, optimizer_level: str = "level1",
         enable_grad_accumulation: bool = False, use_eager_hook: Optional[bool] = True, grad_scale: float = 1.0,
         reduce_dtype: Any = None, comm_async: bool = False, comm_fusion: bool = False, bucket_size: int = -1, *,
         mesh: Optional[DeviceMesh] = None) -> nn.Cell:
    """Shard ``cell``'s own parameters over data parallelism (HyperParallel's signature and argument
    order, plus the keyword ``mesh``); returns ``cell``, now an :class:`HSDPCell`. ``threshold`` and ``bucket_size`` are in
    KB. ``comm_async`` is accepted; the collectives run synchronously.

    Args:
        cell: the Cell whose own parameters (those no earlier call took) are sharded.
        shard_size: ranks per shard group (-1: all); fewer than all: HSDP, replicated across groups.
        threshold: parameters smaller than this many KB stay replicated (their gradient all-reduced); a
            ``UserWarning`` names them (0: shard everything).
        optimizer_level: ``"level1"`` (all-reduce the gradient, keep this rank's slot), ``"level2"`` or
            ``"level3"`` (reduce-scatter); every level holds pieces between steps.
        enable_grad_accumulation: HyperParallel's switch for ``set_requires_grad_sync(False)``; accepted (a
            bool): that call accumulates locally either way.
        use_eager_hook: HyperParallel's choice of PyNative hooks or graph hooks; accepted (a bool or
            ``None``): this engine uses its PyNative hooks in PyNative and gathers in the graph when
            compiled, whatever it says.
        grad_scale: a float multiplying every reduced gradient.
        reduce_dtype: the floating dtype gradients are reduced in (default: the parameter's).
        comm_async: accepted and recorded; the collectives run synchronously.
        comm_fusion: one collective per Cell (or per bucket) instead of one per parameter.
        bucket_size: with ``comm_fusion``, the bucket size in KB (-1: one bucket per Cell).
        mesh: the 1-D data-parallel :class:`DeviceMesh` to shard over (not in HyperParallel), e.g.
            ``mesh["dp"]`` of a ("pp", "dp", "tp") mesh for a pipeline stage; default: every rank
            (or, after parallel styles, the ranks outside this rank's tp group).

    Example::

        hsdp(model, shard_size=-1, threshold=0, optimizer_level="level3", comm_fusion=True)
    """
    if not isinstance(cell, nn.Cell):
        raise ValueError(f"cell's type must be Cell but got {type(cell)}")
    if isinstance(shard_size, bool) or not isinstance(shard_size, int) or (shard_size <= 0 and shard_size != -1):
        raise ValueError(f"shard_size must be a positive integer or -1, but got {shard_size!r}")
    if isinstance(threshold, bool) or not isinstance(threshold, int) or threshold < 0:
        raise ValueError(f"threshold must be a non-negative integer (KB), but got {threshold!r}")
    if optimizer_level not in _LEVELS:
        raise ValueError(f"optimizer_level must be one of {sorted(_LEVELS)}, but got {optimizer_level!r}")
    if use_eager_hook is not None and not isinstance(use_eager_hook, bool):
        raise ValueError(f"use_eager_hook must be bool or None but got {use_eager_hook!r}")
    for name, flag in (("enable_grad_accumulation", enable_grad_accumulation), ("comm_async", comm_async),
                       ("comm_fusion", comm_fusion)):
        if not isinstance(flag, bool):
            raise ValueError(f"{name} must be bool but got {flag!r}")
    if not isinstance(grad_scale, float):
        raise ValueError(f"grad_scale must be float but got {grad_scale!r}")
    if reduce_dtype is not None and reduce_dtype not in _DTYPES:
        raise ValueError(f"reduce_dtype must be a floating mindspore dtype, but got {reduce_dtype!r}")
    if isinstance(bucket_size, bool) or not isinstance(bucket_size, int) or (bucket_size < 0 and bucket_size != -1):
        raise ValueError(f"bucket_size must be a non-negative integer (KB) or -1, but got {bucket_size!r}")
    if not comm_fusion:
        bucket_bytes = 0
    else:
        bucket_bytes = None if bucket_size == -1 else bucket_size * 1024
    name = type(cell).__name__
    shard_cell(cell, _mesh(shard_size, cell, mesh), reshard_after_forward=optimizer_level == "level3",
               threshold_bytes=threshold * 1024, bucket_bytes=bucket_bytes,
               reduce=_LEVELS[optimizer_level], grad_scale=grad_scale, reduce_dtype=reduce_dtype,
               mixin=HSDPCell, prefix="HSDP", engine="hsdp",
               dtensor_mesh=lambda param: replicated_dp_mesh(param, shard_size, f"hsdp({name})"))
    _warn_replicated(cell, name, threshold)
    return cell


def hsdp_wait_grad_handle() -> None:
    """HyperParallel's wait for the gradient reductions an ``hsdp(comm_async=True)`` backward left in
    flight. This engine's reductions are synchronous (``comm_async`` is recorded only): each has
    finished when the backward returns, so there is nothing to wait for and this returns at once.

    Example::

        loss, grads = grad_fn(x)
        hsdp_wait_grad_handle()       # HyperParallel scripts call it before the optimizer step
    """
    return None


def hsdp_sync_stream() -> None:
    """HyperParallel's synchronisation of its communication stream with the compute stream. This
    engine issues every collective on the stream that computes (synchronously), so the two are
    never apart and this returns at once.

    Example::

        hsdp_sync_stream()
    """
    return None
