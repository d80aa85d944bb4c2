"""The op sweep's entries: no rule (yet): the clear NotImplementedError."""
from __future__ import annotations

from typing import List

from mindspore import ops

from ._base import OpCase, collector

CASES: List[OpCase] = []
case, _ = collector(CASES)

case("ops.trace", "unsupported", ops.trace, status="unsupported")
case("ops.diag", "unsupported", lambda t: ops.diag(t[0]), status="unsupported")
case("ops.renorm", "unsupported", lambda t: ops.renorm(t, 2, 0, 1.0), status="unsupported")
case("ops.diff", "unsupported", lambda t: ops.diff(t, 1, 0), status="unsupported")
case("ops.roll", "unsupported", lambda t: ops.roll(t, 1, 1), status="unsupported")
