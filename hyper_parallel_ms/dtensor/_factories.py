"""distribute_tensor and the DTensor factories.

``distribute_tensor`` keeps PyTorch's single-device semantics: the data of group rank
``src_data_rank`` on every mesh dim wins (it is broadcast along each mesh dim), then each
rank keeps its piece; ``src_data_rank=None`` skips communication and each rank cuts its
piece from its own tensor. ``zeros``/``ones``/``full``/``empty`` build the local piece
directly; ``rand``/``randn`` draw the global tensor from MindSpore's generator on every
rank (equal seeds give equal draws, so the pieces form the single-device tensor) and keep
the local piece, so they use memory for the global tensor while they run.

Example::

    w = distribute_tensor(weight, mesh, [Shard(0)])               # rank 0's weight, row-sharded
    z = zeros((8, 4), device_mesh=mesh, placements=[Replicate(), Shard(1)])
"""
from __future__ import annotations

from typing import Optional, Sequence, Tuple, Union

import mindspore as ms
from mindspore import Parameter, Tensor, ops

from .. import comm
from .._deferred import initial_value
from ._dtensor import DTensor
from ._spec import DTensorSpec

__all__ = ["distribute_tensor", "zeros", "ones", "empty", "full", "rand", "randn"]

Size = Union[int, Sequence[int]]


def _size(size: Size) -> Tuple[int, ...]:
    shape = (size,) if isinstance(size, int) else tuple(size)
    if any(isinstance(s, bool) or not isinstance(s, int) or s < 0 for s in shape):
        raise ValueError(f"size must be non-negative ints, got {size!r}")
    return shape


def distribute_tensor(tensor: Tensor, device_mesh, placements: Sequence, *,
                      src_data_rank: Optional[int] = 0) -> DTensor:
    """Distribute a full tensor: each rank keeps its piece of group rank ``src_data_rank``'s data.
    A deferred Parameter is distributed with :func:`~hyper_parallel_ms._deferred.initial_value`
    (its eager value under ``hyper_parallel_ms.no_init_parameters()``) and left deferred.

    Args:
        tensor: the whole tensor (a plain MindSpore Tensor, the same shape on every rank).
        device_mesh: the :class:`DeviceMesh` it is laid out on.
        placements: one ``Shard`` / ``Replicate`` / ``Partial`` per mesh dim, or alias entries per tensor
            dim (``("dp", "None")``).
        src_data_rank: the group rank (on every mesh dim) whose values every rank takes; ``None``: each
            rank cuts its own ``tensor`` (no communication).

    Example::

        dt = distribute_tensor(ms.ops.randn((8, 8)), mesh, [Shard(0), Replicate()])
    """
    if isinstance(tensor, DTensor):
        raise TypeError("distribute_tensor needs a plain Tensor; use DTensor.redistribute for a DTensor")
    if not isinstance(tensor, Tensor):
        raise TypeError(f"distribute_tensor needs a mindspore Tensor, got {type(tensor).__name__}")
    if isinstance(tensor, Parameter) and tensor.has_init:      # deferred: its eager (or first-use) value
        tensor = Tensor(initial_value(tensor), dtype=tensor.dtype)
    spec = DTensorSpec.build(device_mesh, placements, tensor.shape)
    if src_data_rank is not None:
        for a in range(device_mesh.ndim):
            if not 0 <= src_data_rank < device_mesh.shape[a]:
                raise ValueError(f"src_data_rank {src_data_rank} is not a rank index on mesh dim {a} of size "
                                 f"{device_mesh.shape[a]}")
            tensor = comm.broadcast(tensor, device_mesh, a, src=src_data_rank)
    return DTensor(spec.piece_of(tensor), spec)


def full(size: Size, fill_value, *, device_mesh, placements: Sequence, dtype=ms.float32) -> DTensor:
    """A DTensor whose global tensor is filled with ``fill_value`` (Partial(sum): rank pieces
    hold fill_value / n so that the sum is right).

    Args:
        size: the global shape (an int or a sequence of ints).
        fill_value: the value of every element of the global tensor.
        device_mesh: the :class:`DeviceMesh`.
        placements: one placement per mesh dim (or alias entries per tensor dim).
        dtype: the MindSpore dtype (default ``float32``).

    Example::

        dt = full((8, 4), 2.0, device_mesh=mesh, placements=[Shard(0)])
    """
    spec = DTensorSpec.build(device_mesh, placements, _size(size))
    value = ops.full(spec.layout.local_shape(spec.shape, device_mesh.get_coordinate()), fill_value, dtype=dtype)
    for a, p in enumerate(spec.placements):
        if p.is_partial("sum") and device_mesh.shape[a] > 1:
            value = value / device_mesh.shape[a]
    return DTensor(value, spec)


def zeros(size: Size, *, device_mesh, placements: Sequence, dtype=ms.float32) -> DTensor:
    """A DTensor of zeros.

    Args:
        size, device_mesh, placements, dtype: as in :func:`full`.

    Example::

        dt = zeros((8, 4), device_mesh=mesh, placements=[Shard(0)])
    """
    return full(size, 0, device_mesh=device_mesh, placements=placements, dtype=dtype)


def ones(size: Size, *, device_mesh, placements: Sequence, dtype=ms.float32) -> DTensor:
    """A DTensor of ones.

    Args:
        size, device_mesh, placements, dtype: as in :func:`full`.

    Example::

        dt = ones((8, 4), device_mesh=mesh, placements=[Replicate()])
    """
    return full(size, 1, device_mesh=device_mesh, placements=placements, dtype=dtype)


def empty(size: Size, *, device_mesh, placements: Sequence, dtype=ms.float32) -> DTensor:
    """A DTensor with unspecified values (zeros here: MindSpore has no uninitialised CPU kernel).

    Args:
        size, device_mesh, placements, dtype: as in :func:`full`.

    Example::

        dt = empty((8, 4), device_mesh=mesh, placements=[Shard(0)])
    """
    return full(size, 0, device_mesh=device_mesh, placements=placements, dtype=dtype)


def _random(draw, size: Size, device_mesh, placements: Sequence, dtype) -> DTensor:
    spec = DTensorSpec.build(device_mesh, placements, _size(size))
    return DTensor(spec.piece_of(draw(spec.shape, dtype=dtype)), spec)


def rand(size: Size, *, device_mesh, placements: Sequence, dtype=ms.float32) -> DTensor:
    """Uniform [0, 1) values; equal to the single-device ``ops.rand`` with the same seed.

    Args:
        size, device_mesh, placements, dtype: as in :func:`full`.

    Example::

        ms.set_seed(0)
        dt = rand((8, 4), device_mesh=mesh, placements=[Shard(0)])   # == ops.rand((8, 4)) after the same seed
    """
    return _random(ops.rand, size, device_mesh, placements, dtype)


def randn(size: Size, *, device_mesh, placements: Sequence, dtype=ms.float32) -> DTensor:
    """Standard normal values; equal to the single-device ``ops.randn`` with the same seed.

    Args:
        size, device_mesh, placements, dtype: as in :func:`full`.

    Example::

        dt = randn((8, 4), device_mesh=mesh, placements=[Replicate()])
    """
    return _random(ops.randn, size, device_mesh, placements, dtype)
