"""The op sweep's table: MindSpore entry points with sample inputs, and the rank function
that runs every entry on DTensors under every placement of its inputs, comparing the
result and its gradients with the single-device op.

An entry is ``OpCase(name, family, fn, inputs)``; ``inputs`` are :class:`Arg` (shape, kind,
which placements it takes). ``status`` is ``"ok"``, ``"unsupported"`` (no rule: the sweep
checks the clear NotImplementedError), ``"bypass"`` (MindSpore runs it without calling the
tensor hook: the sweep checks that this is still so, so that a fix shows) or ``"cpu_kernel"``
(MindSpore has no CPU kernel: the sweep checks that the rule itself is there) or ``"open"``
(the sweep found a wrong result that is not fixed yet; listed in docs/dtensor.md, not run). ``grad=False``
entries with a ``reason`` compare values only (no CPU kernel for the backward).

One module per op family (``unary``, ``activations``, ``scalars``, ``binary``, ``select``,
``reductions``, ``scans``, ``views``, ``copies``, ``gathers``, ``matmul``, ``integers``,
``unsupported``), assembled in this order by ``_cases``; ``_sweep`` holds the rank function.
"""
from ._base import Arg, OpCase
from ._cases import CASES
from ._sweep import sweep

__all__ = ["Arg", "OpCase", "CASES", "sweep"]
