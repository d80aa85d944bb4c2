"""State-dict values as pieces of global tensors, and writing loaded data back in place.

A value may be a DTensor (also a ``Parameter`` made from one), a ``Parameter`` placed by
a parallel style or by fully_shard (its :func:`~hyper_parallel_ms.nn.parameter_sharding`
record), a :class:`ShardedTensor` (a local tensor with the spec of the tensor it is a piece
of: optimizer moments), a plain ``Tensor``/``Parameter``/numpy array (the whole tensor), or
any other (non-tensor) value. Nested dicts and lists holding tensors are flattened with
``"."``-joined keys, as in PyTorch's distributed checkpoint.

Example::

    refs, values = flatten({"model": {"w": param}, "step": 3})
    refs["model.w"].piece.offsets          # this rank's box of the global tensor
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Dict, List, Tuple, Union

import mindspore as ms
import numpy as np
from mindspore import Tensor

from ..dtensor import DTensor
from ..dtensor._dtensor import _local_view
from ..dtensor._spec import DTensorSpec
from ..fsdp._param import note_piece_written
from ..nn import parameter_sharding
from .._mindspore import fill_deferred, no_grad, pending_init
from ._metadata import CheckpointError
from ._boxes import Piece

__all__ = ["ShardedTensor", "TensorRef", "ValueRef", "flatten", "is_tensor_like", "to_numpy", "cast_for_load",
           "loads_into"]


@dataclass(frozen=True, eq=False)
class ShardedTensor:
    """This rank's piece of a global tensor, for optimizer moments (laid out as their parameters)
    and host copies of sharded values.

    Args:
        local: this rank's piece (a Tensor, or a numpy host copy).
        spec: the ``DTensorSpec`` of the global tensor (mesh, layout, global shape).

    Example::

        moment = ShardedTensor(optimizer.moment1[0], parameter_sharding(model.fc.weight).spec)
    """

    local: Union[Tensor, np.ndarray]
    spec: DTensorSpec


def is_tensor_like(value: Any) -> bool:
    return isinstance(value, (Tensor, np.ndarray, ShardedTensor))


@dataclass(frozen=True, eq=False)
class TensorRef:
    """A tensor of the flattened state dict: its ``piece`` (box) and the object holding it."""

    piece: Piece
    target: Any                      # Tensor / Parameter / DTensor / ShardedTensor / np.ndarray
    spec: Union[DTensorSpec, None]

    def local_numpy(self) -> np.ndarray:
        """This rank's piece as a numpy array (Partial DTensors are reduced first)."""
        return to_numpy(_local_of(self.target))

    def assign(self, data: np.ndarray) -> None:
        """Write ``data`` (the piece's shape and dtype) into the target, in place. A Parameter
        built under ``no_init_parameters()`` counts as initialised by it (``init_parameters`` leaves
        it alone), and a fully_shard unit holding it drops the values it gathered ahead (unshard)."""
        local = _local_of(self.target)
        if isinstance(local, np.ndarray):
            local[...] = data
            return
        if pending_init(local) is not None:
            fill_deferred(local, np.asarray(data, order="C"))
        else:
            # from_numpy shares the buffer (no copy); copy_ writes into the tensor's own storage, not
            # recorded for autodiff (loading is no step of training; with loss.backward() enabled a
            # recorded in-place write into a parameter is refused)
            with no_grad():
                _local_view(local).copy_(Tensor.from_numpy(np.asarray(data, order="C")))
        note_piece_written(local)


@dataclass(frozen=True, eq=False)
class ValueRef:
    """A non-tensor value and where it sits (``container[index]``)."""

    value: Any
    container: Union[dict, list]
    index: Union[str, int]


def to_numpy(t: Union[Tensor, np.ndarray]) -> np.ndarray:
    return t if isinstance(t, np.ndarray) else _local_view(t).asnumpy() if isinstance(t, DTensor) else t.asnumpy()


def _local_of(target: Any) -> Union[Tensor, np.ndarray]:
    if isinstance(target, ShardedTensor):
        return target.local
    if isinstance(target, DTensor):
        return _local_view(target)
    return target


def _describe(key: str, value: Any, *, for_save: bool) -> TensorRef:
    spec = None
    if isinstance(value, DTensor):
        if value._dt_spec.layout.partial_dims():
            if not for_save:
                raise CheckpointError(f"tensor {key!r} is a Partial DTensor ({value._dt_spec.layout}); load into a "
                                      "Replicate or Shard layout")
            value = value.reduce_partial()
        spec = value._dt_spec
    elif isinstance(value, ShardedTensor):
        spec = value.spec
    elif isinstance(value, Tensor) and parameter_sharding(value) is not None:
        spec = parameter_sharding(value).spec
    dtype = _dtype_name(key, value)
    if spec is None:
        shape = tuple(int(s) for s in _local_of(value).shape)
        return TensorRef(Piece(key, shape, dtype, (0,) * len(shape), shape), value, None)
    if spec.layout.partial_dims():
        raise CheckpointError(f"tensor {key!r} has Partial placements {spec.layout}: reduce it (reduce_partial) "
                              "before saving")
    coord = spec.mesh.coordinate
    if coord is None:
        raise CheckpointError(f"tensor {key!r}: this rank is not in its mesh {spec.mesh!r}")
    offsets = spec.layout.global_offset(spec.shape, coord)
    sizes = spec.layout.local_shape(spec.shape, coord)
    local_shape = tuple(int(s) for s in _local_of(value).shape)
    if local_shape != sizes:
        raise CheckpointError(f"tensor {key!r}: local piece has shape {local_shape} but its layout {spec.layout} "
                              f"of global shape {spec.shape} gives this rank {sizes}")
    return TensorRef(Piece(key, tuple(spec.shape), dtype, tuple(offsets), tuple(sizes)), value, spec)


def _dtype_name(key: str, value: Any) -> str:
    local = _local_of(value)
    if isinstance(local, np.ndarray):
        return local.dtype.name
    if not isinstance(local, Tensor):
        raise CheckpointError(f"tensor {key!r}: unsupported value of type {type(local).__name__}")
    if local.dtype not in _NUMPY_NAMES:
        raise CheckpointError(f"tensor {key!r}: dtype {local.dtype} cannot be checkpointed")
    return _NUMPY_NAMES[local.dtype]


_NUMPY_NAMES = {ms.float64: "float64", ms.float32: "float32", ms.float16: "float16", ms.bfloat16: "bfloat16",
                ms.int64: "int64", ms.int32: "int32", ms.int16: "int16", ms.int8: "int8", ms.uint8: "uint8",
                ms.bool_: "bool"}


_FLOAT_NAMES = ("float64", "float32", "float16", "bfloat16")


def loads_into(source: str, target: str) -> bool:
    """Whether a tensor of dtype ``source`` loads into a target of dtype ``target`` (numpy names):
    the same dtype, or both floating (cast on load).

    >>> loads_into("float32", "bfloat16"), loads_into("float32", "int32")
    (True, False)
    """
    return source == target or (source in _FLOAT_NAMES and target in _FLOAT_NAMES)


def cast_for_load(key: str, data: np.ndarray, dtype: str, where: str = "the checkpoint") -> np.ndarray:
    """``data`` (a loaded tensor) in the target's dtype ``dtype`` (a numpy dtype name): floating
    tensors are cast (rounded to nearest even, as PyTorch's ``copy_`` in a load), other dtypes must
    match. ``where`` names the source in the error.

    Example:
        >>> cast_for_load("w", np.ones((2,), np.float32), "float16").dtype
        dtype('float16')
    """
    if data.dtype.name == dtype:
        return data
    if loads_into(data.dtype.name, dtype):
        target = {name: t for t, name in _NUMPY_NAMES.items()}[dtype]
        return Tensor(np.asarray(data, order="C")).astype(target).asnumpy()
    raise CheckpointError(f"tensor {key!r}: {where} holds {data.dtype.name}, the target is {dtype}; a load casts "
                          f"between floating dtypes only: give the tensor dtype {dtype}, or the target {data.dtype.name}")


def flatten(state_dict: Dict[str, Any], *, for_save: bool) -> Tuple[Dict[str, TensorRef], Dict[str, ValueRef]]:
    """Flat key -> :class:`TensorRef` and flat key -> :class:`ValueRef` of a (nested) state dict."""
    if not isinstance(state_dict, dict):
        raise TypeError(f"state_dict must be a dict, got {type(state_dict).__name__}")
    tensors: Dict[str, TensorRef] = {}
    values: Dict[str, ValueRef] = {}
    _walk(state_dict, "", tensors, values, for_save)
    return tensors, values


def _walk(node: Union[dict, list], prefix: str, tensors: Dict[str, TensorRef], values: Dict[str, ValueRef],
          for_save: bool) -> None:
    items: List[Tuple[Any, Any]] = list(node.items()) if isinstance(node, dict) else list(enumerate(node))
    for index, value in items:
        if isinstance(node, dict) and not isinstance(index, str):
            raise CheckpointError(f"state dict keys must be strings, got {index!r} under {prefix or 'the root'!r}")
        key = f"{prefix}{index}"
        if key in tensors or key in values:
            raise CheckpointError(f"two state dict entries flatten to the key {key!r}")
        if is_tensor_like(value):
            tensors[key] = _describe(key, value, for_save=for_save)
        elif isinstance(value, dict) or (isinstance(value, list) and any(_holds_tensor(v) for v in value)):
            _walk(value, key + ".", tensors, values, for_save)
        elif isinstance(value, tuple) and any(_holds_tensor(v) for v in value):
            raise CheckpointError(f"state dict entry {key!r} is a tuple holding tensors; use a list or dict "
                                  "(tuples cannot be filled in place)")
        else:
            if for_save:
                try:
                    json.dumps(value)
                except (TypeError, ValueError) as exc:
                    raise CheckpointError(f"state dict value {key!r} of type {type(value).__name__} is neither a "
                                          f"tensor nor JSON-serialisable ({exc})") from exc
            values[key] = ValueRef(value, node, index)


def _holds_tensor(value: Any) -> bool:
    if is_tensor_like(value):
        return True
    if isinstance(value, dict):
        return any(_holds_tensor(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return any(_holds_tensor(v) for v in value)
    return False
