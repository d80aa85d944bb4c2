"""HyperParallel's ``fully_shard``: this library's, with HyperParallel's convention for the
gradients of DTensor parameters (``shard_module`` / ``distribute_module``).

HyperParallel's models compute with ``weight.to_local()`` on their own pieces of the activations
(a sequence shard, a head shard), so the gradient a rank gets for a parameter that is Replicate on a
mesh dim of its own layout (a norm's weight on the tensor-parallel mesh) is its share only, and
HyperParallel's fully_shard sums those shares over that dim. This library's ``fully_shard`` follows
PyTorch, where ``to_local()`` reads the gradient as the DTensor is laid out (Replicate: whole, no sum).
Served as ``hyper_parallel.core.fully_shard.api.fully_shard`` by
:func:`~hyper_parallel_ms.compat.alias_hyper_parallel`; nothing else calls it.

Example::

    from hyper_parallel.core.fully_shard.api import fully_shard     # after alias_hyper_parallel()
    fully_shard(layer, mesh=dp_mesh)      # a norm's weight Replicate over "tp": gradient summed over "tp"
"""
from __future__ import annotations

from typing import Any, List, Union

from mindspore import nn

from ..fsdp import fully_shard as _fully_shard
from ..fsdp._module import fsdp_state

__all__ = ["fully_shard"]


def fully_shard(module: Union[nn.Cell, List[nn.Cell]], **kwargs: Any) -> Union[nn.Cell, List[nn.Cell]]:
    """:func:`hyper_parallel_ms.fully_shard` with HyperParallel's convention: a DTensor parameter's
    local gradient on the mesh dims where it is Replicate is summed over those dims.

    Args:
        module: the Cell (or list of Cells) to shard.
        **kwargs: :func:`hyper_parallel_ms.fully_shard`'s keywords (``mesh``, ``mp_policy``, ...).

    Example::

        fully_shard(model.layers[0], mesh=dp_mesh, mp_policy=MixedPrecisionPolicy())
    """
    out = _fully_shard(module, **kwargs)
    for cell in (module if isinstance(module, (list, tuple)) else [module]):
        fsdp_state(cell).replicated_grads_partial = True
    return out
