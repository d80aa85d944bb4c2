"""Compatibility with HyperParallel 1.0's import paths (for MindFormers' PyNative stack).

:func:`alias_hyper_parallel` makes ``import hyper_parallel`` and its module paths resolve to this
library's objects, for the process; :data:`HYPER_PARALLEL_NAMES` is the table of what each path
serves (``None``: not provided yet, raising :class:`NotProvidedError`).

Example::

    from hyper_parallel_ms.compat import alias_hyper_parallel
    alias_hyper_parallel()
    from hyper_parallel import DTensor, DeviceMesh
"""
from ._alias import NotProvidedError, alias_hyper_parallel
from ._names import HYPER_PARALLEL_NAMES

__all__ = ["alias_hyper_parallel", "NotProvidedError", "HYPER_PARALLEL_NAMES"]
