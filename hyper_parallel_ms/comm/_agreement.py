"""The ranks of a mesh agreeing on small host-side values (plans, shapes, failure flags).

One service for every layer that must make sure all ranks hold the same description before
they communicate (``nn``'s plan check, ``ops``' first runs, ``fsdp`` through ``nn``, and
``checkpoint``'s save / load outcome): a vector of float32 values (exact for integers below 2**24) is reduced
with max and min over every mesh dim in one all-reduce per dim; entries that differ are
where max and min disagree. Every rank sees the same result, so every rank can raise.
The traffic is bookkeeping: :class:`~hyper_parallel_ms.comm.CommDebugMode` does not record it.

The values travel through the mesh's exchange (:meth:`~._exchange.Exchange.extremes`). On a
simulated mesh the other ranks are not here: :func:`extremes` returns this rank's values (it
agrees with itself), and what a layer asks the ranks to agree on is handed, through
:func:`note_agreement`, to the observers entered with :func:`observing_agreements` (a
simulation compares the ranks' notes once every rank has run, as the cluster would have).

Example::

    high, low = extremes(np.array([4.0, 16.0]), mesh)
    if (high != low).any():
        raise ValueError("the ranks disagree")
"""
from __future__ import annotations

import contextlib
import hashlib
import itertools
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple

import numpy as np

__all__ = ["digest", "DIGEST_LENGTH", "extremes", "failed_coordinates", "failure_messages", "note_agreement",
           "observing_agreements"]

_DIGEST_BITS = 20
DIGEST_LENGTH = 3          # floats per :func:`digest`

Observer = Callable[[str, Any, Sequence[Tuple[str, str]]], None]
_OBSERVERS: List[Observer] = []


@contextlib.contextmanager
def observing_agreements(observer: Observer) -> Iterator[None]:
    """Inside, ``observer(what, mesh, entries)`` receives every agreement noted over a simulated mesh.

    Args:
        observer: called with the agreement's name, the simulated mesh and ``(name, description)`` entries.

    Example::

        notes = []
        with observing_agreements(lambda what, mesh, entries: notes.append((what, entries))):
            parallelize_module(model, simulated_mesh, plan)
    """
    _OBSERVERS.append(observer)
    try:
        yield
    finally:
        _OBSERVERS.remove(observer)


def note_agreement(what: str, mesh, entries: Sequence[Tuple[str, str]]) -> None:
    """Hand what the ranks of the simulated ``mesh`` must agree on to the active observers.

    Args:
        what: the agreement (the call that checks, e.g. ``"parallelize_module"``).
        mesh: the simulated :class:`DeviceMesh` whose ranks must agree.
        entries: ``(name, description)`` pairs that must be equal on every rank.

    Example::

        note_agreement("parallelize_module", mesh, [("fc1", "ColwiseParallel() ...")])
    """
    for observer in list(_OBSERVERS):
        observer(what, mesh, tuple(entries))


def digest(text: str) -> List[float]:
    """A 60-bit hash of ``text`` as three 20-bit chunks in float32 (exact): what the ranks compare
    when they agree on names or descriptions through :func:`extremes`.

    >>> len(digest("layers.0.weight")), digest("a") == digest("a")
    (3, True)
    """
    h = int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "big")
    mask = (1 << _DIGEST_BITS) - 1
    return [float((h >> (_DIGEST_BITS * i)) & mask) for i in range(DIGEST_LENGTH)]


def extremes(values: np.ndarray, mesh) -> Tuple[np.ndarray, np.ndarray]:
    """(max, min) over every rank of ``mesh`` of each entry of the 1-D ``values`` (every rank
    of the mesh must call, with the same number of values).

    Args:
        values: this rank's values (1-D; integers below 2**24 are carried exactly).
        mesh: the :class:`DeviceMesh` whose ranks agree.

    Example::

        high, low = extremes(np.array([float(n_entries)]), mesh)
    """
    return mesh.exchange.extremes(np.asarray(values, np.float32).reshape(-1), mesh)


def failed_coordinates(mesh, failed: bool) -> List[Tuple[int, ...]]:
    """The mesh coordinates of the ranks that report ``failed``, known to every rank of ``mesh``
    (a flag per rank through :func:`extremes`; every rank must call).

    Args:
        mesh: the :class:`DeviceMesh` whose ranks report.
        failed: whether this rank failed.

    Example::

        if failed_coordinates(mesh, error is not None):
            raise error or RuntimeError("another rank failed")
    """
    flags = np.zeros(mesh.shape, np.float32)
    if failed:
        flags[tuple(mesh.coordinate)] = 1.0
    high, _ = extremes(flags.reshape(-1), mesh)
    high = high.reshape(mesh.shape)
    return [c for c in itertools.product(*(range(n) for n in mesh.shape)) if high[c] > 0]


def failure_messages(mesh, message: Optional[str], limit: int = 400) -> Dict[int, str]:
    """Each failed rank's ``message`` (its flat index in ``mesh`` -> text, UTF-8 cut to ``limit``
    bytes), known to every rank of ``mesh``; ``{}`` when no rank failed. One small all-reduce per
    mesh dim when none failed (:func:`failed_coordinates`), the messages only when some did.

    Args:
        mesh: the :class:`DeviceMesh` whose ranks report (every rank must call).
        message: this rank's error text, or ``None`` if it did not fail.
        limit: the most bytes of each message carried.

    Example::

        failed = failure_messages(mesh, None if error is None else str(error))
        if failed:
            raise RuntimeError("; ".join(f"rank {r}: {text}" for r, text in failed.items()))
    """
    failed = [int(np.ravel_multi_index(c, mesh.shape)) for c in failed_coordinates(mesh, message is not None)]
    if not failed:
        return {}
    codes = np.zeros((int(np.prod(mesh.shape)), limit), np.float32)
    if message is not None:
        data = np.frombuffer(message.encode("utf-8")[:limit], np.uint8)
        codes[int(np.ravel_multi_index(tuple(mesh.coordinate), mesh.shape)), :len(data)] = data
    high, _ = extremes(codes.reshape(-1), mesh)
    high = high.reshape(codes.shape).astype(np.uint8)
    return {r: bytes(high[r]).rstrip(b"\0").decode("utf-8", errors="replace") for r in failed}
