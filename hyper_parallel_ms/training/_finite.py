"""``all_finite``: one verdict for every rank on whether this step's gradients are finite.

MindSpore's dynamic loss scaling (``amp.DynamicLossScaler``, ``DynamicLossScaleManager``) checks the
gradients this rank holds: with sharded or data-parallel gradients one rank may overflow while
another does not, so one skips the step and lowers its scale while the other steps, and the
replicas diverge. :func:`all_finite` checks this rank's gradients with MindSpore's own
``amp.all_finite`` and agrees across the mesh in one all-reduce of one number.

Example::

    scaler = amp.DynamicLossScaler(2.0 ** 16, 2, 1000)
    loss, grads = grad_fn(x, y)                    # of scaler.scale(loss)
    grads = scaler.unscale(reducer(grads))
    finite = all_finite(grads, mesh)               # the same on every rank
    scaler.adjust(finite)
    if finite:
        optimizer(grads)
"""
from __future__ import annotations

from typing import Sequence

import mindspore as ms
from mindspore import Tensor, amp

from .. import comm
from .._mindspore import run_in_python

__all__ = ["all_finite"]


@run_in_python
def _flat(mesh):
    """``mesh`` as one dimension, so that one collective reaches all its ranks."""
    return mesh if mesh.ndim == 1 else mesh._flatten("_hpms_all_ranks")


def all_finite(grads: Sequence[Tensor], mesh) -> Tensor:
    """Whether every gradient of every rank of ``mesh`` is finite (a bool scalar, the same on every
    rank): skip or step together. One all-reduce over the mesh's ranks (flattened); PyNative and
    inside ``ms.jit``. Every rank of ``mesh`` must call it.

    Args:
        grads: this rank's gradients (a tuple or list of Tensors, pieces or whole).
        mesh: the :class:`DeviceMesh` of every rank training the model (all its dims agree).

    Example::

        finite = all_finite(grads, mesh)
        scaler.adjust(finite)                   # amp.DynamicLossScaler: the scale drops on every rank
    """
    overflow = (~amp.all_finite(grads)).astype(ms.float32).reshape(1)
    overflow = comm.all_reduce(overflow, _flat(mesh), 0)
    return (overflow == 0).reshape(())
