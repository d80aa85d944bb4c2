"""local_map: run a function written for local tensors on DTensors.

As in PyTorch: the wrapped function receives each DTensor argument's local piece (after
checking, or with ``redistribute_inputs=True`` moving, it to ``in_placements``) and its
results are wrapped as DTensors with ``out_placements`` (``None`` for a non-tensor result).
The function is trusted to produce pieces that fit the placements (even shards: global =
local x shards).

Example::

    @partial(local_map, out_placements=[Shard(0)], in_placements=([Shard(0)],))
    def my_rmsnorm(x):                 # sees only this rank's rows
        return x * ops.rsqrt((x * x).mean(-1, keep_dims=True) + 1e-6)
"""
from __future__ import annotations

import functools
from typing import Callable, Optional, Sequence

from mindspore import Tensor

from ..dtensor import DTensor
from ..dtensor._spec import to_layout

__all__ = ["local_map", "custom_shard"]


def _check_count(caller: str, func: Callable, in_placements: Optional[Sequence], args: Sequence) -> None:
    """``in_placements`` (when given) has one entry per positional argument."""
    if in_placements is not None and len(in_placements) != len(args):
        raise ValueError(f"{caller}({func.__name__}): in_placements has {len(in_placements)} entries for "
                         f"{len(args)} arguments")


def local_map(func: Callable, out_placements: Sequence, in_placements: Optional[Sequence] = None, *,
              device_mesh=None, redistribute_inputs: bool = False) -> Callable:
    """Wrap ``func`` to take DTensors and return DTensors (see the module docstring).

    Args:
        func: the function on local tensors.
        out_placements: the placements of each result (one list per result; ``None`` for a non-tensor).
        in_placements: the placements each positional argument must have (``None`` per argument:
            any; default: no check).
        device_mesh: the mesh of the results (default: the first DTensor argument's).
        redistribute_inputs: move arguments to ``in_placements`` instead of raising when they differ.

    Example::

        scaled = local_map(lambda x: x * 2, out_placements=[Shard(0)], in_placements=([Shard(0)],))(x_dt)
    """
    outs = list(out_placements)
    single_out = bool(outs) and (outs[0] is None or not isinstance(outs[0], (list, tuple)))
    out_list = [outs] if single_out else outs

    @functools.wraps(func)
    def wrapped(*args, **kwargs):
        mesh = device_mesh or next((a.device_mesh for a in args if isinstance(a, DTensor)), None)
        if mesh is None:
            raise ValueError(f"local_map({func.__name__}): no DTensor argument and no device_mesh given")
        _check_count("local_map", func, in_placements, args)
        local_args = []
        for i, a in enumerate(args):
            wanted = None if in_placements is None else in_placements[i]
            if isinstance(a, DTensor) and wanted is not None:
                layout = to_layout(mesh, wanted, a.ndim)
                if layout != a.layout:
                    if not redistribute_inputs:
                        raise ValueError(f"local_map({func.__name__}): argument {i} has placements {a.layout}, "
                                         f"in_placements asks for {layout}; pass redistribute_inputs=True")
                    a = a.redistribute(mesh, layout)
            local_args.append(a.to_local() if isinstance(a, DTensor) else a)
        result = func(*local_args, **kwargs)
        # one result whose placements came as a one-entry tuple (as PyTorch, the result decides)
        one = single_out or (len(out_list) == 1 and not isinstance(result, (tuple, list)))
        results = [result] if one else list(result)
        if len(results) != len(out_list):
            raise ValueError(f"local_map({func.__name__}): {len(results)} results for {len(out_list)} "
                             "out_placements")
        wrapped_results = [DTensor.from_local(r, mesh, p) if p is not None and isinstance(r, Tensor) else r
                           for r, p in zip(results, out_list)]
        return wrapped_results[0] if one else tuple(wrapped_results)
    return wrapped


def custom_shard(func: Callable, device_mesh, out_placements: Sequence, in_placements: Optional[Sequence] = None,
                 redistribute_inputs: bool = True) -> Callable:
    """HyperParallel's spelling of :func:`local_map`: ``device_mesh`` second, one placements entry
    per result in ``out_placements``, inputs moved to ``in_placements`` by default. Stricter than
    local_map, as HyperParallel: a DTensor argument needs its ``in_placements`` entry and a
    non-DTensor argument must have ``None`` there; with no DTensor argument, ``func`` runs on the
    arguments as they are and its results are returned unwrapped.

    Args:
        func: the function on local tensors.
        device_mesh: the mesh of the arguments and results.
        out_placements: one placements sequence per result (``None`` for a non-tensor result).
        in_placements: one placements sequence per positional argument (``None`` for a non-tensor).
        redistribute_inputs: move DTensor arguments to ``in_placements`` (default True; False raises
            where they differ).

    Example::

        add = custom_shard(lambda x, y: x + y, mesh, out_placements=((Shard(0), Replicate()),),
                           in_placements=((Shard(0), Replicate()), (Shard(0), Replicate())))
        z = add(x_dt, y_dt)
    """
    mapped = local_map(func, list(out_placements), in_placements, device_mesh=device_mesh,
                       redistribute_inputs=redistribute_inputs)

    @functools.wraps(func)
    def wrapped(*args, **kwargs):
        _check_count("custom_shard", func, in_placements, args)
        for i, a in enumerate(args):
            if isinstance(a, DTensor) and in_placements is None:
                raise RuntimeError(f"custom_shard({func.__name__}): argument {i} is a DTensor and in_placements is "
                                   "None; give every argument's placements")
            wanted = None if in_placements is None else in_placements[i]
            if isinstance(a, DTensor) and wanted is None:
                raise TypeError(f"custom_shard({func.__name__}): argument {i} is a DTensor; give its placements in "
                                "in_placements")
            if not isinstance(a, DTensor) and wanted is not None:
                raise TypeError(f"custom_shard({func.__name__}): argument {i} is not a DTensor, its in_placements "
                                f"entry must be None, got {wanted}")
        if not any(isinstance(a, DTensor) for a in args):
            return func(*args, **kwargs)
        return mapped(*args, **kwargs)
    return wrapped
