"""One name per concept (in one process, no ranks): across every public module's ``__all__`` a name
means one object, the renamed public names still resolve for one release with a
``DeprecationWarning`` pointing at the caller, and each module is named for what it holds."""
from __future__ import annotations

import importlib
import pkgutil
import sys
import warnings
from typing import Dict, List, Tuple

import pytest

import hyper_parallel_ms

# the one name two public objects share, both PyTorch's: torch.distributed.checkpoint (the package of
# distributed checkpoints) and torch.distributed._composable.checkpoint (activation checkpointing of a
# module); a module and a function, no two classes
SHARED_BY_PYTORCH = {"checkpoint": {"hyper_parallel_ms", "hyper_parallel_ms.training"}}


def public_modules(package=hyper_parallel_ms) -> List[str]:
    """The package and every module under it whose dotted path has no ``_`` part (the renamed ones
    kept for a release, ``hyper_parallel_ms._DEPRECATED_MODULES``, left out, and not imported)."""
    found = [package.__name__]
    for info in pkgutil.iter_modules(package.__path__, f"{package.__name__}."):
        short = info.name.rsplit(".", 1)[1]
        if short.startswith("_") or info.name in {f"hyper_parallel_ms.{m}"
                                                  for m in hyper_parallel_ms._DEPRECATED_MODULES}:
            continue
        found += public_modules(importlib.import_module(info.name)) if info.ispkg else [info.name]
    return found


def exported() -> Dict[str, List[Tuple[str, object]]]:
    """name -> [(module, object)] over every public module's ``__all__``."""
    names: Dict[str, List[Tuple[str, object]]] = {}
    for module_name in public_modules():
        module = importlib.import_module(module_name)
        assert hasattr(module, "__all__"), f"{module_name} is public but has no __all__"
        for name in module.__all__:
            names.setdefault(name, []).append((module_name, getattr(module, name)))
    return names


def test_a_public_name_means_one_object_across_the_public_modules():
    names = exported()
    assert {"hyper_parallel_ms.dryrun", "hyper_parallel_ms.redistribute", "hyper_parallel_ms.checkpoint"} <= {
        module for entries in names.values() for module, _ in entries}
    clashes = []
    for name, entries in sorted(names.items()):
        if len({id(obj) for _, obj in entries}) > 1 and {m for m, _ in entries} != SHARED_BY_PYTORCH.get(name):
            clashes.append(f"{name}: " + ", ".join(f"{m}.{name} ({type(o).__name__} of "
                                                   f"{getattr(o, '__module__', '?')})" for m, o in entries))
    assert not clashes, "one name, several objects:\n" + "\n".join(clashes)
    classes = [name for name, entries in names.items()
               if len({id(o) for _, o in entries}) > 1 and any(isinstance(o, type) for _, o in entries)]
    assert classes == [], classes
    # the two Layouts and two Chunks before the renames are one each now
    assert [m for m, _ in names["Layout"]] == ["hyper_parallel_ms", "hyper_parallel_ms.layout"]
    assert [m for m, _ in names["ParallelDims"]] == ["hyper_parallel_ms.dryrun"]
    assert [m for m, _ in names["Chunk"]] == ["hyper_parallel_ms.checkpoint"]


def _fresh_plan_import():
    """Forget ``hyper_parallel_ms.plan`` so that importing it runs its body (and warns) again."""
    sys.modules.pop("hyper_parallel_ms.plan", None)
    vars(hyper_parallel_ms).pop("plan", None)


def test_the_renamed_public_names_warn_and_resolve_to_the_new_objects():
    from hyper_parallel_ms import dryrun, redistribute
    _fresh_plan_import()
    with pytest.warns(DeprecationWarning, match=r"hyper_parallel_ms\.plan is deprecated \(renamed "
                                                r"hyper_parallel_ms\.dryrun\)") as caught:
        import hyper_parallel_ms.plan as plan
    assert caught[0].filename == __file__, caught[0].filename            # points at the import line
    assert [getattr(plan, n) for n in plan.__all__] == [getattr(dryrun, n) for n in dryrun.__all__]
    assert "Layout" not in plan.__all__ and "plan" not in hyper_parallel_ms.__all__
    with pytest.warns(DeprecationWarning, match=r"plan\.Layout is deprecated \(renamed "
                                                r"hyper_parallel_ms\.dryrun\.ParallelDims\)") as caught:
        from hyper_parallel_ms.plan import Layout
    assert Layout is dryrun.ParallelDims and caught[0].filename == __file__
    with pytest.warns(DeprecationWarning, match=r"plan\.layouts is deprecated"):
        assert plan.layouts is dryrun.parallel_dims_of
    with pytest.raises(AttributeError, match="no attribute 'Missing'"):
        plan.Missing
    _fresh_plan_import()
    with pytest.warns(DeprecationWarning, match=r"hyper_parallel_ms\.plan is deprecated") as caught:
        assert hyper_parallel_ms.plan.simulate is dryrun.simulate           # the lazy top-level attribute
    assert caught[0].filename == __file__, caught[0].filename
    candidate = dryrun.Candidate(dryrun.ParallelDims(dp=2), 1, True, 2.0, 3.0)
    with pytest.warns(DeprecationWarning, match=r"Candidate\.layout is deprecated \(renamed Candidate\.dims\)"):
        assert candidate.layout is candidate.dims
    with pytest.warns(DeprecationWarning, match=r"redistribute\.Chunk is deprecated \(renamed "
                                                r"hyper_parallel_ms\.redistribute\.Narrow\)"):
        assert redistribute.Chunk is redistribute.Narrow
    with warnings.catch_warnings():
        warnings.simplefilter("error")                                      # the new names do not warn
        assert dryrun.ParallelDims(pp=2, dp=4, tp=8).ranks == 64 and candidate.dims.dp == 2


def test_modules_are_named_for_what_they_hold():
    from hyper_parallel_ms.ops import propagator
    from hyper_parallel_ms.training import checkpoint_wrapper
    # op rules filed by family: joins and splits, softmax with the norms, views
    homes = {op: propagator.rule_for(op).__module__.rsplit(".", 1)[1]
             for op in ("Concat", "StackExt", "SplitWithSize", "Chunk", "Softmax", "LogSoftmax", "LayerNorm",
                        "Reshape", "Narrow", "Unstack")}
    assert homes == {"Concat": "concat", "StackExt": "concat", "SplitWithSize": "concat", "Chunk": "concat",
                     "Softmax": "nn_ops", "LogSoftmax": "nn_ops", "LayerNorm": "nn_ops", "Reshape": "view",
                     "Narrow": "view", "Unstack": "view"}
    # activation checkpointing (recomputation) beside the checkpoint package, the box arithmetic named so
    assert checkpoint_wrapper.__module__ == "hyper_parallel_ms.training._recompute"
    # the nn engines' shared path matching and done-markers are named for their targets, apart from op rules
    from hyper_parallel_ms.nn import _targets
    assert {"match_path", "near_names", "check_not_done", "mark_done"} <= set(_targets.__all__)
    for gone in ("hyper_parallel_ms.training._checkpoint", "hyper_parallel_ms.checkpoint._planner",
                 "hyper_parallel_ms.nn._rules"):
        with pytest.raises(ModuleNotFoundError):
            importlib.import_module(gone)
    from hyper_parallel_ms.checkpoint import _boxes
    assert {"assign_writers", "overlap_reads"} <= set(_boxes.__all__)
