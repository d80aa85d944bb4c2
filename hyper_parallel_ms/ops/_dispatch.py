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
``NoFallbackGuard``); each output is wrapped as a DTensor and its local shape checked on the
decision's first run. Where local shapes differ between ranks (uneven or empty pieces), that
first run ends with the ranks agreeing on whether any of them failed (:mod:`..comm._agreement`), so a
wrong rule or a kernel failing on one rank's piece raises on every rank instead of leaving the
others waiting in their next collective.

Gradients: MindSpore differentiates the local op. Where an input is replicated on a mesh
dim on which an output is sharded or partial, each rank's local gradient of that input is
only its share, so the input passes through an identity whose backward sums the gradient
over those mesh dims (Megatron's "f" operator, derived here from the placements).

Example::

    y = ops.matmul(x_dt, w_dt)        # DTensor in, DTensor out, one collective only if needed
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Iterator, List, Optional, Tuple

from mindspore import Tensor
from mindspore.ops import Primitive

from .._mindspore import no_hook, plain_view
from ..dtensor._spec import DTensorSpec, spec_of
from ..layout import Layout
from ..placement import Partial, Replicate
from ..redistribute import redistribution
from ..comm._agreement import failed_coordinates
from ._agreement import shapes_alike
from ._empty import run_on_empty_pieces
from ._registry import propagator
from ._rules._common import replicate_all
from ._schema import OpSchema, OutputSharding, TensorArg

__all__ = ["dispatch", "strict_plain_tensors", "clear_cache"]

_STRICT: List[bool] = [False]


@contextlib.contextmanager
def strict_plain_tensors(enabled: bool = True) -> Iterator[None]:
    """Inside, an op mixing DTensors with plain Tensors raises instead of reading the plain
    Tensor as Replicate.

    Args:
        enabled: ``True`` refuses plain Tensors next to DTensors; ``False`` reads them as Replicate
            (inside an enclosing strict block too).

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
    """Forget the cached sharding decisions (``register_sharding`` does this itself).

    Example::

        clear_cache()            # the next op of each kind decides again
    """
    propagator.clear_cache()


def _call_form(args: tuple, ignored=frozenset()) -> Tuple[tuple, Any, tuple]:
    """(flat positional inputs, rebuild function, primitive attributes). Legacy primitives
    arrive as (prim, name, inputs); their attributes (e.g. LayerNorm's begin_norm_axis) go to
    the rule, except those named in ``ignored`` (random seeds: each ``ops.dropout`` call has
    new ones, which must not make a new cache entry). A list of tensors (``ops.cat([a, b])``)
    is flattened into consecutive inputs."""
    attrs: tuple = ()
    pack: Any = tuple
    for a in args:             # the common case first: no packed arguments
        if isinstance(a, (Primitive, list, tuple)):
            break
    else:
        return args, pack, attrs
    if len(args) == 3 and isinstance(args[0], Primitive) and isinstance(args[2], tuple):
        prim, name = args[0], args[1]
        attrs = tuple(sorted((k, v) for k, v in prim.attrs.items()
                             if isinstance(v, (int, float, str, bool, tuple)) and k not in ignored))
        args, pack = args[2], (lambda new: (prim, name, tuple(new)))
    flat, groups = [], []
    for a in args:
        if isinstance(a, (list, tuple)) and any(isinstance(t, Tensor) for t in a):
            groups.append((len(flat), len(a), type(a)))
            flat.extend(a)
        else:
            flat.append(a)
    if not groups:
        return tuple(flat), pack, attrs

    def rebuild(new):
        out, at = [], 0
        for start, length, kind in groups:
            out.extend(new[at:start])
            out.append(kind(new[start:start + length]))
            at = start + length
        out.extend(new[at:])
        return pack(out)
    return tuple(flat), rebuild, attrs


@dataclass
class _Decision:
    """Everything decided once per (op, argument layouts and shapes, other arguments)."""

    needs: Tuple[Optional[Layout], ...]        # layout each tensor argument must have
    grad_cells: Tuple[Optional[Any], ...]      # identity Cells whose backward sums a shared gradient
    out_specs: Tuple[DTensorSpec, ...]
    local_shapes: Tuple[Tuple[int, ...], ...]  # what each output's local piece must be
    arg_overrides: Optional[Tuple[Any, ...]] = None  # local values for global-size arguments
    inplace: bool = False                      # the op updates argument 0, which is the result
    local_fn: Optional[Any] = None             # runs instead of the op on the local inputs
    calls_op: bool = False                     # local_fn takes the op (a function of new inputs) first
    verified: bool = False                     # the rule's local shapes were checked once
    passthrough: bool = False                  # no argument needs redistribution or a gradient Cell
    empty_inputs: Tuple[int, ...] = ()         # positions of tensor inputs whose local piece is empty
    alike: bool = False                        # every rank's local shapes are the same: no agreement needed


# Ops asking for an object's MindSpore type (``ops.typeof``, which MindSpore's losses call to check
# their arguments): no values are read, the result is not a tensor.
_TYPE_QUERIES = ("typeof",)


def dispatch(func, args: tuple, kwargs: dict):
    """Run ``func`` on DTensor arguments with sharding propagation (see the module docstring).

    Args:
        func: the MindSpore op (a function or primitive) the tensor hook received.
        args: its positional arguments (DTensors, plain tensors, other values).
        kwargs: its keyword arguments.

    Example::

        y = dispatch(ops.matmul, (x_dt, w_dt), {})       # what ``ops.matmul(x_dt, w_dt)`` runs
    """
    name = getattr(func, "name", None) or getattr(func, "__name__", repr(func))
    if name in _TYPE_QUERIES:      # what kind of object it is, not its values: the piece answers for it
        with no_hook():
            return func(*args, **kwargs)
    keyword_dtensors = [k for k, v in (kwargs or {}).items() if spec_of(v) is not None or (
        isinstance(v, (list, tuple)) and any(spec_of(t) is not None for t in v))]
    if keyword_dtensors:
        raise TypeError(f"{name}: the DTensor keyword argument(s) {keyword_dtensors} would reach the op as this "
                        "rank's piece, not laid out with the other inputs; pass them positionally (e.g. "
                        "mint.clamp(x, None, m) for clamp(x, max=m))")
    ignored = propagator.ignored_args(name)
    inputs, rebuild, attrs = _call_form(args if type(args) is tuple else tuple(args), ignored)
    mesh, signature, template = None, [], None
    for i, a in enumerate(inputs):
        spec = spec_of(a)
        if i in ignored:
            signature.append(None)
        elif spec is not None:
            if mesh is None:
                mesh, template = spec.mesh, a
            elif spec.mesh is not mesh and spec.mesh != mesh:
                raise ValueError(f"{name}: argument {i} lives on {spec.mesh!r}, an earlier one on {mesh!r}; "
                                 "DTensors of one op must share a mesh")
            signature.append(spec)
        elif isinstance(a, Tensor):
            if _STRICT[-1]:
                raise TypeError(f"{name}: argument {i} is a plain Tensor of shape {tuple(a.shape)} next to "
                                "DTensors; distribute it (distribute_tensor / DTensor.from_local) or leave "
                                "strict_plain_tensors() to read it as Replicate")
            signature.append(("plain", tuple(a.shape)))
        else:
            signature.append(tuple(a) if isinstance(a, list) else a)
    if mesh is None:
        raise TypeError(f"{name}: no DTensor among the arguments {inputs!r}")
    key = (name, tuple(signature), tuple(sorted(kwargs.items())) if kwargs else (), attrs)
    try:
        decision = propagator.cached(key)
    except TypeError:  # an unhashable argument: decide without the cache
        key, decision = None, None
    if decision is None:
        decision = _decide(name, tuple(None if i in ignored else a for i, a in enumerate(inputs)),
                           kwargs, attrs, mesh)
        if key is not None:
            propagator.remember(key, decision)
    if decision.passthrough:  # every argument already as the rule needs it: pass the DTensors themselves
        local_inputs = inputs
    else:
        local_inputs = [_prepare(a, need, cell, mesh, template) for a, need, cell in
                        zip(inputs, decision.needs, decision.grad_cells)]
    if decision.arg_overrides is not None:
        local_inputs = [a if o is None else o for a, o in zip(local_inputs, decision.arg_overrides)]
    if decision.inplace:  # MindSpore's CPU in-place kernels reject strided views as sources
        local_inputs = local_inputs[:1] + [plain_view(a).copy() if isinstance(a, Tensor) else a
                                           for a in local_inputs[1:]]
    if decision.verified or decision.alike:  # a failure here happens on every rank alike
        return _run(func, rebuild, kwargs, inputs, local_inputs, decision, name, template)
    try:
        result, error = _run(func, rebuild, kwargs, inputs, local_inputs, decision, name, template), None
    except Exception as exc:  # noqa: BLE001  (re-raised below, once every rank knows)
        result, error = None, exc
    failed = failed_coordinates(mesh, error is not None)
    if error is not None:
        raise error
    if failed:
        decision.verified = False   # the failed ranks did not verify it: every rank checks it again next time
        raise RuntimeError(f"{name} failed on the ranks at mesh coordinates {failed} (their errors name the "
                           f"cause); this rank ({mesh.coordinate}) raises too, so that no rank waits in a "
                           "collective the failed ones never reach")
    return result


def _run(func, rebuild, kwargs: dict, inputs, local_inputs, decision: "_Decision", name: str, template):
    """The op on this rank's local inputs, wrapped as DTensors (checked on a first run)."""
    with no_hook():
        if decision.empty_inputs:
            out = run_on_empty_pieces(lambda new: func(*rebuild(new), **kwargs), local_inputs,
                                      decision.empty_inputs, decision.out_specs, decision.local_shapes)
        elif decision.calls_op:
            out = decision.local_fn(lambda *new: func(*rebuild(new)), *local_inputs, **kwargs)
        elif decision.local_fn is not None:
            out = decision.local_fn(*local_inputs, **kwargs)
        else:
            out = func(*rebuild(local_inputs), **kwargs)
        if decision.inplace:
            target = inputs[0]
            if out is not target:  # MindSpore's CPU kernels of add_/mul_/... compute out of place
                target.copy_(out)
            decision.verified = True
            return target
    return _wrap(out, decision, name, template)


def _decide(name: str, inputs: tuple, kwargs: dict, attrs: tuple, mesh) -> _Decision:
    template = next(spec_of(a).layout for a in inputs if spec_of(a) is not None)
    replicated = replicate_all(template)
    described = tuple(TensorArg(spec_of(a).layout, a.shape) if spec_of(a) is not None else
                      TensorArg(replicated, tuple(a.shape), is_dtensor=False) if isinstance(a, Tensor) else a
                      for a in inputs)
    schema = OpSchema(name, described, tuple(sorted(kwargs.items())), attrs)
    rule = propagator.rule_for(name)
    if rule is None:
        raise NotImplementedError(
            f"no sharding rule for MindSpore op '{name}' called as {schema}. Register one with "
            f"@hyper_parallel_ms.ops.register_sharding('{name}'), run it on local tensors with "
            "hyper_parallel_ms.ops.local_map, or call .to_local() / .full_tensor() first")
    try:
        sharding: OutputSharding = rule(schema)
    except ValueError as error:
        _explain_plain_broadcast(name, described, error)
        raise
    split_axes = {a for layout, _ in sharding.outputs for a, p in enumerate(layout.placements)
                  if not p.is_replicate() and mesh.shape[a] > 1}
    needs, cells = [], []
    for d, need in zip(described, sharding.inputs):
        if not isinstance(d, TensorArg):
            needs.append(None)
            cells.append(None)
            continue
        need = d.layout if need is None or need == d.layout else need  # same object: cheap check per call
        needs.append(need)
        cells.append(_gradient_sum_cell(mesh, need, d.shape, split_axes))
    coord = mesh.coordinate
    specs = tuple(DTensorSpec(mesh, layout, shape) for layout, shape in sharding.outputs)
    overrides = None if sharding.local_args is None else tuple(sharding.local_args(coord))
    passthrough = not sharding.inplace and overrides is None and all(
        cell is None and (not isinstance(d, TensorArg) or (need is d.layout if d.is_dtensor else need.is_replicated()))
        for d, need, cell in zip(described, needs, cells))
    empty = () if overrides is not None or sharding.local_fn is not None or sharding.inplace else tuple(
        i for i, (d, need) in enumerate(zip(described, needs))
        if isinstance(d, TensorArg) and 0 in need.local_shape(d.shape, coord) and 0 not in d.shape)
    alike = overrides is None and sharding.local_fn is None and shapes_alike(
        [(need, d.shape) for d, need in zip(described, needs) if isinstance(d, TensorArg)] +
        [(spec.layout, spec.shape) for spec in specs])
    return _Decision(tuple(needs), tuple(cells), specs,
                     tuple(spec.layout.local_shape(spec.shape, coord) for spec in specs), overrides,
                     sharding.inplace, None if sharding.local_fn is None else sharding.local_fn(coord),
                     sharding.calls_op, passthrough=passthrough and not empty, empty_inputs=empty, alike=alike)


def _explain_plain_broadcast(name: str, described: tuple, error: ValueError) -> None:
    """A rule failing on shapes that do not broadcast, with a plain Tensor among the
    arguments: raise an error saying which argument is plain and how it was read."""
    plain = [(i, d) for i, d in enumerate(described) if isinstance(d, TensorArg) and not d.is_dtensor]
    if not plain or "broadcast" not in str(error):
        return
    dtensors = [tuple(d.shape) for d in described if isinstance(d, TensorArg) and d.is_dtensor]
    i, arg = plain[0]
    raise ValueError(
        f"{name}: argument {i} is a plain Tensor of shape {tuple(arg.shape)}, read as Replicate (the whole tensor "
        f"on every rank), and it does not broadcast with the DTensor arguments' global shapes {dtensors}. If it "
        "is this rank's local piece, wrap it with DTensor.from_local; to refuse plain Tensors next to DTensors, "
        f"use hyper_parallel_ms.ops.strict_plain_tensors() ({error})") from error


def _gradient_sum_cell(mesh, need: Layout, shape, split_axes):
    """An identity whose backward sums the gradient over the mesh dims where the input is
    replicated but an output is split (each rank holds only its share of that gradient)."""
    shared = [a for a in split_axes if need.placements[a].is_replicate()]
    if not shared:
        return None
    # the gradient of a Partial input is replicated on that mesh dim: only the shared dims are summed
    partial = need.with_placements(tuple(Partial() if a in shared else Replicate() if p.is_partial() else p
                                         for a, p in enumerate(need.placements)))
    return redistribution(mesh, need, need, shape, grad_src=partial)


def _prepare(arg, need: Optional[Layout], cell, mesh, template):
    """The tensor to pass: ``arg`` redistributed to ``need``, through ``cell`` if any. A
    DTensor itself is passed where possible: under the guard the op sees its local data, and
    making a view of a pending result would wait for it. A plain tensor read as Replicate is
    cut into this rank's piece of ``need`` (``template``: a DTensor argument, which makes it a DTensor)."""
    if need is None:
        return arg
    spec = spec_of(arg)
    if spec is not None:
        if need is not spec.layout and need != spec.layout:
            arg = arg.redistribute(mesh, need)
    elif not need.is_replicated():
        cut = DTensorSpec.build(mesh, need, arg.shape)
        arg = template._adopt(cut.piece_of(arg), cut)
    return arg if cell is None else cell(plain_view(arg))


def _wrap(out, decision: _Decision, name: str, template):
    """``out`` as DTensors (``template``: a DTensor argument, whose static ``_adopt`` makes them)."""
    if decision.verified and type(out) is Tensor:   # the common case: one output, its rule checked before
        return template._adopt(out, decision.out_specs[0])
    single = isinstance(out, Tensor)
    results = (out,) if single else tuple(out)
    if len(results) != len(decision.out_specs):
        raise RuntimeError(f"the rule of {name} describes {len(decision.out_specs)} outputs but the op returned "
                           f"{len(results)}")
    if not decision.verified:  # reading a shape waits for the op, so check each decision once
        for result, spec, expected in zip(results, decision.out_specs, decision.local_shapes):
            got = tuple(Tensor.shape.fget(result))
            if got != expected:
                raise RuntimeError(f"the sharding rule of {name} is wrong: it promised a local shape {expected} "
                                   f"(global {spec.shape}, {spec.layout}) but the op produced {got}")
        decision.verified = True
    wrapped = tuple(template._adopt(result, spec) for result, spec in zip(results, decision.out_specs))
    return wrapped[0] if single else wrapped
