"""Exact all-reduce sums of every dtype over MCCL's float32 ``AllReduce``.

MindSpore's CPU all-reduce carries float32 and float16 only. Other dtypes travel as float32
values that the float32 sum keeps exact:

- integers (int8, int16, int32, int64, uint8): each value is cut into ``w``-bit limbs
  (bitwise and / arithmetic right shift; the top limb keeps the sign), the limbs are
  stacked on a new leading axis and all-reduced as float32, and the limb sums are recombined
  with carries in int64 (Horner: ``((s3 * 2**w + s2) * 2**w + s1) * 2**w + s0``). With ``g``
  ranks a limb sum is below ``g * 2**w`` in magnitude; ``w = 16`` while ``g <= 256`` and
  ``w = 8`` beyond keep every limb sum under float32's 24-bit mantissa, so the integer sum is
  exact (negative values included; a sum outside the dtype's range wraps as integer sums do).
  int32 moves 2 float32 limbs per value (8 bytes), int64 4 (16 bytes), int8/int16/uint8 one.
- bool: the float32 sum of 0/1 counts the ``True`` ranks (exact below 2**24 ranks); a
  nonzero count is ``True``: a bool sum is a logical or, as in PyTorch.
- float64, in PyNative: the 64 bits of each value move as an int64 (``Tensor.view``),
  bit-exact. Inside ``ms.jit``, where MindSpore cannot reinterpret bits, each value moves as
  five float32 by arithmetic alone: the exponent ``e`` (``floor(log2|x|)``, corrected by one
  where rounding missed), the significand ``x / 2**e`` in [1, 2) cut into three float32
  (24 + 24 + 5 of its 53 bits), and a slot for inf / nan and the sign of zero (scaling by
  ``2**e`` in two halves keeps the largest values exact). Every normal value, +-0 and +-inf
  come back bit for bit, NaN as NaN (payload bits not kept); subnormals (below 2.2e-308) can
  come back as 0, because MindSpore's CPU float64 kernels flush them to zero in some paths
  (measured: ``a * a`` of ``2**-537`` gives 0 on a 2-element tensor). Both forms are exact
  when at most one rank contributes a nonzero value per element, which is how every
  data-moving collective (gather, broadcast, all-to-all, the slots of max/min) uses the
  all-reduce. A true float64 sum is never formed from them: :func:`sum_over` gathers the
  pieces into slots that way and adds them locally in float64, in rank order.
- bfloat16 travels widened to float32 (exact, both ways).

:func:`place_over` is the all-reduce of buffers in which each element comes from one rank
(zeros elsewhere); :func:`sum_over` the reduction ``sum``. For float32 and float16 both are
``ops.AllReduce`` itself.

Example (two ranks, group ``g``)::

    total = sum_over(ms.Tensor([2**31 - 1, -7], ms.int64), g)   # [2**32 - 2, -14], exact
"""
from __future__ import annotations

from typing import Tuple
import mindspore as ms
from mindspore import nn, ops

from .._mindspore import cached_in_python, cell_per_call_site, is_compiling, run_in_python
from ._tensor import pad_slot

__all__ = ["INTEGER_DTYPES", "WIRE_DTYPES", "check_dtype", "place_over", "sum_over", "wire_sum", "wire_itemsize",
           "limb_width"]

WIRE_DTYPES = (ms.float32, ms.float16)
INTEGER_DTYPES = (ms.int8, ms.int16, ms.int32, ms.int64, ms.uint8)
_BITS = {ms.int8: 8, ms.int16: 16, ms.int32: 32, ms.int64: 64, ms.uint8: 8}


@cached_in_python
def _all_reduce_sum_prim(group_name: str):
    return ops.AllReduce(ops.ReduceOp.SUM, group_name)


class _GraphSum(nn.Cell):
    """``ops.AllReduce`` sum with its own backward (the all-reduce of the gradient). In a GRAPH_MODE
    Cell, MindSpore 2.10 differentiates the bare primitive wrongly when its output is read twice:
    ``y = AllReduce(x); (y * y).sum()`` gives twice the gradient (``ms.jit`` and PyNative are right;
    measured: ``tests/test_comm.py``)."""

    def __init__(self, group_name: str) -> None:
        super().__init__()
        self.reduce = ops.AllReduce(ops.ReduceOp.SUM, group_name)

    def construct(self, x):
        return self.reduce(x)

    def bprop(self, x, out, dout):
        return (self.reduce(dout),)


@cell_per_call_site
def _graph_sum(group_name: str) -> _GraphSum:
    return _GraphSum(group_name)


@run_in_python
def _in_graph_mode() -> bool:
    """Whether a GRAPH_MODE Cell is being compiled (not an ``ms.jit`` function in PyNative)."""
    return is_compiling() and ms.get_context("mode") == ms.GRAPH_MODE


def wire_sum(x, group_name: str):
    """All-reduce sum of a tensor of a dtype the wire carries (float32 / float16), with the right
    gradient in every mode (GRAPH_MODE Cells through :class:`_GraphSum`).

    Example::

        total = wire_sum(x, group.name)       # x: float32
    """
    if _in_graph_mode():
        return _graph_sum(group_name)(x)
    return _all_reduce_sum_prim(group_name)(x)


def limb_width(group_size: int) -> int:
    """Bits per limb so that ``group_size`` limb sums stay below 2**24 (exact in float32).

    >>> limb_width(256), limb_width(257)
    (16, 8)
    """
    return 16 if group_size * (2 ** 16 - 1) < 2 ** 24 else 8


def _limb_count(dtype, group_size: int) -> int:
    return -(-_BITS[dtype] // limb_width(group_size))


def wire_itemsize(dtype, itemsize: int, group_size: int, compiled: bool = False) -> int:
    """Bytes per element that the float32 all-reduce carries for ``dtype`` (``compiled``:
    inside ``ms.jit``, where float64 moves as five float32).

    >>> wire_itemsize(ms.int32, 4, 2), wire_itemsize(ms.int64, 8, 2), wire_itemsize(ms.float64, 8, 2)
    (8, 16, 16)
    >>> wire_itemsize(ms.float64, 8, 2, compiled=True)
    20
    """
    if dtype in WIRE_DTYPES:
        return itemsize
    if dtype in INTEGER_DTYPES:
        return 4 * _limb_count(dtype, group_size)
    if dtype == ms.float64:
        return 4 * _FLOAT64_PARTS if compiled else wire_itemsize(ms.int64, 8, group_size)
    return 4          # bool, bfloat16: one float32 per element


@cached_in_python
def _limbs_of(dtype, group_size: int) -> Tuple[int, int]:
    """(limb base 2**w, number of limbs); evaluated in Python, also under ms.jit."""
    return 2 ** limb_width(group_size), _limb_count(dtype, group_size)


def _integer_sum(x, group):
    base, count = _limbs_of(x.dtype, group.size)
    width = base.bit_length() - 1
    value = x.astype(ms.int64)
    limbs = []
    for _ in range(count - 1):     # bit operations: CPU floor_mod/floor_div on int64 round through float64
        limbs.append(ops.bitwise_and(value, base - 1).astype(ms.float32))
        value = ops.bitwise_right_shift(value, width)
    limbs.append(value.astype(ms.float32))                  # the top limb keeps the sign
    sums = _all_reduce_sum_prim(group.name)(ops.stack(limbs))
    total = sums[count - 1].astype(ms.int64)
    for k in range(count - 2, -1, -1):
        total = total * base + sums[k].astype(ms.int64)
    return total if x.dtype == ms.int64 else total.astype(x.dtype)


_FLOAT64_PARTS = 5      # inside ms.jit: three significand parts, the exponent, inf / nan / sign of zero


def _times_power_of_two(x, k):
    """``x * 2**k`` for integral float64 ``k`` in [-1100, 1100], exact where the result is
    representable: two factors, each a normal float64."""
    half = ops.floor(k / 2)
    two = ops.fill(ms.float64, x.shape, 2.0)
    return x * ops.pow(two, half) * ops.pow(two, k - half)


def _float64_parts(x):
    """float64 ``x`` as a float32 tensor of shape ``(5,) + x.shape``, exact (see the module
    docstring); zeros everywhere for +0, so that summing one rank's parts with other ranks'
    zeros keeps them."""
    finite = ops.isfinite(x)
    nonzero = ops.logical_and(finite, x != 0)
    size = ops.where(nonzero, ops.abs(x), ops.ones(x.shape, ms.float64))
    exponent = ops.floor(ops.log2(size))
    significand = _times_power_of_two(size, -exponent)
    exponent = exponent + (significand >= 2).astype(ms.float64) - (significand < 1).astype(ms.float64)
    significand = ops.where(nonzero, _times_power_of_two(size, -exponent), ops.zeros(x.shape, ms.float64))
    significand = ops.where(x < 0, -significand, significand)
    high = significand.astype(ms.float32)
    rest = significand - high.astype(ms.float64)
    middle = rest.astype(ms.float32)
    low = (rest - middle.astype(ms.float64)).astype(ms.float32)
    negative_zero = ops.logical_and(x == 0, ops.reciprocal(x) < 0)
    exponent = ops.where(nonzero, exponent, negative_zero.astype(ms.float64))
    special = ops.where(finite, ops.zeros(x.shape, ms.float64), x).astype(ms.float32)
    return ops.stack([high, middle, low, exponent.astype(ms.float32), special])


def _float64_from_parts(parts):
    """The inverse of :func:`_float64_parts`."""
    high, middle, low, exponent, special = (parts[i] for i in range(_FLOAT64_PARTS))
    significand = high.astype(ms.float64) + middle.astype(ms.float64) + low.astype(ms.float64)
    value = _times_power_of_two(significand, exponent.astype(ms.float64))
    zero = ops.where(exponent > 0, ops.fill(ms.float64, value.shape, -0.0), ops.zeros(value.shape, ms.float64))
    value = ops.where(high == 0, zero, value)
    is_special = ops.logical_or(special != 0, ops.isnan(special))
    return ops.where(is_special, special.astype(ms.float64), value)


class _PlaceFloat64(nn.Cell):
    """float64 buffers with one contributing rank per element (bit patterns in PyNative,
    float32 parts inside ms.jit).
    Backward: the adjoint of an all-reduce sum, the float64 sum of the gradients."""

    def __init__(self, group) -> None:
        super().__init__()
        self.group = group

    def construct(self, x):
        return _place_float64(x, self.group)

    def bprop(self, x, out, dout):
        return (_float64_sum(dout, self.group),)


@cell_per_call_site
def _place_float64_cell(group) -> _PlaceFloat64:
    return _PlaceFloat64(group)


@run_in_python
def _compiling() -> bool:
    return is_compiling()


def _place_float64(x, group):
    if _compiling():
        return _float64_from_parts(_all_reduce_sum_prim(group.name)(_float64_parts(x)))
    return _integer_sum(x.view(ms.int64), group).view(ms.float64)


def _float64_sum(x, group):
    slots = pad_slot(x.expand_dims(0), 0, group.rank, group.size - 1 - group.rank)
    gathered = _place_float64(slots, group)
    total = gathered[0]
    for r in range(1, group.size):
        total = total + gathered[r]
    return total


def check_dtype(dtype) -> None:
    """Raise ``TypeError`` for a dtype the CPU collectives cannot carry (checked while planning).

    >>> check_dtype(ms.int64)
    """
    if dtype not in WIRE_DTYPES + INTEGER_DTYPES + (ms.bool_, ms.bfloat16, ms.float64):
        raise TypeError(f"collectives on CPU carry float16/32/64, bfloat16, int8/16/32/64, uint8 and bool "
                        f"tensors, got {dtype}; cast the tensor to one of these first")


def place_over(x, group):
    """All-reduce sum of a buffer where each element is nonzero on at most one rank
    (a gather's slots): bit-exact for every supported dtype."""
    if x.dtype in WIRE_DTYPES:
        return wire_sum(x, group.name)
    if x.dtype == ms.float64:
        return _place_float64_cell(group)(x)
    return sum_over(x, group)


def sum_over(x, group):
    """All-reduce sum over ``group``: exact for integers, a logical or for bool, float64
    added locally in rank order, bfloat16 through float32."""
    dtype = x.dtype
    if dtype in WIRE_DTYPES:
        return wire_sum(x, group.name)
    if dtype in INTEGER_DTYPES:
        return _integer_sum(x, group)
    if dtype == ms.bool_:
        return _all_reduce_sum_prim(group.name)(x.astype(ms.float32)) > 0
    if dtype == ms.bfloat16:
        return wire_sum(x.astype(ms.float32), group.name).astype(ms.bfloat16)
    check_dtype(dtype)
    return _float64_sum(x, group)
