"""``simulate``: run a training script's own code as ranks of a simulated cluster, in this process.

Each simulated rank runs ``fn(mesh)`` on the mesh it sees (:func:`~hyper_parallel_ms.mesh.init_device_mesh`
with ``simulate=``), inside a shape-only run: parameters get no values (every piece is a
deferred Parameter and any attempt to give one values raises), the step's ops propagate shapes
through the sharding rules (:mod:`._abstract`) and its backward replays the Python backward of
the project's collectives (:mod:`._autodiff`). What the rank holds is read from the objects it
built (:mod:`._memory`); what it sends is what ``CommDebugMode`` records during one ``step()``.

Which ranks run (``ranks=None``): ranks whose mesh coordinates are equivalent run once. A
rank's *fingerprint* is what its numbers and checks depend on: its pieces' names, shapes and
dtypes, its optimizer slots, its activation estimate, the kind, mesh dim, shape and bytes of
every collective it issues and the plans it agrees to. Starting from the rank at coordinate 0
on every dim, each mesh dim is probed by running the rank at its last coordinate (``torch.chunk``
sizes only shrink at the end, so the first and last coordinates differ whenever any do): where
the fingerprints differ, the dim distinguishes ranks (a pipeline dim, an uneven shard, a batch
split unevenly) and each of its coordinates gets a representative. Every other representative
then checks the dims found uniform against its own pieces: where the sharding record of any of
its parameters gives another shape at another coordinate along the dim, that dim is probed
again from there by running, and a dim found to distinguish ranks anywhere distinguishes them
everywhere (this repeats until nothing changes). A rank stands for every rank with its
coordinates on the distinguishing dims. Until a dim is probed, no rank stands for another along
it: a probe's rank that needs messages from ranks at other coordinates of that dim (the last
pipeline stage from the one before it) runs those ranks themselves. The rule assumes that what
a rank does depends on its coordinates only through the plan (its pieces, its pipeline stage)
and through data shapes that its code derives the same way at every stage. Pass ``ranks`` to run
exactly those ranks (``ranks=range(world)`` runs every rank, as the cluster would: the way to
check that every rank applies the same plan).

Cross-rank checks (:mod:`._checks`) run over the ranks that ran. A rank receiving host values
(a pipeline's shape header) from a rank that has not run yet has that rank run first; ranks
that need each other's headers (two stages per rank) run in turns (:meth:`_Simulation.outcome`).

Example::

    def build(mesh):
        with no_init_parameters():
            model = Llama(config)
        parallelize_module(model, mesh["tp"], tp_plan())
        optimizer = nn.AdamWeightDecay(model.trainable_params())
        grad_fn = ms.value_and_grad(loss_cell(model), None, optimizer.parameters)
        def step():
            loss, grads = grad_fn(*batch())
            optimizer(grads)
        return model, optimizer, step

    report = simulate(build, mesh_shape=(8, 8), mesh_dim_names=("dp", "tp"))
    print(report.table())
"""
from __future__ import annotations

import contextlib
import dataclasses
import itertools
import time
import traceback
from math import prod
from typing import Any, Callable, Dict, List, Optional, Sequence, Set, Tuple

import numpy as np

from .._cluster import World, simulating
from .._mindspore import abstract_run
from ..comm import CommDebugMode
from ..comm._agreement import observing_agreements
from ..comm._exchange import exchanging
from ..mesh import init_device_mesh
from ..nn._parameter import parameter_sharding
from ._abstract import abstract_scope, observing_ops
from ._autodiff import AbstractAutodiff
from ._checks import RankRun, cross_rank_problems, grouped
from ._exchange import Mailbox, MissingMessage
from ._memory import Held, cells_of, memory_of
from ._report import CommStats, Problem, RankReport, SimulationReport

__all__ = ["simulate"]


class _Attributed(list):
    """Collective records, each noting the Cell that issued it (``where``)."""

    def __init__(self, where: Callable[[], str]) -> None:
        super().__init__()
        self._where_now, self.where = where, []

    def append(self, record) -> None:
        super().append(record)
        self.where.append(self._where_now())


class _AttributedMode(CommDebugMode):
    """``CommDebugMode`` whose records say where they were issued."""

    def __init__(self, where: Callable[[], str]) -> None:
        super().__init__()
        self._where_now = where

    def __enter__(self) -> "_AttributedMode":
        super().__enter__()
        self.records = _Attributed(self._where_now)
        return self


class _Outcome:
    """One rank's run: the checks' view (:class:`RankRun`), what it holds, its step."""

    def __init__(self, rank: int) -> None:
        self.run = RankRun(rank)
        self.held: Optional[Held] = None
        self.step_records: list = []
        self.activation: Optional[int] = None
        self.flops: Optional[int] = None
        self.largest: Optional[int] = None          # the largest batch-dependent op output of the step
        self.stepped = False
        self.specs: list = []            # the sharding records (DTensorSpec) of its parameters

    def fingerprint(self) -> tuple:
        records = tuple((r.kind, r.mesh_dim, r.group_size, r.path, r.bytes, r.wire_bytes, tuple(r.shape), r.dtype)
                        for r in self.step_records)
        notes = tuple((what, entries) for what, _, entries in self.run.notes)
        held = None if self.held is None else (self.held.parameters, tuple(sorted(self.held.optimizer_slots.items())))
        return held, records, notes, self.activation, self.run.error


def _unpack(built: Any) -> Tuple[Any, Any, Optional[Callable]]:
    if not isinstance(built, tuple) or len(built) not in (2, 3):
        raise TypeError(f"fn(mesh) must return (model, optimizer) or (model, optimizer, step), got "
                        f"{type(built).__name__}")
    step = built[2] if len(built) == 3 else None
    if step is not None and not callable(step):
        raise TypeError(f"the step fn(mesh) returns must be callable (it runs one training step), got {step!r}")
    return built[0], built[1], step


class _Simulation:
    """The ranks of one simulated cluster, run in turn."""

    def __init__(self, fn: Callable, shape: Tuple[int, ...], names: Optional[Tuple[str, ...]],
                 device_type: str, routing: Any = "uniform") -> None:
        self.fn, self.shape, self.names, self.device_type = fn, shape, names, device_type
        self.size = prod(shape)
        self.outcomes: Dict[int, _Outcome] = {}
        self.split: Set[int] = set()                 # mesh dims that distinguish ranks
        self.uniform: Set[int] = set()               # mesh dims probed and found not to distinguish ranks
        self.exchange = Mailbox(self._stand_in, routing)
        self._running: List[int] = []
        self._stopped: Set[int] = set()               # ranks stopped by a missing message (their mail kept)

    # ---------------------------------------------------------------- geometry
    def coord(self, rank: int) -> Tuple[int, ...]:
        return tuple(int(c) for c in np.unravel_index(rank, self.shape))

    def rank_at(self, coord: Sequence[int]) -> int:
        return int(np.ravel_multi_index(tuple(coord), self.shape))

    def representative(self, rank: int) -> int:
        """The rank that stands for ``rank``: 0 on the dims found uniform, its own coordinates on the
        others. A dim not probed yet keeps the rank's coordinate: until a probe says otherwise it may
        distinguish ranks (a pipeline's middle stage cannot stand for the stage after it)."""
        c = self.coord(rank)
        return self.rank_at([0 if d in self.uniform else c[d] for d in range(len(self.shape))])

    def _stand_in(self, rank: int) -> Tuple[int, Callable[[int], int]]:
        if rank in self.outcomes or rank in self._running or rank in self._stopped:
            return rank, lambda peer: peer
        rep = self.representative(rank)
        return rep, self.translation(rep, rank)

    def translation(self, rep: int, rank: int) -> Callable[[int], int]:
        """Maps the ranks ``rep`` deals with to those ``rank`` deals with (same coordinate offset)."""
        delta = np.array(self.coord(rank)) - np.array(self.coord(rep))

        def translate(peer: int) -> int:
            moved = np.array(self.coord(peer)) + delta
            return self.rank_at(moved) if all(0 <= m < s for m, s in zip(moved, self.shape)) else -1
        return translate

    def group_of(self, rep: int, rank: int, group: Sequence[int]) -> Tuple[int, ...]:
        """The group of ``rank`` that corresponds to ``rep``'s ``group``: the same mesh dims spanned,
        ``rank``'s coordinates on the others."""
        base, mine = self.coord(rep), self.coord(rank)
        coords = [self.coord(q) for q in group]
        spanned = {d for c in coords for d in range(len(base)) if c[d] != base[d]}
        return tuple(self.rank_at([c[d] if d in spanned else mine[d] for d in range(len(base))]) for c in coords)

    # ---------------------------------------------------------------- running
    def outcome(self, rank: int) -> _Outcome:
        """Run ``rank`` (once); a rank it needs messages from runs first. Ranks that need each other's
        messages (a pipeline's forwards going both ways between two ranks, as with two stages per
        rank) run in turns: a rank stopped by a missing message keeps what it sent, the sender runs
        as far as that lets it, then the first runs again from the start, further each time; a rank
        stopped twice with nothing new sent to it in between would wait forever on the cluster too."""
        waiting = [rank]                  # ranks to finish, the next to run last
        stopped_at: Dict[int, int] = {}   # rank -> messages the others had sent when it last stopped
        while waiting:
            current = waiting[-1]
            if current in self.outcomes:
                waiting.pop()
                continue
            heard = self.exchange.sent_by_others(current)
            if stopped_at.get(current) == heard:
                raise RuntimeError(f"simulated rank {current} waits for host values no rank sends (the ranks "
                                   f"{sorted(set(waiting))} wait for each other): on the cluster they would wait "
                                   "forever")
            self.exchange.forget(current)
            self._stopped.discard(current)
            try:
                self.outcomes[current] = self._run(current)
            except MissingMessage as missing:
                stopped_at[current] = heard
                self._stopped.add(current)
                sender = missing.sender
                if sender in self.outcomes:
                    raise RuntimeError(f"simulated rank {current} waits for host values from rank {sender}, which "
                                       "sent none: on the cluster it would wait forever") from None
                rep = self.representative(sender)
                target = rep if rep not in self.outcomes and rep != current else sender
                if target in waiting:
                    waiting.remove(target)
                waiting.append(target)
        return self.outcomes[rank]

    def _run(self, rank: int) -> _Outcome:
        out = _Outcome(rank)
        autodiff = AbstractAutodiff()
        world = World(self.size, rank, simulated=True, device_type=self.device_type)

        def note(what, mesh, entries):
            out.run.notes.append((what, mesh.rank_list, tuple(entries)))
        self._running.append(rank)
        mode = _AttributedMode(autodiff.where)
        try:
            with contextlib.ExitStack() as stack:
                for ctx in (abstract_scope(), simulating(world), abstract_run(autodiff), observing_ops(autodiff.on_op),
                            exchanging(self.exchange), observing_agreements(note), mode):
                    stack.enter_context(ctx)
                self._build_and_step(rank, out, autodiff, mode)
        finally:
            self._running.remove(rank)
        out.run.records, out.run.where = list(mode.records), list(mode.records.where)
        return out

    def _build_and_step(self, rank: int, out: _Outcome, autodiff: AbstractAutodiff, mode: _AttributedMode) -> None:
        names: Dict[int, str] = {}
        try:
            mesh = init_device_mesh(self.device_type, self.shape, mesh_dim_names=self.names,
                                    simulate=(self.size, rank))
            model, optimizer, step = _unpack(self.fn(mesh))
            cells = cells_of(model)
            autodiff.name_cells(cells)
            names.update((id(c), n) for top in cells for n, c in top.cells_and_names() if n)
            out.held = memory_of(model, optimizer)
            out.specs = [rec.spec for c in cells for p in c.get_parameters()
                         for rec in (parameter_sharding(p),) if rec is not None]
            if step is not None:
                autodiff.begin_step()
                start = len(mode.records)
                step()
                out.step_records = list(mode.records[start:])
                out.activation = autodiff.activation_peak()
                out.flops = autodiff.flops
                out.largest = autodiff.largest_activation
                out.stepped = True
        except MissingMessage:
            raise
        except Exception as exc:  # noqa: BLE001  (a rank's failure is reported, as the cluster would show it)
            out.run.error = f"{type(exc).__name__}: {exc}"
            out.run.error_cell = _raising_cell(exc, names)
            out.run.traceback = "".join(traceback.format_exception(exc))

    # ---------------------------------------------------------------- classes
    def run_classes(self) -> None:
        """Run one rank per class of equivalent ranks (see the module docstring)."""
        dims = [d for d, n in enumerate(self.shape) if n > 1]
        first = self.rank_at([0] * len(self.shape))
        for d in dims:
            self._probe(first, d)
        changed = True
        while changed:
            changed = False
            for rep in self._representatives():
                self.outcome(rep)       # a middle coordinate of a distinguishing dim is a class of its own
                for d in dims:
                    if d not in self.split and self._uneven(rep, d) and self._probe(rep, d):
                        changed = True
                if changed:
                    break

    def _probe(self, rep: int, dim: int) -> bool:
        """Run the rank at the last coordinate of ``dim`` from ``rep``; whether ``dim`` now distinguishes ranks."""
        probe = list(self.coord(rep))
        probe[dim] = self.shape[dim] - 1
        if self.outcome(self.rank_at(probe)).fingerprint() != self.outcome(rep).fingerprint():
            self.split.add(dim)
            self.uniform.discard(dim)
            return True
        if dim not in self.split:
            self.uniform.add(dim)
        return False

    def _uneven(self, rank: int, dim: int) -> bool:
        """Whether a parameter piece of ``rank`` has another shape at another coordinate along ``dim``."""
        base = self.coord(rank)
        others = []
        for c in range(self.shape[dim]):
            moved = list(base)
            moved[dim] = c
            others.append(self.rank_at(moved))
        for spec in self.outcome(rank).specs:
            mine = spec.local_shape()
            for other in others:
                where = np.argwhere(spec.mesh.mesh == other)
                if len(where) and tuple(spec.layout.local_shape(spec.shape, tuple(int(i) for i in where[0]))) != mine:
                    return True
        return False

    def _representatives(self) -> List[int]:
        axes = [range(self.shape[d]) if d in self.split else [0] for d in range(len(self.shape))]
        return [self.rank_at(c) for c in itertools.product(*axes)]

    # ---------------------------------------------------------------- report
    def report(self, ranks: Sequence[int], seconds: float, by_class: bool) -> SimulationReport:
        reports = {}
        for rank in ranks:
            rep = self.representative(rank) if by_class else rank
            reports[rank] = _rank_report(rank, self.coord(rank), rep, self.outcomes[rep],
                                         lambda group, rep=rep, rank=rank: self.group_of(rep, rank, group))
        runs = {r: o.run for r, o in self.outcomes.items()}
        problems = cross_rank_problems(runs)
        if by_class:
            problems = [self._for_class(p, ranks) for p in problems]
        return SimulationReport(reports, self.shape, self.names, grouped(problems), tuple(self.outcomes), seconds)

    def _for_class(self, problem: Problem, ranks: Sequence[int]) -> Problem:
        """An error of the ranks that ran, given to every rank of ``ranks`` they stand for (those that
        did not run themselves): their code raises alike."""
        if problem.kind != "error":
            return problem
        stood = {q for q in ranks if q not in self.outcomes and self.representative(q) in problem.ranks}
        return dataclasses.replace(problem, ranks=tuple(sorted(stood | set(problem.ranks))))


def _raising_cell(exc: BaseException, names: Dict[int, str]) -> str:
    """The innermost Cell whose code ran when ``exc`` was raised, as ``"path (Class)"`` (``names``:
    id -> path in the model; a Cell outside the model, such as the loss, by its class); through the
    exceptions it was raised from, the first one raised counts; ``""`` outside any Cell."""
    from mindspore import nn
    found, seen = "", set()
    current: Optional[BaseException] = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        tb, here = current.__traceback__, ""
        while tb is not None:
            cell = tb.tb_frame.f_locals.get("self")
            if isinstance(cell, nn.Cell):
                path = names.get(id(cell))
                here = f"{path} ({type(cell).__name__})" if path else type(cell).__name__
            tb = tb.tb_next
        found = here or found
        current = current.__cause__ or current.__context__
    return found


def _rank_report(rank: int, coord: Tuple[int, ...], rep: int, outcome: _Outcome,
                 group_of: Callable[[Sequence[int]], Tuple[int, ...]]) -> RankReport:
    held = outcome.held or Held(0, 0, 0, {}, ())
    comm: Dict[Tuple[str, str], CommStats] = {}
    for r in outcome.step_records:
        key = (r.kind, r.mesh_dim)
        stats = comm.get(key)
        comm[key] = CommStats((stats.calls if stats else 0) + 1, (stats.bytes if stats else 0) + r.bytes, r.group_size,
                              stats.group if stats else group_of(r.group))
    return RankReport(rank, coord, held.param_bytes, held.grad_bytes, held.optimizer_bytes, dict(held.optimizer_slots),
                      outcome.activation, sum(r.bytes for r in outcome.step_records) if outcome.stepped else None,
                      comm, rep, outcome.flops, outcome.largest)


def simulate(fn: Callable, *, mesh_shape: Sequence[int], mesh_dim_names: Optional[Sequence[str]] = None,
             ranks: Optional[Sequence[int]] = None, device_type: str = "npu",
             routing: Any = "uniform") -> SimulationReport:
    """Run ``fn(mesh)`` as the ranks of a simulated cluster of ``prod(mesh_shape)`` ranks, without
    values, and report what each rank holds and sends (see the module docstring).

    Args:
        fn: the training script's own code: ``fn(mesh)`` builds the model (under
            ``no_init_parameters()``), applies ``parallelize_module`` / ``fully_shard`` / pipeline
            stages on ``mesh`` and returns ``(model, optimizer)``, or ``(model, optimizer, step)``
            where ``step()`` runs one training step (gradients through ``mindspore.value_and_grad`` /
            ``mindspore.grad`` or a pipeline schedule).
        mesh_shape: the cluster's mesh, e.g. ``(8, 16, 8)``.
        mesh_dim_names: its dim names, e.g. ``("pp", "dp", "tp")``.
        ranks: the ranks to run (default: one per class of equivalent ranks, reported for every rank).
        device_type: the simulated cluster's device, ``"npu"`` (Ascend's collectives) or ``"cpu"``.
        routing: what a mixture-of-experts router is assumed to do (a simulated rank has no values to
            route by), for expert parallelism's token exchange: ``"uniform"`` (each rank's routed slots,
            tokens times top-k, spread evenly over the experts: ``1 / ep`` of them to each peer) or
            shares per expert, ``(E,)`` for every rank or ``(ep, E)`` per rank of the expert-parallel
            group (see :mod:`hyper_parallel_ms.dryrun._routing`).

    Returns:
        A :class:`~hyper_parallel_ms.dryrun.SimulationReport`: ``report[r].param_bytes``, ``.grad_bytes``,
        ``.optimizer_bytes``, ``.activation_bytes``, ``.comm_bytes``, ``.comm``; ``report.problems``,
        ``report.table()``, ``report.to_json()``.

    Example::

        report = simulate(build, mesh_shape=(2, 4), mesh_dim_names=("dp", "tp"))
        report[5].comm_bytes
    """
    shape = tuple(mesh_shape) if not isinstance(mesh_shape, int) else (mesh_shape,)
    if not shape or any(isinstance(s, bool) or not isinstance(s, int) or s < 1 for s in shape):
        raise ValueError(f"mesh_shape must be a non-empty tuple of positive ints, got {mesh_shape!r}")
    if not callable(fn):
        raise TypeError(f"fn must be callable as fn(mesh), got {fn!r}")
    names = None if mesh_dim_names is None else tuple(mesh_dim_names)
    sim = _Simulation(fn, shape, names, device_type, routing)
    world = sim.size
    began = time.perf_counter()
    if ranks is None:
        sim.run_classes()
        wanted: Sequence[int] = range(world)
    else:
        wanted = sorted(set(int(r) for r in ranks))
        bad = [r for r in wanted if not 0 <= r < world]
        if bad or not wanted:
            raise ValueError(f"ranks must be ranks of the {world}-rank mesh {shape}, got {list(ranks)!r}")
        for rank in wanted:
            sim.outcome(rank)
    return sim.report(wanted, time.perf_counter() - began, by_class=ranks is None)
