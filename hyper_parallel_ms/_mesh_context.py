"""The current device mesh: the stack of meshes entered with ``with mesh:`` (PyTorch's mesh
context), read by :func:`current_mesh` / :func:`get_current_mesh` and by the APIs that take the
current mesh when given none (``parallelize_module``, the DTensor factories).

Example::

    with mesh["tp"]:
        parallelize_module(block, parallelize_plan=ColwiseParallel())   # takes mesh["tp"]
"""
from __future__ import annotations

from typing import Any, List, Optional

__all__ = ["enter", "leave", "current_mesh", "get_current_mesh"]

_ACTIVE: List[Any] = []      # meshes entered with ``with mesh:``, innermost last


def enter(mesh: Any) -> None:
    """Make ``mesh`` the current mesh (``DeviceMesh.__enter__``)."""
    _ACTIVE.append(mesh)


def leave() -> None:
    """Restore the mesh current before the last :func:`enter` (``DeviceMesh.__exit__``)."""
    _ACTIVE.pop()


def current_mesh() -> Optional[Any]:
    """The innermost mesh entered with ``with mesh:``, or ``None``.

    Example:
        >>> from hyper_parallel_ms.mesh import DeviceMesh
        >>> m = DeviceMesh("cpu", [0])
        >>> with m:
        ...     current_mesh() is m
        True
        >>> current_mesh() is None
        True
    """
    return _ACTIVE[-1] if _ACTIVE else None


def get_current_mesh() -> Any:
    """The innermost mesh entered with ``with mesh:``; raises where none is (PyTorch's and
    HyperParallel's ``get_current_mesh``; :func:`current_mesh` returns ``None`` instead).

    Example:
        >>> from hyper_parallel_ms.mesh import DeviceMesh
        >>> m = DeviceMesh("cpu", [0])
        >>> with m:
        ...     get_current_mesh() is m
        True
    """
    mesh = current_mesh()
    if mesh is None:
        raise RuntimeError("No device mesh is currently active: enter one with `with mesh:` first")
    return mesh
