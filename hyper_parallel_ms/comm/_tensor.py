"""Shape helpers shared by the collective implementations.

They run in PyNative and inside ``ms.jit`` and are safe for empty pieces (a rank can
hold zero rows of an unevenly sharded tensor): MindSpore's ``pad`` has no backward
for empty inputs and ``narrow`` rejects a zero-length slice at the end, so both are
avoided for those cases.

Example:
    >>> import numpy as np, mindspore as ms
    >>> x = ms.Tensor(np.ones((2, 3), np.float32))
    >>> pad_dim(x, 0, 1, 0).shape, narrow(x, 1, 3, 0).shape
    ((3, 3), (2, 0))
"""
from __future__ import annotations

from typing import Sequence, Tuple

from mindspore import mint, ops
from mindspore.common import dtype as mstype

__all__ = ["narrow", "pad_dim", "pad_slot", "slot_zeros", "shape_with", "front_perms", "move_to_front", "move_from_front",
           "select_pieces", "owned_copy"]


def shape_with(shape: Sequence[int], dim: int, size: int) -> tuple:
    """``shape`` with ``shape[dim]`` replaced by ``size``."""
    return tuple(shape[:dim]) + (size,) + tuple(shape[dim + 1:])


def narrow(x, dim: int, start: int, length: int):
    """``x[..., start:start + length, ...]`` along ``dim`` (zero length allowed)."""
    if start == 0 and length == x.shape[dim]:
        return x
    if length == 0 or x.dtype == mstype.float64:   # NarrowView inside ms.jit rejects float64
        return x[(slice(None),) * dim + (slice(start, start + length),)]
    return mint.narrow(x, dim, start, length)


def pad_dim(x, dim: int, before: int, after: int):
    """Zero-pad ``x`` along ``dim`` with ``before`` and ``after`` slices.

    An empty ``x`` is left out of the concatenation but kept as a dependency of the
    result, so that autodiff still reaches (and runs the backward of) what consumes it.
    """
    parts = []
    if before > 0:
        parts.append(ops.zeros(shape_with(x.shape, dim, before), x.dtype))
    if x.shape[dim] > 0:
        parts.append(x)
    if after > 0:
        parts.append(ops.zeros(shape_with(x.shape, dim, after), x.dtype))
    if not parts:
        return x
    out = parts[0] if len(parts) == 1 else mint.cat(parts, dim)
    return out if x.shape[dim] > 0 else ops.depend(out, x)


def slot_zeros(shape: Sequence[int], dtype):
    """Zeros for the slots of a buffer that other ranks fill, summed by an all-reduce: -0.0 for the
    dtypes summed as floats (float32, float16, bfloat16: ``x + -0.0`` is ``x`` for every ``x``, -0.0
    included, where ``+0.0`` would turn a -0.0 into 0.0), 0 for those summed as bit patterns or
    integers (float64, integers, bool).

    Example:
        >>> import numpy as np, mindspore as ms
        >>> bool(np.signbit(slot_zeros((1,), ms.float32).asnumpy()[0]))
        True
    """
    zeros = ops.zeros(shape, dtype)
    if dtype == mstype.float32 or dtype == mstype.float16 or dtype == mstype.bfloat16:
        return -zeros
    return zeros


def pad_slot(x, dim: int, before: int, after: int):
    """``x`` in its slot of a collective's buffer: ``before`` zero slices, ``x``, ``after`` zero slices
    along ``dim``, made by the same ops whatever the sizes: one more zero slice on each side,
    concatenated, then split off (no part is ever empty but ``x``; MindSpore's compiled CPU
    backward of a concatenation fails on an empty part off dim 0: "For 'Slice', memcpy failed").
    Where the sizes differ between the ranks of a collective, every rank then runs the same ops: a
    compiled graph whose ops differ between ranks may order its independent collectives differently
    on each, and the ranks would pair different collectives (:func:`pad_dim` leaves zero-size parts
    out).

    Example:
        >>> import numpy as np, mindspore as ms
        >>> pad_slot(ms.Tensor(np.ones((2, 3), np.float32)), 1, 0, 2).shape
        (2, 5)
    """
    wide = mint.cat((slot_zeros(shape_with(x.shape, dim, before + 1), x.dtype), x,
                     slot_zeros(shape_with(x.shape, dim, after + 1), x.dtype)), dim)
    # a split, not :func:`narrow`: MindSpore 2.10 fails to compile ("The func graph is empty") a helper
    # of this package called both in a custom-bprop Cell's construct and in its bprop, and its
    # compiled NarrowView rejects float64
    return mint.split(wide, (1, before + x.shape[dim] + after, 1), dim)[1]


def pad_to_block(x, dim: int, sizes: Sequence[int]):
    """``x``, one rank's piece of a collective whose pieces have ``sizes`` along ``dim``, zero-padded
    after to the largest (unchanged where all are equal): :func:`pad_slot` on every rank, so that the
    ranks run the same ops, or :func:`pad_dim` where a piece is empty (an empty concatenation part has
    no compiled backward on CPU).

    Example:
        >>> import numpy as np, mindspore as ms
        >>> pad_to_block(ms.Tensor(np.ones((2, 3), np.float32)), 1, (3, 2)).shape
        (2, 3)
    """
    block = max(sizes)
    if min(sizes) == block:
        return x
    return (pad_dim if 0 in sizes else pad_slot)(x, dim, 0, block - x.shape[dim])


def front_perms(ndim: int, dim: int) -> Tuple[tuple, tuple]:
    """The axis permutations moving axis ``dim`` of an ``ndim``-d tensor to position 0 (the others
    keep their order) and back.

    >>> front_perms(3, 1)
    ((1, 0, 2), (1, 0, 2))
    >>> front_perms(3, 2)
    ((2, 0, 1), (1, 2, 0))
    """
    to = (dim,) + tuple(d for d in range(ndim) if d != dim)
    return to, tuple(to.index(d) for d in range(ndim))


def move_to_front(x, dim: int):
    """``x`` with axis ``dim`` moved to position 0 (the others keep their order)."""
    if dim == 0:
        return x
    return ops.transpose(x, front_perms(x.ndim, dim)[0])


def move_from_front(x, dim: int):
    """Inverse of :func:`move_to_front`: axis 0 goes back to position ``dim``."""
    if dim == 0:
        return x
    return ops.transpose(x, front_perms(x.ndim, dim)[1])


def select_pieces(x, dim: int, block: int, sizes: Sequence[int]):
    """From ``len(sizes)`` blocks of ``block`` slices along ``dim``, keep the first
    ``sizes[i]`` slices of block ``i`` and concatenate them (drops padding)."""
    pieces = [narrow(x, dim, i * block, s) for i, s in enumerate(sizes) if s > 0]
    if not pieces:
        return narrow(x, dim, 0, 0)
    return pieces[0] if len(pieces) == 1 else mint.cat(pieces, dim)


def owned_copy(x):
    """A copy of ``x`` owning its memory (a view's copy is not a view), the gradient passing
    through: ``ops.deepcopy``, except bfloat16 on CPU, whose copy kernel (Identity) has no bfloat16,
    where the exact round trip through float32 copies it.

    >>> import numpy as np, mindspore as ms
    >>> y = owned_copy(ms.Tensor(np.array([1.5, -2.0]), ms.bfloat16))
    >>> y.dtype, y.astype(ms.float32).asnumpy().tolist()
    (mindspore.bfloat16, [1.5, -2.0])
    """
    from .._cluster import device_target
    if x.dtype == mstype.bfloat16 and device_target() == "CPU":
        return x.astype(mstype.float32).astype(mstype.bfloat16)
    return ops.deepcopy(x)
