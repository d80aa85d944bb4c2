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

Example::

    ms.set_seed(0)
    with no_init_parameters():
        model = Net()
    initial_value(model.fc.weight)        # equal to Net().fc.weight built eagerly from seed 0
"""
from __future__ import annotations

import hashlib
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterable, Iterator, Optional, Tuple

import numpy as np
from mindspore import Parameter, Tensor
from mindspore.nn.utils import no_init_parameters as _mindspore_no_init_parameters

from ._mindspore import (deferred_creation_hooked, draw_numpy_seed, fill_deferred, initial_array, initializer_draws,
                         pending_init)

__all__ = ["no_init_parameters", "initial_value", "initialise", "check_initial_values"]

_RECORD = "_hpms_init_record"


@dataclass(frozen=True)
class _Record:
    """numpy's global generator state just before the initialiser would have drawn, and for an
    initialiser whose draws are not known, the digest of the value it gave then."""

    state: Tuple
    digest: Optional[bytes]


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


def _refusal(name: str, init) -> str:
    return (f"parameter {name!r} is not initialised and its initializer {type(init).__name__} draws from the "
            "random stream, but where it would have drawn eagerly was not recorded (the model was built under "
            "mindspore.nn.utils.no_init_parameters(), or the initializer was set after the recording context "
            "ended), so its value would differ from the eager one for the same seed: build the model under "
            "hyper_parallel_ms.no_init_parameters() instead")


@contextmanager
def _drawing_from(record: Optional[_Record]) -> Iterator[None]:
    """Inside, numpy's global generator is at ``record``'s state (where it is, for ``None``); after, where it was."""
    saved = np.random.get_state()
    if record is not None:
        np.random.set_state(record.state)
    try:
        yield
    finally:
        np.random.set_state(saved)


def _checked_record(name: str, pending: Tensor) -> Optional[_Record]:
    record = getattr(pending, _RECORD, None)
    if record is None and initializer_draws(pending.init) != 0:
        raise ValueError(_refusal(name, pending.init))
    return record


def _replay(name: str, pending: Tensor) -> np.ndarray:
    record = _checked_record(name, pending)
    with _drawing_from(record):
        values = initial_array(pending.init, pending.shape, pending.dtype)
    if record is not None and record.digest is not None and _digest(values) != record.digest:
        raise ValueError(f"parameter {name!r}: its initializer {type(pending.init).__name__} gave other values when "
                         "run again from the same numpy random state (it draws from another random source or is "
                         "not deterministic), so its eager value cannot be reproduced later: build this parameter "
                         "eagerly, or give it an initializer that draws only from numpy's global generator")
    return values


def initial_value(param: Parameter) -> np.ndarray:
    """The value ``param`` has eagerly for the same seed: its data if initialised, else its
    recorded initialiser replayed (raises ``ValueError`` when that value cannot be given).

    Example::

        full = initial_value(model.fc.weight)
    """
    pending = pending_init(param)
    if pending is None:
        return param.asnumpy()
    return _replay(param.name, pending)


def check_initial_values(params: Iterable[Parameter]) -> None:
    """Raise ``ValueError`` naming the first of ``params`` whose eager value :func:`initial_value`
    cannot give (checked before anything is changed; initialisers of unknown draws are run once).

    Example::

        check_initial_values(model.get_parameters())
    """
    for param in params:
        pending = pending_init(param)
        if pending is not None:
            record = _checked_record(param.name, pending)
            if record is not None and record.digest is not None:
                _replay(param.name, pending)


def initialise(param: Parameter) -> None:
    """Give a deferred ``param`` its eager value in place; raises ``ValueError`` as
    :func:`initial_value`.

    Example::

        initialise(model.fc.weight)
    """
    pending = pending_init(param)
    if pending is not None:
        fill_deferred(param, _replay(param.name, pending))
