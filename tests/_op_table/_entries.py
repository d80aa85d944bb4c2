"""The op sweep's entries: :class:`Arg`, :class:`OpCase`, the shared sample inputs and
:class:`Table`, which each family module fills."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, List, Tuple

from mindspore import mint


F = mint.nn.functional


@dataclass(frozen=True)
class Arg:
    """A sample input: ``kind`` is "f" (float), "pos" (positive float), "unit" (in (-1, 1)),
    "b" (bool), "i<n>" (int64 in [0, n)), "i32<n>"; ``shard`` says which placements it takes:
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
    one_d_only: str = ""    # why the entry is left out on the 2-D mesh


A = (5, 6)          # uneven over 4 ranks on both dims (2, 2, 1, 0 and 2, 2, 2, 0): empty pieces
A3 = (4, 5, 6)
X = Arg(A)
POS = Arg(A, "pos")
UNIT = Arg(A, "unit")
MASK = Arg(A, "b", "tied")

Y = Arg(A)
NO_GRAD = "value only: MindSpore has no CPU kernel for the backward of {}"


class Table:
    """The entries of one family module, in the order they are added."""

    def __init__(self) -> None:
        self.cases: List[OpCase] = []

    def case(self, name, family, fn, *inputs, status="ok", reason="", grad=True, prim="", one_d_only=""):
        self.cases.append(OpCase(name, family, fn, tuple(inputs) or (X,), status, reason, grad, prim, one_d_only))

    def gap(self, name, family, fn, prim, *inputs, grad=True):
        """An entry point whose kernel MindSpore lacks on CPU: its rule is checked, not run."""
        self.case(name, family, fn, *inputs, status="cpu_kernel", reason=f"no CPU kernel for {prim} in MindSpore 2.10",
                  grad=grad, prim=prim)


