"""``alias_hyper_parallel()``: ``import hyper_parallel`` (and the module paths MindFormers imports)
served by this library's objects, through one meta-path finder installed on request.

Each served module is made on first import; its names resolve on first access from
:data:`~hyper_parallel_ms.compat._names.HYPER_PARALLEL_NAMES`. A HyperParallel name this library
does not provide yet raises :class:`NotProvidedError`; a module path outside the table raises
``ModuleNotFoundError`` saying so. Nothing is faked.

Example::

    from hyper_parallel_ms.compat import alias_hyper_parallel
    alias_hyper_parallel()
    from hyper_parallel.core.dtensor.dtensor import DTensor     # hyper_parallel_ms.DTensor
"""
from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
import threading
import types
from typing import Any, Optional

from ._names import HYPER_PARALLEL_NAMES, alias_packages

__all__ = ["alias_hyper_parallel", "NotProvidedError"]

_ROOT = "hyper_parallel"
_DOC = "docs/mindformers.md"
_LOCK = threading.Lock()


class NotProvidedError(ImportError):
    """A HyperParallel name (module path and attribute) that ``hyper_parallel_ms`` does not
    provide yet. An ``ImportError``, so ``from ... import name`` reports it as it is.

    Example::

        from hyper_parallel.platform import get_platform    # raises NotProvidedError
    """


class _NotProvidedMeta(type):
    """Calling a not-provided name, or reading one of its attributes, raises NotProvidedError."""

    def __call__(cls, *args: Any, **kwargs: Any):
        raise NotProvidedError(cls._hpms_message, name=cls.__module__)

    def __getattr__(cls, attr: str):
        if attr.startswith("__"):
            raise AttributeError(attr)
        raise NotProvidedError(cls._hpms_message, name=cls.__module__)


def _not_provided(module: str, name: str) -> type:
    """A placeholder for HyperParallel's ``module.name``: importable (and subclassable, as MindFormers'
    styles subclass HyperParallel's), but calling it, instantiating it or reading its attributes
    raises :class:`NotProvidedError` naming it. Nothing runs in its place."""
    message = (f"{module}.{name} (HyperParallel) is not provided by hyper_parallel_ms; importing it works, "
               f"using it does not. {_DOC} lists what is provided")
    return _NotProvidedMeta(name, (), {"__module__": module, "_hpms_message": message,
                                       "__doc__": f"Not provided: {message}"})


class _AliasModule(types.ModuleType):
    """A served ``hyper_parallel`` module: attributes resolve from the table on first access."""

    def __getattr__(self, name: str) -> Any:
        table = HYPER_PARALLEL_NAMES.get(self.__name__, {})
        if f"{self.__name__}.{name}" in alias_packages():      # a served submodule: imported on access
            return importlib.import_module(f"{self.__name__}.{name}")
        if name not in table:
            raise AttributeError(f"module {self.__name__!r} has no attribute {name!r} (hyper_parallel_ms "
                                 f"serves {sorted(table) or 'no names'} there; see {_DOC})")
        target = table[name]
        if target is None:
            value = _not_provided(self.__name__, name)
        else:
            module, attr = target.split(":")
            value = getattr(importlib.import_module(f"hyper_parallel_ms.{module}"), attr)
        setattr(self, name, value)
        return value

    def __dir__(self):
        return sorted(set(super().__dir__()) | set(HYPER_PARALLEL_NAMES.get(self.__name__, {})))


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Serves the ``hyper_parallel`` module paths of the table; refuses the others by name."""

    def __init__(self) -> None:
        self._paths = alias_packages()

    def find_spec(self, fullname: str, path, target=None) -> Optional[importlib.machinery.ModuleSpec]:
        if fullname != _ROOT and not fullname.startswith(_ROOT + "."):
            return None
        if fullname not in self._paths:
            raise ModuleNotFoundError(f"{fullname} (HyperParallel) is not provided yet by hyper_parallel_ms "
                                      f"(alias_hyper_parallel serves the module paths listed in {_DOC})",
                                      name=fullname)
        return importlib.util.spec_from_loader(fullname, self, origin="hyper_parallel_ms.compat", is_package=True)

    def create_module(self, spec) -> types.ModuleType:
        return _AliasModule(spec.name, f"HyperParallel's {spec.name}, served by hyper_parallel_ms (see {_DOC}).")

    def exec_module(self, module: types.ModuleType) -> None:
        """Nothing to run: names resolve on first access."""


def _installed() -> Optional[_Finder]:
    return next((f for f in sys.meta_path if isinstance(f, _Finder)), None)


def alias_hyper_parallel() -> None:
    """Make ``import hyper_parallel`` and the HyperParallel module paths MindFormers imports resolve
    to this library's objects, for this process. Opt-in; idempotent (a second call does nothing).

    ``hyper_parallel.DTensor`` is ``hyper_parallel_ms.DTensor``,
    ``hyper_parallel.core.fully_shard.api.HSDPModule`` is ``hyper_parallel_ms.FSDPModule``, and so on
    (the table: :data:`hyper_parallel_ms.compat.HYPER_PARALLEL_NAMES`). Names not provided import as
    placeholders: calling one, instantiating one or reading its attributes raises
    :class:`NotProvidedError` naming it.

    Raises:
        RuntimeError: a real ``hyper_parallel`` is already imported, or importable (installed):
            the alias would hide it. Uninstall it, or do not call this.

    Example::

        alias_hyper_parallel()
        import hyper_parallel
        assert hyper_parallel.DeviceMesh is hyper_parallel_ms.DeviceMesh
    """
    with _LOCK:
        if _installed() is not None:
            return
        loaded = sys.modules.get(_ROOT)
        if loaded is not None:
            raise RuntimeError(f"alias_hyper_parallel: a hyper_parallel package is already imported "
                               f"({getattr(loaded, '__file__', None) or loaded!r}); the alias would hide it. "
                               f"Use that package, or call alias_hyper_parallel() in a process without it")
        spec = importlib.util.find_spec(_ROOT)
        if spec is not None:
            raise RuntimeError(f"alias_hyper_parallel: a hyper_parallel package is installed ({spec.origin}); "
                               f"the alias would hide it. Uninstall it (pip uninstall hyper_parallel) to use "
                               f"hyper_parallel_ms under its name, or do not call alias_hyper_parallel()")
        sys.meta_path.insert(0, _Finder())


def _remove_alias() -> None:
    """Undo :func:`alias_hyper_parallel` (the finder and the served modules): for tests."""
    with _LOCK:
        sys.meta_path[:] = [f for f in sys.meta_path if not isinstance(f, _Finder)]
        for name in [n for n, m in sys.modules.items() if isinstance(m, _AliasModule)]:
            del sys.modules[name]
