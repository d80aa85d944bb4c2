"""The CPU twins of MindSpore's C++ tensor methods (no Python primitive call to replace: ``cpu_twins``
puts them in place of the methods' Python names): in-place writes MindSpore 2.10's CPU backend does not
make (``add_``, ``mul_``, ``fill_``, ``zero_``, ``scatter_``, ``copy_`` into a view), ``clone`` and mixed-dtype
``__mul__``. A DTensor keeps the method it had (this library's dispatcher places its in-place ops).

Example::

    with cpu_twins():
        counts.add_(ones)          # written into counts on CPU
"""
from __future__ import annotations

import mindspore as ms
import numpy as np
from mindspore import ops

from ._twin_values import _ORIGINALS, _axis, _copy, _dtensor, _host, _partial_view, _wide

__all__ = ["_tensor_add_", "_tensor_mul_", "_tensor_fill_", "_tensor_zero_", "_tensor_scatter_", "_tensor_clone",
           "_tensor_copy_", "_tensor_mul"]


def _tensor_add_(self, other, *, alpha=1):
    """``Tensor.add_``: MindSpore 2.10's CPU backend returns the sum without writing it into the tensor.
    A DTensor keeps the method it had (this library's dispatcher places its in-place ops)."""
    if _dtensor(self):
        return _ORIGINALS["Tensor.add_"](self, other, alpha=alpha)
    alpha = _host(alpha)
    return self.copy_((self + (other if alpha == 1 else other * alpha)).astype(self.dtype))


def _tensor_mul_(self, other):
    """``Tensor.mul_``: MindSpore 2.10's CPU backend returns the product without writing it into the tensor
    (MindFormers' gradient clipping scales the gradients with it). A DTensor keeps its method."""
    if _dtensor(self):
        return _ORIGINALS["Tensor.mul_"](self, other)
    return self.copy_((self * other).astype(self.dtype))


def _tensor_fill_(self, value):
    """``Tensor.fill_`` (a number or a one-element tensor): no CPU kernel in MindSpore 2.10. A DTensor's
    piece is filled (every placement holds the value: a Partial one is refused)."""
    if _dtensor(self):
        _refuse_partial_fill(self)
        _tensor_fill_(self.to_local(), value)
        return self
    return self.copy_(ops.fill(self.dtype, tuple(self.shape), _host(value)))


def _tensor_zero_(self):
    """``Tensor.zero_``: no CPU kernel in MindSpore 2.10 (a DTensor: its piece)."""
    if _dtensor(self):
        _tensor_zero_(self.to_local())
        return self
    return self.copy_(ops.zeros(tuple(self.shape), self.dtype))


def _refuse_partial_fill(tensor) -> None:
    """Refuse filling a DTensor with a Partial placement (each rank's piece would hold the value: their sum is
    not it)."""
    if any(p.is_partial() for p in tensor.placements):
        raise ValueError(f"fill_ of a DTensor with a Partial placement {tuple(tensor.placements)}: the ranks' "
                         f"pieces would sum to a multiple of the value; redistribute it to Replicate or Shard first")


def _tensor_scatter_(self, dim, index, src, *, reduce=None):
    """``Tensor.scatter_``: a method of MindSpore's C++ tensor (no Python primitive call to replace).
    A DTensor keeps the method it had (this library's dispatcher places its in-place ops)."""
    if _dtensor(self):
        extra = {} if reduce is None else {"reduce": reduce}
        return _ORIGINALS["Tensor.scatter_"](self, dim, index, src, **extra)
    if reduce is not None:
        raise ValueError("cpu_twins: the Tensor.scatter_ twin writes values only (reduce=None); run on Ascend")
    dim = _axis(dim, self.ndim)
    if isinstance(src, ms.Tensor):
        source = src[tuple(slice(0, n) for n in index.shape)].astype(self.dtype)
    else:
        source = ms.Tensor(np.full(tuple(index.shape), src), self.dtype)
    wire = ms.int32 if self.dtype == ms.bool_ else self.dtype
    out = ops.tensor_scatter_elements(self.astype(wire), index, source.astype(wire), axis=dim)
    return self.copy_(out.astype(self.dtype))


def _tensor_clone(self, *args, **kwargs):
    """``Tensor.clone``: a C++ method (the ``Clone`` primitive's Python call is not reached)."""
    if isinstance(self, ms.Parameter):                 # a DTensor parameter's class lists Tensor before Parameter
        return ms.Parameter.clone(self, *args, **kwargs)
    if _dtensor(self):
        return _ORIGINALS["Tensor.clone"](self, *args, **kwargs)
    return _copy(self)


def _tensor_copy_(self, src, *args, **kwargs):
    """``Tensor.copy_``: MindSpore 2.10's CPU ``InplaceCopy`` assumes whole buffers; a DTensor keeps its method."""
    if _dtensor(self):
        return _ORIGINALS["Tensor.copy_"](self, src, *args, **kwargs)
    if isinstance(src, ms.Tensor) and not _dtensor(src) and _partial_view(src):
        src = _copy(src)
    if _partial_view(self):
        self[...] = src.astype(self.dtype) if isinstance(src, ms.Tensor) else src
        return self
    return _ORIGINALS["Tensor.copy_"](self, src, *args, **kwargs)


def _tensor_mul(self, other):
    """``Tensor.__mul__``: a 0-d float tensor times a tensor of another float dtype (MindSpore infers the
    dimensioned tensor's dtype; the CPU kernel lacks the mixed entry), else the method itself."""
    original = _ORIGINALS["Tensor.__mul__"]
    if (isinstance(other, ms.Tensor) and not _dtensor(self) and not _dtensor(other) and self.dtype != other.dtype
            and (self.ndim == 0) != (other.ndim == 0) and self.dtype.is_floating_point
            and other.dtype.is_floating_point):
        wide, result = _wide(self, other), (other if self.ndim == 0 else self).dtype
        return original(self.astype(wide), other.astype(wide)).astype(result)
    return original(self, other)
