"""Old public names, kept for one release after a rename: each use warns (``DeprecationWarning``)
naming the new one. The renames are listed on the docs' differences page.

Example::

    def __getattr__(name):                     # a module's deprecated names
        if name == "Layout":
            renamed("hyper_parallel_ms.plan.Layout", "hyper_parallel_ms.dryrun.ParallelDims")
            return ParallelDims
"""
from __future__ import annotations

import sys
import warnings

__all__ = ["renamed", "importer_stacklevel"]


def renamed(old: str, new: str, *, stacklevel: int = 3) -> None:
    """Warn that ``old`` is deprecated in favour of ``new`` (the warning points at the caller's
    caller: the user code reading the old name).

    >>> import warnings
    >>> with warnings.catch_warnings(record=True) as caught:
    ...     warnings.simplefilter("always")
    ...     renamed("a.Old", "a.New")
    >>> str(caught[0].message)
    'a.Old is deprecated (renamed a.New); the old name goes in the next release'
    """
    warnings.warn(f"{old} is deprecated (renamed {new}); the old name goes in the next release",
                  DeprecationWarning, stacklevel=stacklevel)


def importer_stacklevel() -> int:
    """For :func:`renamed` called in a module's body: the ``stacklevel`` of the code importing that
    module (the first frame above it outside Python's import machinery and the package's lazy
    exports), so that the warning points at the user's ``import`` line.

    Example::

        renamed("hyper_parallel_ms.plan", "hyper_parallel_ms.dryrun", stacklevel=importer_stacklevel())
    """
    frame, level = sys._getframe(2), 3      # renamed's warn: 1 renamed, 2 the module body, 3 the frame above
    while frame is not None:
        name, filename = frame.f_globals.get("__name__", ""), frame.f_code.co_filename
        if "importlib" in filename and "_bootstrap" in filename:
            pass                            # warnings skips these frames itself: they count no level
        elif name == "importlib" or name.startswith("importlib.") or name == "hyper_parallel_ms":
            level += 1                      # importlib.import_module, the package's lazy exports
        else:
            return level
        frame = frame.f_back
    return level
