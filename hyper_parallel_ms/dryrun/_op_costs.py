"""What one op costs a shape-only step: the tensors its backward keeps (:func:`saved_tensors`, the
activations among them :func:`saved_activations`) and its matmul FLOPs (:func:`matmul_flops`), by
MindSpore primitive name. :mod:`._autodiff` charges them as the simulated step runs.

Example::

    kept = saved_activations("MatMulExt", [a, w], [out])       # the activation input a
"""
from __future__ import annotations

from math import prod
from typing import Any, List, Sequence

from mindspore import Tensor

from ._abstract import AbstractTensor, flags_of, is_abstract

__all__ = ["saved_activations", "saved_tensors", "matmul_flops", "MATMULS", "is_activation"]

_VIEWS = ("Reshape", "View", "Transpose", "TransposeView", "DeprecatedTranspose", "TransposeExtView", "TransposeExt",
          "ExpandDims", "ExpandDimsView", "Unsqueeze", "Squeeze", "Flatten", "FlattenExt", "GetItem", "StridedSlice",
          "Slice", "Narrow", "NarrowView", "Split", "SplitWithSize", "SplitWithSizeView", "SplitTensor",
          "SplitTensorView", "Concat", "Cat", "StackExt", "Stack", "BroadcastTo", "BroadcastToView", "Expand",
          "ExpandAs", "Tile", "Repeat", "Unstack", "UnstackExtView", "UnstackExt", "TExt", "Clone")
_LINEAR = ("AddExt", "Add", "BiasAdd", "SubExt", "Sub", "AddScalar", "SubScalar", "Neg", "Muls", "Divs", "Cast",
           "ToDtype", "SumExt", "DeprecatedSum", "ReduceSum", "MeanExt", "DeprecatedMean", "ReduceMean", "ZerosLike",
           "OnesLike", "ZerosLikeExt", "OnesLikeExt", "FullLike", "EmptyLike", "NewZeros", "NewOnes")
_SAVES_NOTHING = frozenset(_VIEWS + _LINEAR)
_SAVES_OUTPUT = frozenset({"Softmax", "LogSoftmax", "LogSoftmaxExt", "Exp", "Sigmoid", "Tanh", "Rsqrt", "Sqrt",
                           "Reciprocal"})


def saved_activations(op: str, inputs: Sequence[Tensor], outputs: Sequence[Tensor]) -> List[Tensor]:
    """The activations (batch-dependent tensors) ``op`` keeps for its backward: none for views,
    additions, casts and sums; its output for softmax-like ops whose gradient reads it; else its
    activation inputs (the batch-dependent ones of :func:`saved_tensors`).

    Args:
        op: the primitive's name, as :func:`saved_tensors` takes it.
        inputs: the op's tensor arguments.
        outputs: the op's results.

    >>> import mindspore as ms
    >>> a = AbstractTensor((2, 3), ms.float32)
    >>> [t.shape for t in saved_activations("MatMulExt", [a, AbstractTensor((3, 4), ms.float32)], [])]
    [(2, 3), (3, 4)]
    >>> saved_activations("AddExt", [a, a], [a])
    []
    """
    return [t for t in saved_tensors(op, inputs, outputs) if is_activation(t)]


def saved_tensors(op: str, inputs: Sequence[Tensor], outputs: Sequence[Tensor]) -> List[Tensor]:
    """Every tensor ``op`` keeps for its backward, activations and weights alike (what MindSpore's
    saved-tensor hooks see: a matmul keeps both operands, fully_shard's gathered weight included).

    Args:
        op: the primitive's name.
        inputs: its tensor arguments.
        outputs: its results.

    >>> import mindspore as ms
    >>> a = AbstractTensor((2, 3), ms.float32)
    >>> len(saved_tensors("MatMulExt", [a, a], [a])), saved_tensors("Reshape", [a], [a])
    (2, [])
    """
    if op in _SAVES_NOTHING:
        return []
    chosen = outputs if op in _SAVES_OUTPUT else inputs
    return [t for t in chosen if isinstance(t, Tensor)]


MATMULS = frozenset({"MatMul", "MatMulExt", "BatchMatMul", "BatchMatMulExt", "Mm", "Dense", "BMM", "Bmm"})


def matmul_flops(a: Tensor, out: Tensor) -> int:
    """Multiply-adds times two of a matmul of ``a`` (``..., m, k`` or transposed) giving ``out``
    (``..., m, n``): ``2 numel(out) k`` with ``k = numel(a) n / numel(out)``.

    Args:
        a: the first operand.
        out: the result.

    >>> import mindspore as ms
    >>> matmul_flops(AbstractTensor((4, 3), ms.float32), AbstractTensor((4, 5), ms.float32))
    120
    """
    size = prod(tuple(out.shape))
    if not size or not out.shape:
        return 0
    return 2 * size * (prod(tuple(a.shape)) * tuple(out.shape)[-1] // size)


def is_activation(t: Any) -> bool:
    """Whether ``t`` is a shape-only activation (batch-dependent, not a parameter's data)."""
    return isinstance(t, Tensor) and is_abstract(t) and flags_of(t)[1]
