"""Which Cells a plan targets, and whether they may be targeted: what the three ways to shard a
Cell (``parallelize_module``, ``shard_module``, ``distribute_module``) share: one path-matching
rule, one mesh check, one done-marker.

Path matching: a key is a dotted path whose segments are ``fnmatch`` patterns matched one
segment at a time (``*`` never crosses a dot): ``"layers.*.attn.q"`` matches
``layers.0.attn.q`` but not ``layers.0.inner.attn.q``; ``""`` is the module itself.

Done-marker: set by each engine and by ``fully_shard`` / ``hsdp`` on the Cells they shard. A
Cell goes through one engine once, and a parallel style cannot follow ``fully_shard`` / ``hsdp``
anywhere in the model (their pieces and hooks expect full, possibly TP-placed parameters):
:func:`check_not_fully_sharded` refuses it naming the order that works (TP first).

Example:
    >>> match_path("layers.3.attn.w[qk]", "layers.3.attn.wq"), match_path("*", "layers.0")
    (True, False)
"""
from __future__ import annotations

import difflib
import re
from fnmatch import fnmatchcase
from typing import Dict, List, Optional, Sequence, Tuple

from mindspore import nn

from ..mesh import DeviceMesh
from ._adapter import CellChanges, named_cells

__all__ = ["match_path", "near_names", "check_mesh", "mark_done", "check_not_done", "check_not_fully_sharded",
           "changed_cells", "DATA_PARALLEL"]

_DONE = "_hpms_sharded_by"
DATA_PARALLEL = ("fully_shard", "hsdp")     # the engines sharding over data parallelism


def match_path(pattern: str, path: str) -> bool:
    """Whether the dotted ``path`` matches ``pattern`` segment by segment."""
    if pattern == "" or path == "":
        return pattern == path
    parts, segs = pattern.split("."), path.split(".")
    return len(parts) == len(segs) and all(fnmatchcase(s, p) for s, p in zip(segs, parts))


# last path tokens that name the same kind of layer in PyTorch and MindSpore models (``linear1`` / ``dense1``)
_SAME_ROLE: Tuple[Tuple[str, ...], ...] = (
    ("linear", "dense", "fc", "proj", "lin"), ("embedding", "embed", "embeddings", "wte", "tok_embeddings"),
    ("norm", "ln", "layernorm", "layer_norm"), ("attn", "attention", "self_attn"), ("mlp", "ffn", "feed_forward"))


def _stem(token: str) -> Tuple[str, str]:
    """``("linear", "1")`` for ``"linear1"``: the name and its trailing number."""
    name, number = re.fullmatch(r"(.*?)_?(\d*)", token).groups()
    return name.lower(), number


def near_names(key: str, names: Sequence[str], n: int = 5) -> List[str]:
    """Suggestions for the dotted ``key`` (matched by :func:`match_path`) that names none of
    ``names``: by its last token among the names under what its other segments match, written in
    the key's own pattern (``layers.*.linear1`` gives ``layers.*.dense1``: the same kind of layer by
    PyTorch's and MindSpore's names, ``linear`` / ``dense`` / ``fc`` / ``proj``, then close
    spellings); else close spellings of the whole path.

    >>> near_names("layers.*.linear1", ["layers.0.norm1", "layers.0.dense1", "layers.0.dense2"])
    ['layers.*.dense1', 'layers.*.dense2', 'layers.*.norm1']
    >>> near_names("upp", ["up", "down"])
    ['up']
    """
    prefix, _, last = key.rpartition(".")
    siblings: List[str] = []
    for name in names:
        parent, _, token = name.rpartition(".")
        if match_path(prefix, parent) and token not in siblings:
            siblings.append(token)
    stem, number = _stem(last)
    role = next((group for group in _SAME_ROLE if stem in group), ())
    same = sorted((t for t in siblings if _stem(t)[0] in role), key=lambda t: _stem(t)[1] != number)
    picks = list(dict.fromkeys(same + difflib.get_close_matches(last, siblings, n=n, cutoff=0.5)))
    if picks:
        return [".".join(p for p in (prefix, t) if p) for t in picks[:n]]
    return difflib.get_close_matches(key, list(names), n=n, cutoff=0.5)


def check_mesh(mesh, what: str, ndim: Optional[int] = None) -> DeviceMesh:
    """``mesh`` is a DeviceMesh holding this rank (with ``ndim`` dims if given), or raise naming ``what``."""
    if not isinstance(mesh, DeviceMesh):
        raise TypeError(f"{what} needs a DeviceMesh (e.g. init_device_mesh(...)['tp']), got {mesh!r}")
    if ndim is not None and mesh.ndim != ndim:
        raise ValueError(f"{what} needs a {ndim}-D mesh (e.g. mesh['tp']), got a {mesh.ndim}-D mesh of shape "
                         f"{mesh.shape}")
    if mesh.coordinate is None:
        raise ValueError(f"this rank ({mesh.get_rank()}) is not in {mesh!r}")
    return mesh


def mark_done(changes: CellChanges, cell: nn.Cell, engine: str) -> None:
    """Record that ``engine`` replaced parameters of ``cell`` (undone with ``changes``)."""
    changes.set_attribute(cell, _DONE, engine)


def _where(prefix: str, path: str, cell: nn.Cell) -> str:
    full = ".".join(p for p in (prefix, path) if p)
    return f"'{full}' ({type(cell).__name__})" if full else f"the module ({type(cell).__name__})"


def _after_data_parallel(engine: str, where: str, done: str) -> RuntimeError:
    again = "fully_shard(block, mesh=mesh['dp'])" if done == "fully_shard" else "hsdp(block)"
    return RuntimeError(
        f"{engine}: {where} was already sharded by {done}, so its parameters are data-parallel pieces gathered by "
        f"its hooks, which a parallel style cannot cut. Apply tensor parallelism first, then {done}: on a model not "
        f"sharded yet, {engine}(model, mesh['tp'], ...), then {again} for each block and the root "
        "(mesh = init_device_mesh(device, (dp, tp), mesh_dim_names=('dp', 'tp'))). Nothing was changed")


def check_not_done(root: nn.Cell, engine: str, prefix: str = "", nested_ok: Optional[str] = None) -> None:
    """Raise if a Cell under ``root`` already went through one of the engines: its parameters
    are pieces already, and a second engine would cut them again. ``nested_ok``: an engine whose
    earlier calls on sub-Cells (not ``root``) are accepted (the caller keeps their parameters)."""
    for path, cell in named_cells(root).items():
        done = cell.__dict__.get(_DONE)
        if done in DATA_PARALLEL:
            raise _after_data_parallel(engine, _where(prefix, path, cell), done)
        if done is not None and not (path and done == nested_ok):
            full = ".".join(p for p in (prefix, path) if p)
            where = f"'{full}'" if full else "the module"
            raise RuntimeError(f"{engine}: {where} was already sharded by {done}; its parameters are pieces already "
                               f"(apply one plan per Cell, once)")


def check_not_fully_sharded(root: nn.Cell, engine: str) -> None:
    """Raise, naming the order that works, if a Cell under ``root`` (``root`` included) was
    sharded by ``fully_shard`` or ``hsdp``; the same on every rank, before any change.

    Args:
        root: the Cell a parallel style engine is about to change.
        engine: the engine's name, for the message (``"parallelize_module"``).

    Example::

        check_not_fully_sharded(model, "parallelize_module")   # RuntimeError after fully_shard(model)
    """
    for path, cell in named_cells(root).items():
        done = cell.__dict__.get(_DONE)
        if done in DATA_PARALLEL:
            raise _after_data_parallel(engine, _where("", path, cell), done)


def changed_cells(root: nn.Cell) -> Dict[str, str]:
    """Cell path -> what changed it, for each Cell under ``root`` (``root`` included) that an
    engine sharded (its done-marker: ``"parallelize_module"``, ``"fully_shard"``, ...) or whose
    ``construct`` a parallel style wrapped with input / output conversions.

    Args:
        root: any Cell.

    Example::

        parallelize_module(model, mesh, {"fc1": ColwiseParallel()})
        changed_cells(model)          # {'fc1': 'parallelize_module'}
    """
    found: Dict[str, str] = {}
    for path, cell in named_cells(root).items():
        done = cell.__dict__.get(_DONE)
        if done is None and getattr(type(cell), "_hpms_converting", False):
            done = "a parallel style's input / output conversion"
        if done is not None:
            found[path] = done
    return found
