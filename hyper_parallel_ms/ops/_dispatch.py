"""The dispatcher: MindSpore ops on DTensors, through the ``__fallback__`` tensor hook.

Why ``__fallback__`` and not ``MsDispatchMode``: the hook is per tensor (no global mode to
switch on, nothing happens for plain tensors), it sees functional ops, operators, methods
and the primitives inside ``nn.Dense`` with the DTensor objects themselves as arguments,
and what it returns is the op's result, so DTensors come out of ops. ``MsDispatchMode``
is global and experimental, passes arguments as plain Tensors (placements lost) and breaks
later use when it returns a subclass. Measured on this CPU: an 8x8 add is about 23 us
plain; a minimal hook adds the guard (about 20 us).

For each call: the arguments' layouts and shapes form the key of a cached
:class:`OutputSharding` from the op's rule; tensor arguments are redistributed to the
layouts the rule asks for; the op runs once on the local tensors (under
``NoFallbackGuard``); each output is wrapped as a DTensor and its local shape checked.

Gradients: MindSpore differentiates the local op. Where an input is replicated on a mesh
dim on which an output is sharded or partial, each rank's local gradient of that input is
only its share, so the input passes through an identity whose backward sums the gradient
over those mesh dims (Megatron's "f" operator, derived here from the placements).

Example::

    y = ops.matmul(x_dt, w_dt)        # DTensor in, DTensor out, one collective only if needed
"""
from __future__ import annotations

import contextlib
from typing import Any, Dict, Iterator, List, Tuple

from mindspore import Tensor
from mindspore._c_expression import NoFallbackGuard
from mindspore.ops import Primitive

from ..dtensor import DTensor, distribute_tensor
from ..dtensor._dtensor import _local_view
from ..dtensor._spec import DTensorSpec
from ..layout import Layout
from ..placement import Partial, Replicate
from ..redistribute import redistribution
from ._registry import rule_for
from ._schema import OpSchema, OutputSharding, TensorArg

__all__ = ["dispatch", "strict_plain_tensors", "clear_cache"]

_CACHE: Dict[tuple, OutputSharding] = {}
_STRICT: List[bool] = [False]


@contextlib.contextmanager
def strict_plain_tensors(enabled: bool = True) -> Iterator[None]:
    """Inside, an op mixing DTensors with plain Tensors raises instead of reading the plain
    Tensor as Replicate.

    Example::

        with strict_plain_tensors():
            dt + plain        # TypeError
    """
    _STRICT.append(bool(enabled))
    try:
        yield
    finally:
        _STRICT.pop()


def clear_cache() -> None:
    """Forget the cached sharding decisions (after re-registering a rule)."""
    _CACHE.clear()


def _call_form(args: tuple) -> Tuple[tuple, Any]:
    """(positional inputs, rebuild function). Legacy primitives arrive as (prim, name, inputs)."""
    if len(args) == 3 and isinstance(args[0], Primitive) and isinstance(args[2], tuple):
        prim, name = args[0], args[1]
        return args[2], lambda new: (prim, name, tuple(new))
    return args, tuple


def _replicated(layout_template: Layout) -> Layout:
    return Layout(layout_template.mesh_shape, (Replicate(),) * len(layout_template.mesh_shape),
                  mesh_dim_names=layout_template.mesh_dim_names)


def dispatch(func, args: tuple, kwargs: dict):
    """Run ``func`` on DTensor arguments with sharding propagation (see the module docstring)."""
    name = getattr(func, "name", None) or getattr(func, "__name__", repr(func))
    inputs, rebuild = _call_form(tuple(args))
    kwargs = dict(kwargs or {})
    mesh = next((a.device_mesh for a in inputs if isinstance(a, DTensor)), None)
    if mesh is None:
        raise TypeError(f"{name}: DTensors inside lists are not supported yet (got {inputs!r}); "
                        "call .to_local() on them first")
    replicated = None
    described = []
    for i, a in enumerate(inputs):
        if isinstance(a, DTensor):
            if a.device_mesh != mesh:
                raise ValueError(f"{name}: argument {i} lives on {a.device_mesh!r}, argument 0 on {mesh!r}; "
                                 "DTensors of one op must share a mesh")
            described.append(TensorArg(a.layout, a.shape))
        elif isinstance(a, Tensor):
            if _STRICT[-1]:
                raise TypeError(f"{name}: argument {i} is a plain Tensor of shape {tuple(a.shape)} next to "
                                "DTensors; distribute it (distribute_tensor / DTensor.from_local) or leave "
                                "strict_plain_tensors() to read it as Replicate")
            if replicated is None:
                first = next(x for x in inputs if isinstance(x, DTensor))
                replicated = _replicated(first.layout)
            described.append(TensorArg(replicated, tuple(a.shape), is_dtensor=False))
        else:
            described.append(a)
    schema = OpSchema(name, tuple(described), tuple(sorted(kwargs.items())))
    try:
        key = (schema.op, schema.args, schema.kwargs)
        sharding = _CACHE.get(key)
    except TypeError:  # an unhashable argument: decide without the cache
        key, sharding = None, None
    if sharding is None:
        rule = rule_for(name)
        if rule is None:
            raise NotImplementedError(
                f"no sharding rule for MindSpore op '{name}' called as {schema}. Register one with "
                f"@hyper_parallel_ms.ops.register_sharding('{name}'), run it on local tensors with "
                "hyper_parallel_ms.ops.local_map, or call .to_local() / .full_tensor() first")
        sharding = rule(schema)
        if key is not None:
            _CACHE[key] = sharding
    split_axes = {a for layout, _ in sharding.outputs for a, p in enumerate(layout.placements)
                  if not p.is_replicate() and mesh.shape[a] > 1}
    local_inputs = [_prepare(a, d, need, mesh, split_axes) for a, d, need in zip(inputs, described, sharding.inputs)]
    with NoFallbackGuard():
        out = func(*rebuild(local_inputs), **kwargs)
    return _wrap(out, sharding.outputs, mesh, schema)


def _prepare(arg, described, need, mesh, split_axes):
    """The local tensor to pass: ``arg`` redistributed to the layout ``need``, its gradient
    summed over the mesh dims in ``split_axes`` where it is replicated."""
    if not isinstance(described, TensorArg):
        return arg
    need = need or described.layout
    if not described.is_dtensor:
        if need != described.layout:
            arg = distribute_tensor(arg, mesh, need, src_data_rank=None)
    elif need != arg.layout:
        arg = arg.redistribute(mesh, need)
    local = _local_view(arg)
    shared = [a for a in split_axes if need.placements[a].is_replicate()]
    if not shared:
        return local
    partial = Layout(need.mesh_shape, tuple(Partial() if a in shared else p for a, p in enumerate(need.placements)),
                     mesh_dim_names=need.mesh_dim_names, shard_order=dict(need.shard_order))
    return _local_view(redistribution(mesh, need, need, described.shape, grad_src=partial)(local))


def _wrap(out, outputs, mesh, schema: OpSchema):
    single = isinstance(out, Tensor)
    results = (out,) if single else tuple(out)
    if len(results) != len(outputs):
        raise RuntimeError(f"the rule of {schema.op} describes {len(outputs)} outputs but the op returned "
                           f"{len(results)}")
    wrapped = []
    coord = mesh.get_coordinate()
    for result, (layout, shape) in zip(results, outputs):
        expected = layout.local_shape(shape, coord)
        got = tuple(Tensor.shape.fget(result))
        if got != expected:
            raise RuntimeError(f"the sharding rule of {schema.op} is wrong for {schema}: it promised a local "
                               f"shape {expected} (global {shape}, {layout}) but the op produced {got}")
        wrapped.append(DTensor(result, DTensorSpec(mesh, layout, shape)))
    return wrapped[0] if single else tuple(wrapped)
