"""Rules shared by the three ways to shard a Cell (``parallelize_module``, ``shard_module``,
``distribute_module``): one path-matching rule, one mesh check, one done-marker.

Path matching: a key is a dotted path whose segments are ``fnmatch`` patterns matched one
segment at a time (``*`` never crosses a dot): ``"layers.*.attn.q"`` matches
``layers.0.attn.q`` but not ``layers.0.inner.attn.q``; ``""`` is the module itself.

Example:
    >>> match_path("layers.3.attn.w[qk]", "layers.3.attn.wq"), match_path("*", "layers.0")
    (True, False)
"""
from __future__ import annotations

from fnmatch import fnmatchcase
from typing import Optional

from mindspore import nn

from ..mesh import DeviceMesh
from ._adapter import CellChanges, named_cells

__all__ = ["match_path", "check_mesh", "mark_done", "check_not_done"]

_DONE = "_hpms_sharded_by"


def match_path(pattern: str, path: str) -> bool:
    """Whether the dotted ``path`` matches ``pattern`` segment by segment."""
    if pattern == "" or path == "":
        return pattern == path
    parts, segs = pattern.split("."), path.split(".")
    return len(parts) == len(segs) and all(fnmatchcase(s, p) for s, p in zip(segs, parts))


def check_mesh(mesh, what: str, ndim: Optional[int] = None) -> DeviceMesh:
    """``mesh`` is a DeviceMesh holding this rank (with ``ndim`` dims if given), or raise naming ``what``."""
    if not isinstance(mesh, DeviceMesh):
        raise TypeError(f"{what} needs a DeviceMesh (e.g. init_device_mesh(...)['tp']), got {mesh!r}")
    if ndim is not None and mesh.ndim != ndim:
        raise ValueError(f"{what} needs a {ndim}-D mesh (e.g. mesh['tp']), got a {mesh.ndim}-D mesh of shape "
                         f"{mesh.shape}")
    if mesh.get_coordinate() is None:
        raise ValueError(f"this rank ({mesh.get_rank()}) is not in {mesh!r}")
    return mesh


def mark_done(changes: CellChanges, cell: nn.Cell, engine: str) -> None:
    """Record that ``engine`` replaced parameters of ``cell`` (undone with ``changes``)."""
    changes.set_attribute(cell, _DONE, engine)


def check_not_done(root: nn.Cell, engine: str, prefix: str = "", nested_ok: Optional[str] = None) -> None:
    """Raise if a Cell under ``root`` already went through one of the engines: its parameters
    are pieces already, and a second engine would cut them again. ``nested_ok``: an engine whose
    earlier calls on sub-Cells (not ``root``) are accepted (the caller keeps their parameters)."""
    for path, cell in named_cells(root).items():
        done = cell.__dict__.get(_DONE)
        if done is not None and not (path and done == nested_ok):
            full = ".".join(p for p in (prefix, path) if p)
            where = f"'{full}'" if full else "the module"
            raise RuntimeError(f"{engine}: {where} was already sharded by {done}; its parameters are pieces already "
                               f"(apply one plan per Cell, once)")
