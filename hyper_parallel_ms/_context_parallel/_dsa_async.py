"""The asynchronous forms of the DeepSeek sparse attention boundary styles (:mod:`._dsa`): each starts the
all-gathers of its key side at the Cells handing those tensors over (``key_handoff`` ...), whose outputs must
reach the boundary unchanged (an op between them raises). MindSpore's collectives complete before they
return, so the results are the synchronous styles'.

Example::

    AsyncDSASparseAttentionContextParallel(use_local_output=True).apply(
        core.sparse_flash_attention, mesh["cp"], key_handoff=core.sparse_key_handoff)
"""
from __future__ import annotations

from typing import Optional

from mindspore import nn

from ..mesh import DeviceMesh
from ._dsa import DSAIndexerContextParallel, DSAIndexerLossContextParallel, DSASparseAttentionContextParallel

__all__ = ["AsyncDSAIndexerContextParallel", "AsyncDSASparseAttentionContextParallel",
           "AsyncDSAIndexerLossContextParallel"]


def _async_doc(synchronous: type, summary: str, example: str) -> str:
    """The docstring of an ``Async*`` style: ``summary``, the synchronous style's Args, ``example``."""
    doc = synchronous.__doc__
    args = doc[doc.index("    Args:"):doc.index("    Example::")].rstrip()
    return f"{summary}\n\n{args}\n\n    Example::\n\n        {example}\n    "


class AsyncDSAIndexerContextParallel(DSAIndexerContextParallel):
    __doc__ = _async_doc(
        DSAIndexerContextParallel,
        (':class:`DSAIndexerContextParallel` whose key gather starts at ``key_handoff`` (the Cell whose output '
         "reaches the boundary as its key), where an asynchronous backend overlaps it with the query side's "
         "work; MindSpore's collectives complete before they return, so the results are the synchronous "
         "style's."),
        'AsyncDSAIndexerContextParallel().apply(indexer.compute_sparse_indices, mesh["cp"], key_handoff=kh)')

    def apply(self, module: nn.Cell, device_mesh: DeviceMesh, key_handoff: Optional[nn.Cell] = None) -> nn.Cell:
        """Register the hooks (on ``key_handoff`` too, when given) and return ``module``.

        Args:
            module: the boundary Cell.
            device_mesh: the 1-D cp mesh.
            key_handoff: the Cell whose output is the boundary's key.

        Example::

            AsyncDSAIndexerContextParallel().apply(boundary, mesh["cp"], key_handoff=kh)
        """
        return self._register(module, self._mesh(type(self).__name__, device_mesh), {"key": key_handoff})

    _apply = apply


class AsyncDSASparseAttentionContextParallel(DSASparseAttentionContextParallel):
    __doc__ = _async_doc(
        DSASparseAttentionContextParallel,
        (":class:`DSASparseAttentionContextParallel` whose key, value and key_rope gathers start at their "
         "handoff Cells (see :class:`AsyncDSAIndexerContextParallel`)."),
        'AsyncDSASparseAttentionContextParallel().apply(sfa, mesh["cp"], key_handoff=k, value_handoff=v)')

    def apply(self, module: nn.Cell, device_mesh: DeviceMesh, key_handoff: Optional[nn.Cell] = None,
              value_handoff: Optional[nn.Cell] = None, key_rope_handoff: Optional[nn.Cell] = None) -> nn.Cell:
        """Register the hooks (on the handoff Cells too, when given) and return ``module``.

        Args:
            module: the boundary Cell.
            device_mesh: the 1-D cp mesh.
            key_handoff: the Cell whose output is the boundary's key (likewise value, key_rope).
            value_handoff: see ``key_handoff``.
            key_rope_handoff: see ``key_handoff``.

        Example::

            AsyncDSASparseAttentionContextParallel().apply(sfa, mesh["cp"], key_handoff=k)
        """
        return self._register(module, self._mesh(type(self).__name__, device_mesh),
                              {"key": key_handoff, "value": value_handoff, "key_rope": key_rope_handoff})

    _apply = apply


class AsyncDSAIndexerLossContextParallel(DSAIndexerLossContextParallel):
    __doc__ = _async_doc(
        DSAIndexerLossContextParallel,
        (":class:`DSAIndexerLossContextParallel` whose key, key_index and key_rope gathers start at their "
         "handoff Cells (see :class:`AsyncDSAIndexerContextParallel`)."),
        'AsyncDSAIndexerLossContextParallel().apply(loss_boundary, mesh["cp"], key_handoff=k)')

    def apply(self, module: nn.Cell, device_mesh: DeviceMesh, key_handoff: Optional[nn.Cell] = None,
              key_indexer_handoff: Optional[nn.Cell] = None, key_rope_handoff: Optional[nn.Cell] = None) -> nn.Cell:
        """Register the hooks (on the handoff Cells too, when given) and return ``module``.

        Args:
            module: the boundary Cell.
            device_mesh: the 1-D cp mesh.
            key_handoff: the Cell whose output is the boundary's key (likewise key_index, key_rope).
            key_indexer_handoff: see ``key_handoff``.
            key_rope_handoff: see ``key_handoff``.

        Example::

            AsyncDSAIndexerLossContextParallel().apply(loss_boundary, mesh["cp"], key_handoff=k)
        """
        return self._register(module, self._mesh(type(self).__name__, device_mesh),
                              {"key": key_handoff, "key_indexer": key_indexer_handoff, "key_rope": key_rope_handoff})

    _apply = apply
