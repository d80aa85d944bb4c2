"""CPU twins: compositions of ops that MindSpore's CPU backend has, put in place of the
primitives it has no CPU kernel for, so that models written for Ascend (MindFormers') run on CPU
ranks in tests.

Inside ``with cpu_twins():`` each primitive class below computes through its twin in PyNative,
whatever name reached it (``mint.full``, ``ops.rms_norm``, a ``FlashAttentionScore`` instance a
Cell built before the block): the twin replaces the class's ``__call__`` and the block restores
it. Each twin is the operator's formula; autodiff differentiates the composition. Refused: a
device target other than CPU (on Ascend the real kernels run), and options a twin does not
compute (named in the error). For tests only: nothing in the library enters it.

| primitive | what calls it | twin |
| --- | --- | --- |
| ``FillScalar`` | ``mint.full`` | ``numpy.full`` (a Tensor fill value: broadcast) |
| ``TrilExt`` | ``mint.tril`` | select by a lower-triangular mask |
| ``IndexSelect`` | ``mint.index_select`` | ``ops.gather`` |
| ``Arange`` | ``mint.arange`` | ``numpy.arange`` |
| ``Outer`` | ``mint.outer`` | column times row |
| ``RmsNorm`` | ``ops.rms_norm`` | ``x * rsqrt(mean(x^2) + eps) * gamma`` in fp32, and ``rstd`` |
| ``Embedding`` | ``mint.nn.functional.embedding`` | ``ops.gather`` (no gradient at ``padding_idx``) |
| ``FlashAttentionScore`` | ``ops.flash_attention_score`` | softmax(scale q k^T + shift, masked) v in fp32; \
DTensor arguments: the op's sharding rule, then the twin on each rank's pieces |
| ``ZerosLikeExt`` / ``OnesLikeExt`` | ``mint.zeros_like`` / ``mint.ones_like`` | ``ops.zeros`` / ``ops.ones`` |
| ``SplitTensorView`` / ``SplitWithSizeView`` | ``mint.split`` | ``mint.narrow`` pieces (MindSpore 2.10's CPU \
backward of these views misplaces a gradient that is itself a view: ``cat((b, a))`` of the pieces) |
| ``ScatterAddExt`` | ``mint.scatter_add`` | ``ops.tensor_scatter_elements(..., reduction="add")`` |
| ``InnerCommAllReduce`` / ``InnerCommAllGather`` / ``InnerCommReduceScatter`` | ``ops.communication``'s \
``all_reduce`` / ``all_gather_into_tensor`` / ``reduce_scatter_tensor`` (not in place) | this library's \
``comm`` collectives on the group's ranks (synchronous) |
| ``InnerCommAllToAllV`` | ``ops.communication``'s ``all_to_all_single`` / ``all_to_all`` (not in place) | \
this library's ``comm.all_to_all_single`` on the flat elements (uneven splits; backward: the splits swapped) |
| ``DistCommAllReduce`` | ``mint.distributed.all_reduce`` (in place) | ``comm.all_reduce``, written into the input |
| ``TopkExt`` / ``SortExt`` / ``ArgSort`` | ``mint.topk`` / ``mint.sort`` / ``mint.argsort`` | a stable order on the \
host (ties: the lower index first; ``sorted=False`` answers sorted), values by ``ops.gather_elements`` \
(differentiable) |
| ``HistcExt`` | ``mint.histc`` | ``numpy.bincount`` of the bins (outside ``[min, max]``: not counted; ``max`` \
in the last bin), in the input's dtype |
| ``CumsumExt`` | ``mint.cumsum`` | ``ops.cumsum``, cast to ``dtype`` |
| ``GroupedMatmul`` | ``ops.grouped_matmul`` (``split_item=3, group_type=0``: rows grouped by the cumulative \
``group_list``; ``split_item=0``: a list of matmuls) | one matmul per group on its rows, concatenated |
| ``MoeTokenPermute`` / ``MoeTokenUnpermute`` | ``ops.moe_token_permute`` / ``ops.moe_token_unpermute`` \
(no dropping, not padded) | a stable sort of the flattened expert ids on the host, rows by ``ops.gather`` \
(the second output: each (token, slot)'s row) / rows gathered back, weighted by ``probs`` and summed over top-k |
| ``Tensor.scatter_`` / ``Tensor.add_`` / ``Tensor.mul_`` / ``mint.floor_divide`` / ``mint.repeat_interleave`` | C++ \
methods and functions, no Python primitive call: the Python names are replaced (``Tensor``'s methods, \
``mindspore.mint``'s functions) | ``ops.tensor_scatter_elements`` written back with ``copy_`` / the sum, the \
product written back with ``copy_`` (MindSpore 2.10's CPU ``add_`` / ``mul_`` return it without writing it) / ``ops.floor_div`` / ``ops.gather`` of the \
repeated indices |
| ``Mm`` / ``Addmm`` / ``BatchMatMulExt`` / ``Baddbmm`` | ``mint.mm`` / ``mint.addmm`` / ``mint.bmm`` / ``mint.baddbmm`` | ``beta * input + alpha * (a @ b)`` computed in float32 for float16 / bfloat16 operands (as the kernels accumulate), in the operands' dtype otherwise, returned in the input's dtype |
| ``StackExt`` | ``mint.stack`` | ``ops.stack`` (bfloat16 through float32: exact) |
| ``LinalgVectorNorm`` | ``mint.norm`` / ``mint.linalg.vector_norm`` | ``sqrt(sum(x^2))`` for ``ord=2``, ``sum(abs(x)^p)^(1/p)``, ``max`` / ``min`` of ``abs(x)`` for ``inf`` / ``-inf``, the nonzero count for ``0``; in ``dtype`` when given |
| ``AddcmulExt`` | ``mint.addcmul`` (MindFormers' AdamW) | ``input + tensor1 * tensor2 * value`` in the input's dtype |
| ``Tensor.fill_`` / ``Tensor.zero_`` | C++ methods (MindFormers' initialisation of norms and biases; no CPU kernel) | ``ops.fill`` / ``ops.zeros`` written back with ``copy_``; a DTensor's piece likewise (MindFormers' initialisation of a tensor-parallel model; a Partial DTensor's ``fill_`` is refused) |
| ``InplaceNormal`` | ``Tensor.normal_`` (MindFormers' parameter initialisation) | numpy's normal draws seeded by (seed, offset), written in place: deterministic, not the device generator's values |
| ``Clone`` / ``Tensor.clone`` | ``mint.clone`` / ``Tensor.clone`` (a C++ method) | ``ops.deepcopy`` (bfloat16 through float32: exact); a ``Parameter`` keeps ``Parameter.clone`` (a DTensor parameter's class puts ``Tensor`` first) |
| ``Tensor.copy_`` | ``Tensor.copy_`` (a C++ method) | into a view (storage offset, strides, or part of a larger storage): ``self[...] = src`` (MindSpore 2.10's CPU ``InplaceCopy`` writes nothing into ``a[2:4]``, measured, and refuses a source that is such a view); a source view is first copied whole; else the method itself |
| ``Tensor.__mul__`` | ``*`` of a 0-d float tensor and a tensor of another float dtype | the product computed in float32 (float64 if either is) and returned in the dimensioned tensor's dtype, as MindSpore infers it (the CPU ``Mul`` kernel has no float32 x bfloat16 -> bfloat16 entry) |
| ``DistCommAllGatherIntoTensor`` | ``mint.distributed.all_gather_into_tensor`` (in place) | ``comm.all_gather`` on the group's ranks, written into the output (synchronous: the handle's ``wait`` returns at once) |
| ``DistCommBatchIsendIrecv`` | ``mint.distributed.batch_isend_irecv`` (``P2POp`` lists) | this library's ``comm.send`` of every ``isend`` in order, then ``comm.recv`` of every ``irecv`` in order, written into its tensor (synchronous; relies on the CPU backend buffering sends, as ``comm.send`` states) |

Example::

    from hyper_parallel_ms.testing import cpu_twins
    with cpu_twins():
        model = PyNativeQwen3ForCausalLM(config)      # its FlashAttentionScore, RmsNorm, ... run on CPU
        loss = model(input_ids=ids, labels=labels)
"""
from __future__ import annotations

import contextlib
import threading
from typing import Any, Callable, Dict, Iterator, Tuple

import mindspore as ms
import numpy as np
from mindspore import mint, ops

from ._twin_values import _ORIGINALS, _axis, _copy, _host, _wide
from ._twins_methods import (_tensor_add_, _tensor_clone, _tensor_copy_, _tensor_fill_, _tensor_mul, _tensor_mul_,
                             _tensor_scatter_, _tensor_zero_)
from ._twins_attention import _flash_attention_score
from ._twins_comm import (_all_gather, _all_reduce, _all_to_all_v, _dist_all_gather_into_tensor, _dist_all_reduce,
                          _dist_batch_isend_irecv, _reduce_scatter)

__all__ = ["cpu_twins", "TWINS"]

_LOCK = threading.Lock()
_DEPTH = [0]
_SAVED: Dict[type, Any] = {}
_SAVED_METHODS: Dict[str, Any] = {}
_ABSENT = object()
# twins put in place of a Python name (a C++ tensor method, a C++ overloaded function), not of a primitive
_ATTRIBUTES: Dict[str, Tuple[Any, str]] = {"Tensor.scatter_": (ms.Tensor, "scatter_"),
                                           "Tensor.add_": (ms.Tensor, "add_"),
                                           "Tensor.mul_": (ms.Tensor, "mul_"),
                                           "Tensor.fill_": (ms.Tensor, "fill_"),
                                           "Tensor.zero_": (ms.Tensor, "zero_"),
                                           "mint.floor_divide": (mint, "floor_divide"),
                                           "mint.repeat_interleave": (mint, "repeat_interleave"),
                                           "Tensor.clone": (ms.Tensor, "clone"),
                                           "Tensor.copy_": (ms.Tensor, "copy_"),
                                           "Tensor.__mul__": (ms.Tensor, "__mul__")}


def _fill_scalar(self, size, fill_value, dtype=None):
    if dtype is None:
        dtype = ms.bool_ if isinstance(_host(fill_value), (bool, np.bool_)) else ms.float32
    shape = tuple(int(_host(s)) for s in size)
    if isinstance(fill_value, ms.Tensor):                         # keeps the fill value's gradient
        return ops.broadcast_to(fill_value.astype(dtype).reshape(()), shape)
    return ms.Tensor(np.full(shape, fill_value), dtype)


def _tril(self, input, diagonal=0):  # noqa: A002 - MindSpore's argument name
    rows, cols = input.shape[-2:]
    keep = ms.Tensor(np.tril(np.ones((rows, cols), dtype=bool), int(_host(diagonal))))
    return ops.select(ops.broadcast_to(keep, input.shape), input, ops.zeros_like(input))


def _index_select(self, input, dim, index):  # noqa: A002
    return ops.gather(input, index, int(_host(dim)))


def _arange(self, start=0, end=None, step=1, dtype=None):
    start, end, step = _host(start), _host(end), _host(step)
    if end is None:
        start, end = 0, start
    if dtype is None:
        dtype = ms.int64 if all(isinstance(v, (int, np.integer)) for v in (start, end, step)) else ms.float32
    return ms.Tensor(np.arange(start, end, step), dtype)


def _outer(self, input, vec2):  # noqa: A002
    return mint.mul(input.reshape(-1, 1), vec2.reshape(1, -1))


def _rms_norm(self, x, gamma, epsilon=1e-6):
    axes = tuple(range(x.ndim - gamma.ndim, x.ndim))
    x32 = x.astype(ms.float32)
    rstd = ops.rsqrt(mint.mean(x32 * x32, dim=axes, keepdim=True) + float(_host(epsilon)))
    y = (x32 * rstd * gamma.astype(ms.float32)).astype(x.dtype)
    return y, rstd


def _embedding(self, input, weight, padding_idx=None, max_norm=None, norm_type=2.0, scale_grad_by_freq=False):  # noqa: A002
    if max_norm is not None or scale_grad_by_freq:
        raise ValueError("cpu_twins: the Embedding twin computes neither max_norm nor scale_grad_by_freq; "
                         "pass max_norm=None, scale_grad_by_freq=False, or run on Ascend")
    rows = ops.gather(weight, input, 0)
    if padding_idx is None:
        return rows
    padding = ops.expand_dims(input == int(_host(padding_idx)), -1)
    return ops.select(ops.broadcast_to(padding, rows.shape), ops.stop_gradient(rows), rows)


def _zeros_like(self, input, dtype=None):  # noqa: A002
    return ops.zeros(input.shape, input.dtype if dtype is None else dtype)


def _ones_like(self, input, dtype=None):  # noqa: A002
    return ops.ones(input.shape, input.dtype if dtype is None else dtype)


def _scatter_add(self, input, dim, index, src):  # noqa: A002
    dim = int(_host(dim))
    if tuple(src.shape) != tuple(index.shape):                          # only index's part of src is added
        src = src[tuple(slice(0, n) for n in index.shape)]
    return ops.tensor_scatter_elements(input, index, src, axis=dim, reduction="add")


def _split_view(self, input, split_size, dim=0):  # noqa: A002
    dim = int(_host(dim))
    length = input.shape[dim]
    if isinstance(split_size, (list, tuple)):
        sizes = [int(_host(n)) for n in split_size]
    else:
        step = int(_host(split_size))
        sizes = [min(step, length - start) for start in range(0, length, step)]
    starts = np.cumsum([0] + sizes[:-1])
    return tuple(mint.narrow(input, dim, int(start), n) for start, n in zip(starts, sizes))


def _order(input, dim: int, descending: bool) -> np.ndarray:  # noqa: A002
    """Stable order along ``dim`` (ties: the lower index first, either direction), on the host."""
    values = input.asnumpy()
    if values.ndim == 0:
        return np.zeros((), np.int64)
    if values.dtype == np.bool_:
        values = values.astype(np.int8)
    key = -values.astype(np.float64) if descending else values
    return np.argsort(key, axis=dim, kind="stable").astype(np.int64)


def _picked(input, index: np.ndarray, dim: int):  # noqa: A002
    """``input``'s elements at ``index`` along ``dim``, differentiable with respect to ``input``."""
    if input.ndim == 0:
        return input
    return ops.gather_elements(input, dim, ms.Tensor(index))


def _topk(self, input, k, dim=-1, largest=True, sorted=True):  # noqa: A002
    dim, k = _axis(dim, input.ndim), int(_host(k))
    length = input.shape[dim] if input.ndim else 1
    if not 0 <= k <= length:
        raise ValueError(f"cpu_twins: topk k={k} is out of range for {length} elements along dim {dim}")
    index = np.take(_order(input, dim, bool(largest)), np.arange(k), axis=dim) if input.ndim else _order(input, 0, True)
    return _picked(input, index, dim), ms.Tensor(index)


def _sort(self, input, dim=-1, descending=False, stable=False):  # noqa: A002
    dim = _axis(dim, input.ndim)
    index = _order(input, dim, bool(descending))
    return _picked(input, index, dim), ms.Tensor(index)


def _argsort(self, input, dim=-1, descending=False, stable=False):  # noqa: A002
    return ms.Tensor(_order(input, _axis(dim, input.ndim), bool(descending)))


def _histc(self, input, bins=100, min=0, max=0):  # noqa: A002 - MindSpore's argument names
    values = input.asnumpy().astype(np.float64).reshape(-1)
    bins, low, high = int(_host(bins)), float(_host(min)), float(_host(max))
    if bins <= 0:
        raise ValueError(f"cpu_twins: histc bins must be positive, got {bins}")
    if low == high == 0.0 and values.size:
        low, high = float(values.min()), float(values.max())
    if low == high:
        low, high = low - 1.0, high + 1.0
    if low > high:
        raise ValueError(f"cpu_twins: histc min {low} is larger than max {high}")
    inside = values[(values >= low) & (values <= high)]
    which = np.minimum(((inside - low) * bins / (high - low)).astype(np.int64), bins - 1)
    return ms.Tensor(np.bincount(which, minlength=bins).astype(ms.dtype_to_nptype(input.dtype)))


def _cumsum(self, input, dim, dtype=None):  # noqa: A002
    out = ops.cumsum(input, _axis(dim, input.ndim))
    return out if dtype is None else out.astype(dtype)


def _floor_divide(input, other):  # noqa: A002
    """``mint.floor_divide``: a C++ overloaded function (no Python primitive call to replace)."""
    return ops.floor_div(input, _host(other) if not isinstance(other, ms.Tensor) else other)


def _moe_token_permute(self, tokens, indices, num_out_tokens=None, padded_mode=False):
    if padded_mode or num_out_tokens is not None:
        raise ValueError("cpu_twins: the MoeTokenPermute twin permutes every token (num_out_tokens=None, "
                         "padded_mode=False); run on Ascend for token dropping")
    experts = indices.asnumpy().astype(np.int64)
    top_k = 1 if experts.ndim == 1 else experts.shape[1]
    order = np.argsort(experts.reshape(-1), kind="stable")                 # ties: token-major order
    where = np.empty_like(order)
    where[order] = np.arange(order.size)                                   # each (token, slot)'s row
    return ops.gather(tokens, ms.Tensor((order // top_k).astype(np.int64)), 0), ms.Tensor(where.astype(np.int32))


def _moe_token_unpermute(self, permuted_tokens, sorted_indices, probs=None, padded_mode=False, restore_shape=None):
    if padded_mode:
        raise ValueError("cpu_twins: the MoeTokenUnpermute twin takes padded_mode=False; run on Ascend")
    rows = ops.gather(permuted_tokens, sorted_indices.reshape(-1).astype(ms.int64), 0)
    if probs is None:
        return rows
    tokens, top_k = probs.shape
    weighted = rows.reshape(tokens, top_k, -1) * probs.astype(rows.dtype).reshape(tokens, top_k, 1)
    return weighted.sum(1)


def _repeat_interleave(input, repeats, dim=None, output_size=None):  # noqa: A002
    """``mint.repeat_interleave``: a C++ overloaded function (no Python primitive call to replace)."""
    if dim is None:
        input, dim = input.reshape(-1), 0                                   # noqa: A001
    dim = _axis(dim, input.ndim)
    length = input.shape[dim]
    counts = np.asarray(repeats.asnumpy() if isinstance(repeats, ms.Tensor) else repeats, np.int64).reshape(-1)
    counts = np.broadcast_to(counts, (length,)) if counts.size == 1 else counts
    if counts.size != length or np.any(counts < 0):
        raise ValueError(f"cpu_twins: repeat_interleave takes one non-negative repeat count or {length}, got "
                         f"{counts.tolist()}")
    index = np.repeat(np.arange(length), counts)
    if output_size is not None and int(_host(output_size)) != index.size:
        raise ValueError(f"cpu_twins: repeat_interleave output_size {int(_host(output_size))} is not the "
                         f"{index.size} elements the repeats give")
    return ops.gather(input, ms.Tensor(index.astype(np.int64)), dim)


def _grouped_matmul(self, x, weight, bias=None, scale=None, offset=None, antiquant_scale=None, antiquant_offset=None,
                    group_list=None):
    if any(v is not None for v in (bias, scale, offset, antiquant_scale, antiquant_offset)):
        raise ValueError("cpu_twins: the GroupedMatmul twin computes x @ weight only (no bias, quantisation or "
                         "antiquantisation); run on Ascend for those")
    split_item, group_type = int(_host(self.split_item)), int(_host(self.group_type))
    if self.transpose_a:
        raise ValueError("cpu_twins: the GroupedMatmul twin does not compute transpose_a=True; run on Ascend")

    def matmul(a, w):
        return mint.matmul(a, mint.transpose(w, -1, -2) if self.transpose_b else w)
    if split_item == 0 and group_type == -1:
        if len(x) != len(weight):
            raise ValueError(f"cpu_twins: GroupedMatmul split_item=0 takes as many x as weights, got {len(x)} "
                             f"and {len(weight)}")
        return tuple(matmul(a, w) for a, w in zip(x, weight))
    if split_item != 3 or group_type != 0:
        raise ValueError(f"cpu_twins: GroupedMatmul takes split_item=0 with group_type=-1, or split_item=3 with "
                         f"group_type=0; got split_item={split_item}, group_type={group_type}")
    if group_list is None or len(x) != 1 or len(weight) != 1:
        raise ValueError("cpu_twins: GroupedMatmul split_item=3 takes one x, one 3-d weight and group_list")
    (a,), (w,) = x, weight
    ends = np.asarray(group_list.asnumpy() if isinstance(group_list, ms.Tensor) else group_list, np.int64).reshape(-1)
    if w.ndim != 3 or ends.shape[0] != w.shape[0]:
        raise ValueError(f"cpu_twins: GroupedMatmul group_list has one cumulative row count per weight "
                         f"(weight {tuple(w.shape)}), got {ends.shape[0]}")
    starts = np.concatenate([[0], ends[:-1]])
    if np.any(ends < starts) or ends[-1] != a.shape[0]:
        raise ValueError(f"cpu_twins: GroupedMatmul group_list must be non-decreasing cumulative row counts "
                         f"ending at x's {a.shape[0]} rows, got {ends.tolist()}")
    pieces = [matmul(mint.narrow(a, 0, int(start), int(end - start)), w[e])
              for e, (start, end) in enumerate(zip(starts, ends)) if end > start]
    if not pieces:
        return (ops.zeros((0, w.shape[1] if self.transpose_b else w.shape[2]), a.dtype),)
    return (pieces[0] if len(pieces) == 1 else ops.cat(pieces, 0),)


def _addmm_twin(product: Callable, input, a, b, beta, alpha):  # noqa: A002
    wide = _wide(input, a, b)
    out = product(a.astype(wide), b.astype(wide))
    alpha, beta = _host(alpha), _host(beta)
    out = out if alpha == 1 else out * alpha
    if beta != 0:
        out = out + (input.astype(wide) if beta == 1 else input.astype(wide) * beta)
    return out.astype(input.dtype)


def _mm(self, input, mat2):  # noqa: A002
    wide = _wide(input, mat2)
    return ops.matmul(input.astype(wide), mat2.astype(wide)).astype(input.dtype)


def _addmm(self, input, mat1, mat2, beta=1, alpha=1):  # noqa: A002
    return _addmm_twin(ops.matmul, input, mat1, mat2, beta, alpha)


def _bmm(self, input, mat2):  # noqa: A002
    wide = _wide(input, mat2)
    return ops.bmm(input.astype(wide), mat2.astype(wide)).astype(input.dtype)


def _baddbmm(self, input, batch1, batch2, beta=1, alpha=1):  # noqa: A002
    return _addmm_twin(ops.bmm, input, batch1, batch2, beta, alpha)


def _stack(self, tensors, dim=0):
    tensors = list(tensors)
    if tensors and tensors[0].dtype == ms.bfloat16:
        return ops.stack([t.astype(ms.float32) for t in tensors], int(_host(dim))).astype(ms.bfloat16)
    return ops.stack(tensors, int(_host(dim)))


def _vector_norm(self, x, ord=2, dim=None, keepdim=False, dtype=None):  # noqa: A002 - MindSpore's names
    ord = float(_host(ord))
    x = x.astype(dtype) if dtype is not None else x
    dims = None if dim is None else tuple(_axis(d, x.ndim) for d in ((dim,) if isinstance(dim, int) else dim))
    magnitude = ops.abs(x)
    if ord == float("inf"):
        return ops.amax(magnitude, dims, keepdim)
    if ord == float("-inf"):
        return ops.amin(magnitude, dims, keepdim)
    if ord == 0:
        return ops.sum((x != 0).astype(x.dtype), dims, keepdim)
    if ord == 2:
        return ops.sqrt(ops.sum(x * x, dims, keepdim))
    return ops.pow(ops.sum(ops.pow(magnitude, ord), dims, keepdim), 1.0 / ord)


def _inplace_normal(self, input, mean, std, seed, offset):  # noqa: A002 - MindSpore's names
    """``Tensor.normal_``: draws from numpy's generator seeded by (seed, offset), written in place: the
    same values for the same seed and offset (not the device generator's values)."""
    rng = np.random.default_rng([int(_host(seed)), int(_host(offset))])
    values = rng.normal(float(_host(mean)), float(_host(std)), tuple(input.shape))
    return input.copy_(ms.Tensor(values.astype(np.float32)).astype(input.dtype))


def _addcmul(self, input, tensor1, tensor2, value=1):  # noqa: A002 - MindSpore's names
    value = _host(value)
    return (input + (tensor1 * tensor2) * value).astype(input.dtype)


def _clone(self, input):  # noqa: A002
    return _copy(input)


_PYBOOST_CLASSES = {"RmsNorm": "_PyboostRmsNormPrim", "StackExt": "_PyboostStackExtPrim"}   # ops.rms_norm's, mint.stack's


def _primitive_classes() -> Dict[str, type]:
    """The primitive class of each twin of :data:`TWINS` that replaces a primitive (the others replace
    the Python names of :data:`_ATTRIBUTES`)."""
    from mindspore.ops.auto_generate import gen_ops_prim, pyboost_inner_prim
    return {name: getattr(pyboost_inner_prim, _PYBOOST_CLASSES[name]) if name in _PYBOOST_CLASSES
            else getattr(gen_ops_prim, name) for name in TWINS if name not in _ATTRIBUTES}


TWINS: Dict[str, Callable] = {
    "FillScalar": _fill_scalar, "TrilExt": _tril, "IndexSelect": _index_select, "Arange": _arange,
    "Outer": _outer, "RmsNorm": _rms_norm, "Embedding": _embedding, "FlashAttentionScore": _flash_attention_score,
    "ZerosLikeExt": _zeros_like, "OnesLikeExt": _ones_like, "ScatterAddExt": _scatter_add,
    "SplitTensorView": _split_view, "SplitWithSizeView": _split_view,
    "InnerCommAllReduce": _all_reduce, "InnerCommAllGather": _all_gather, "InnerCommReduceScatter": _reduce_scatter,
    "InnerCommAllToAllV": _all_to_all_v, "TopkExt": _topk, "SortExt": _sort, "ArgSort": _argsort, "HistcExt": _histc,
    "CumsumExt": _cumsum, "GroupedMatmul": _grouped_matmul,
    "DistCommAllReduce": _dist_all_reduce, "Tensor.scatter_": _tensor_scatter_, "Tensor.add_": _tensor_add_,
    "Tensor.mul_": _tensor_mul_,
    "mint.floor_divide": _floor_divide, "mint.repeat_interleave": _repeat_interleave,
    "MoeTokenPermute": _moe_token_permute, "MoeTokenUnpermute": _moe_token_unpermute,
    "Mm": _mm, "Addmm": _addmm, "BatchMatMulExt": _bmm, "Baddbmm": _baddbmm, "StackExt": _stack,
    "LinalgVectorNorm": _vector_norm, "AddcmulExt": _addcmul, "InplaceNormal": _inplace_normal,
    "Tensor.fill_": _tensor_fill_, "Tensor.zero_": _tensor_zero_, "Clone": _clone, "Tensor.clone": _tensor_clone, "Tensor.copy_": _tensor_copy_,
    "Tensor.__mul__": _tensor_mul, "DistCommAllGatherIntoTensor": _dist_all_gather_into_tensor,
    "DistCommBatchIsendIrecv": _dist_batch_isend_irecv,
}


@contextlib.contextmanager
def cpu_twins() -> Iterator[Tuple[str, ...]]:
    """Run the primitives of :data:`TWINS` as CPU compositions inside the block (PyNative, CPU only).

    Yields the names of the primitives replaced. Re-entrant; the outermost block restores the
    primitives. Refused on a device target other than CPU.

    Example::

        with cpu_twins():
            y = mindspore.mint.arange(4)            # Arange has no CPU kernel in MindSpore 2.10
    """
    from .._mindspore import process_device_target
    target = process_device_target()
    if target != "CPU":
        raise RuntimeError(f"cpu_twins() is for tests on CPU ranks; the device target is {target!r}, "
                           f"whose own kernels run these primitives")
    with _LOCK:
        if _DEPTH[0] == 0:
            for name, cls in _primitive_classes().items():
                _SAVED[cls] = cls.__dict__["__call__"]
                cls.__call__ = TWINS[name]
            for key, (owner, name) in _ATTRIBUTES.items():   # C++ methods and functions: their Python names
                _SAVED_METHODS[key] = owner.__dict__.get(name, _ABSENT)
                _ORIGINALS[key] = getattr(owner, name)
                setattr(owner, name, TWINS[key])
        _DEPTH[0] += 1
    try:
        yield tuple(TWINS)
    finally:
        with _LOCK:
            _DEPTH[0] -= 1
            if _DEPTH[0] == 0:
                for cls, call in _SAVED.items():
                    cls.__call__ = call
                _SAVED.clear()
                for key, method in _SAVED_METHODS.items():
                    owner, name = _ATTRIBUTES[key]
                    if method is _ABSENT:
                        delattr(owner, name)
                    else:
                        setattr(owner, name, method)
                _SAVED_METHODS.clear()
