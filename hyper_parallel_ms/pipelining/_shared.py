"""Parameters shared by several stages (a tied embedding and head on the first and the last
stage): found by name on every stage, agreed over the pp ranks, their gradients summed.

One full-model Parameter used in two places keeps one name (``split_blocks`` keeps full-model
names), so a group is usually one name; a group may list several names when the stages were
built with different names for the same weight. On a rank holding several stages of a group
(ZBV puts the first and the last stage on rank 0) the stages are made to share one Parameter
object; across ranks the holders' gradients are summed by one all-reduce per group and step,
over a group of exactly the ranks holding it, so every copy takes the same optimizer step.

Example::

    schedule = Schedule1F1B(stage, 4, loss_fn, shared_parameters=["embed.weight"])
    schedule.step(x, target=y)
    opt(schedule.gradients())        # embed.weight's gradient: first-stage part + last-stage part
"""
from __future__ import annotations

from typing import Dict, List, Optional, Sequence, Tuple, Union

import mindspore as ms
import numpy as np
from mindspore import Tensor

from .. import comm
from ..comm._agreement import DIGEST_LENGTH, digest, extremes
from ..nn._adapter import named_cells, own_parameters
from ._action import ScheduleError
from ._stage import PipelineStage

__all__ = ["SharedParameters", "SharedSpec", "check_names_unshared"]

SharedSpec = Sequence[Union[str, Sequence[str]]]


def _groups(spec: Optional[SharedSpec]) -> List[Tuple[str, ...]]:
    groups = []
    for entry in spec or ():
        names = (entry,) if isinstance(entry, str) else tuple(entry)
        if not names or not all(isinstance(n, str) and n for n in names):
            raise TypeError(f"shared_parameters: each entry is a parameter name or a tuple of names, got {entry!r}")
        groups.append(names)
    return groups


def _tie(stages: Sequence[PipelineStage], first: ms.Parameter, copies: Sequence[ms.Parameter]) -> None:
    """Make every Cell of ``stages`` holding one of ``copies`` hold ``first`` instead."""
    ids = {id(c) for c in copies}
    for stage in stages:
        for cell in named_cells(stage.submodule).values():
            for attr, p in own_parameters(cell).items():
                if id(p) in ids:
                    setattr(cell, attr, first)


class SharedParameters:
    """The groups of ``spec`` on this rank's ``stages``: checked, tied on this rank, summed across ranks.

    Args:
        spec: parameter names (or tuples of names), one entry per shared parameter.
        stages: this rank's stages.
        mesh: the 1-D pp mesh.
        name: the schedule's name, for error messages.

    Example::

        shared = SharedParameters(["embed.weight"], stages, pp_mesh, "Schedule1F1B")
        grads = shared.reduce(params, grads)     # summed over the stages holding embed.weight
    """

    def __init__(self, spec: Optional[SharedSpec], stages: Sequence[PipelineStage], mesh, name: str) -> None:
        self.groups = _groups(spec)
        self._local: List[Optional[ms.Parameter]] = []
        self._meshes: List[Optional[object]] = []
        # held here, and by a lower pp rank too: a sum over the pp ranks counts it there
        self.counted_elsewhere: List[ms.Parameter] = []
        if not self.groups:
            return
        pp, me = mesh.size(), mesh.get_local_rank()
        found = []
        counts = np.zeros((2, len(self.groups), pp), np.float32)   # [stages holding it, its element count]
        for g, names in enumerate(self.groups):
            held = [p for st in stages for p in st.parameters() if p.name in names]
            found.append(held)
            counts[0, g, me] = len(held)
            counts[1, g, me] = held[0].size if held else 0
        high, _ = extremes(counts.ravel(), mesh)
        high = high.reshape(counts.shape)
        for g, names in enumerate(self.groups):
            holders = [r for r in range(pp) if high[0, g, r]]
            if high[0, g].sum() < 2:
                raise ScheduleError(f"{name}: shared_parameters {names}: held by {int(high[0, g].sum())} stage(s) "
                                    f"(ranks {holders}); a shared parameter must be a parameter of at least two "
                                    f"stages: check the names (the stages' parameters keep full-model names)")
            sizes = {int(high[1, g, r]) for r in holders}
            if len(sizes) > 1:
                raise ScheduleError(f"{name}: shared_parameters {names}: the stages hold it with different element "
                                    f"counts {sorted(sizes)} (ranks {holders}); share one full-model parameter")
        for g, held in enumerate(found):
            if len({id(p) for p in held}) > 1:
                _tie(stages, held[0], held[1:])
            self._local.append(held[0] if held else None)
            if held and min(r for r in range(pp) if high[0, g, r]) != me:
                self.counted_elsewhere.append(held[0])
        device = mesh.device_type
        for g in range(len(self.groups)):     # every rank creates the groups in the same order
            holders = [r for r in range(pp) if high[0, g, r]]
            ranks = [int(mesh.mesh[r]) for r in holders]
            self._meshes.append(None if len(ranks) < 2 else _holders_mesh(device, ranks, me in holders))

    def reduce(self, params: Sequence[ms.Parameter], grads: Sequence[Tensor]) -> Tuple[Tensor, ...]:
        """``grads`` (aligned with ``params``) with each shared parameter's gradient summed over its holders."""
        grads = list(grads)
        where: Dict[int, int] = {id(p): i for i, p in enumerate(params)}
        for local, group_mesh in zip(self._local, self._meshes):
            if local is None or group_mesh is None:
                continue
            i = where[id(local)]
            grads[i] = comm.all_reduce(grads[i], group_mesh, 0)
        return tuple(grads)


def _holders_mesh(device: str, ranks: List[int], member: bool):
    from ..mesh import DeviceMesh
    mesh = DeviceMesh(device, ranks, mesh_dim_names=("pp_shared",))
    return mesh if member else None


def check_names_unshared(stages: Sequence[PipelineStage], mesh, spec: Optional[SharedSpec], name: str) -> None:
    """Refuse, on every pp rank, a parameter name held by two stages (different Parameters) and not
    listed in ``shared_parameters``: a weight tied across stages (an embedding and the head) would
    train as two weights, each with its own stage's part of the gradient, and a checkpoint would
    hold two values under one key.

    Example::

        check_names_unshared(stages, pp_mesh, ["embed.weight"], "Schedule1F1B")
    """
    shared = {n for names in _groups(spec) for n in names}
    held: Dict[str, set] = {}
    for stage in stages:
        for p in stage.parameters():
            if p.name not in shared:
                held.setdefault(p.name, set()).add(id(p))
    here = sorted(n for n, ids in held.items() if len(ids) > 1)     # two stages of this rank
    names = sorted(held)
    pp, me = mesh.size(), mesh.get_local_rank()
    count = int(extremes(np.array([float(len(names))]), mesh)[0][0])
    table = np.full((pp, count, DIGEST_LENGTH), -1.0, np.float32)
    for i, n in enumerate(names):
        table[me, i] = digest(n)
    flags = np.zeros(pp, np.float32)
    flags[me] = float(bool(here))
    high, _ = extremes(np.concatenate([table.ravel(), flags]), mesh)
    table, flags = high[:table.size].reshape(table.shape), high[table.size:]
    ranks: Dict[Tuple[float, ...], List[int]] = {}
    for r in range(pp):
        for row in table[r]:
            if row[0] >= 0:
                ranks.setdefault(tuple(row), []).append(r)
    across = {key: rs for key, rs in ranks.items() if len(rs) > 1}
    if not across and not flags.any():
        return
    mine = here + [n for n in names if tuple(digest(n)) in across and n not in here]
    where = (f"this rank (pp rank {me}) holds {mine[:4]}" if mine else
             f"pp ranks {sorted({r for rs in across.values() for r in rs} | set(np.flatnonzero(flags).tolist()))} "
             "hold them")
    raise ScheduleError(
        f"{name}: parameters of one name are held by several stages: {where}. A weight tied across stages "
        "(an embedding and the head) must be listed in shared_parameters=[...] (its gradient is then summed over "
        "the stages); stages built separately must give their parameters distinct names (split_blocks keeps the "
        "full model's names)")
