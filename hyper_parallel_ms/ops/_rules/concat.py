"""Joins and splits: ``Concat`` (cat), ``StackExt`` / ``Stack`` (stack) and the splits (``Split``,
``SplitWithSize``, ``SplitTensor``, ``Chunk``: equal or uneven pieces).

The inputs of a join are brought to one placement per mesh dim: a dim sharded in any input (other
than the joined dim of a cat) shards all of them, Partial(sum) in every input stays Partial, anything
else is replicated; a cat gathers its joined dim, a stack shifts the sharded dims at or after the
new one. Splitting a dim gathers it (the pieces cut across shard boundaries); the other dims keep
their placements.

Example::

    y = ops.cat([a_dt, b_dt], axis=1)       # a, b S(0): y S(0), no communication
"""
from __future__ import annotations

from typing import List, Optional, Sequence, Tuple

from ...placement import Placement, Replicate, Shard
from .._registry import register_sharding
from .._schema import OpSchema, OutputSharding, TensorArg
from ._common import gathered_on, ints, layout_like

__all__ = ["split_sizes"]


def _joined_placements(tensors: Sequence[TensorArg], joined_dim: Optional[int]) -> List[Placement]:
    """Per mesh dim, the placement every input of a cat / stack is brought to: a dim other
    than ``joined_dim`` sharded in any input shards all of them; Partial(sum) of every input
    stays Partial; anything else is Replicate."""
    need: List[Placement] = []
    for axis in range(len(tensors[0].layout.mesh_shape)):
        here = [t.layout.placements[axis] for t in tensors]
        shards = [p for p in here if p.is_shard() and p.dim != joined_dim]
        if shards:
            need.append(shards[0])
        elif all(p.is_partial("sum") for p in here):
            need.append(here[0])
        else:
            need.append(Replicate())
    return need


def _split_args(schema: OpSchema) -> Tuple[List[TensorArg], list]:
    return ([a for a in schema.args if isinstance(a, TensorArg)],
            [a for a in schema.args if not isinstance(a, TensorArg)])


@register_sharding("Concat", "Cat")
def concat_rule(schema: OpSchema) -> OutputSharding:
    """``ops.cat(tensors, dim)``: the tensors arrive as consecutive arguments, then ``dim``;
    ``dim`` itself is gathered."""
    tensors, rest = _split_args(schema)
    dim = (rest[0] if rest and isinstance(rest[0], int) else int(schema.kwarg("dim", 0))) % tensors[0].ndim
    out_shape = list(tensors[0].shape)
    out_shape[dim] = sum(t.shape[dim] for t in tensors)
    need = _joined_placements(tensors, dim)
    layout = layout_like(tensors[0].layout, need, ndim=len(out_shape))
    inputs = tuple(layout_like(a.layout, need, ndim=a.ndim) if isinstance(a, TensorArg) else None
                   for a in schema.args)
    return OutputSharding(inputs, ((layout, tuple(out_shape)),))


@register_sharding("StackExt", "Stack")
def stack_rule(schema: OpSchema) -> OutputSharding:
    """``mint.stack(tensors, dim)``: a new dim at ``dim``; sharded dims at or after it shift by one."""
    tensors, rest = _split_args(schema)
    if len({t.shape for t in tensors}) != 1:
        raise ValueError(f"{schema.op}: stacked tensors must have one shape, got {[t.shape for t in tensors]}")
    ndim = tensors[0].ndim + 1
    dim = (rest[0] if rest and isinstance(rest[0], int) else int(schema.kwarg("dim", schema.attr("axis", 0)))) % ndim
    need = _joined_placements(tensors, None)
    out = [Shard(p.dim + (p.dim >= dim)) if p.is_shard() else p for p in need]
    out_shape = tensors[0].shape[:dim] + (len(tensors),) + tensors[0].shape[dim:]
    inputs = tuple(layout_like(a.layout, need, ndim=a.ndim) if isinstance(a, TensorArg) else None
                   for a in schema.args)
    return OutputSharding(inputs, ((layout_like(tensors[0].layout, out, ndim=ndim), out_shape),))


def split_sizes(length: int, schema: OpSchema) -> Tuple[int, ...]:
    """The piece sizes along the split dim, by the op's own convention."""
    op, arg = schema.op, schema.args[1]
    if op == "Split":                                   # Split(x, axis, output_num): equal pieces
        count = int(schema.args[2])
        if length % count:
            raise ValueError(f"Split: dim of size {length} does not split into {count} equal pieces")
        return (length // count,) * count
    if op.startswith("SplitWithSize"):                  # explicit sizes
        sizes = ints(arg)
        if sum(sizes) != length:
            raise ValueError(f"{op}: sizes {sizes} do not add up to the dim size {length}")
        return sizes
    if op.startswith("SplitTensor"):                    # pieces of ``arg`` elements, the last smaller
        size = int(arg)
        return tuple(min(size, length - start) for start in range(0, length, size)) or (0,)
    chunks = int(arg)                                   # Chunk: torch.chunk's ceil-sized pieces
    size = -(-length // chunks)
    return tuple(min(size, length - start) for start in range(0, length, size)) if size else (0,) * chunks


@register_sharding("Split", "SplitWithSize", "SplitWithSizeView", "SplitTensor", "SplitTensorView",
                   "Chunk", "ChunkView")
def split_rule(schema: OpSchema) -> OutputSharding:
    """``split`` / ``chunk`` into equal or uneven pieces; the split dim is gathered, the other
    placements are kept. ``Split(x, axis, n)``; the others ``(x, sizes | size | chunks, dim)``."""
    x = schema.args[0]
    if schema.op == "SplitWithSizeView":
        # measured on CPU (tests/test_silent_cases.py): when two of its pieces are used, the
        # gradient MindSpore's view machinery hands back for a DTensor's pieces is read at wrong
        # offsets (the same ops on plain tensors are right), whatever kernel runs the pieces
        raise NotImplementedError(
            f"mint.split with a list of sizes {list(ints(schema.args[1]))} on a DTensor: MindSpore's backward of "
            "this view op (SplitWithSizeView) gives its pieces wrong gradients there; use x.split(sizes, dim) or "
            "ops.split(x, sizes, dim): the same values, with a right gradient")
    if schema.op == "Split":
        axis = int(schema.args[1])
    else:
        axis = int(schema.args[2]) if len(schema.args) > 2 else int(schema.kwarg("dim", 0))
    axis %= x.ndim
    layout = gathered_on(x.layout, axis, x.ndim)
    pieces = []
    sizes = split_sizes(x.shape[axis], schema)
    for size in sizes:
        shape = list(x.shape)
        shape[axis] = size
        pieces.append((layout, tuple(shape)))
    return OutputSharding((layout,) + (None,) * (len(schema.args) - 1), tuple(pieces))
