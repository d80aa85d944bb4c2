"""MindSpore's names for the tensors of a state dict made by ``get_state_dict``: the names
``mindspore.save_checkpoint(net)`` and ``mindspore.save_checkpoint(optimizer)`` write and
``mindspore.load_param_into_net`` matches.

Flat keys (as :func:`~hyper_parallel_ms.checkpoint.save` stores them) map by role:

- an optimizer state dict under a root ``R`` (recognised by its ``R.param_groups.<i>.params``
  lists of parameter names): the moment ``R.state.<fqn>.<slot>`` is ``<slot>.<fqn>``
  (``adam_m.fc.weight``: the slots are named as MindSpore's optimizers name their moments) and
  ``R.param_groups.<i>.<name>`` is ``<name>`` (``global_step``, ``beta1_power``, ...);
- the model state dict under ``"model"`` (beside an optimizer, or alone: every tensor under
  ``"model"``): ``model.<fqn>`` is ``<fqn>``;
- any other key keeps its name (a bare model state dict: its keys are the parameter names).

A key of an optimizer that names no parameter, a moment whose shape differs from its
parameter's, or two keys with one name raise :class:`CheckpointError`: a file with such names
would load moments into weights.

Example:
    >>> shapes = {"model.fc.weight": (2, 3), "optim.state.fc.weight.adam_m": (2, 3),
    ...           "optim.param_groups.0.global_step": (1,)}
    >>> mindspore_names(shapes, {"optim.param_groups.0.params": ["fc.weight"]})
    {'model.fc.weight': 'fc.weight', 'optim.state.fc.weight.adam_m': 'adam_m.fc.weight', \
'optim.param_groups.0.global_step': 'global_step'}
"""
from __future__ import annotations

import re
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

from ._metadata import CheckpointError

__all__ = ["mindspore_names", "is_param_list", "MODEL_ROOT"]

MODEL_ROOT = "model"
_PARAMS = re.compile(r"^(?:(.*)\.)?param_groups\.(\d+)\.params$")


def is_param_list(key: str) -> bool:
    """Whether ``key`` is the ``params`` list of an optimizer's param group (structure, not state)."""
    return _PARAMS.match(key) is not None


def _optimizer_roots(values: Mapping[str, Any]) -> Dict[str, List[str]]:
    """Root (``""`` for a bare optimizer state dict) -> the parameter names of its groups."""
    roots: Dict[str, List[str]] = {}
    for key, value in values.items():
        match = _PARAMS.match(key)
        if match and isinstance(value, (list, tuple)) and all(isinstance(v, str) for v in value):
            roots.setdefault(match.group(1) or "", []).extend(value)
    return roots


def _under(key: str, root: str) -> Optional[str]:
    """``key`` without ``root.`` if it lies under ``root`` (every key lies under ``""``)."""
    if not root:
        return key
    return key[len(root) + 1:] if key.startswith(root + ".") else None


def _optimizer_name(key: str, rest: str, fqns: Sequence[str]) -> Tuple[str, Optional[str]]:
    """(MindSpore name, fqn of the parameter for a moment) of an optimizer tensor key."""
    if rest.startswith("state."):
        rest = rest[len("state."):]
        owners = [f for f in fqns if rest.startswith(f + ".") and "." not in rest[len(f) + 1:]]
        if owners:
            fqn = max(owners, key=len)
            return f"{rest[len(fqn) + 1:]}.{fqn}", fqn
        raise CheckpointError(f"optimizer state {key!r} names no parameter of its param_groups: it matches nothing "
                              "(a state dict not made by get_optimizer_state_dict?)")
    match = re.match(r"^param_groups\.\d+\.(.+)$", rest)
    if match and match.group(1) != "params":
        return match.group(1), None
    raise CheckpointError(f"optimizer entry {key!r} is neither state.<parameter>.<slot> nor param_groups.<i>.<name>")


def mindspore_names(shapes: Mapping[str, Tuple[int, ...]], values: Mapping[str, Any]) -> Dict[str, str]:
    """Flat tensor key -> MindSpore name, for the keys of ``shapes`` (key -> global shape);
    ``values``: the non-tensor values of the same state dict (the ``params`` lists)."""
    roots = _optimizer_roots(values)
    model_root = bool(roots) or all(_under(key, MODEL_ROOT) is not None for key in shapes)
    names: Dict[str, str] = {}
    moments: Dict[str, str] = {}
    for key in shapes:
        root = next((r for r in sorted(roots, key=len, reverse=True) if _under(key, r) is not None), None)
        if root is not None:
            names[key], fqn = _optimizer_name(key, _under(key, root), roots[root])
            if fqn is not None:
                moments[key] = fqn
        elif model_root and _under(key, MODEL_ROOT) is not None:
            names[key] = _under(key, MODEL_ROOT)
        else:
            names[key] = key
    _check_roles(shapes, names, moments)
    return names


def _check_roles(shapes: Mapping[str, Tuple[int, ...]], names: Dict[str, str], moments: Dict[str, str]) -> None:
    by_name: Dict[str, str] = {}
    for key, name in names.items():
        if name in by_name:
            raise CheckpointError(f"{by_name[name]!r} and {key!r} both have MindSpore's name {name!r}: one would load "
                                  "into the other's place")
        by_name[name] = key
    for key, fqn in moments.items():
        weight = by_name.get(fqn)
        if weight is not None and tuple(shapes[weight]) != tuple(shapes[key]):
            raise CheckpointError(f"optimizer moment {key!r} has shape {tuple(shapes[key])}, its parameter {weight!r} "
                                  f"has {tuple(shapes[weight])}: the moment does not belong to that parameter")
