"""Activation memory per transformer layer against Korthikanti et al. 2022 and against the planner.

The GPT-3-style layer of ``tests/_gpt_layer.py`` (tanh GeLU, float16 parameters and activations:
the CPU runs them) at h=512, a=8, s=512, b=1 on 2 real CPU ranks (t=2), under tensor parallelism
(TP) and TP + sequence parallelism (SP), with and without dropout, and with the attention core or
the whole layer recomputed (``checkpoint_wrapper(policy="attention_core")`` / ``policy=None``). The
real bytes are what MindSpore's autodiff keeps for the backward (its saved-tensor hooks, each
storage once, parameters excluded; for a selective policy also the op outputs it keeps itself).
The formula is the paper's with 2-byte activations and 1-byte dropout masks
(``_gpt_layer.formula_bytes``); the planner's bytes per layer are ``simulate``'s of two layers less
one. ``docs/activation-memory.md`` tabulates the same numbers.

With dropout (p=0.1) the formula counts 1-byte masks; MindSpore's ``Dropout`` keeps its mask in the
activation's dtype, and every recomputation policy keeps the dropout outputs (output and mask; for
the attention dropout on this rank's heads, the whole draw of all heads): the ratios say what that
costs.

The bounds are the ratios measured (MindSpore 2.10, CPU) with a 3% margin: the kept bytes are
deterministic for a MindSpore release (the same ops keep the same tensors); the margin absorbs the
small tensors (LayerNorm statistics, the sequence-parallel norms' parameter reads, ~0.1% here) that
another release may keep in another dtype. A change that keeps more fails; one that keeps less
fails the lower bound and must lower the numbers here and in the docs page.
"""
from __future__ import annotations

import dataclasses

from hyper_parallel_ms.testing import run_on_ranks
from tests._gpt_layer import GPTShape, formula_bytes, measure_cases, planned_bytes

SHAPE = GPTShape(h=512, a=8, s=512, b=1, t=2, dtype="float16")
DROPOUT = dataclasses.replace(SHAPE, p=0.1)
# (shape, sequence_parallel, recompute) -> (real / formula, planner / real), measured (MindSpore 2.10, CPU)
MEASURED = {
    (SHAPE, False, "none"): (1.001, 0.999),
    (SHAPE, True, "none"): (1.085, 0.998),
    (DROPOUT, False, "none"): (1.334, 0.999),
    (DROPOUT, True, "none"): (1.461, 0.999),
    (SHAPE, True, "attention_core"): (1.190, 0.893),
    (DROPOUT, True, "attention_core"): (3.237, 0.963),
    (SHAPE, True, "full"): (1.000, 1.000),
    (DROPOUT, True, "full"): (41.0, 1.000),
}
MARGIN = 0.03


def _formula(shape: GPTShape, sequence_parallel: bool, recompute: str) -> float:
    recompute = "selective" if recompute == "attention_core" else recompute
    return formula_bytes(shape, sequence_parallel, itemsize=shape.itemsize, recompute=recompute)


def test_kept_activation_bytes_against_the_formula_and_the_planner():
    cases = list(MEASURED)
    real = run_on_ranks(measure_cases, 2, [(dataclasses.asdict(s), sp, r) for s, sp, r in cases], timeout=300)
    rows = {}
    for (shape, sp, recompute), (kept, diff), (kept1, _) in zip(cases, real[0], real[1]):
        assert kept == kept1, (shape, sp, recompute)          # the ranks keep the same
        # recomputation gives the gradients of the plain layer exactly (random ops' outputs are kept)
        assert diff == 0.0, (shape, sp, recompute, diff)
        planned = planned_bytes(shape, sp, recompute)
        rows[(shape, sp, recompute)] = (kept / _formula(shape, sp, recompute), planned / kept, kept)
    for key, (to_formula, to_real, kept) in rows.items():
        want_formula, want_real = MEASURED[key]
        label = (key[0].p, key[1], key[2], round(to_formula, 3), round(to_real, 3))
        assert want_formula * (1 - MARGIN) <= to_formula <= want_formula * (1 + MARGIN), label
        assert want_real * (1 - MARGIN) <= to_real <= want_real * (1 + MARGIN), label
    # without dropout each recomputation keeps less than the one before; with dropout every policy
    # keeps the dropout outputs (MindSpore's dropout kernels cannot draw the same mask again), so
    # the attention core's recomputation keeps more than none (docs/activation-memory.md)
    assert rows[(SHAPE, True, "full")][2] < rows[(SHAPE, True, "attention_core")][2] < rows[(SHAPE, True, "none")][2]
    assert rows[(DROPOUT, True, "full")][2] < rows[(DROPOUT, True, "none")][2]
