"""Helpers the CPU twins share: a scalar argument's Python value, whether a tensor views part of
a storage, a dim's index, the dtype a twin computes in, a whole copy, whether a value is a DTensor,
and the originals the twins replaced (filled by ``cpu_twins``).

Example::

    step = int(_host(split_size))        # a Python int or a 0-d Tensor
"""
from __future__ import annotations

from typing import Any, Dict

import mindspore as ms
from mindspore import ops

__all__ = ["_host", "_partial_view", "_axis", "_wide", "_copy", "_dtensor", "_ORIGINALS"]

_ORIGINALS: Dict[str, Any] = {}     # what cpu_twins() replaced, by twin name, while it is active


def _host(value: Any) -> Any:
    return value.item() if isinstance(value, ms.Tensor) else value


def _partial_view(t) -> bool:
    """``t`` is a view on part of a storage (offset, strides, or a slice of a larger buffer); a tensor
    whose storage cannot be asked (not materialized) is not: the method itself handles it, as before."""
    try:
        return t.storage_offset() != 0 or not t.is_contiguous() or t.untyped_storage().nbytes() != t.nbytes
    except (RuntimeError, TypeError, ValueError):
        return False


def _axis(dim: Any, ndim: int) -> int:
    dim = int(_host(dim))
    if not -max(ndim, 1) <= dim < max(ndim, 1):
        raise IndexError(f"cpu_twins: dim {dim} is out of range for a {ndim}-d tensor")
    return dim % max(ndim, 1)


def _wide(*tensors) -> Any:
    """The dtype a twin computes in: float32 for float16 / bfloat16 operands, else their own."""
    dtypes = {t.dtype for t in tensors}
    if ms.float64 in dtypes:
        return ms.float64
    return ms.float32 if dtypes & {ms.float16, ms.bfloat16, ms.float32} else tensors[0].dtype


def _copy(x):
    """A whole copy of ``x`` (a view's elements only), exact in every dtype."""
    return x.astype(ms.float32).astype(x.dtype) if x.dtype == ms.bfloat16 else ops.deepcopy(x)


def _dtensor(value: Any) -> bool:
    from ..dtensor import DTensor
    return isinstance(value, DTensor)
