"""Helpers the CPU twins share: a scalar argument's Python value, whether a tensor views part of
a storage.

Example::

    step = int(_host(split_size))        # a Python int or a 0-d Tensor
"""
from __future__ import annotations

from typing import Any

import mindspore as ms

__all__ = ["_host", "_partial_view"]


def _host(value: Any) -> Any:
    return value.item() if isinstance(value, ms.Tensor) else value


def _partial_view(t) -> bool:
    """``t`` is a view on part of a storage (offset, strides, or a slice of a larger buffer); a tensor
    whose storage cannot be asked (not materialized) is not: the method itself handles it, as before."""
    try:
        return t.storage_offset() != 0 or not t.is_contiguous() or t.untyped_storage().nbytes() != t.nbytes
    except (RuntimeError, TypeError, ValueError):
        return False
