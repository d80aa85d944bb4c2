"""Compile-time Python helpers; they live in :mod:`hyper_parallel_ms._mindspore` (the seam
with MindSpore's internals) and are re-exported here for existing imports.

Example:
    >>> from hyper_parallel_ms._jit import run_in_python
    >>> run_in_python(abs)(-2)
    2
"""
from ._mindspore import cached_in_python, is_compiling, run_in_python

__all__ = ["cached_in_python", "run_in_python", "is_compiling"]
