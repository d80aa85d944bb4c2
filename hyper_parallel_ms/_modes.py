"""Which features run in PyNative and which compile (``ms.jit`` / GRAPH_MODE): one registry,
each cell with the tests that prove it.

The table of docs/modes.md ("PyNative and graph mode") is :func:`mode_table`'s output (a test compares
them and checks that every named test exists); regenerate it with
``python -m hyper_parallel_ms._modes``. Loads no MindSpore.

>>> print(mode_table().splitlines()[0])
| feature | PyNative | `ms.jit` / GRAPH_MODE |
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Tuple

__all__ = ["ModeCell", "Feature", "FEATURES", "mode_table"]


@dataclass(frozen=True)
class ModeCell:
    """What one feature does in one mode, and the tests that show it.

    Args:
        text: the table's cell: ``"yes"`` (or ``"yes, except ..."``), or what happens instead
            (``"no: ..."``).
        proofs: ``"tests/<file>.py::<test>"`` names of tests that run it (for ``"yes"``) or check
            the refusal; empty only where no test checks the cell (never for ``"yes"``).

    >>> ModeCell("yes", ("tests/test_comm.py::test_all_gather",)).supported
    True
    """

    text: str
    proofs: Tuple[str, ...] = ()

    @property
    def supported(self) -> bool:
        return self.text.startswith("yes")


@dataclass(frozen=True)
class Feature:
    """One row of the table.

    Args:
        name: the feature, as the docs' table names it (Markdown).
        pynative: the cell for PyNative.
        graph: the cell for ``ms.jit`` and GRAPH_MODE Cells.

    >>> Feature("x", ModeCell("yes", ("t.py::a",)), ModeCell("no")).graph.supported
    False
    """

    name: str
    pynative: ModeCell
    graph: ModeCell


_STYLES = "tests/test_parallel_styles.py::"
_MATRIX = "tests/test_styles_graph_matrix.py::"
_ENGINE = "tests/test_engine_rules.py::"
FEATURES: Tuple[Feature, ...] = (
    Feature("`parallelize_module` styles, `GradientReducer`, collectives, redistribution of local tensors",
            ModeCell("yes", (_STYLES + "test_dp_x_tp_on_2x2_mesh", "tests/test_comm.py::test_all_gather",
                             "tests/test_local_redistribute.py::test_local_redistribute_values_and_gradients")),
            ModeCell("yes", (_MATRIX + "test_styles_and_conversions_in_every_mode_and_container",
                             _STYLES + "test_transformer_trains_inside_ms_jit", "tests/test_comm.py::test_all_gather",
                             "tests/test_redistribute.py::test_plans_execute_inside_jit",
                             "tests/test_local_redistribute.py::test_local_redistribute_values_and_gradients"))),
    Feature("DTensor objects, ops on DTensors (the dispatcher), `DTensor.redistribute`",
            ModeCell("yes", ("tests/test_ops.py::test_matmul_on_2d_mesh",
                             "tests/test_redistribute.py::test_nested_sharding_orders_and_aliases")),
            ModeCell("no: pass local tensors",
                     ("tests/test_dtensor_guards.py::test_dtensors_are_refused_by_ms_jit_and_graph_mode_cells",))),
    Feature("`shard_module` / `distribute_module` (DTensor parameters)",
            ModeCell("yes", ("tests/test_sharding_plan.py::test_seed_example_on_2d_mesh",
                             "tests/test_sharding_plan.py::test_distribute_module_partition_hooks_and_refusals")),
            ModeCell("no: raises", (_ENGINE + "test_misuses_that_would_compute_silently_raise",
                                    "tests/test_sharding_plan.py::"
                                    "test_plans_refuse_to_compile_naming_the_cause_and_none_means_no_entries"))),
    Feature("`use_local_output=False` (DTensor outputs), DTensor inputs to styled Cells",
            ModeCell("yes", (_STYLES + "test_prepare_module_input_output_kwargs_and_dtensor_outputs",)),
            ModeCell("outputs stay local")),
    Feature("`PrepareModuleInput(input_kwarg_layouts=...)` (keyword inputs)",
            ModeCell("yes", (_STYLES + "test_prepare_module_input_output_kwargs_and_dtensor_outputs",)),
            ModeCell("no: raises (MindSpore compiles no kwargs hooks)",
                     (_ENGINE + "test_keyword_conversions_refuse_to_compile_instead_of_being_skipped",))),
    Feature("`fully_shard`, `hsdp`",
            ModeCell("yes", ("tests/test_fsdp.py::test_fully_shard_2_ranks_sgd_adamw_and_schedule",
                             "tests/test_hsdp.py::test_hsdp_levels_fusion_and_threshold_2_ranks")),
            ModeCell("yes, except gradient sync off, input / output casts and SequenceParallel inside "
                     "sharded blocks (see \"Sharding over data parallelism\")",
                     ("tests/test_fsdp_compiled.py::test_fully_shard_and_hsdp_in_jit_2_ranks",
                      "tests/test_fsdp_compiled.py::test_fully_shard_and_hsdp_in_graph_mode_2_ranks",
                      "tests/test_fsdp_compiled.py::test_fully_shard_hsdp_and_tp_compiled_4_ranks"))),
)


def mode_table(features: Tuple[Feature, ...] = FEATURES) -> str:
    """The Markdown table of ``features`` (docs/modes.md, "PyNative and graph mode").

    Args:
        features: the rows (default: the package's registry).

    >>> print(mode_table((Feature("f", ModeCell("yes", ("t.py::a",)), ModeCell("no")),)))
    | feature | PyNative | `ms.jit` / GRAPH_MODE |
    | --- | --- | --- |
    | f | yes | no |
    """
    rows = ["| feature | PyNative | `ms.jit` / GRAPH_MODE |", "| --- | --- | --- |"]
    rows += [f"| {f.name} | {f.pynative.text} | {f.graph.text} |" for f in features]
    return "\n".join(rows)


if __name__ == "__main__":
    print(mode_table())
