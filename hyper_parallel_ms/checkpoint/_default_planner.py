"""Save and load planners (PyTorch DCP's ``DefaultSavePlanner`` / ``DefaultLoadPlanner``
roles): what a save writes and what a load fills, from which key. Subclass them to filter or
rename keys; :func:`~hyper_parallel_ms.checkpoint.save` and ``load`` take one as ``planner=``.

A save calls, on every rank: ``set_up_planner(state_dict, is_coordinator=)``,
``create_local_plan()`` (this rank's pieces), then with every rank's plan
``create_global_plan(plans, ...)`` (who writes what), and ``resolve_data(piece)`` for each
piece this rank writes. A load calls ``set_up_planner(state_dict, metadata, full_file=)``
and ``create_local_plan()``: the checkpoint key of each entry to fill (entries left out keep
their values).

Example (leave the optimizer out of a save; load only the model from a full checkpoint)::

    class ModelOnly(DefaultSavePlanner):
        def set_up_planner(self, state_dict, *, is_coordinator):
            super().set_up_planner({"model": state_dict["model"]}, is_coordinator=is_coordinator)

    class Renamed(DefaultLoadPlanner):          # the checkpoint holds "net.*" for our "model.*"
        def create_local_plan(self):
            plan = super().create_local_plan()
            return LoadPlan({k: "net." + k[len("model."):] for k in plan.tensors}, plan.values)
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Dict, List, Sequence

import numpy as np
from mindspore import Parameter

from ._metadata import CheckpointError, Metadata
from ._names import is_param_list, mindspore_names
from ._pieces import TensorRef, ValueRef, flatten
from ._boxes import Piece, assign_writers
from ._safetensors import crc32

__all__ = ["DefaultSavePlanner", "DefaultLoadPlanner", "LoadPlan"]

_LISTED = 8
# optimizer slots saved by earlier releases under the optimizer's attribute names
_EARLIER_SLOTS = {"adam_m": "moments1", "adam_v": "moments2", "lamb_m": "moments1", "lamb_v": "moments2",
                  "mean_square": "ms"}


def _saved_key(key: str, metadata: Metadata) -> str:
    """``key``, or the name an earlier release saved that optimizer slot under
    (``state.<fqn>.moments1`` for ``adam_m``) when only that one is in the checkpoint."""
    head, _, slot = key.rpartition(".")
    earlier = f"{head}.{_EARLIER_SLOTS[slot]}" if slot in _EARLIER_SLOTS and ".state." in f".{head}" else None
    return earlier if key not in metadata.tensors and earlier in metadata.tensors else key


_RANK_STATE_NAMES = ("moving_mean", "moving_variance", "running_mean", "running_var", "num_batches_tracked")


def _rank_state(target: Any) -> bool:
    """Module state each rank updates from its own batch: a batch norm's statistics (a Parameter with
    ``requires_grad=False`` named as MindSpore's and PyTorch-style batch norms name them). Other
    frozen weights keep the check that their copies agree (a piece saved without its layout)."""
    return (isinstance(target, Parameter) and not target.requires_grad
            and target.name.rsplit(".", 1)[-1] in _RANK_STATE_NAMES)


class DefaultSavePlanner:
    """Every tensor and value of the state dict, each distinct box written once.

    Example::

        class ModelOnly(DefaultSavePlanner):                 # leave the optimizer out of a save
            def set_up_planner(self, state_dict, *, is_coordinator):
                super().set_up_planner({"model": state_dict["model"]}, is_coordinator=is_coordinator)

        save({"model": model_sd, "optim": optim_sd}, checkpoint_id="ckpt/model", planner=ModelOnly())
    """

    tensors: Dict[str, TensorRef]
    values: Dict[str, Any]

    def set_up_planner(self, state_dict: Dict[str, Any], *, is_coordinator: bool) -> None:
        """Flatten ``state_dict`` (nested dicts joined with ``"."``) into :attr:`tensors` and
        :attr:`values` (what is saved)."""
        self.tensors, values = flatten(state_dict, for_save=True)
        self.values = {k: v.value for k, v in values.items()}
        self.is_coordinator = is_coordinator

    def create_local_plan(self, *, with_checksums: bool = True) -> List[Piece]:
        """This rank's pieces; a plain tensor's carries the CRC-32 of its data (its copies on
        the ranks must agree, since only one is written)."""
        return [ref.piece if ref.spec is not None or not with_checksums else
                replace(ref.piece, crc32=crc32(ref.local_numpy()), rank_state=_rank_state(ref.target))
                for ref in self.tensors.values()]

    def create_global_plan(self, plans: Sequence[Sequence[Piece]], *, remove_redundancy: bool = True,
                           save_to_minimum_rank: bool = False) -> List[List[Piece]]:
        """For each rank, the pieces it writes (see :func:`~._boxes.assign_writers`)."""
        return assign_writers(plans, remove_redundancy=remove_redundancy, save_to_minimum_rank=save_to_minimum_rank)

    def resolve_data(self, piece: Piece) -> np.ndarray:
        """This rank's data of ``piece``."""
        return self.tensors[piece.key].local_numpy()


@dataclass(frozen=True)
class LoadPlan:
    """State-dict key -> checkpoint key, for the tensors and the values to fill (entries
    of the state dict left out keep their values).

    Args:
        tensors: flat state-dict key of each tensor to fill -> its key in the checkpoint.
        values: flat state-dict key of each non-tensor value to replace -> its key in the checkpoint.

    Example:
        >>> plan = LoadPlan({"model.fc.weight": "net.fc.weight"}, {"step": "step"})
        >>> plan.tensors["model.fc.weight"]
        'net.fc.weight'
    """

    tensors: Dict[str, str]
    values: Dict[str, str]


class DefaultLoadPlanner:
    """Every entry of the state dict, from the checkpoint key of the same name (from
    MindSpore's name, for a full MindSpore checkpoint).

    Args:
        allow_partial_load: entries of the state dict that the checkpoint does not hold keep
            their values (PyTorch's ``allow_partial_load``: e.g. a new head on a pretrained body);
            by default (``False``) a missing entry is refused with a :class:`CheckpointError`.
        allow_unused: a full MindSpore checkpoint may hold tensors that no entry takes (e.g.
            the model alone from a file that also holds the optimizer); by default
            (``False``) they are refused with a :class:`CheckpointError`.

    Example::

        load({"model": get_model_state_dict(model)}, checkpoint_id="full.safetensors",
             planner=DefaultLoadPlanner(allow_unused=True))          # the optimizer's tensors skipped
        load({"model": get_model_state_dict(model)}, checkpoint_id="ckpt/body",
             planner=DefaultLoadPlanner(allow_partial_load=True))    # entries not saved there kept
    """

    tensors: Dict[str, TensorRef]
    values: Dict[str, ValueRef]

    def __init__(self, *, allow_partial_load: bool = False, allow_unused: bool = False) -> None:
        self.allow_partial_load = allow_partial_load
        self.allow_unused = allow_unused

    def set_up_planner(self, state_dict: Dict[str, Any], metadata: Metadata, *, full_file: bool = False) -> None:
        """Flatten ``state_dict`` into :attr:`tensors` and :attr:`values` (what may be filled)."""
        self.tensors, self.values = flatten(state_dict, for_save=False)
        self.metadata, self.full_file = metadata, full_file

    def create_local_plan(self) -> LoadPlan:
        """The checkpoint key of every entry (with ``allow_partial_load``, of every entry the
        checkpoint holds). A full MindSpore checkpoint holds tensors under MindSpore's names and
        no values (param lists are structure, not read), and must hold nothing else: a tensor of
        the file that no entry takes is refused."""
        if not self.full_file:
            plan = LoadPlan({k: _saved_key(k, self.metadata) for k in self.tensors}, {k: k for k in self.values})
        else:
            plan = self._full_file_plan()
        if not self.allow_partial_load:
            return plan
        return LoadPlan({k: n for k, n in plan.tensors.items() if n in self.metadata.tensors},
                        {k: n for k, n in plan.values.items() if n in self.metadata.values})

    def _full_file_plan(self) -> LoadPlan:
        names = mindspore_names({k: ref.piece.shape for k, ref in self.tensors.items()},
                                {k: ref.value for k, ref in self.values.items()})
        unused = sorted(set(self.metadata.tensors) - set(names.values()))
        if unused and not self.allow_unused:
            shown = ", ".join(repr(k) for k in unused[:_LISTED]) + (" ..." if len(unused) > _LISTED else "")
            raise CheckpointError(f"{len(unused)} tensors of the checkpoint match no entry of the state dict: {shown} "
                                  "(load the model and the optimizer together as {'model': ..., 'optim': ...}, export "
                                  "only what this state dict holds, or pass planner=DefaultLoadPlanner("
                                  "allow_unused=True))")
        return LoadPlan(names, {k: k for k in self.values if not is_param_list(k)})
