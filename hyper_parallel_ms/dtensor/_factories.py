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
import numpy as np
from mindspore import Parameter, Tensor, ops

from .. import comm
from ..comm._agreement import digest, extremes
from .._deferred import initial_value
from ._dtensor import DTensor, mesh_and_placements
from ._spec import DTensorSpec

__all__ = ["distribute_tensor", "zeros", "ones", "empty", "full", "rand", "randn", "manual_seed"]

Size = Union[int, Sequence[int]]


def _size(size: Size) -> Tuple[int, ...]:
    shape = (size,) if isinstance(size, int) else tuple(size)
    if any(isinstance(s, bool) or not isinstance(s, int) or s < 0 for s in shape):
        raise ValueError(f"size must be non-negative ints, got {size!r}")
    return shape


def distribute_tensor(tensor: Tensor, device_mesh=None, placements: Optional[Sequence] = None, *,
                      src_data_rank: Optional[int] = 0) -> DTensor:
    """Distribute a full tensor: each rank keeps its piece of group rank ``src_data_rank``'s data.
    A deferred Parameter is distributed with :func:`~hyper_parallel_ms._deferred.initial_value`
    (its eager value under ``hyper_parallel_ms.no_init_parameters()``) and left deferred.

    Args:
        tensor: the whole tensor (a plain MindSpore Tensor, the same shape on every rank).
        device_mesh: the :class:`DeviceMesh` it is laid out on (default: the current mesh, ``with mesh:``).
        placements: one ``Shard`` / ``Replicate`` / ``Partial`` per mesh dim, or alias entries per tensor
            dim (``("dp", "None")``); default: Replicate on every mesh dim.
        src_data_rank: the group rank (on every mesh dim) whose values every rank takes; ``None``: each
            rank cuts its own ``tensor`` (no communication).

    Example::

        dt = distribute_tensor(ms.ops.randn((8, 8)), mesh, [Shard(0), Replicate()])
    """
    if isinstance(tensor, DTensor):
        raise TypeError("distribute_tensor needs a plain Tensor; use DTensor.redistribute for a DTensor")
    if not isinstance(tensor, Tensor):
        raise TypeError(f"distribute_tensor needs a mindspore Tensor, got {type(tensor).__name__}")
    device_mesh, placements = mesh_and_placements(device_mesh, placements, "distribute_tensor")
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


def _shape_of(size: tuple, what: str) -> Tuple[int, ...]:
    """``zeros(8, 4)`` and ``zeros((8, 4))`` alike (PyTorch's ``*size``)."""
    if len(size) == 1 and not isinstance(size[0], int):
        return _size(size[0])
    if not size:
        raise TypeError(f"{what} needs a size")
    return _size(size)


def full(size: Size, fill_value, *, dtype=None, layout=None, requires_grad: bool = False, device_mesh=None,
         placements: Optional[Sequence] = None) -> DTensor:
    """A DTensor whose local pieces are filled with ``fill_value`` (PyTorch's ``full``: on a Partial
    mesh dim every piece holds it, so the global tensor is their sum).

    Args:
        size: the global shape (an int or a sequence of ints).
        fill_value: the value of every element of each piece.
        dtype: the MindSpore dtype (default ``float32``).
        layout: accepted as PyTorch's ``layout`` (strided, the only kind here).
        requires_grad: recorded on the result (``dt.requires_grad``), as PyTorch.
        device_mesh: the :class:`DeviceMesh` (default: the current mesh, ``with mesh:``).
        placements: one placement per mesh dim, or alias entries per tensor dim (default: Replicate).

    Example::

        dt = full((8, 4), 2.0, device_mesh=mesh, placements=[Shard(0)])
    """
    shape = _size(size)
    device_mesh, placements = mesh_and_placements(device_mesh, placements, "full")
    spec = DTensorSpec.build(device_mesh, placements, shape)
    local = ops.full(spec.layout.local_shape(spec.shape, device_mesh.coordinate), fill_value,
                     dtype=ms.float32 if dtype is None else dtype)
    return DTensor(local, spec).requires_grad_(requires_grad)


def zeros(*size, dtype=None, layout=None, requires_grad: bool = False, device_mesh=None,
          placements: Optional[Sequence] = None) -> DTensor:
    """A DTensor of zeros (``zeros(8, 4, ...)`` or ``zeros((8, 4), ...)``).

    Args:
        size, dtype, layout, requires_grad, device_mesh, placements: as in :func:`full`.

    Example::

        dt = zeros(8, 4, device_mesh=mesh, placements=[Shard(0)])
    """
    return full(_shape_of(size, "zeros"), 0, dtype=dtype, requires_grad=requires_grad, device_mesh=device_mesh,
                placements=placements)


def ones(*size, dtype=None, layout=None, requires_grad: bool = False, device_mesh=None,
         placements: Optional[Sequence] = None) -> DTensor:
    """A DTensor of ones (each piece: on a Partial mesh dim the global tensor is their sum).

    Args:
        size, dtype, layout, requires_grad, device_mesh, placements: as in :func:`full`.

    Example::

        dt = ones((8, 4), device_mesh=mesh, placements=[Replicate()])
    """
    return full(_shape_of(size, "ones"), 1, dtype=dtype, requires_grad=requires_grad, device_mesh=device_mesh,
                placements=placements)


def empty(*size, dtype=None, layout=None, requires_grad: bool = False, device_mesh=None,
          placements: Optional[Sequence] = None) -> DTensor:
    """A DTensor with unspecified values (zeros here: MindSpore has no uninitialised CPU kernel).

    Args:
        size, dtype, layout, requires_grad, device_mesh, placements: as in :func:`full`.

    Example::

        dt = empty((8, 4), device_mesh=mesh, placements=[Shard(0)])
    """
    return full(_shape_of(size, "empty"), 0, dtype=dtype, requires_grad=requires_grad, device_mesh=device_mesh,
                placements=placements)


def _random(draw, size: tuple, what: str, dtype, requires_grad: bool, device_mesh, placements) -> DTensor:
    shape = _shape_of(size, what)
    device_mesh, placements = mesh_and_placements(device_mesh, placements, what)
    spec = DTensorSpec.build(device_mesh, placements, shape)
    local = spec.piece_of(draw(spec.shape, dtype=ms.float32 if dtype is None else dtype))
    return DTensor(local, spec).requires_grad_(requires_grad)


def rand(*size, dtype=None, layout=None, requires_grad: bool = False, device_mesh=None,
         placements: Optional[Sequence] = None) -> DTensor:
    """Uniform [0, 1) values; equal to the single-device ``ops.rand`` with the same seed.

    Args:
        size, dtype, layout, requires_grad, device_mesh, placements: as in :func:`full`.

    Example::

        ms.set_seed(0)
        dt = rand((8, 4), device_mesh=mesh, placements=[Shard(0)])   # == ops.rand((8, 4)) after the same seed
    """
    return _random(ops.rand, size, "rand", dtype, requires_grad, device_mesh, placements)


def randn(*size, dtype=None, layout=None, requires_grad: bool = False, device_mesh=None,
          placements: Optional[Sequence] = None) -> DTensor:
    """Standard normal values; equal to the single-device ``ops.randn`` with the same seed.

    Args:
        size, dtype, layout, requires_grad, device_mesh, placements: as in :func:`full`.

    Example::

        dt = randn((8, 4), device_mesh=mesh, placements=[Replicate()])
    """
    return _random(ops.randn, size, "randn", dtype, requires_grad, device_mesh, placements)


def manual_seed(seed: int, device_mesh) -> None:
    """PyTorch's ``torch.distributed.tensor.random.manual_seed``: seed MindSpore's generator
    (``ms.set_seed``) that :func:`rand` / :func:`randn` and the sharded dropouts draw the whole
    tensor from, after checking that every rank of ``device_mesh`` passes the same ``seed`` (one
    small all-reduce per mesh dim): with different seeds the pieces would come from different
    tensors, so every rank raises instead.

    Args:
        seed: a non-negative int, the same on every rank of the mesh.
        device_mesh: the :class:`~hyper_parallel_ms.mesh.DeviceMesh` whose ranks draw together.

    Example::

        manual_seed(1234, mesh)
        noise = randn((8, 4), device_mesh=mesh, placements=[Shard(0)])   # ops.randn((8, 4)) after set_seed(1234)
    """
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise ValueError(f"manual_seed: seed must be a non-negative int, got {seed!r}")
    high, low = extremes(np.array(digest(str(seed)), np.float32), device_mesh)
    if (high != low).any():
        raise RuntimeError(f"manual_seed: the ranks of mesh {device_mesh.shape} pass different seeds (this rank "
                           f"{seed}); random DTensors draw the whole tensor from the seed on every rank, so their "
                           f"pieces would not form one tensor: pass the same seed on every rank")
    ms.set_seed(seed)
