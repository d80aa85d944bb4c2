"""Parameters shared by several Cells (tied weights: an LM head using the embedding table as
its weight): one Parameter object held under several (Cell, attribute) pairs.

The engines cut such a parameter once and put the one new Parameter into every holder, so it
stays one parameter, one piece, whose gradient MindSpore sums over its uses. Before anything
changes, :func:`check_tied` refuses a plan whose holders would cut it differently (or leave it
whole in one Cell and cut it in another), naming both Cells and both placements; after user
code replaced a shared parameter in one holder, :func:`retie` puts the replacement into the
others.

Example::

    holders = parameter_holders(model)   # {id(table): [("embed", embed, "embedding_table"), ("head", head, "weight")]}
    check_tied(holders, {(id(embed), "embedding_table"): rows, (id(head), "weight"): rows}, "parallelize_module")
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional, Tuple

from mindspore import Parameter, nn

from ._adapter import CellChanges, named_cells, own_parameters

__all__ = ["Holder", "parameter_holders", "check_tied", "retie", "describe_use"]

Holder = Tuple[str, nn.Cell, str]          # (Cell path, Cell, attribute)


def parameter_holders(root: nn.Cell) -> Dict[int, List[Holder]]:
    """Every (path, Cell, attribute) holding each parameter under ``root``, by the parameter's id."""
    out: Dict[int, List[Holder]] = {}
    for path, cell in named_cells(root).items():
        for attr, p in own_parameters(cell).items():
            out.setdefault(id(p), []).append((path, cell, attr))
    return out


def describe_use(path: str, attr: str) -> str:
    """``'head.weight'``: a parameter's use by its Cell path and attribute."""
    return f"'{path}.{attr}'" if path else f"'{attr}' of the root Cell"


def _placement_text(placement: Any) -> str:
    if placement is None:
        return "left whole (nothing places it)"
    text = "(" + ", ".join(str(p) for p in placement.placements) + ")"
    if getattr(placement, "grad_partial_dims", ()):
        text += f" with partial gradients over mesh dims {placement.grad_partial_dims}"
    return text


def check_tied(holders: Dict[int, List[Holder]], planned: Dict[Tuple[int, str], Any], engine: str) -> None:
    """Raise if a parameter held by several Cells is placed differently by them. ``planned``
    maps (id(Cell), attribute) to its placement (a :class:`~._parameter.ParameterPlacement`);
    a holder missing from it keeps the parameter whole."""
    for users in holders.values():
        if len(users) < 2:
            continue
        placed = [(path, cell, attr, planned.get((id(cell), attr))) for path, cell, attr in users]
        if all(pl is None for *_, pl in placed):
            continue
        first = next(u for u in placed if u[3] is not None)
        for other in placed:
            if other[3] != first[3]:
                name = own_parameters(first[1])[first[2]].name
                raise ValueError(
                    f"{engine}: the parameter {name!r} is shared (tied) by {describe_use(first[0], first[2])} and "
                    f"{describe_use(other[0], other[2])}, which place it differently: {_placement_text(first[3])} "
                    f"and {_placement_text(other[3])}. A shared parameter is one tensor cut one way: place it "
                    "alike in every Cell using it, in the same call (e.g. RowwiseParallel on the embedding and "
                    "ColwiseParallel on the head both cut the (vocab, dim) table as (S(0))), or untie it")


def retie(changes: CellChanges, root: nn.Cell, snapshot: List[tuple], engine: str) -> None:
    """After user code replaced parameters: a parameter that several Cells under ``root`` held
    (``snapshot`` from :func:`~._adapter.snapshot_parameters`) and that one of them now holds a replacement
    of gets that replacement in every holder; two different replacements are refused."""
    uses: Dict[int, List[tuple]] = {}
    for cell, attr, p in snapshot:
        uses.setdefault(id(p), []).append((cell, attr, p))
    paths = {id(c): path for path, c in named_cells(root).items()}
    for users in uses.values():
        if len(users) < 2:
            continue
        original = users[0][2]
        new = [(cell, attr, own_parameters(cell).get(attr)) for cell, attr, _ in users]
        replaced = {id(p): (cell, attr, p) for cell, attr, p in new if p is not original}
        if len(replaced) > 1:
            (c1, a1, p1), (c2, a2, p2) = list(replaced.values())[:2]
            raise ValueError(
                f"{engine}: the parameter {original.name!r} is shared (tied) by "
                f"{describe_use(paths.get(id(c1), type(c1).__name__), a1)} and "
                f"{describe_use(paths.get(id(c2), type(c2).__name__), a2)}, and each got its own new Parameter "
                f"({_what(p1)} and {_what(p2)}): replace it once, in one of them; the other uses then get "
                "the same Parameter")
        if replaced:
            (_, _, p), = replaced.values()
            for cell, attr, held in new:
                if held is original:
                    changes.set_parameter(cell, attr, p)


def _what(p: Optional[Parameter]) -> str:
    spec = getattr(p, "_dt_spec", None)
    return str(tuple(str(x) for x in spec.placements)) if spec is not None else f"shape {tuple(p.shape)}"

