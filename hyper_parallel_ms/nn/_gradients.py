"""Gradient reduction the parallel styles leave to the training step, as PyTorch's DDP does it:
averaging over the data-parallel mesh dim; and summing over the mesh dims a parameter's
``ParameterSharding.grad_partial_dims`` names, where a user's own record says each rank's gradient
is its share (the styles sum their sequence-parallel shares in the backward themselves).

Example::

    reducer = GradientReducer(model.trainable_params(), dp_mesh=mesh, dp_dim="dp")
    loss, grads = ms.value_and_grad(loss_fn, None, model.trainable_params())(x, y)
    optimizer(reducer(grads))
"""
from __future__ import annotations

from typing import Sequence, Tuple

from mindspore import Parameter, nn

from .. import comm
from ._parameter import parameter_sharding

__all__ = ["GradientReducer"]

# set by fully_shard / hsdp on their pieces: the gradient they return is already averaged over dp
_DP_REDUCED = "_hpms_grad_reduced_dims"


class _AllReduce(nn.Cell):
    def __init__(self, mesh, mesh_dim, op: str) -> None:
        super().__init__()
        self.mesh, self.mesh_dim, self.op = mesh, mesh_dim, op

    def construct(self, g):
        return comm.all_reduce(g, self.mesh, self.mesh_dim, op=self.op)


class _Identity(nn.Cell):
    def construct(self, g):
        return g


class _Chain(nn.Cell):
    def __init__(self, cells: Sequence[nn.Cell]) -> None:
        super().__init__()
        self.steps = nn.CellList(list(cells) or [_Identity()])

    def construct(self, g):
        for step in self.steps:
            g = step(g)
        return g


class GradientReducer(nn.Cell):
    """Reduce a tuple of gradients (in the order of ``parameters``): summed over the mesh
    dims where a parameter's gradient is partial, then averaged over ``dp_dim`` of ``dp_mesh``
    (if given; skipped for the pieces of ``fully_shard`` / ``hsdp``, whose gradients arrive
    already reduced over data parallelism). Works in PyNative and inside ms.jit.

    Args:
        parameters: the parameters, in the order of the gradient tuples it will reduce.
        dp_mesh: the :class:`DeviceMesh` holding the data-parallel dim (``None``: no averaging).
        dp_dim: the name or index of the data-parallel dim of ``dp_mesh``.

    Example::

        reducer = GradientReducer(params, dp_mesh=mesh, dp_dim="dp")
        grads = reducer(grads)
    """

    def __init__(self, parameters: Sequence[Parameter], *, dp_mesh=None, dp_dim=None) -> None:
        super().__init__()
        parameters = list(parameters)
        if (dp_mesh is None) != (dp_dim is None):
            raise ValueError("give both dp_mesh and dp_dim, or neither")
        if dp_mesh is not None:
            dp_mesh.dim_index(dp_dim)          # raises for an unknown mesh dim
        chains = []
        for p in parameters:
            if not isinstance(p, Parameter):
                raise TypeError(f"GradientReducer needs Parameters, got {type(p).__name__}")
            steps = []
            sharding = parameter_sharding(p)
            if sharding is not None:
                steps += [_AllReduce(sharding.spec.mesh, d, "sum") for d in sharding.grad_partial_dims]
            if dp_mesh is not None and not getattr(p, _DP_REDUCED, ()):
                steps.append(_AllReduce(dp_mesh, dp_dim, "avg"))
            chains.append(_Chain(steps))
        self.chains = nn.CellList(chains)
        self.count = len(parameters)

    def construct(self, grads: Tuple):
        out = ()
        for g, chain in zip(grads, self.chains):
            out = out + (chain(g),)
        return out


