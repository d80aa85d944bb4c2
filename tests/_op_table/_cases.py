"""The op sweep's table: every family's entries, in the table's order."""
from __future__ import annotations

from typing import List

from . import (activations, binary, copies, gathers, integers, matmul, reductions, scalars, scans, select, unary,
               unsupported, views)
from ._base import OpCase

FAMILIES = (unary, activations, scalars, binary, select, reductions, scans, views, copies, gathers, matmul, integers,
            unsupported)
CASES: List[OpCase] = [entry for family in FAMILIES for entry in family.CASES]
