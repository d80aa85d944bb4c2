"""Basic indexing of a DTensor: ``x[1]``, ``x[:, 2:5]``, ``x[..., None]``; ``StridedSlice``, ``Slice``.

``DTensor.__getitem__`` turns the index into a hashable key (ints, slices, ``None``,
``...``) and dispatches it as the op ``GetItem``: a dim kept whole by a slice keeps its
sharding; a dim that is cut or selected by an int is gathered first; ``None`` adds a dim.
Indexing with tensors or lists (advanced indexing) is refused with a clear error.

Example::

    row = x_dt[0]            # x S(1): row S(0), no communication
    head = x_dt[:, :4]       # x S(1): dim 1 gathered first, then cut
"""
from __future__ import annotations

from typing import Any, List, Tuple

from mindspore import Tensor

from ...placement import Placement, Replicate, Shard
from .._registry import register_sharding
from .._schema import OpSchema, OutputSharding, TensorArg
from ._common import layout_like

__all__ = ["GetItem", "index_key", "getitem_rule", "strided_slice_rule", "slice_rule"]

Key = Tuple[tuple, ...]


def index_key(index: Any, ndim: int) -> Key:
    """``index`` as a tuple of ``("int", i)`` / ``("slice", start, stop, step)`` / ``("new",)``,
    one entry per input dim plus the new dims, with ``...`` expanded."""
    items = index if isinstance(index, tuple) else (index,)
    for item in items:
        if not (item is None or item is Ellipsis or isinstance(item, slice)
                or (isinstance(item, int) and not isinstance(item, bool))):
            raise NotImplementedError(
                f"DTensor indexing supports ints, slices, None and ...; got {type(item).__name__} {item!r}. "
                "Call .to_local() or .full_tensor() for advanced indexing")
    if sum(item is Ellipsis for item in items) > 1:
        raise IndexError("an index can only have a single ellipsis ('...')")
    used = sum(1 for item in items if item is not None and item is not Ellipsis)
    if used > ndim:
        raise IndexError(f"too many indices for a {ndim}-D DTensor: {index!r}")
    key: List[tuple] = []
    for item in items:
        if item is Ellipsis:
            key.extend(("slice", None, None, None) for _ in range(ndim - used))
        elif item is None:
            key.append(("new",))
        elif isinstance(item, slice):
            key.append(("slice", item.start, item.stop, item.step))
        else:
            key.append(("int", item))
    consumed = sum(1 for k in key if k[0] != "new")
    key.extend(("slice", None, None, None) for _ in range(ndim - consumed))
    return tuple(key)


def _index_of(key: Key) -> tuple:
    return tuple(None if k[0] == "new" else slice(*k[1:]) if k[0] == "slice" else k[1] for k in key)


class _GetItem:
    """The op ``GetItem(x, key)``: basic indexing of the local piece."""

    name = "GetItem"

    def __call__(self, x: Tensor, key: Key) -> Tensor:
        return Tensor.__getitem__(x, _index_of(key))


GetItem = _GetItem()


def _index_sharding(x: TensorArg, key: Key):
    """(layout ``x`` needs, output layout, output shape, input dims kept whole) for ``x[key]``."""
    moved = {}                       # input dim -> output dim, for dims kept whole
    out_shape: List[int] = []
    dim = 0
    for k in key:
        if k[0] == "new":
            out_shape.append(1)
            continue
        size = x.shape[dim]
        if k[0] == "int":
            if not -size <= k[1] < size:
                raise IndexError(f"index {k[1]} is out of bounds for dim {dim} of size {size}")
        else:
            if k[3] == 0:
                raise ValueError("slice step cannot be zero")
            start, stop, step = slice(*k[1:]).indices(size)
            if (start, stop, step) == (0, size, 1):
                moved[dim] = len(out_shape)
            out_shape.append(len(range(start, stop, step)))
        dim += 1
    need: List[Placement] = []
    out: List[Placement] = []
    for p in x.layout.placements:
        if p.is_shard() and p.dim not in moved:
            need.append(Replicate())
            out.append(Replicate())
        else:
            need.append(p)
            out.append(Shard(moved[p.dim]) if p.is_shard() else p)
    return (layout_like(x.layout, need, ndim=x.ndim), layout_like(x.layout, out, ndim=len(out_shape)),
            tuple(out_shape), tuple(moved))


@register_sharding("GetItem")
def getitem_rule(schema: OpSchema) -> OutputSharding:
    x, key = schema.args[0], schema.args[1]
    need, out, shape, _ = _index_sharding(x, key)
    return OutputSharding((need, None), ((out, shape),))


@register_sharding("StridedSlice")
def strided_slice_rule(schema: OpSchema) -> OutputSharding:
    """``StridedSlice(x, begin, end, strides, begin_mask, end_mask, ellipsis_mask, new_axis_mask,
    shrink_axis_mask)`` (``ops.split`` with sizes, ``ops.strided_slice``); a dim kept whole
    keeps its sharding, and this rank's ``end`` there becomes its local size."""
    x = schema.args[0]
    begin, end, strides = (tuple(schema.args[i]) for i in (1, 2, 3))
    begin_mask, end_mask, ellipsis_mask, new_axis_mask, shrink_mask = (int(v) for v in schema.args[4:9])
    if ellipsis_mask or new_axis_mask:
        raise NotImplementedError("StridedSlice on a DTensor with ellipsis_mask or new_axis_mask: index the "
                                  "DTensor (x[..., None]) or call .to_local()")
    key = []
    for i, (b, e, st) in enumerate(zip(begin, end, strides)):
        if shrink_mask >> i & 1:
            key.append(("int", b))
        else:
            key.append(("slice", None if begin_mask >> i & 1 else b, None if end_mask >> i & 1 else e, st))
    key.extend(("slice", None, None, None) for _ in range(x.ndim - len(key)))
    need, out, shape, whole = _index_sharding(x, tuple(key))

    def local_args(coord):
        local = need.local_shape(x.shape, coord)
        local_end = tuple(local[i] if i in whole else e for i, e in enumerate(end))
        return (None, None, local_end) + (None,) * (len(schema.args) - 3)
    return OutputSharding((need,) + (None,) * (len(schema.args) - 1), ((out, shape),), local_args)


@register_sharding("Slice")
def slice_rule(schema: OpSchema) -> OutputSharding:
    """``Slice(x, begin, size)`` (``ops.slice``; ``ops.split`` into uneven pieces); a size of
    -1 runs to the end. A dim kept whole keeps its sharding, with this rank's size there."""
    x = schema.args[0]
    begin, size = tuple(schema.args[1]), tuple(schema.args[2])
    key = tuple(("slice", b, None if n == -1 else b + n, 1) for b, n in zip(begin, size))
    need, out, shape, whole = _index_sharding(x, key)

    def local_args(coord):
        local = need.local_shape(x.shape, coord)
        return (None, None, tuple(local[i] if i in whole else n for i, n in enumerate(size)))
    return OutputSharding((need, None, None), ((out, shape),), local_args)
