"""The active shape-only run (:func:`.abstract.abstract_run`): the seam's functions that MindSpore's
execution or autodiff would serve ask it first. Innermost run last; empty outside a simulation.
"""
from __future__ import annotations

from typing import Any, List

from mindspore._c_expression import NoFallbackGuard

__all__ = ["ACTIVE_RUNS", "unhooked_op"]

ACTIVE_RUNS: List[Any] = []      # the active shape-only runs (``dryrun._autodiff``), innermost last


def unhooked_op(func: Any, args: tuple, kwargs: dict) -> Any:
    """An op reaching a tensor hook under :func:`.hooks.no_hook` in a shape-only run: shapes only
    when it reads shape-only data, else run as on plain tensors."""
    run = ACTIVE_RUNS[-1]
    if run.reads_abstract(args):
        return run.infer(func, args, kwargs)
    with NoFallbackGuard():
        return func(*args, **kwargs)
