"""Running library Python while ``ms.jit`` compiles a caller.

MindSpore's jit parser compiles the Python functions a jitted function calls, but treats
an ``functools.lru_cache`` object as an opaque callable and evaluates it in Python on its
(constant) arguments. Planning code (group lookup, argument checks, byte counts) is
wrapped that way so that the same public functions work in PyNative and inside jit:
:func:`cached_in_python` memoises, :func:`run_in_python` runs on every call.
:func:`is_compiling` tells whether Python is running on behalf of the graph compiler.

Example:
    >>> @run_in_python
    ... def double(n):
    ...     return 2 * n
    >>> double(4), is_compiling()
    (8, False)
"""
from __future__ import annotations

import functools
import os
import sys
from typing import Callable, TypeVar

__all__ = ["cached_in_python", "run_in_python", "is_compiling"]

F = TypeVar("F", bound=Callable)
_COMPILE_FILE = os.path.join("mindspore", "graph", "api.py")


def cached_in_python(fn: F) -> F:
    """Memoise ``fn`` (hashable arguments); under ms.jit it runs in Python at compile time."""
    return functools.lru_cache(maxsize=4096)(fn)


def run_in_python(fn: F) -> F:
    """Under ms.jit, run ``fn`` in Python at compile time instead of compiling it (no memo)."""
    return functools.lru_cache(maxsize=0)(fn)


def is_compiling() -> bool:
    """Whether a caller frame is MindSpore's graph ``compile`` (``mindspore/graph/api.py``)."""
    frame = sys._getframe(1)
    while frame is not None:
        code = frame.f_code
        if code.co_name == "compile" and code.co_filename.endswith(_COMPILE_FILE):
            return True
        frame = frame.f_back
    return False
