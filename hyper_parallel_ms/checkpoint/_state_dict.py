"""Model and optimizer state dicts of parallelized Cells (PyTorch's
``torch.distributed.checkpoint.state_dict`` functions).

Model: fully qualified parameter name -> the Parameter itself (sharded ones keep their
sharding record or are DTensors, so :func:`save` writes pieces and :func:`load` fills them
in place). Optimizer: ``{"state": {fqn: {slot: moment}}, "param_groups": [{...}]}`` where a
moment of a sharded parameter is a :class:`ShardedTensor` laid out as its parameter. The slots
are the optimizer's ParameterTuples aligned with its parameters, named as MindSpore names the
moments (the prefix of their Parameter names: ``adam_m``/``adam_v`` of AdamWeightDecay,
``moment1``/``moment2`` of Adam, ``moments`` of Momentum, ``accum``/``stat`` of SGD, ``lamb_m``/
``lamb_v`` of Lamb), so that ``export_full`` writes ``<slot>.<fqn>``, the names
``mindspore.load_param_into_net(optimizer, ...)`` matches; the group holds the optimizer's other
Parameters by name (``global_step``, ``learning_rate``, ``beta1_power``, ...) and the fqns of
its parameters.

Example::

    model_sd, optim_sd = get_state_dict(model, optimizer)
    save({"model": model_sd, "optim": optim_sd}, checkpoint_id="ckpt/step_10")
"""
from __future__ import annotations

import pickle
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

import numpy as np
from mindspore import Parameter, ParameterTuple, Tensor, nn

from ..dtensor import DTensor
from ..dtensor._dtensor import _local_view
from ..nn import as_dtensor, parameter_sharding
from ..nn._adapter import own_parameters
from ..nn._parameter import parameter_spec
from ._dist import Coordinator
from ._metadata import CheckpointError
from ._pieces import ShardedTensor, TensorRef, cast_for_load, flatten, is_tensor_like, to_numpy

__all__ = ["StateDictOptions", "get_model_state_dict", "get_optimizer_state_dict", "get_state_dict",
           "set_model_state_dict", "set_optimizer_state_dict", "set_state_dict", "IncompatibleKeys"]


@dataclass(frozen=True)
class StateDictOptions:
    """Options of the state-dict functions (PyTorch's ``StateDictOptions``).

    Args:
        full_state_dict: whole tensors instead of pieces (gathered: call on every rank).
        cpu_offload: host (numpy) copies instead of the live tensors; with ``full_state_dict``
            only rank 0 gets them, the other ranks an empty dict (PyTorch's: no rank but one
            holds the whole model on the host).
        ignore_frozen_params: leave out parameters with ``requires_grad=False``.
        strict: ``set_*`` raise on missing or unexpected keys.
        broadcast_from_rank0: ``set_*`` take the whole state dict rank 0 was given (the other
            ranks' are ignored: pass ``{}``) and each rank keeps its pieces; needs
            ``full_state_dict``.

    >>> StateDictOptions(full_state_dict=True).strict
    True
    """

    full_state_dict: bool = False
    cpu_offload: bool = False
    ignore_frozen_params: bool = False
    strict: bool = True
    broadcast_from_rank0: bool = False

    def __post_init__(self) -> None:
        if self.broadcast_from_rank0 and not self.full_state_dict:
            raise ValueError("StateDictOptions(broadcast_from_rank0=True) needs full_state_dict=True: rank 0 holds "
                             "whole tensors and every rank cuts its pieces from them")

    @property
    def rank0_only(self) -> bool:
        """Whether ``get_*`` return the state on rank 0 only (``full_state_dict`` and ``cpu_offload``)."""
        return self.full_state_dict and self.cpu_offload


@dataclass(frozen=True)
class IncompatibleKeys:
    """What ``set_*_state_dict`` with ``strict=False`` did not match (as PyTorch's ``load_state_dict``).

    Args:
        missing_keys: keys of the model / optimizer that the state dict did not give.
        unexpected_keys: keys of the state dict that the model / optimizer does not have.

    >>> IncompatibleKeys(("fc.bias",), ()).missing_keys
    ('fc.bias',)
    """

    missing_keys: Tuple[str, ...]
    unexpected_keys: Tuple[str, ...]


def _export(value: Union[Tensor, ShardedTensor], options: StateDictOptions) -> Any:
    """``value`` as the options ask: itself, a host copy (sharded ones stay
    :class:`ShardedTensor` pieces: a bare numpy piece would read as a whole tensor), or the
    whole tensor."""
    if options.full_state_dict:
        full = _full(value)
        return to_numpy(full).copy() if options.cpu_offload else full
    if not options.cpu_offload:
        return value
    spec = value.spec if isinstance(value, ShardedTensor) else parameter_spec(value)
    host = to_numpy(value.local if isinstance(value, ShardedTensor) else value).copy()
    return host if spec is None else ShardedTensor(host, spec)


def _full(value: Union[Tensor, ShardedTensor]) -> Tensor:
    if isinstance(value, ShardedTensor):
        spec = value.spec
        local = Tensor(value.local) if isinstance(value.local, np.ndarray) else _local_view(value.local)
        return DTensor.from_local(local, spec.mesh, spec.layout, shape=spec.shape).full_tensor()
    if isinstance(value, DTensor):
        return value.full_tensor()
    if parameter_sharding(value) is not None:
        return as_dtensor(value).full_tensor()
    return value


def _model_params(model: nn.Cell, options: StateDictOptions) -> Dict[str, Parameter]:
    return {name: p for name, p in model.parameters_and_names()
            if not (options.ignore_frozen_params and not p.requires_grad)}


def get_model_state_dict(model: nn.Cell, *, options: Optional[StateDictOptions] = None) -> Dict[str, Any]:
    """Fully qualified name -> parameter (its piece; whole with ``full_state_dict``).

    Args:
        model: the Cell.
        options: a :class:`StateDictOptions` (default: pieces, live tensors).

    Example::

        model_sd = get_model_state_dict(model)          # {"fc.weight": <this rank's piece>, ...}
    """
    options = options or StateDictOptions()
    state = {name: _export(p, options) for name, p in _model_params(model, options).items()}
    return {} if options.rank0_only and Coordinator(distributed=True).rank != 0 else state


def _slots(model: nn.Cell, optimizer: nn.Optimizer) -> Tuple[Dict[str, Dict[str, Parameter]], Dict[str, Parameter],
                                                              List[str]]:
    """Per-parameter slots (fqn -> slot -> Parameter), the optimizer's other Parameters, and
    the fqns of the parameters it updates. A slot is a ParameterTuple attribute of the
    optimizer aligned with its parameters (same length, each the parameter's local shape),
    named by :func:`_slot_name`."""
    fqn_of = {id(p): name for name, p in model.parameters_and_names()}
    params = list(optimizer.parameters)
    missing = [p.name for p in params if id(p) not in fqn_of]
    if missing:
        raise CheckpointError(f"optimizer parameters {missing} are not parameters of the model")
    fqns = [fqn_of[id(p)] for p in params]
    own = {id(p) for p in params}
    held = own_parameters(optimizer)
    key_of = {id(q): name for name, q in held.items()}
    slots: Dict[str, Dict[str, Parameter]] = {}
    in_slots = set()
    for attr, value in sorted(vars(optimizer).items()):
        if not isinstance(value, ParameterTuple) or len(value) != len(params) or attr in _NOT_SLOTS:
            continue
        if any(id(q) in own for q in value):
            continue
        if all(tuple(q.shape) == _local_shape(p) for p, q in zip(params, value)):
            slot = _slot_name(attr, [key_of.get(id(p)) for p in params], [key_of.get(id(q)) for q in value])
            for fqn, q in zip(fqns, value):
                if slot in slots.get(fqn, {}):
                    raise CheckpointError(f"optimizer {type(optimizer).__name__} has two slots named {slot!r}")
                slots.setdefault(fqn, {})[slot] = q
                in_slots.add(id(q))
    scalars = {name: q for name, q in held.items() if id(q) not in own and id(q) not in in_slots}
    return slots, scalars, fqns


def _slot_name(attr: str, param_names: List[Optional[str]], slot_names: List[Optional[str]]) -> str:
    """MindSpore's name of a slot: the common prefix ``P`` of its Parameters' names
    ``P.<parameter name>`` (``adam_m`` of AdamWeightDecay's ``moments1``), read from the names
    under which the optimizer holds them (not changed when it is placed inside another Cell);
    the attribute name when the Parameters are not named so."""
    prefixes = set()
    for p, q in zip(param_names, slot_names):
        if p is None or q is None or not q.endswith("." + p):
            return attr
        prefixes.add(q[:-len(p) - 1])
    prefix = prefixes.pop() if len(prefixes) == 1 else ""
    return prefix if prefix and "." not in prefix else attr


_NOT_SLOTS = ("parameters", "_parameters")


def _local_shape(p: Parameter) -> Tuple[int, ...]:
    return tuple(p.local_shape) if isinstance(p, DTensor) else tuple(p.shape)


def get_optimizer_state_dict(model: nn.Cell, optimizers: Union[nn.Optimizer, Sequence[nn.Optimizer]], *,
                             options: Optional[StateDictOptions] = None) -> Dict[str, Any]:
    """``{"state": {fqn: {slot: moment}}, "param_groups": [group per optimizer]}``; moments of
    sharded parameters are :class:`ShardedTensor` pieces with their parameter's layout.

    Args:
        model: the Cell the optimizers train (names the moments by parameter).
        optimizers: one optimizer or a sequence of them.
        options: a :class:`StateDictOptions`.

    Example::

        optim_sd = get_optimizer_state_dict(model, optimizer)   # {"state": {"fc.weight": {"moment1": ...}}, ...}
    """
    options = options or StateDictOptions()
    state: Dict[str, Dict[str, Any]] = {}
    groups = []
    for optimizer in _optimizer_list(optimizers):
        slots, scalars, fqns = _slots(model, optimizer)
        params = dict(model.parameters_and_names())
        for fqn, named in slots.items():
            spec = parameter_spec(params[fqn])
            state[fqn] = {slot: _export(q if spec is None else ShardedTensor(q, spec), options)
                          for slot, q in named.items()}
        group: Dict[str, Any] = {k: _export(v, options) for k, v in scalars.items()}
        group["params"] = fqns
        groups.append(group)
    if options.rank0_only and Coordinator(distributed=True).rank != 0:
        return {}
    return {"state": state, "param_groups": groups}


def _optimizer_list(optimizers: Any) -> List[nn.Cell]:
    """``optimizers`` (one or a sequence) as a list of MindSpore optimizers: ``nn.Optimizer`` or
    ``mint.optim`` / ``experimental.optim`` ones (their moments are ParameterTuples aligned with
    the parameters too: ``exp_avg``, ``exp_avg_sq``, ``momentum_buf``, ...); anything else is refused
    naming the supported kinds."""
    from mindspore.experimental.optim import Optimizer as MintOptimizer
    found = [optimizers] if isinstance(optimizers, nn.Cell) else list(optimizers) if isinstance(
        optimizers, (list, tuple)) else [optimizers]
    wrong = [type(o).__module__ + "." + type(o).__name__ for o in found
             if not isinstance(o, (nn.Optimizer, MintOptimizer))]
    if wrong:
        raise TypeError(f"optimizer state dicts read MindSpore optimizers (nn.Optimizer: nn.AdamWeightDecay, nn.Adam, "
                        f"nn.SGD, ...; mint.optim / experimental.optim: Adam, SGD, ...); got {wrong}")
    return found


def get_state_dict(model: nn.Cell, optimizers: Union[nn.Optimizer, Sequence[nn.Optimizer]], *,
                   options: Optional[StateDictOptions] = None) -> Tuple[Dict[str, Any], Dict[str, Any]]:
    """``(get_model_state_dict(model), get_optimizer_state_dict(model, optimizers))``.

    Args:
        model, optimizers, options: as in :func:`get_optimizer_state_dict`.

    Example::

        model_sd, optim_sd = get_state_dict(model, optimizer)
    """
    return (get_model_state_dict(model, options=options),
            get_optimizer_state_dict(model, optimizers, options=options))


def _stage(key: str, target: Union[Parameter, ShardedTensor], value: Any) -> Optional[Tuple[TensorRef, np.ndarray]]:
    """Check ``value`` (the target's piece, or the whole tensor to cut) against ``target``;
    return the reference and the data to assign (``None`` when value is the target itself)."""
    local = target.local if isinstance(target, ShardedTensor) else target
    if value is local or value is target or (isinstance(value, ShardedTensor) and value.local is local):
        return None
    refs, _ = flatten({key: target}, for_save=False)
    ref = refs[key]
    piece = ref.piece
    _check_same_box(key, ref, value)
    data = to_numpy(value.local if isinstance(value, ShardedTensor) else value)
    if tuple(data.shape) == piece.shape and piece.sizes != piece.shape:
        data = data[tuple(slice(o, o + s) for o, s in zip(piece.offsets, piece.sizes))]
    if tuple(data.shape) != piece.sizes:
        raise CheckpointError(f"state dict entry {key!r} has shape {tuple(data.shape)}; expected this rank's piece "
                              f"{piece.sizes} or the whole tensor {piece.shape}")
    return ref, np.asarray(cast_for_load(key, data, piece.dtype, "the state dict entry"), order="C")


def _boxes(spec: Any) -> Dict[int, Tuple[Tuple[int, ...], Tuple[int, ...]]]:
    """Every rank's (offsets, sizes) under ``spec`` (the same answer on every rank)."""
    mesh = spec.mesh.mesh
    return {int(mesh[c]): (tuple(spec.layout.global_offset(spec.shape, c)), tuple(spec.layout.local_shape(spec.shape, c)))
            for c in np.ndindex(*mesh.shape)}


def _check_same_box(key: str, ref: TensorRef, value: Any) -> None:
    """Refuse a value that is a piece of another layout (a DTensor, a ShardedTensor or a sharded
    Parameter whose box on some rank is not the target's there): copying it would put other rows
    in place, silently. Decided from both layouts, so every rank raises alike. A whole value (or
    a plain tensor of the piece's shape) is taken as before."""
    if not is_tensor_like(value) or ref.spec is None:
        return
    given = flatten({key: value}, for_save=True)[0][key]
    if given.spec is None or given.piece.sizes == given.piece.shape or given.piece.shape != ref.piece.shape:
        return
    theirs, ours = _boxes(given.spec), _boxes(ref.spec)
    if any(ours.get(r, box) != box for r, box in theirs.items()) or set(ours) - set(theirs):
        raise CheckpointError(
            f"state dict entry {key!r} is a piece of another layout ({given.spec.layout} on ranks "
            f"{sorted(theirs)}) than the target's ({ref.spec.layout} on ranks {sorted(ours)}): copying pieces "
            f"would put other rows in place. Pass whole tensors (get_model_state_dict / "
            f"get_optimizer_state_dict with StateDictOptions(full_state_dict=True)) or save and load through "
            f"hyper_parallel_ms.checkpoint, which reshards")


def _check_keys(kind: str, expected: Sequence[str], given: Sequence[str], strict: bool) -> IncompatibleKeys:
    keys = IncompatibleKeys(tuple(k for k in expected if k not in set(given)),
                            tuple(k for k in given if k not in set(expected)))
    if strict and (keys.missing_keys or keys.unexpected_keys):
        raise CheckpointError(f"{kind} state dict does not match: missing keys {list(keys.missing_keys)}, "
                              f"unexpected keys {list(keys.unexpected_keys)}")
    return keys


def _model_staged(model: nn.Cell, state_dict: Dict[str, Any], options: StateDictOptions):
    params = _model_params(model, options)
    keys = _check_keys("model", list(params), list(state_dict), options.strict)
    staged = [_stage(k, params[k], v) for k, v in state_dict.items() if k in params]
    return keys, staged


def _optimizer_staged(model: nn.Cell, optimizers, state_dict: Dict[str, Any], options: StateDictOptions):
    current = get_optimizer_state_dict(model, optimizers)
    given_state, given_groups = state_dict.get("state", {}), state_dict.get("param_groups", [])
    flat_now = {f"{fqn}.{slot}": v for fqn, slots in current["state"].items() for slot, v in slots.items()}
    flat_given = {f"{fqn}.{slot}": v for fqn, slots in given_state.items() for slot, v in slots.items()}
    if len(given_groups) != len(current["param_groups"]):
        raise CheckpointError(f"optimizer state dict has {len(given_groups)} param_groups, the optimizers have "
                              f"{len(current['param_groups'])}")
    for i, (now, given) in enumerate(zip(current["param_groups"], given_groups)):
        if list(given.get("params", now["params"])) != list(now["params"]):
            raise CheckpointError(f"param_groups[{i}] lists other parameters than the optimizer updates")
        for k, v in now.items():
            if k != "params":
                flat_now[f"param_groups.{i}.{k}"] = v
        for k, v in given.items():
            if k != "params":
                flat_given[f"param_groups.{i}.{k}"] = v
    keys = _check_keys("optimizer", list(flat_now), list(flat_given), options.strict)
    staged = [_stage(k, flat_now[k], v) for k, v in flat_given.items() if k in flat_now]
    return keys, staged


def _host_tree(value: Any, key: str = "") -> Any:
    """``value`` (rank 0's whole state dict) with every tensor as a host array, to send."""
    if isinstance(value, dict):
        return {k: _host_tree(v, f"{key}.{k}" if key else str(k)) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_host_tree(v, f"{key}.{i}") for i, v in enumerate(value))
    if isinstance(value, (DTensor, ShardedTensor)) or (isinstance(value, Tensor) and
                                                        parameter_sharding(value) is not None):
        raise CheckpointError(f"state dict entry {key!r} given to rank 0 is a sharded tensor; with "
                              "broadcast_from_rank0 rank 0 gives whole tensors (get_model_state_dict / "
                              "get_optimizer_state_dict with StateDictOptions(full_state_dict=True, cpu_offload=True))")
    return to_numpy(value).copy() if isinstance(value, Tensor) else value


def _from_rank0(state_dict: Dict[str, Any], options: StateDictOptions) -> Dict[str, Any]:
    """``state_dict`` itself, or with ``broadcast_from_rank0`` rank 0's, received by every rank
    (a failure on rank 0 raises on every rank)."""
    if not options.broadcast_from_rank0:
        return state_dict
    coord = Coordinator(distributed=True)
    payload, error = None, None
    if coord.rank == 0:
        try:
            if not isinstance(state_dict, dict):
                raise CheckpointError(f"state dict must be a dict, got {type(state_dict).__name__}")
            payload = pickle.dumps(_host_tree(state_dict), protocol=pickle.HIGHEST_PROTOCOL)
        except (CheckpointError, pickle.PicklingError, TypeError) as exc:
            error = f"rank 0's state dict cannot be sent: {exc}"
    coord.agree(error)
    return pickle.loads(coord.broadcast(payload))


def _assign(staged) -> None:
    for item in staged:
        if item is not None:
            item[0].assign(item[1])


def set_model_state_dict(model: nn.Cell, model_state_dict: Dict[str, Any], *,
                         options: Optional[StateDictOptions] = None) -> IncompatibleKeys:
    """Copy ``model_state_dict`` into the model's parameters; each value may be this rank's
    piece or the whole tensor (cut to the piece). Everything is checked before any change.

    Args:
        model: the Cell.
        model_state_dict: name -> value (a piece, the whole tensor, a DTensor or a ShardedTensor).
        options: a :class:`StateDictOptions` (``strict``: raise on missing or unexpected keys).

    Example::

        keys = set_model_state_dict(model, model_sd, options=StateDictOptions(strict=False))
    """
    options = options or StateDictOptions()
    keys, staged = _model_staged(model, _from_rank0(model_state_dict, options), options)
    _assign(staged)
    return keys


def set_optimizer_state_dict(model: nn.Cell, optimizers: Union[nn.Optimizer, Sequence[nn.Optimizer]],
                             optim_state_dict: Dict[str, Any], *,
                             options: Optional[StateDictOptions] = None) -> IncompatibleKeys:
    """Copy an optimizer state dict (as :func:`get_optimizer_state_dict` makes it, pieces or
    whole tensors) into the optimizers' moments and scalars.

    Args:
        model: the Cell the optimizers train.
        optimizers: one optimizer or a sequence of them.
        optim_state_dict: as :func:`get_optimizer_state_dict` makes it.
        options: a :class:`StateDictOptions`.

    Example::

        set_optimizer_state_dict(model, optimizer, optim_sd)
    """
    options = options or StateDictOptions()
    keys, staged = _optimizer_staged(model, optimizers, _from_rank0(optim_state_dict, options), options)
    _assign(staged)
    return keys


def set_state_dict(model: nn.Cell, optimizers: Union[nn.Optimizer, Sequence[nn.Optimizer]], *,
                   model_state_dict: Dict[str, Any], optim_state_dict: Dict[str, Any],
                   options: Optional[StateDictOptions] = None) -> IncompatibleKeys:
    """:func:`set_model_state_dict` and :func:`set_optimizer_state_dict`, all checked first.

    Args:
        model, optimizers: as in :func:`set_optimizer_state_dict`.
        model_state_dict: as in :func:`set_model_state_dict`.
        optim_state_dict: as in :func:`set_optimizer_state_dict`.
        options: a :class:`StateDictOptions`.

    Example::

        set_state_dict(model, optimizer, model_state_dict=model_sd, optim_state_dict=optim_sd)
    """
    options = options or StateDictOptions()
    model_keys, model_staged = _model_staged(model, _from_rank0(model_state_dict, options), options)
    optim_keys, optim_staged = _optimizer_staged(model, optimizers, _from_rank0(optim_state_dict, options), options)
    _assign(model_staged + optim_staged)
    return IncompatibleKeys(model_keys.missing_keys + optim_keys.missing_keys,
                            model_keys.unexpected_keys + optim_keys.unexpected_keys)
