"""Micro-batches and the shapes that cross stages: splitting a batch (along dim 0, or the dims
of :class:`TensorChunkSpec`) and merging the outputs, and the small integer descriptions
(signatures) of a tuple of tensors that ranks exchange to learn receive shapes.

A signature is ``(count, dtype code, ndim, d0, .., d7, dtype code, ndim, ...)``; it fits the
fixed :data:`HEADER` length (up to :data:`MAX_TENSORS` tensors of at most :data:`MAX_NDIM` dims).

Example::

    mbs = split_microbatches((x, y), 4)              # 4 tuples (x_m, y_m), rows as torch.tensor_split
    split_microbatches(((a, b), {"mask": m}), 2)     # nested tuples, lists and dicts: each Tensor split
    sig = signature(mbs[0]); like_tensors(sig)       # receive templates of those shapes and dtypes
"""
from __future__ import annotations

import copy

from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple

import mindspore as ms
from mindspore import Tensor, ops

from .._mindspore import stride_free_view

__all__ = ["TensorChunkSpec", "BatchDimSpec", "chunk_sizes", "split_microbatches", "split_dims", "merge_chunks",
           "split_args_kwargs_into_chunks", "tree_leaves",
           "tree_unflatten", "signature", "fitting_signature", "like_tensors", "HEADER", "MAX_TENSORS",
           "MAX_NDIM", "as_tuple", "is_float", "stage_outputs"]

MAX_TENSORS, MAX_NDIM = 8, 8
HEADER = 1 + MAX_TENSORS * (2 + MAX_NDIM)
_DTYPES = (ms.float32, ms.float16, ms.bfloat16, ms.float64, ms.int32, ms.int64, ms.uint8, ms.int8, ms.int16, ms.bool_)
_FLOATS = (ms.float32, ms.float16, ms.bfloat16, ms.float64)


def as_tuple(value) -> Tuple:
    """A stage's output as a tuple of tensors."""
    return tuple(value) if isinstance(value, (tuple, list)) else (value,)


def stage_outputs(value: object, stage: int) -> Tuple[Tensor, ...]:
    """A stage's output, to cross to the next stage, as a tuple of Tensors; anything else (a dict,
    a nested tuple, ``None``) raises naming the stage.

    >>> stage_outputs({"h": 1}, 0)
    Traceback (most recent call last):
    ...
    TypeError: stage 0 returned a dict; a stage that is not the last must return a Tensor or a flat tuple / list of Tensors (they cross to the next stage): return (h, mask) rather than a dict or nested tuples
    """
    out = as_tuple(value)
    if isinstance(value, dict) or not all(isinstance(t, Tensor) for t in out):
        kinds = type(value).__name__ if not isinstance(value, (tuple, list)) else \
            f"{type(value).__name__} of {[type(t).__name__ for t in out]}"
        raise TypeError(f"stage {stage} returned a {kinds}; a stage that is not the last must return a Tensor or a "
                        f"flat tuple / list of Tensors (they cross to the next stage): return (h, mask) rather than a "
                        f"dict or nested tuples")
    return out


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
        out = copy.copy(like)          # keeps the dict's type and its settings (a defaultdict's factory)
        for key, item in like.items():
            out[key] = tree_unflatten(item, leaves)
        return out
    return next(leaves)


class TensorChunkSpec:
    """How a Tensor of the batch splits into micro-batches: along ``split_dim`` (PyTorch's
    ``TensorChunkSpec``; a schedule's ``args_chunk_spec`` / ``kwargs_chunk_spec`` /
    ``output_merge_spec``). ``None`` in their place gives the value whole to every micro-batch.

    Args:
        split_dim: the dim to split (and to concatenate outputs along); negative counts from the end.

    Example::

        ScheduleGPipe(stage, 4, loss_fn, args_chunk_spec=(TensorChunkSpec(1),))   # x: (seq, batch, dim)
        TensorChunkSpec.from_tuple((1, 0))            # (TensorChunkSpec(1), TensorChunkSpec(0))
    """

    def __init__(self, split_dim: int) -> None:
        if isinstance(split_dim, bool) or not isinstance(split_dim, int):
            raise TypeError(f"TensorChunkSpec takes an int split_dim, got {split_dim!r}")
        self.split_dim = split_dim

    def __repr__(self) -> str:
        return f"TensorChunkSpec({self.split_dim})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, TensorChunkSpec) and other.split_dim == self.split_dim

    def __hash__(self) -> int:
        return hash(("TensorChunkSpec", self.split_dim))

    @classmethod
    def from_tuple(cls, chunk_dims: Tuple[int, ...]) -> Tuple["TensorChunkSpec", ...]:
        """One spec per positional input, from their split dims.

        Args:
            chunk_dims: a split dim per input.

        Example::

            args_chunk_spec = TensorChunkSpec.from_tuple((0, 1))
        """
        return tuple(cls(d) for d in chunk_dims)

    @classmethod
    def from_dict(cls, chunk_dims: Dict[str, int]) -> Dict[str, "TensorChunkSpec"]:
        """One spec per keyword input, from their split dims.

        Args:
            chunk_dims: a split dim per keyword.

        Example::

            kwargs_chunk_spec = TensorChunkSpec.from_dict({"mask": 1})
        """
        return {k: cls(d) for k, d in chunk_dims.items()}


class BatchDimSpec(TensorChunkSpec):
    """HyperParallel's name of :class:`TensorChunkSpec`: the dim a Tensor of the batch splits along
    (a schedule's ``args_batch_dim`` / ``kwargs_batch_dim``).

    Args:
        batch_dim: the batch dim; negative counts from the end.

    Example::

        ScheduleGPipe(stage, micro_batch_num=4, loss_fn=loss_fn, args_batch_dim=[BatchDimSpec(1)])
        BatchDimSpec.from_tuple((1, 0))               # (BatchDimSpec(1), BatchDimSpec(0))
    """

    def __init__(self, batch_dim: int) -> None:
        if isinstance(batch_dim, bool) or not isinstance(batch_dim, int):
            raise TypeError(f"batch_dim must be int, but got type {type(batch_dim)}.")
        super().__init__(batch_dim)

    @property
    def batch_dim(self) -> int:
        """The batch dim (:attr:`split_dim`)."""
        return self.split_dim

    def __repr__(self) -> str:
        return f"BatchDimSpec({self.split_dim})"

    @classmethod
    def from_tuple(cls, batch_dims: Tuple[int, ...]) -> Tuple["BatchDimSpec", ...]:
        """One spec per positional input.

        Args:
            batch_dims: a batch dim per input (a tuple).

        Example::

            args_batch_dim = BatchDimSpec.from_tuple((0, 1))
        """
        if not isinstance(batch_dims, tuple):
            raise TypeError(f"batch_dims must be tuple, but got type {type(batch_dims)}.")
        return super().from_tuple(batch_dims)

    @classmethod
    def from_dict(cls, batch_dims: Dict[str, int]) -> Dict[str, "BatchDimSpec"]:
        """One spec per keyword input.

        Args:
            batch_dims: a batch dim per keyword (a dict).

        Example::

            kwargs_batch_dim = BatchDimSpec.from_dict({"mask": 1})
        """
        if not isinstance(batch_dims, dict):
            raise TypeError(f"batch_dims must be dict, but got type {type(batch_dims)}.")
        return super().from_dict(batch_dims)


def _dims_of(value: object, spec: Any, what: str) -> List[Optional[int]]:
    """The split dim of each leaf of ``value`` under ``spec``: a :class:`TensorChunkSpec` for all
    its Tensors, ``None`` for none of them, or a structure like ``value``'s with one of those per
    leaf; other leaves are never split."""
    leaves = tree_leaves(value)
    if spec is None or isinstance(spec, TensorChunkSpec):
        specs = [spec] * len(leaves)
    else:
        specs = tree_leaves(spec)
        if len(specs) != len(leaves) or not all(s is None or isinstance(s, TensorChunkSpec) for s in specs):
            raise ValueError(f"{what}: the chunk spec {spec!r} must be a TensorChunkSpec, None, or a structure like the "
                             f"input's with one of those per Tensor ({len(leaves)} leaves)")
    dims: List[Optional[int]] = []
    for leaf, s in zip(leaves, specs):
        if not isinstance(leaf, Tensor) or s is None:
            dims.append(None)
        elif leaf.ndim == 0:
            dims.append(0)                  # no dim to split: the batch check names it
        elif -leaf.ndim <= s.split_dim < leaf.ndim:
            dims.append(s.split_dim % leaf.ndim)
        else:
            raise ValueError(f"{what}: {s!r} does not fit a Tensor of shape {tuple(leaf.shape)}")
    return dims


def split_dims(args: Sequence[object], kwargs: Dict[str, object], args_chunk_spec: Optional[Sequence[Any]],
               kwargs_chunk_spec: Optional[Dict[str, Any]]) -> List[Optional[int]]:
    """The split dim of each leaf of ``args + tuple(kwargs.values())`` (``None``: given whole):
    dim 0 of every Tensor by default, else as the specs say (PyTorch's ``args_chunk_spec`` /
    ``kwargs_chunk_spec``; a keyword the spec does not name splits along dim 0).

    >>> split_dims(("tag",), {}, None, None)
    [None]
    """
    if args_chunk_spec is not None and len(args_chunk_spec) != len(args):
        raise ValueError(f"args_chunk_spec has {len(args_chunk_spec)} entries for {len(args)} positional inputs; give "
                         f"one per input (None: given whole to every micro-batch)")
    unknown = sorted(set(kwargs_chunk_spec or {}) - set(kwargs))
    if unknown:
        raise ValueError(f"kwargs_chunk_spec names {unknown}, which are not keyword inputs of this step "
                         f"({sorted(kwargs)})")
    default = TensorChunkSpec(0)
    dims: List[Optional[int]] = []
    for i, a in enumerate(args):
        dims += _dims_of(a, default if args_chunk_spec is None else args_chunk_spec[i], f"input {i}")
    for k, v in kwargs.items():
        dims += _dims_of(v, (kwargs_chunk_spec or {}).get(k, default), f"keyword input {k!r}")
    return dims


def split_microbatches(values: Sequence[object], n: int, dims: Optional[Sequence[Optional[int]]] = None
                       ) -> List[Tuple[object, ...]]:
    """``n`` tuples like ``values``, the i-th holding the i-th chunk (:func:`chunk_sizes`) of each
    Tensor of ``values``, inside nested tuples, lists and dicts too; any other value goes to every
    micro-batch unchanged (PyTorch's). ``dims``: the split dim of each leaf (:func:`split_dims`;
    ``None`` gives it whole); default dim 0 of every Tensor."""
    values = tuple(values)
    leaves = tree_leaves(values)
    dims = [0 if isinstance(v, Tensor) else None for v in leaves] if dims is None else dims
    chunks = [ops.split(v, chunk_sizes(v.shape[d], n), axis=d) if d is not None else (v,) * n
              for v, d in zip(leaves, dims)]
    return [tree_unflatten(values, iter([c[m] for c in chunks])) for m in range(n)]


def split_args_kwargs_into_chunks(args: Sequence[object], kwargs: Optional[Dict[str, object]], chunks: int,
                                  args_chunk_spec: Optional[Sequence[Any]] = None,
                                  kwargs_chunk_spec: Optional[Dict[str, Any]] = None
                                  ) -> Tuple[List[Tuple[object, ...]], List[Dict[str, object]]]:
    """PyTorch's split of a batch's inputs: ``chunks`` micro-batches of positional arguments (tuples)
    and of keyword arguments (dicts), each Tensor split by its spec (:func:`split_dims`; default
    dim 0, as ``torch.tensor_split``), other values given whole.

    Args:
        args: the positional inputs.
        kwargs: the keyword inputs (``None``: none).
        chunks: the number of micro-batches.
        args_chunk_spec: per positional input, a :class:`TensorChunkSpec`, ``None`` or a structure of them.
        kwargs_chunk_spec: per keyword input, as ``args_chunk_spec``.

    Example::

        args_split, kwargs_split = split_args_kwargs_into_chunks((x,), {"mask": m}, 2)
    """
    kwargs = dict(kwargs or {})
    args = tuple(args)
    dims = split_dims(args, kwargs, args_chunk_spec, kwargs_chunk_spec)
    split = split_microbatches(args + tuple(kwargs.values()), chunks, dims)
    return [mb[:len(args)] for mb in split], [dict(zip(kwargs, mb[len(args):])) for mb in split]


_DEFAULT = TensorChunkSpec(0)


def _merge(items: Sequence[object], spec: Any, where: str) -> object:
    """``items`` (one value per micro-batch, alike) merged under ``spec`` (see :func:`merge_chunks`)."""
    first = items[0]
    if isinstance(first, dict):
        if spec is not None and not isinstance(spec, (dict, TensorChunkSpec)):
            raise ValueError(f"output_merge_spec{where} {spec!r} is a {type(spec).__name__}, but the outputs are a "
                             f"dict; give a dict of TensorChunkSpec per key")
        specs = spec if isinstance(spec, dict) else {}
        unknown = sorted(set(specs) - set(first), key=str)
        if unknown:
            raise ValueError(f"output_merge_spec{where} names {unknown}, which are not keys of the outputs "
                             f"({list(first)})")
        whole = spec if isinstance(spec, TensorChunkSpec) else _DEFAULT
        out = copy.copy(first)          # keeps the dict's type
        for key in first:
            out[key] = _merge([item[key] for item in items], specs.get(key, whole), f"{where}[{key!r}]")
        return out
    if isinstance(first, (tuple, list)):
        if isinstance(spec, dict):
            raise ValueError(f"output_merge_spec{where} {spec!r} is a dict, but the outputs are a "
                             f"{type(first).__name__}")
        size = len(first)
        specs = list(spec) if isinstance(spec, (tuple, list)) else [spec] * size
        if len(specs) != size:
            raise ValueError(f"output_merge_spec{where} has {len(specs)} entries for outputs of {size} elements")
        merged = [_merge([item[i] for item in items], specs[i], f"{where}[{i}]") for i in range(size)]
        return type(first)(*merged) if hasattr(first, "_fields") else type(first)(merged)
    if isinstance(spec, (tuple, list, dict)):
        raise ValueError(f"output_merge_spec{where} {spec!r} is a {type(spec).__name__}, but the outputs are one value")
    if spec is None or not all(isinstance(t, Tensor) and t.ndim > 0 for t in items):
        return list(items)
    if not -first.ndim <= spec.split_dim < first.ndim:
        raise ValueError(f"output_merge_spec{where} {spec!r} does not fit an output of shape {tuple(first.shape)}")
    return ops.cat(items, axis=spec.split_dim % first.ndim)


def merge_chunks(chunks: Sequence[object], chunk_spec: Any = None) -> object:
    """The whole batch's output from its micro-batches' (PyTorch's merge): Tensors concatenated
    along dim 0 or their ``chunk_spec``'s dim, inside nested tuples, lists and dicts too (their
    types kept); 0-d tensors, other values and ``None`` entries of a spec as a list over the
    micro-batches. A spec that does not fit the outputs raises ``ValueError``.

    Args:
        chunks: each micro-batch's output (a Tensor, or a tuple / list / dict of values).
        chunk_spec: a :class:`TensorChunkSpec` (for every Tensor), or a structure like the
            outputs' holding one (or ``None``) per element: a tuple for a tuple output, a dict for a
            dict output (keys it does not name: dim 0); default: dim 0.

    Example::

        whole = merge_chunks([out_0, out_1], TensorChunkSpec(1))       # concatenated along dim 1
        merge_chunks([{"m": a0}, {"m": a1}], {"m": TensorChunkSpec(1)})   # {"m": a0 and a1 along dim 1}
    """
    if not chunks:
        raise ValueError("merge_chunks needs the outputs of at least one micro-batch, got none")
    return _merge(list(chunks), _DEFAULT if chunk_spec is None else chunk_spec, "")


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
    """Receive templates with the shapes and dtypes ``sig`` (a fitting signature) describes: a receive
    reads only a template's shape and dtype, so each is one zero element seen with every stride 0
    (an activation's template allocates nothing)."""
    sig = [int(v) for v in sig]
    out = []
    for i in range(sig[0]):
        code, ndim, *dims = sig[1 + i * (2 + MAX_NDIM): 1 + (i + 1) * (2 + MAX_NDIM)]
        out.append(stride_free_view(ops.zeros((1,), _DTYPES[code]), dims[:ndim]))
    return tuple(out)
