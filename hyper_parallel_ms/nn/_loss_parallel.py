"""Cross-entropy on logits sharded on the class dim, without gathering the logits.

One implementation of the math, :func:`parallel_cross_entropy` on this rank's piece of the
logits (last dim split with ``torch.chunk`` sizes over one mesh dim), and two drivers:

- :class:`ParallelCrossEntropy`, a Cell a train step calls on the LOCAL logits (PyNative
  and ``ms.jit``);
- :func:`loss_parallel`, a context in which ``ops.cross_entropy``, ``nn.CrossEntropyLoss``
  and ``mint.nn.functional.cross_entropy`` (and ``mint.nn.CrossEntropyLoss``) given DTensor
  logits placed ``Shard(-1)`` run this math and return a Replicate DTensor.

The math per row: ``m`` = all-reduce(max) of the row max (no gradient through it),
``lse = m + log(all-reduce(sum) of sum(exp(x - m)))``, the target logit by a masked local
gather and all-reduce(sum); with label smoothing also all-reduce(sum) of the row sum. Each
all-reduce passes the gradient through unchanged (every rank holds the same replicated
loss, so each rank's gradient of the reduced value is already the whole gradient). Three
all-reduces of ``N`` floats each (four with label smoothing) replace an all-gather of
``N x C`` logits, and the logits gradient stays sharded.

Example::

    with loss_parallel():
        loss = ops.cross_entropy(logits_dt, target)     # logits_dt: Shard(-1)
    # graph mode, on the local logits
    loss = ParallelCrossEntropy(mesh, num_classes=32000)(local_logits, target)
"""
from __future__ import annotations

import contextlib
from typing import Callable, Iterator, List, Optional, Tuple

import mindspore as ms
from mindspore import nn, ops

from .. import comm
from .._mindspore import Swap, entry_points_swapped, is_compiling, run_in_python
from ..layout import chunk_sizes

__all__ = ["parallel_cross_entropy", "ParallelCrossEntropy", "loss_parallel"]

_REDUCTIONS = ("mean", "sum", "none")


def _reduced(x, mesh, mesh_dim, op: str):
    """``all_reduce(x, op)`` in value, the identity for the gradient."""
    return x + ops.stop_gradient(comm.all_reduce(x, mesh, mesh_dim, op=op) - x)


def _check_options(reduction: str, label_smoothing: float) -> None:
    if reduction not in _REDUCTIONS:
        raise ValueError(f"reduction must be one of {_REDUCTIONS}, got {reduction!r}")
    if not 0.0 <= float(label_smoothing) <= 1.0:
        raise ValueError(f"label_smoothing must be in [0, 1], got {label_smoothing!r}")


def class_range(num_classes: int, mesh, mesh_dim) -> Tuple[int, int]:
    """(first class, class count) of this rank's piece: ``torch.chunk`` pieces over ``mesh_dim``.

    Example::

        class_range(7, mesh, "tp")     # (0, 4) on tp rank 0, (4, 3) on tp rank 1
    """
    sizes = chunk_sizes(num_classes, mesh.size(mesh_dim))
    rank = mesh.get_local_rank(mesh_dim)
    return sum(sizes[:rank]), sizes[rank]


@run_in_python
def _check_targets(target, num_classes: int, ignore_index: int) -> None:
    """Raise for a class index outside [0, num_classes) other than ``ignore_index`` (the masked
    gather would read it as a logit of 0 instead of failing as the plain op does). Inside
    ``ms.jit`` / GRAPH_MODE MindSpore runs it as Python at each call of the graph (with the
    call's targets); while the graph compiles it does nothing."""
    if is_compiling():
        return
    bad = ops.logical_and(ops.logical_or(target < 0, target >= num_classes), target != ignore_index)
    if bool(bad.any()):
        raise ValueError(f"cross_entropy targets must be class indices in [0, {num_classes}) or ignore_index="
                         f"{ignore_index}; got {target.asnumpy()[bad.asnumpy()].tolist()[:8]}")


def parallel_cross_entropy(local_logits, target, mesh, mesh_dim=0, *, num_classes: int, ignore_index: int = -100,
                           reduction: str = "mean", label_smoothing: float = 0.0):
    """Cross-entropy of ``(N, C)`` logits whose class dim is split over ``mesh_dim``. Returns the
    loss every rank agrees on.

    Args:
        local_logits: this rank's ``(N, c)`` piece of the logits (``torch.chunk`` sizes of ``num_classes``).
        target: ``(N,)`` class indices, the same on every rank.
        mesh: the :class:`DeviceMesh` whose ``mesh_dim`` splits the classes.
        mesh_dim: the name or index of that mesh dim (default 0).
        num_classes: the global class count ``C``.
        ignore_index: targets equal to it add no loss and are not counted in the mean.
        reduction: ``"mean"`` (default), ``"sum"`` or ``"none"`` (one loss per row).
        label_smoothing: in ``[0, 1]``, as in ``mindspore.ops.cross_entropy``.

    Example::

        loss = parallel_cross_entropy(piece, target, mesh, "tp", num_classes=32000)
    """
    _check_options(reduction, label_smoothing)
    start, count = class_range(num_classes, mesh, mesh_dim)
    if tuple(local_logits.shape[-1:]) != (count,) or len(local_logits.shape) != 2:
        raise ValueError(f"parallel_cross_entropy needs (N, {count}) local logits on this rank ({num_classes} classes "
                         f"in torch.chunk pieces), got {tuple(local_logits.shape)}")
    rows = local_logits.shape[0]
    target = target.astype(ms.int32)
    _check_targets(target, num_classes, ignore_index)
    if count > 0:
        row_max = ops.stop_gradient(local_logits).max(axis=-1)
    else:
        row_max = ops.full((rows,), float("-inf"), dtype=local_logits.dtype)
    row_max = ops.stop_gradient(comm.all_reduce(row_max, mesh, mesh_dim, op="max"))
    shifted = local_logits - ops.expand_dims(row_max, -1)
    sum_exp = _reduced(ops.exp(shifted).sum(axis=-1), mesh, mesh_dim, "sum")
    log_sum_exp = ops.log(sum_exp)                      # of the shifted logits
    local_index = target - start
    inside = ops.logical_and(local_index >= 0, local_index < count)
    if count > 0:
        safe = ops.select(inside, local_index, ops.zeros_like(local_index))
        picked = ops.gather_d(shifted, 1, ops.expand_dims(safe, -1)).squeeze(-1)
        picked = picked * inside.astype(picked.dtype)
    else:
        picked = ops.zeros((rows,), local_logits.dtype)
    picked = _reduced(picked, mesh, mesh_dim, "sum")
    loss = log_sum_exp - picked
    if label_smoothing > 0.0:
        total = _reduced(shifted.sum(axis=-1), mesh, mesh_dim, "sum")
        smooth = num_classes * log_sum_exp - total       # minus the sum of the log-probabilities
        loss = (1.0 - label_smoothing) * loss + (label_smoothing / num_classes) * smooth
    kept = (target != ignore_index).astype(loss.dtype)
    loss = loss * kept
    if reduction == "none":
        return loss
    if reduction == "sum":
        return loss.sum()
    # every target ignored: the loss is nan (0 / 0, as one device) and the gradient 0 (a plain
    # division would send inf * 0 = nan into every logit)
    count = kept.sum()
    mean = loss.sum() / ops.maximum(count, ops.ones_like(count))
    return ops.where(count > 0, mean, ops.full_like(mean, float("nan")))


class ParallelCrossEntropy(nn.Cell):
    """Cross-entropy on this rank's piece of class-sharded logits (PyNative and ``ms.jit``).

    Call it with the local ``(N, c)`` logits and the replicated ``(N,)`` targets. An index outside
    the classes that is not ``ignore_index`` raises ``ValueError``, in PyNative and inside ``ms.jit``
    / GRAPH_MODE alike (MindSpore runs the check as Python at each call of the graph: one read of
    the targets per call).

    Args:
        mesh: the mesh (a 1-D tp mesh, or give ``mesh_dim``).
        num_classes: the global class count (pieces are ``torch.chunk`` sizes of it).
        mesh_dim, ignore_index, reduction, label_smoothing: as in :func:`parallel_cross_entropy`.

    Example::

        loss_fn = ParallelCrossEntropy(mesh, num_classes=32000, label_smoothing=0.1)
        loss = loss_fn(head(x).to_local(), target)
    """

    def __init__(self, mesh, *, num_classes: int, mesh_dim=0, ignore_index: int = -100, reduction: str = "mean",
                 label_smoothing: float = 0.0) -> None:
        super().__init__()
        _check_options(reduction, label_smoothing)
        class_range(num_classes, mesh, mesh_dim)           # checks the mesh dim
        self.mesh, self.mesh_dim, self.num_classes = mesh, mesh_dim, int(num_classes)
        self.ignore_index, self.reduction, self.label_smoothing = int(ignore_index), reduction, float(label_smoothing)

    def construct(self, local_logits, target):
        return parallel_cross_entropy(local_logits, target, self.mesh, self.mesh_dim, num_classes=self.num_classes,
                                      ignore_index=self.ignore_index, reduction=self.reduction,
                                      label_smoothing=self.label_smoothing)


# ----------------------------------------------------------------- the DTensor driver
def _class_mesh_dim(logits) -> Optional[int]:
    """The mesh dim splitting the class (last) dim of 2-D logits placed Shard(-1) there and
    Replicate elsewhere, or ``None`` when the logits are laid out otherwise."""
    placements = logits.placements
    if logits.ndim != 2:
        return None
    split = [i for i, p in enumerate(placements) if not p.is_replicate()]
    if len(split) != 1 or not placements[split[0]].is_shard() or placements[split[0]].dim not in (1, -1):
        return None
    return split[0]


def _replicated_target(target, mesh):
    from ..dtensor import DTensor
    if isinstance(target, DTensor):
        if not all(p.is_replicate() for p in target.placements):
            raise ValueError(f"loss_parallel needs replicated targets, got placements {target.placements}; "
                             "redistribute them to Replicate() first")
        return target.to_local()
    return target


def _dtensor_cross_entropy(original: Callable) -> Callable:
    """``original`` (a cross_entropy function), with Shard(-1) DTensor logits run by
    :func:`parallel_cross_entropy`; any other call goes to ``original``."""
    from ..dtensor import DTensor
    from ..placement import Replicate

    def cross_entropy(input, target, weight=None, ignore_index=-100, reduction="mean", label_smoothing=0.0):
        mesh_dim = _class_mesh_dim(input) if isinstance(input, DTensor) else None
        if mesh_dim is None:
            return original(input, target, weight, ignore_index, reduction, label_smoothing)
        if weight is not None:
            raise NotImplementedError("loss_parallel does not support class weights; gather the logits "
                                      "(.full_tensor()) or drop weight")
        if target.dtype in (ms.float16, ms.float32, ms.float64, ms.bfloat16):
            raise NotImplementedError("loss_parallel supports class-index targets only; class-probability targets "
                                      "need the gathered logits (.full_tensor())")
        mesh = input.device_mesh
        target = _replicated_target(target, mesh)
        loss = parallel_cross_entropy(input.to_local(), target, mesh, mesh_dim,   # it checks the targets
                                      num_classes=input.shape[-1], ignore_index=ignore_index, reduction=reduction,
                                      label_smoothing=label_smoothing)
        return DTensor.from_local(loss, mesh, [Replicate()] * mesh.ndim, shape=tuple(loss.shape))
    return cross_entropy


def _loss_cell_construct(original: Callable) -> Callable:
    """``nn.CrossEntropyLoss.construct``, sending Shard(-1) DTensor logits to the
    loss_parallel ``ops.cross_entropy`` (its own input check reads the type with a primitive
    that has no DTensor rule)."""
    from ..dtensor import DTensor

    def construct(self, logits, labels):
        if isinstance(logits, DTensor) and _class_mesh_dim(logits) is not None:
            return ops.cross_entropy(logits, labels, self.weight, self.ignore_index, self.reduction,
                                     self.label_smoothing)
        return original(self, logits, labels)
    return construct


def _entry_points() -> List[Swap]:
    """(owner, attribute, wrapper) of each cross_entropy function that user code and the loss
    Cells call."""
    import importlib
    mint_nn = importlib.import_module("mindspore.mint.nn")
    mint_functional = importlib.import_module("mindspore.mint.nn.functional")
    return [(ops, "cross_entropy", _dtensor_cross_entropy), (mint_functional, "cross_entropy", _dtensor_cross_entropy),
            (mint_nn, "cross_entropy", _dtensor_cross_entropy),
            (nn.CrossEntropyLoss, "construct", _loss_cell_construct)]


@contextlib.contextmanager
def loss_parallel() -> Iterator[None]:
    """Inside, ``ops.cross_entropy``, ``nn.CrossEntropyLoss``, ``mint.nn.functional.cross_entropy``
    and ``mint.nn.CrossEntropyLoss`` on 2-D DTensor logits placed ``Shard(-1)`` (Replicate on
    other mesh dims) compute the loss without gathering the logits; targets are class indices,
    a plain Tensor or a Replicate DTensor. The loss is a Replicate DTensor and the logits
    gradient stays ``Shard(-1)``. Other calls behave as outside. Functions imported by name
    before entering (``from mindspore.ops import cross_entropy``) are not covered.

    Example::

        with loss_parallel():
            loss = nn.CrossEntropyLoss(label_smoothing=0.1)(logits_dt, target)
    """
    with entry_points_swapped(_entry_points()):
        yield
