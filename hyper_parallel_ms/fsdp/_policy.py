"""MixedPrecisionPolicy: the dtypes fully_shard gathers parameters in and reduces gradients in.

The pieces (what the optimizer updates) keep their own dtype (fp32); ``param_dtype`` is
the dtype of the gathered parameters the forward computes with, ``reduce_dtype`` that of
the gradient reduction, ``output_dtype`` that of the sharded Cell's floating outputs, and
``cast_forward_inputs`` casts floating inputs to ``param_dtype``.

Example:
    >>> import mindspore as ms
    >>> MixedPrecisionPolicy(param_dtype=ms.bfloat16, reduce_dtype=ms.float32).param_dtype
    mindspore.bfloat16
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import mindspore as ms

__all__ = ["MixedPrecisionPolicy", "OffloadPolicy", "CPUOffloadPolicy"]

FLOATS = (ms.float16, ms.bfloat16, ms.float32, ms.float64)


@dataclass(frozen=True)
class MixedPrecisionPolicy:
    """Like ``torch.distributed.fsdp.MixedPrecisionPolicy``; ``None`` keeps the piece's dtype.

    Args:
        param_dtype: the dtype pieces are gathered in (the forward's compute dtype); pieces stay in theirs.
        reduce_dtype: the dtype gradients are reduced in.
        output_dtype: the dtype a sharded Cell's floating outputs are cast to.
        cast_forward_inputs: cast floating inputs to ``param_dtype`` (refused in compiled code:
            use ``False`` and cast in the model).
        apply_grad_on_fp32_main_grad: HyperParallel's: the gradients handed back are float32 (its
            fp32 "main grad"). Gradients here have their pieces' dtype, so ``fully_shard`` requires
            float32 pieces with it (refused otherwise, naming the parameters).

    Example::

        fully_shard(model, mp_policy=MixedPrecisionPolicy(param_dtype=ms.bfloat16, reduce_dtype=ms.float32))
    """

    param_dtype: Optional[Any] = None
    reduce_dtype: Optional[Any] = None
    output_dtype: Optional[Any] = None
    cast_forward_inputs: bool = True
    apply_grad_on_fp32_main_grad: bool = False

    def __post_init__(self) -> None:
        for field in ("param_dtype", "reduce_dtype", "output_dtype"):
            dtype = getattr(self, field)
            named = getattr(ms, dtype, None) if isinstance(dtype, str) else dtype
            if dtype is not None and named not in FLOATS:
                raise TypeError(f"MixedPrecisionPolicy: {field} must be None or a floating dtype (ms.float16, "
                                f"ms.bfloat16, ms.float32, ms.float64), got {dtype!r}: the gathered parameters, "
                                "reduced gradients and outputs are floating")
        if not isinstance(self.apply_grad_on_fp32_main_grad, bool):
            raise TypeError(f"MixedPrecisionPolicy: apply_grad_on_fp32_main_grad must be a bool, got "
                            f"{self.apply_grad_on_fp32_main_grad!r}")


@dataclass(frozen=True)
class OffloadPolicy:
    """FSDP2's ``OffloadPolicy``: no offloading (the default of ``fully_shard``).

    Example::

        fully_shard(model, offload_policy=OffloadPolicy())
    """


@dataclass(frozen=True)
class CPUOffloadPolicy(OffloadPolicy):
    """FSDP2's ``CPUOffloadPolicy``: pieces, gradients and optimizer state in host memory. On MindSpore's
    CPU backend they are there already, so it is accepted; on Ascend ``fully_shard`` refuses it
    (offloading to the host is not built).

    Args:
        pin_memory: accepted as in FSDP2 (no effect on the CPU backend).

    Example::

        fully_shard(model, offload_policy=CPUOffloadPolicy())     # CPU ranks
    """

    pin_memory: bool = True
