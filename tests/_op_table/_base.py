"""What the op sweep's entries are made of: :class:`Arg` (a sample input), :class:`OpCase`
(an entry), the shared sample inputs, and :func:`collector` (the ``case`` / ``gap`` helpers of
a family module)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, List, Tuple

from mindspore import mint

F = mint.nn.functional


@dataclass(frozen=True)
class Arg:
    """A sample input: ``kind`` is "f" (float), "pos" (positive float), "unit" (in (-1, 1)),
    "b" (bool), "i-<n>" (int64 in [0, n)), "i32-<n>" (int32), "z-<n>" (int64 in [-n, n)),
    "z32-<n>" (int32 in [-n, n)); ``shard`` says which placements it takes:
    "all", "rep" (replicated), "tied" (the first input's placement) or a tuple of the tensor
    dims it may be sharded on."""

    shape: Tuple[int, ...]
    kind: str = "f"
    shard: Any = "all"


@dataclass(frozen=True)
class OpCase:
    name: str
    family: str
    fn: Callable
    inputs: Tuple[Arg, ...]
    status: str = "ok"
    reason: str = ""
    grad: bool = True
    prim: str = ""          # the primitive a "cpu_kernel" entry dispatches (its rule must exist)


A = (5, 6)          # uneven over 4 ranks on both dims (2, 2, 1, 0 and 2, 2, 2, 0): empty pieces
A3 = (4, 5, 6)
X = Arg(A)
POS = Arg(A, "pos")
UNIT = Arg(A, "unit")
MASK = Arg(A, "b", "tied")
Y = Arg(A)
ROW = Arg((6,))
COL = Arg((5, 1))
BOOL = Arg(A, "b")
IDX1 = Arg((4,), "i32-5", "rep")

_NO_GRAD = "value only: MindSpore has no CPU kernel for the backward of {}"


def collector(cases: List[OpCase]) -> Tuple[Callable[..., None], Callable[..., None]]:
    """``(case, gap)`` appending entries to ``cases``: ``case(name, family, fn, *inputs, status=,
    reason=, grad=, prim=)`` (no inputs: ``X``); ``gap(name, family, fn, prim, *inputs, grad=)`` an
    entry point whose kernel MindSpore lacks on CPU (its rule is checked, not run)."""
    def case(name, family, fn, *inputs, status="ok", reason="", grad=True, prim=""):
        cases.append(OpCase(name, family, fn, tuple(inputs) or (X,), status, reason, grad, prim))

    def gap(name, family, fn, prim, *inputs, grad=True):
        case(name, family, fn, *inputs, status="cpu_kernel", reason=f"no CPU kernel for {prim} in MindSpore 2.10",
             grad=grad, prim=prim)
    return case, gap
