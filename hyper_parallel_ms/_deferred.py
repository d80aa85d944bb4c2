"""Deferred parameters that initialise to their eager values: :func:`no_init_parameters`.

Eagerly, MindSpore runs a Parameter's initialiser the moment the Parameter is made (or an
initialiser Tensor is handed to ``set_data``); the random ones draw from numpy's global
generator, so each value depends on every draw made before it, in creation order.
``mindspore.nn.utils.no_init_parameters()`` skips the draws, and initialising later
(``Cell.init_parameters_data``: attribute order, from wherever the generator is then) gives
other values as soon as a Parameter is defined after a sub-Cell. :func:`no_init_parameters`
does what MindSpore's does and, at each moment an initialiser would have run, records the
generator's state for it and advances the generator as the initialiser would have (one draw
for MindSpore's random classes; other initialisers are run once and their value's digest
kept). :func:`initial_value` replays an initialiser from its recorded state: the eager value,
whatever the order in which Parameters are initialised, for any definition order, shared
sub-Cells, tied Parameters and numpy draws of the model's own in between. The generator is
left where eager construction leaves it.

An unrecorded random initialiser (MindSpore's own context) runs from numpy's current state
when its value is first needed, as MindSpore runs it when a deferred Parameter's data is
first read, and that state is kept for it (later uses give the same value); the callers run
them in MindSpore's order and :func:`unrecorded_notice` warns once per call.

Example::

    ms.set_seed(0)
    with no_init_parameters():
        model = Net()
    initial_value(model.fc.weight)        # equal to Net().fc.weight built eagerly from seed 0
"""
from __future__ import annotations

import hashlib
import warnings
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Iterable, Iterator, List, Optional, Tuple

import numpy as np
from mindspore import Parameter, Tensor
from mindspore.nn.utils import no_init_parameters as _mindspore_no_init_parameters

from . import _cluster
from ._mindspore import (deferred_creation_hooked, draw_numpy_seed, fill_deferred, initial_array, initializer_draws,
                         pending_init)

__all__ = ["no_init_parameters", "init_empty_weights", "init_on_device", "initial_value", "initialise", "check_initial_values",
           "unrecorded_notice"]

_RECORD = "_hpms_init_record"
# names of parameters whose unrecorded initialisers ran inside the current unrecorded_notice()
_UNRECORDED: ContextVar[Optional[List[str]]] = ContextVar("hpms_unrecorded_initialisers", default=None)


@dataclass(frozen=True)
class _Record:
    """numpy's global generator state just before the initialiser would have drawn eagerly
    (``eager``; else: just before it first ran, unrecorded), and for an initialiser whose draws
    are not known, the digest of the value it gave then."""

    state: Tuple
    digest: Optional[bytes]
    eager: bool = True            # recorded at creation; False: fixed when first run unrecorded


def _digest(values: np.ndarray) -> bytes:
    return hashlib.sha256(np.ascontiguousarray(values).tobytes()).digest()


def _record(init_tensor: Tensor) -> None:
    if getattr(init_tensor, _RECORD, None) is not None:
        return                                 # one initialiser Tensor runs once eagerly, then is data
    state = np.random.get_state()
    draws = initializer_draws(init_tensor.init)
    digest = None
    if draws is None:                          # run it: the generator moves exactly as eagerly
        digest = _digest(initial_array(init_tensor.init, init_tensor.shape, init_tensor.dtype))
    else:
        for _ in range(draws):
            draw_numpy_seed()
    object.__setattr__(init_tensor, _RECORD, _Record(state, digest))


@contextmanager
def no_init_parameters() -> Iterator[None]:
    """``mindspore.nn.utils.no_init_parameters()`` that records where each initialiser would
    have drawn, so that :func:`initial_value` (``init_parameters``, the parallel styles) gives
    the eager values.

    Example::

        ms.set_seed(0)
        with no_init_parameters():
            model = Llama(config)
    """
    with _mindspore_no_init_parameters(), deferred_creation_hooked(_record):
        yield


@contextmanager
def init_empty_weights(include_buffers: bool = False) -> Iterator[None]:
    """HyperParallel's ``init_empty_weights``: Parameters made inside hold no values (as on
    PyTorch's meta device) until ``init_parameters`` / ``init_parameters_data`` gives them their
    eager values or a checkpoint is loaded; :func:`no_init_parameters` under another name.

    Args:
        include_buffers: accepted for HyperParallel's signature; it changes nothing: MindSpore keeps
            module state (BatchNorm's moving averages) in Parameters, deferred like the others.

    Example::

        with init_empty_weights():
            model = Llama(config)          # no memory for the weights yet
    """
    del include_buffers                    # MindSpore has no buffers apart from Parameters
    with no_init_parameters():
        yield


@contextmanager
def init_on_device(device: object, include_buffers: bool = False) -> Iterator[None]:
    """HyperParallel's ``init_on_device``: ``"meta"`` defers the Parameters made inside (as
    :func:`init_empty_weights`); this rank's device (``"cpu"``, ``"npu"``, ``"npu:0"``, ``"Ascend"``)
    changes nothing, MindSpore placing every tensor on the device ``ms.set_device`` chose; another
    device is refused.

    Args:
        device: ``"meta"`` or this rank's device (a string, or an object whose ``str`` is one).
        include_buffers: as :func:`init_empty_weights`.

    Example::

        with init_on_device("meta"):
            model = Llama(config)          # no memory for the weights yet
    """
    name = str(device)
    if name == "meta":
        with init_empty_weights(include_buffers):
            yield
        return
    kind = name.split(":")[0]
    if _cluster.device_key(kind) != _cluster.device_type():
        raise ValueError(f"init_on_device({device!r}): this rank computes on {_cluster.device_target()} "
                         f"(ms.set_device); use 'meta' or this device")
    yield


def _warn(names: List[str], when: str) -> None:
    shown = ", ".join(repr(n) for n in names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
    warnings.warn(f"deferred parameters {shown} have random initializers that hyper_parallel_ms.no_init_parameters() "
                  "did not record (built under mindspore.nn.utils.no_init_parameters(), or set after the recording "
                  f"context ended): they were initialised from numpy's random state {when}, as MindSpore initialises "
                  "deferred Parameters (init_parameters_data(): attribute order; a Parameter alone: when first "
                  "read). These values differ from the eager ones when a Parameter is created in another order than "
                  "its Cell lists it; build the model under hyper_parallel_ms.no_init_parameters() for the eager "
                  "values", UserWarning, stacklevel=4)


@contextmanager
def unrecorded_notice(when: str) -> Iterator[None]:
    """One warning, when the block ends without error, naming the parameters whose unrecorded
    random initialisers ran inside it (``when``: the order they ran in); nested blocks report
    to the outermost.

    Example::

        with unrecorded_notice("in attribute order (as Cell.init_parameters_data())"):
            for param in params:
                initialise(param)
    """
    if _UNRECORDED.get() is not None:
        yield
        return
    names: List[str] = []
    token = _UNRECORDED.set(names)
    try:
        yield
    finally:
        _UNRECORDED.reset(token)
    if names:
        _warn(names, when)


def _run_now(name: str, pending: Tensor) -> np.ndarray:
    """Run an unrecorded initialiser from numpy's current state (as MindSpore does when a deferred
    Parameter's data is first read) and keep that state for it: later uses give the same value."""
    draws = initializer_draws(pending.init)
    state = np.random.get_state()
    values = initial_array(pending.init, pending.shape, pending.dtype)
    if draws != 0:
        object.__setattr__(pending, _RECORD, _Record(state, _digest(values) if draws is None else None, eager=False))
        names = _UNRECORDED.get()
        if names is None:
            _warn([name], "when first used (here)")
        else:
            names.append(name)
    return values


@contextmanager
def _drawing_from(record: _Record) -> Iterator[None]:
    """Inside, numpy's global generator is at ``record``'s state; after, where it was."""
    saved = np.random.get_state()
    np.random.set_state(record.state)
    try:
        yield
    finally:
        np.random.set_state(saved)


def _replay(name: str, pending: Tensor) -> np.ndarray:
    record = getattr(pending, _RECORD, None)
    if record is None:
        return _run_now(name, pending)
    with _drawing_from(record):
        values = initial_array(pending.init, pending.shape, pending.dtype)
    if record.digest is not None and _digest(values) != record.digest:
        raise ValueError(f"parameter {name!r}: its initializer {type(pending.init).__name__} gave other values when "
                         "run again from the same numpy random state (it draws from another random source or is "
                         "not deterministic), so its value cannot be reproduced later: build this parameter "
                         "eagerly, or give it an initializer that draws only from numpy's global generator")
    return values


def initial_value(param: Parameter) -> np.ndarray:
    """``param``'s value: its data if initialised; else its initialiser replayed from the state
    recorded by :func:`no_init_parameters` (the eager value); else (unrecorded) run now from
    numpy's current state and kept for it, with a warning (see :func:`unrecorded_notice`).
    Raises ``ValueError`` for a recorded initialiser that does not replay. ``param`` stays deferred.

    Example::

        full = initial_value(model.fc.weight)
    """
    pending = pending_init(param)
    if pending is None:
        return param.asnumpy()
    return _replay(param.name, pending)


def _kind(pending: Tensor) -> str:
    record = getattr(pending, _RECORD, None)
    if initializer_draws(pending.init) == 0 or (record is not None and not record.eager):
        return "fixed"                         # draws nothing, or its value was fixed when first used
    return "recorded" if record is not None else "unrecorded"


def check_initial_values(params: Iterable[Parameter]) -> None:
    """Raise ``ValueError`` before anything is changed when ``params`` cannot all be initialised
    by one rule: recorded random initialisers mixed with unrecorded ones, or a recorded
    initialiser that does not replay (initialisers of unknown draws are run once to check).

    Example::

        check_initial_values(model.get_parameters())
    """
    kinds = {}
    for param in params:
        pending = pending_init(param)
        if pending is None:
            continue
        kinds.setdefault(_kind(pending), param.name)
        record = getattr(pending, _RECORD, None)
        if record is not None and record.digest is not None:
            _replay(param.name, pending)
    if "recorded" in kinds and "unrecorded" in kinds:
        raise ValueError(f"parameter {kinds['recorded']!r} was built under hyper_parallel_ms.no_init_parameters() "
                         f"(initialised to its eager value) but parameter {kinds['unrecorded']!r} has a random "
                         "initializer it did not record (built under mindspore.nn.utils.no_init_parameters(), or "
                         "set after the recording context ended), whose value would depend on the others' order: "
                         "build the whole model, and any set_data(initializer(...)) on it, inside one "
                         "hyper_parallel_ms.no_init_parameters() block")


def initialise(param: Parameter) -> None:
    """Give a deferred ``param`` its value (:func:`initial_value`) in place.

    Example::

        initialise(model.fc.weight)
    """
    pending = pending_init(param)
    if pending is not None:
        fill_deferred(param, _replay(param.name, pending))
