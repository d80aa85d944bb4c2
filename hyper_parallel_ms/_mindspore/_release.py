"""The installed MindSpore release, checked on import, and what differs between releases.

>>> MINDSPORE_VERSION >= (2, 8)
True
"""
from __future__ import annotations

from typing import Callable, Tuple, TypeVar

import mindspore

from .. import _check_mindspore, _release

_check_mindspore(mindspore.__version__)  # before touching the internals below

try:  # MindSpore 2.9 and later
    from mindspore.graph import api as _graph_api  # noqa: E402
except ImportError:  # MindSpore 2.8
    from mindspore.common import api as _graph_api  # noqa: E402

__all__ = ["MINDSPORE_VERSION", "LIST_ARGS_REACH_HOOK", "HOOK_ERRORS_REACH_CALLER", "ADOPTED_REACH_HOOK",
           "OVERLOAD_OPS_CALLABLE", "F", "ABSENT"]

F = TypeVar("F", bound=Callable)
ABSENT = object()        # an attribute a swap found missing

MINDSPORE_VERSION: Tuple[int, int] = _release(mindspore.__version__)
# 2.10 calls the hook for tensors inside list arguments (ops.cat([dt, ...])); 2.8 / 2.9 only
# inside tuples. 2.10 passes an exception raised in the hook to the caller; 2.8 / 2.9 print it
# and raise ``RuntimeError: Python fallback failed.`` instead.
LIST_ARGS_REACH_HOOK: bool = MINDSPORE_VERSION >= (2, 10)
HOOK_ERRORS_REACH_CALLER: bool = MINDSPORE_VERSION >= (2, 10)
# On 2.8 an object whose ``__class__`` was swapped to the subclass reaches the hook in
# generated ops (``ops.add``, ``mint.*``) but not in legacy primitives (``ops.reduce_sum``:
# a silent local result) nor as the first tensor of a tuple argument; an object made by
# ``_make_subclass`` reaches it everywhere. 2.9 and later look at the class.
ADOPTED_REACH_HOOK: bool = MINDSPORE_VERSION >= (2, 9)
# 2.8 / 2.9: the op object that an overloaded functional op (a function of
# ``functional_overload``, ``return _<name>_instance(*args, **kwargs)``) hands the hook returns,
# when called from Python, a result whose last reference it has already released.
OVERLOAD_OPS_CALLABLE: bool = MINDSPORE_VERSION >= (2, 10)
