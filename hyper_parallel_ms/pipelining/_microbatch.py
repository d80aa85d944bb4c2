"""Micro-batches and the shapes that cross stages: splitting along dim 0, and the small integer
descriptions (signatures) of a tuple of tensors that ranks exchange to learn receive shapes.

A signature is ``(count, dtype code, ndim, d0, .., d7, dtype code, ndim, ...)``; it fits the
fixed :data:`HEADER` length (up to :data:`MAX_TENSORS` tensors of at most :data:`MAX_NDIM` dims).

Example::

    mbs = split_microbatches((x, y), 4)              # 4 tuples (x_m, y_m), rows as torch.tensor_split
    split_microbatches(((a, b), {"mask": m}), 2)     # nested tuples, lists and dicts: each Tensor split
    sig = signature(mbs[0]); like_tensors(sig)       # zero tensors of those shapes and dtypes
"""
from __future__ import annotations

from typing import Iterator, List, Sequence, Tuple

import mindspore as ms
import numpy as np
from mindspore import Tensor, ops

__all__ = ["chunk_sizes", "split_microbatches", "tree_leaves", "tree_unflatten", "signature", "fitting_signature", "like_tensors", "HEADER", "MAX_TENSORS",
           "MAX_NDIM", "as_tuple", "is_float"]

MAX_TENSORS, MAX_NDIM = 8, 8
HEADER = 1 + MAX_TENSORS * (2 + MAX_NDIM)
_DTYPES = (ms.float32, ms.float16, ms.bfloat16, ms.float64, ms.int32, ms.int64, ms.uint8, ms.int8, ms.int16, ms.bool_)
_FLOATS = (ms.float32, ms.float16, ms.bfloat16, ms.float64)


def as_tuple(value) -> Tuple:
    """A stage's output as a tuple of tensors."""
    return tuple(value) if isinstance(value, (tuple, list)) else (value,)


def is_float(x: Tensor) -> bool:
    """Whether ``x`` carries a gradient between stages (floating dtypes)."""
    return x.dtype in _FLOATS


def chunk_sizes(rows: int, n: int) -> List[int]:
    """The rows of each of ``n`` micro-batches of a batch of ``rows`` (``torch.tensor_split``'s: the
    first ``rows % n`` hold one more).

    >>> chunk_sizes(10, 4)
    [3, 3, 2, 2]
    """
    q, r = divmod(rows, n)
    return [q + 1] * r + [q] * (n - r)


def tree_leaves(value: object) -> List[object]:
    """The leaves of ``value``: nested tuples, lists and dicts flattened in order (dict values in
    their order), anything else a leaf.

    >>> tree_leaves((1, [2, {"a": 3}], "x"))
    [1, 2, 3, 'x']
    """
    if isinstance(value, (tuple, list)):
        return [leaf for item in value for leaf in tree_leaves(item)]
    if isinstance(value, dict):
        return [leaf for item in value.values() for leaf in tree_leaves(item)]
    return [value]


def tree_unflatten(like: object, leaves: Iterator[object]) -> object:
    """``like``'s structure (as :func:`tree_leaves` walks it) with its leaves taken from ``leaves``
    in order; tuple, list and dict types (named tuples too) are kept.

    >>> tree_unflatten((1, [2, {"a": 3}]), iter("xyz"))
    ('x', ['y', {'a': 'z'}])
    """
    if isinstance(like, (tuple, list)):
        items = [tree_unflatten(item, leaves) for item in like]
        return type(like)(*items) if hasattr(like, "_fields") else type(like)(items)
    if isinstance(like, dict):
        return type(like)((key, tree_unflatten(item, leaves)) for key, item in like.items())
    return next(leaves)


def split_microbatches(values: Sequence[object], n: int) -> List[Tuple[object, ...]]:
    """``n`` tuples like ``values``, the i-th holding the i-th chunk (along dim 0, :func:`chunk_sizes`)
    of each Tensor of ``values``, inside nested tuples, lists and dicts too; any other value goes to
    every micro-batch unchanged (PyTorch's)."""
    values = tuple(values)
    chunks = [ops.split(v, chunk_sizes(v.shape[0], n), axis=0) if isinstance(v, Tensor) else (v,) * n
              for v in tree_leaves(values)]
    return [tree_unflatten(values, iter([c[m] for c in chunks])) for m in range(n)]


def signature(tensors: Sequence[Tensor]) -> Tuple[int, ...]:
    """The fixed-length integer description of ``tensors`` (shapes and dtypes), -1 first if it does not fit."""
    if len(tensors) > MAX_TENSORS or any(t.ndim > MAX_NDIM or t.dtype not in _DTYPES for t in tensors):
        return (-1,) + (0,) * (HEADER - 1)
    out = [len(tensors)]
    for t in tensors:
        out += [_DTYPES.index(t.dtype), t.ndim] + list(t.shape) + [0] * (MAX_NDIM - t.ndim)
    return tuple(out) + (0,) * (HEADER - len(out))


def fitting_signature(tensors: Sequence[Tensor]) -> Tuple[int, ...]:
    """:func:`signature` of ``tensors``, or a ``ValueError`` naming the limits when it does not fit."""
    sig = signature(tensors)
    if sig[0] < 0:
        raise ValueError(f"a stage output does not fit the shape header: at most {MAX_TENSORS} tensors of at most "
                         f"{MAX_NDIM} dims with dtypes {[str(d) for d in _DTYPES]}, got "
                         f"{[(tuple(t.shape), str(t.dtype)) for t in tensors]}")
    return sig


def like_tensors(sig: Sequence[int]) -> Tuple[Tensor, ...]:
    """Zero tensors with the shapes and dtypes ``sig`` (a fitting signature) describes (receive templates)."""
    sig = [int(v) for v in sig]
    out = []
    for i in range(sig[0]):
        code, ndim, *dims = sig[1 + i * (2 + MAX_NDIM): 1 + (i + 1) * (2 + MAX_NDIM)]
        out.append(Tensor(np.zeros(dims[:ndim]), _DTYPES[code]))
    return tuple(out)
