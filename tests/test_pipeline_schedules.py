"""Pipeline schedules as data (pure Python, no processes): every schedule's per-rank lists pass
the blocking send/recv validator for 2..8 ranks and 1..16 micro-batches, corrupted lists are
refused naming the action, tables print, and bubble fractions match the textbook formulas."""
from __future__ import annotations

import functools
import random
import subprocess
import sys

import pytest

from hyper_parallel_ms.pipelining import (B, F, I, RECV_F, SEND_B, SEND_F, W, Action, ActionKind,
                                          PipelinePlan, ScheduleError, SCHEDULES, add_comms,
                                          build_plan, stage_to_rank, stages_of_rank, validate)

RANKS = range(2, 9)
MICROBATCHES = range(1, 17)
_plan = functools.lru_cache(maxsize=None)(build_plan)     # plans are immutable: build each once per file


def _lists(plan: PipelinePlan) -> dict:
    return {r: list(acts) for r, acts in enumerate(plan.actions)}


def _check(lists: dict, plan: PipelinePlan):
    return validate(lists, plan.placement, plan.n_microbatches)


def test_action_strings_round_trip():
    for kind in ActionKind:
        action = Action(12, kind, None if kind.is_fsdp else 3)       # parameter actions: no micro-batch
        assert Action.parse(str(action)) == action and str(action) == f"12{kind.value}{'' if kind.is_fsdp else 3}"
    assert [str(Action.parse(a)) for a in ("1UNSHARD", "0RESHARD", "3REDUCE_GRAD")] == [
        "1UNSHARD", "0RESHARD", "3REDUCE_GRAD"]
    for bad in ("1UNSHARD0", "0F"):
        with pytest.raises(ValueError, match=f"invalid action string '{bad}'.*e.g. '1UNSHARD'"):
            Action.parse(bad)
    assert [str(Action.parse(a)) for a in ("0F1", "1B0", "2W3", "2I3")] == ["0F1", "1B0", "2W3", "2I3"]
    assert Action.parse("3SEND_F1").matching() == Action(4, RECV_F, 1)
    assert Action.parse("3SEND_B1").matching() == Action.parse("2RECV_B1")
    with pytest.raises(ValueError, match="invalid action string 'F0'"):
        Action.parse("F0")
    with pytest.raises(ValueError, match="compute action"):
        Action.parse("0F0").matching()


def test_placements():
    assert stage_to_rank("loop", 3, 6) == (0, 1, 2, 0, 1, 2)
    assert stage_to_rank("v", 3, 6) == (0, 1, 2, 2, 1, 0)
    # the V repeated for any number of stages per rank (PyTorch's): down the ranks, back, again
    assert stage_to_rank("v", 2, 8) == (0, 1, 1, 0, 0, 1, 1, 0)
    assert stage_to_rank("v", 3, 12) == (0, 1, 2, 2, 1, 0, 0, 1, 2, 2, 1, 0)
    assert stage_to_rank("v", 3, 9) == (0, 1, 2, 2, 1, 0, 0, 1, 2)        # an odd count ends going down
    assert stage_to_rank("v", 2, 2) == (0, 1)
    for pp, per_rank in ((1, 2), (2, 6), (4, 4)):
        placement = stage_to_rank("v", pp, pp * per_rank)
        assert all(stages_of_rank(placement, r) == tuple(
            s for k in range(0, per_rank, 2) for s in (k * pp + r, (k + 2) * pp - 1 - r)) for r in range(pp))
    with pytest.raises(ValueError, match="do not divide evenly"):
        stage_to_rank("loop", 3, 4)


@pytest.mark.parametrize("schedule", sorted(SCHEDULES))
def test_every_schedule_passes_the_validator(schedule):
    """2..8 ranks x 1..16 micro-batches: each plan is valid (checked when made) and complete: every
    (stage, micro-batch) of a rank has one F and either one B or one I and one W (zero-bubble
    schedules split every backward, DualPipeV some)."""
    split = {"ZBVZeroBubble": True, "InterleavedZeroBubble": True, "DualPipeV": None}.get(schedule, False)
    for pp in RANKS:
        for n in MICROBATCHES:
            fewest = {"1F1B": pp, "DualPipeV": 2 * pp}.get(schedule, 1)
            if n < fewest:
                with pytest.raises(ScheduleError, match=f"{schedule} needs at least as many micro-batches as "
                                                        f"stages: got {n} micro-batches for {fewest} stages"):
                    build_plan(schedule, pp, n)
                continue
            plan = _plan(schedule, pp, n)
            assert plan.pp == pp and plan.num_stages == pp * (1 if schedule in ("GPipe", "1F1B") else 2)
            _check_complete(plan, split)


def _check_complete(plan: PipelinePlan, split) -> None:
    """Every (stage, micro-batch) of a rank has one F and either one B or one I and one W (``split``:
    True all split, False none, None either); no transfer between two stages of one rank."""
    n = plan.n_microbatches
    for rank, acts in enumerate(plan.actions):
        compute = [a for a in acts if a.kind.is_compute]
        assert len(set(compute)) == len(compute), compute
        for s in plan.stages_of(rank):
            for m in range(n):
                kinds = {a.kind for a in compute if (a.stage, a.microbatch) == (s, m)}
                assert kinds in ({F, B}, {F, I, W}), (rank, s, m, kinds)
                if split is not None:
                    assert kinds == ({F, I, W} if split else {F, B}), (plan.schedule, s, m, kinds)
        assert len(compute) == sum(3 if {a.kind for a in compute if a.stage == s and a.microbatch == m} ==
                                   {F, I, W} else 2 for s in plan.stages_of(rank) for m in range(n))
        for a in acts:       # no transfer between two stages of one rank
            assert a.kind.is_compute or plan.placement[a.peer_stage()] != rank


def test_looped_schedules_run_one_stage_per_rank():
    """Interleaved 1F1B, looped BFS and interleaved zero bubble with one stage per rank (PyTorch runs
    them; they were refused): valid and complete for 1..8 ranks x 1..16 micro-batches, in their
    one-stage forms: looped BFS is GPipe with the backwards from the last micro-batch, interleaved
    1F1B is 1F1B with 2 (pp - 1 - rank) warm-up forwards (the last rank's order is 1F1B's), and
    interleaved zero bubble splits every backward."""
    for pp in range(1, 9):
        for n in MICROBATCHES:
            for schedule, split in (("Interleaved1F1B", False), ("LoopedBFS", False), ("InterleavedZeroBubble", True)):
                plan = _plan(schedule, pp, n, stages_per_rank=1)
                assert plan.placement == tuple(range(pp)), plan.placement
                _check_complete(plan, split)
            compute = [[a for a in acts if a.kind.is_compute] for acts in _plan("LoopedBFS", pp, n,
                                                                                 stages_per_rank=1).actions]
            assert compute == [[Action(r, F, m) for m in range(n)] + [Action(r, B, m) for m in reversed(range(n))]
                               for r in range(pp)]
            interleaved = _plan("Interleaved1F1B", pp, n, stages_per_rank=1).actions
            for r, acts in enumerate(interleaved):
                compute = [a for a in acts if a.kind.is_compute]
                warmup = next((i for i, a in enumerate(compute) if a.kind is B), len(compute))
                assert warmup == min(n, 2 * (pp - 1 - r) + 1), (pp, n, r, compute)
            if n >= pp:
                assert compute == [a for a in _plan("1F1B", pp, n).actions[-1] if a.kind.is_compute]


def test_interleaved_three_stages_per_rank_and_uneven_rounds():
    for pp, n in ((2, 5), (3, 7), (4, 9), (4, 3)):
        plan = build_plan("Interleaved1F1B", pp, n, stages_per_rank=3)
        assert plan.num_stages == 3 * pp and plan.stages_of(1) == (1, 1 + pp, 1 + 2 * pp)


def test_construction_refusals():
    with pytest.raises(ScheduleError, match="unknown schedule 'PipeDream'"):
        build_plan("PipeDream", 2, 4)
    with pytest.raises(ScheduleError, match="1F1B runs 1 stage"):
        build_plan("1F1B", 2, 4, stages_per_rank=2)
    with pytest.raises(ScheduleError, match="ZBVZeroBubble runs 2 stage"):
        build_plan("ZBVZeroBubble", 2, 4, stages_per_rank=3)
    with pytest.raises(ScheduleError, match=r"Interleaved1F1B runs 1 or more stage\(s\) per rank, got stages_per"):
        build_plan("Interleaved1F1B", 2, 4, stages_per_rank=0)
    with pytest.raises(ScheduleError, match=r"LoopedBFS runs 1 or more stage\(s\) per rank, got stages_per_rank='2'"):
        build_plan("LoopedBFS", 2, 4, stages_per_rank="2")
    with pytest.raises(ScheduleError, match="ZBVZeroBubble runs 2 stage"):
        build_plan("ZBVZeroBubble", 2, 4, stages_per_rank=1)
    with pytest.raises(ScheduleError, match="DualPipeV runs 2 stage"):
        build_plan("DualPipeV", 2, 4, stages_per_rank=3)
    with pytest.raises(ScheduleError, match="DualPipeV needs at least as many micro-batches as stages: got 7 "
                                            "micro-batches for 8 stages"):
        build_plan("DualPipeV", 4, 7)
    with pytest.raises(ScheduleError, match="n_microbatches must be a positive int, got 0"):
        build_plan("GPipe", 2, 0)


ONE_F_ONE_B_TABLE = """\
        rank 0    rank 1
step 0  0F0       1RECV_F0
step 1  0SEND_F0  1F0
step 2  0F1       1RECV_F1
step 3  0SEND_F1  1B0
step 4  0RECV_B0  1SEND_B0
step 5  0B0       1F1
step 6  0RECV_B1  1B1
step 7  0B1       1SEND_B1"""

GPIPE_TIMED = """\
     rank 0  rank 1
t 0  0F0
t 1  0F1     1F0
t 2          1F1
t 3          1B0
t 4  0B0     1B1
t 5  0B1"""


def test_tables_print():
    plan = build_plan("1F1B", 2, 2)
    assert plan.table() == ONE_F_ONE_B_TABLE
    assert str(plan) == "1F1B: 2 ranks, 2 stages, 2 micro-batches\n" + ONE_F_ONE_B_TABLE
    assert build_plan("GPipe", 2, 2).table(timed=True) == GPIPE_TIMED


def _corrupt(lists: dict, rank: int, edit) -> dict:
    out = {r: list(a) for r, a in lists.items()}
    out[rank] = edit([str(a) for a in out[rank]])
    out[rank] = [Action.parse(a) for a in out[rank]]
    return out


def _move(items, name, to):
    items.remove(name)
    items.insert(to, name)
    return items


CORRUPTIONS = [
    # (schedule, pp, n, rank, edit, expected message)
    ("1F1B", 2, 2, 0, lambda a: _move(a, "0RECV_B0", a.index("0SEND_F1")),      # swapped send/recv
     r"deadlock under blocking send/recv, ranks waiting in a cycle 0 -> 1 -> 0: rank 0 is blocked on "
     r"0RECV_B0 \(step 3\) waiting for rank 1 to reach 1SEND_B0 \(rank 1 is at 1RECV_F1\); rank 1 is "
     r"blocked on 1RECV_F1 \(step 2\) waiting for rank 0 to reach 0SEND_F1 \(rank 0 is at 0RECV_B0\)"),
    ("1F1B", 2, 2, 1, lambda a: [x for x in a if x != "1RECV_F1"],               # missing recv
     r"rank 0: 0SEND_F1 \(step 3\) has no matching 1RECV_F1 on rank 1"),
    ("1F1B", 2, 2, 1, lambda a: _move(a, "1F0", 0),                              # F before its input
     r"rank 1: 1F0 \(step 0\) runs before the output of 0F0 is on rank 1"),
    ("1F1B", 2, 2, 0, lambda a: a + ["0F1"],                                     # duplicated action
     r"rank 0: 0F1 \(step 8\) is listed twice \(also at step 2 of rank 0\)"),
    ("1F1B", 2, 2, 0, lambda a: _move(a, "0RECV_B0", 0),                         # cyclic wait
     r"cycle 0 -> 1 -> 0: rank 0 is blocked on 0RECV_B0 \(step 0\)"),
    ("Interleaved1F1B", 3, 1, 0, lambda a: _move(a, "3RECV_F0", 0),              # three-rank cycle
     r"cycle 0 -> 2 -> 1 -> 0: rank 0 is blocked on 3RECV_F0 \(step 0\)"),
    ("1F1B", 2, 2, 1, lambda a: _move(a, "1B0", a.index("1F0")),                 # loss stage: B before F
     r"rank 1: 1B0 \(step 1\) runs before the forward state of 1F0 is on rank 1"),
    ("ZBVZeroBubble", 2, 2, 0, lambda a: _move(a, "3W0", a.index("3I0")),        # W before its I
     r"rank 0: 3W0 \(step \d+\) runs before the saved state of 3I0 is on rank 0"),
    ("1F1B", 2, 2, 1, lambda a: a + ["0F0"],                                     # stage on the wrong rank
     r"rank 1: 0F0 \(step 8\) acts for stage 0, which rank 0 holds"),
    ("ZBVZeroBubble", 2, 2, 1, lambda a: a + ["1SEND_F0"],                       # transfer within a rank
     r"rank 1: 1SEND_F0 \(step \d+\) goes between stages 1 and 2, both on rank 1"),
    ("1F1B", 2, 2, 0, lambda a: [x for x in a if x != "0B1"],                    # missing backward
     r"rank 0 lacks 0B1: every stage and micro-batch needs one F"),
    ("1F1B", 2, 2, 1, lambda a: _move(a, "1SEND_B0", a.index("1B0")),            # send before computing
     r"rank 1: 1SEND_B0 \(step 3\) runs before the input gradient of stage 1, micro-batch 0 is on rank 1"),
]


@pytest.mark.parametrize("case", CORRUPTIONS, ids=lambda c: c[-1][:40])
def test_corrupted_orders_are_refused_naming_the_action(case):
    schedule, pp, n, rank, edit, message = case
    plan = build_plan(schedule, pp, n)
    lists = _lists(plan)
    _check(lists, plan)
    with pytest.raises(ScheduleError, match=message):
        _check(_corrupt(lists, rank, edit), plan)
    with pytest.raises(ScheduleError, match=message):       # a plan cannot even be made from them
        PipelinePlan(schedule, n, plan.placement, tuple(tuple(a) for a in _corrupt(lists, rank, edit).values()))


def test_a_compute_order_that_cannot_run_is_refused_before_comms_are_added():
    order = {0: [Action(0, B, 0), Action(0, F, 0)], 1: [Action(1, F, 0), Action(1, B, 0)]}
    with pytest.raises(ScheduleError, match=r"rank 0 waits at 0B0 \(step 0\) for the forward state of 0F0, "
                                            r"the input gradient of stage 1, micro-batch 0; rank 1 waits at "
                                            r"1F0 \(step 0\) for the output of 0F0"):
        add_comms(order, (0, 1))


def test_transfers_placed_with_any_durations_never_deadlock():
    """The ordering argument of add_comms holds for any positive durations, not only unit ones."""
    rng = random.Random(0)
    for schedule in sorted(SCHEDULES):
        for pp, n in ((2, 3), (3, 5), (4, 8), (5, 16)):
            plan = _plan(schedule, pp, max(n, 2 * pp) if schedule == "DualPipeV" else n)
            n = plan.n_microbatches
            order = {r: [a for a in acts if a.kind.is_compute] for r, acts in enumerate(plan.actions)}
            for _ in range(3):
                durations = {k: rng.uniform(0.1, 3.0) for k in (F, B, I, W)}
                lists = add_comms(order, plan.placement, durations)
                assert validate(lists, plan.placement, n, durations).makespan > 0


def _formula(pp: int, n: int, v: int = 1) -> float:
    return (pp - 1) / (v * n + pp - 1)


def test_bubble_fractions_match_the_formulas():
    for pp in RANKS:
        for n in MICROBATCHES:
            assert _plan("GPipe", pp, n).bubble_fraction() == pytest.approx(_formula(pp, n), abs=1e-12)
            zbv = _plan("ZBVZeroBubble", pp, n).bubble_fraction()
            assert zbv < _formula(pp, n), (pp, n, zbv)
            if n >= pp:
                one = _plan("1F1B", pp, n)
                assert one.bubble_fraction() == pytest.approx(_formula(pp, n), abs=1e-12)
                # backward twice as long as forward: blocking transfers still cost 1F1B nothing
                assert one.bubble_fraction({B: 2.0}) == pytest.approx(_formula(pp, n), abs=1e-12)
                assert zbv < _formula(pp, n, v=2), (pp, n, zbv)
            if n % pp == 0:
                inter = _plan("Interleaved1F1B", pp, n).bubble_fraction()
                assert inter == pytest.approx(_formula(pp, n, v=2), abs=1e-12)
            # split backwards fill bubbles: below the looped / V schedules they refine
            izb = _plan("InterleavedZeroBubble", pp, n).bubble_fraction()
            assert izb < _plan("Interleaved1F1B", pp, n).bubble_fraction(), (pp, n, izb)
            if n >= 2 * pp:
                dual = _plan("DualPipeV", pp, n).bubble_fraction()
                assert dual <= zbv and dual < _formula(pp, n, v=2), (pp, n, dual, zbv)


def test_peak_activations():
    """Forward states held at once: GPipe all n, 1F1B pp - rank, ZBV at most 2 pp half-size stages
    (the memory of 1F1B's first rank, on every rank)."""
    for pp in RANKS:
        for n in MICROBATCHES:
            assert _plan("GPipe", pp, n).peak_activations() == (n,) * pp
            assert max(_plan("ZBVZeroBubble", pp, n).peak_activations()) <= 2 * pp
            assert max(_plan("InterleavedZeroBubble", pp, n).peak_activations()) <= 2 * pp
            if n >= 2 * pp:      # DualPipeV: one more (its steady phase's forward runs before the paired backward)
                assert max(_plan("DualPipeV", pp, n).peak_activations()) <= 2 * pp + 1
            if n >= pp:
                assert _plan("1F1B", pp, n).peak_activations() == tuple(min(n, pp - r) for r in range(pp))


def test_package_loads_no_mindspore():
    code = ("import sys, hyper_parallel_ms.pipelining as p; p.build_plan('ZBVZeroBubble', 2, 2); "
            "assert 'mindspore' not in sys.modules, 'mindspore was imported'")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_validate_checks_the_rank_set_and_types():
    plan = build_plan("GPipe", 2, 1)
    with pytest.raises(ScheduleError, match=r"ranks 0..1 .* got ranks \[0\]"):
        validate({0: list(plan.actions[0])}, plan.placement, 1)
    with pytest.raises(ScheduleError, match="rank 0, step 0: '0F0' is not an Action"):
        validate({0: ["0F0"], 1: list(plan.actions[1])}, plan.placement, 1)
    with pytest.raises(ScheduleError, match=r"rank 0: 0F0 \(step 0\) is out of range: 2 stages, 0 micro-batches"):
        validate(_lists(plan), plan.placement, 0)
    assert SEND_F.is_send and SEND_B.is_send and RECV_F.is_recv and not F.is_send and W.is_compute


# ----------------------------------------------------------------------------- lowering for fully_shard stages
def test_fsdp_lowering_gathers_each_stage_once_and_reduces_after_its_last_backward():
    """build_plan(fsdp=True) (what the schedules run over fully_shard stages): the compute actions
    and transfers of the plain plan, in the same order, plus per stage one UNSHARD before its first
    compute action, one RESHARD after its last and one REDUCE_GRAD right after its last B or W
    (PyTorch's UNSHARD / RESHARD / REDUCE_GRAD lowering, up to 3 stages held per rank)."""
    from hyper_parallel_ms.pipelining import REDUCE_GRAD, RESHARD, UNSHARD

    for schedule in sorted(SCHEDULES):
        for pp, n in ((2, 4), (3, 6), (4, 8)):
            plain, lowered = _plan(schedule, pp, n), build_plan(schedule, pp, n, fsdp=True)
            assert lowered.timeline().starts == plain.timeline().starts           # no compute action moves
            for rank, acts in enumerate(lowered.actions):
                assert [a for a in acts if not a.kind.is_fsdp] == list(plain.actions[rank])
                for s in plain.stages_of(rank):
                    steps = {k: [i for i, a in enumerate(acts) if a == Action(s, k)] for k in (UNSHARD, RESHARD,
                                                                                             REDUCE_GRAD)}
                    work = [i for i, a in enumerate(acts) if a.stage == s and a.kind.is_compute]
                    weight = [i for i, a in enumerate(acts) if a.stage == s and a.kind in (B, W)]
                    assert [len(v) for v in steps.values()] == [1, 1, 1], (schedule, rank, s, acts)
                    assert steps[UNSHARD][0] < work[0] and steps[RESHARD][0] > work[-1]
                    assert steps[REDUCE_GRAD][0] > weight[-1] and steps[REDUCE_GRAD][0] < steps[RESHARD][0]
    # four stages per rank, three held at most: a stage is freed and gathered again, never computed while freed
    plan = build_plan("Interleaved1F1B", 2, 8, stages_per_rank=4, fsdp=True)
    for acts in plan.actions:
        held, most = set(), 0
        for a in acts:
            held = held | {a.stage} if a.kind is UNSHARD else held - {a.stage} if a.kind is RESHARD else held
            most = max(most, len(held))
            assert not a.kind.is_compute or a.stage in held
        assert most == 3 and sum(a.kind is UNSHARD for a in acts) > 4
    assert len(build_plan("Interleaved1F1B", 2, 8, stages_per_rank=4, fsdp=True, max_active_stages=4)
               .actions[0]) == len(_plan("Interleaved1F1B", 2, 8, stages_per_rank=4).actions[0]) + 3 * 4
    # the parameter actions take no time unless given a duration (a gather's time: the step grows by it)
    one = build_plan("1F1B", 2, 4, fsdp=True)
    assert one.timeline().makespan == _plan("1F1B", 2, 4).timeline().makespan
    assert one.timeline({UNSHARD: 2.0}).makespan == _plan("1F1B", 2, 4).timeline().makespan + 2.0
    with pytest.raises(ValueError, match="max_active_stages must be a positive int, got 0"):
        build_plan("1F1B", 2, 4, fsdp=True, max_active_stages=0)


PARAMETER_CORRUPTIONS = [
    # (rank, edit, expected message), on build_plan("1F1B", 2, 2, fsdp=True)
    (0, lambda a: _move(a, "0UNSHARD", a.index("0F0") + 1),                     # compute before the gather
     r"rank 0: 0F0 \(step 0\) runs while stage 0 is sharded: put 0UNSHARD before it"),
    (1, lambda a: ["1UNSHARD"] + a,                                              # gathered twice
     r"rank 1: 1UNSHARD \(step 1\) gathers stage 1 again: its UNSHARD at step 0 has no RESHARD before"),
    (1, lambda a: [x for x in a if x != "1RESHARD"],                             # left gathered
     r"rank 1 leaves stage\(s\) \[1\] gathered at the end of the step: add 1RESHARD"),
    (0, lambda a: a + ["0RESHARD"],                                              # freed twice
     r"rank 0: 0RESHARD \(step \d+\) frees stage 0, which no UNSHARD gathered"),
    (0, lambda a: _move(a, "0REDUCE_GRAD", a.index("0B1")),                      # reduce before the last backward
     r"rank 0: 0REDUCE_GRAD \(step \d+\) runs before the last weight gradient of stage 0 \(0B1 at step \d+\)"),
    (1, lambda a: a + ["1REDUCE_GRAD"],                                          # reduced twice
     r"rank 1: 1REDUCE_GRAD \(step \d+\) is listed twice"),
    (0, lambda a: a + ["1UNSHARD"],                                              # another rank's stage
     r"rank 0: 1UNSHARD \(step \d+\) acts for stage 1, which rank 1 holds"),
]


@pytest.mark.parametrize("case", PARAMETER_CORRUPTIONS, ids=lambda c: c[-1][:40])
def test_corrupted_parameter_actions_are_refused_naming_the_action(case):
    rank, edit, message = case
    plan = build_plan("1F1B", 2, 2, fsdp=True)
    lists = _lists(plan)
    with pytest.raises(ScheduleError, match=message):
        _check(_corrupt(lists, rank, edit), plan)
    # a parameter action names no micro-batch, every other one does
    for bad, why in ((Action(0, ActionKind.UNSHARD, 1), r"0UNSHARD1 \(step 0\) names a micro-batch"),
                     (Action(0, F), r"0F \(step 0\) has no micro-batch")):
        with pytest.raises(ScheduleError, match=why):
            _check({0: [bad] + lists[0], 1: lists[1]}, plan)
