"""hyper_parallel_ms.compat: ``alias_hyper_parallel()`` serves HyperParallel 1.0's module paths
(the ones MindFormers 2.1.0's PyNative stack imports) with this library's objects, refuses to hide
a real ``hyper_parallel``, and names what is not provided yet. In the pytest process, no ranks."""
from __future__ import annotations

import importlib
import sys
import types

import pytest

import hyper_parallel_ms as hp
from hyper_parallel_ms import nn as hnn
from hyper_parallel_ms.compat import HYPER_PARALLEL_NAMES, NotProvidedError, alias_hyper_parallel
from hyper_parallel_ms.compat._alias import _remove_alias
from hyper_parallel_ms.compat._fsdp import fully_shard as compat_fully_shard
from hyper_parallel_ms.compat._platform import MindSporePlatform
from hyper_parallel_ms.compat import _activation, _pipeline, _redistribute_infer, _schedules
from hyper_parallel_ms import pipelining
from hyper_parallel_ms.training import checkpoint_exclude_wrapper, enable_mindspore_backward_compat

# Every ``hyper_parallel`` import of MindFormers 2.1.0's mindformers/pynative/ (module path, names),
# read from its sources; the schedules are MindFormers' _SCHEDULE_REGISTRY (importlib + getattr).
MINDFORMERS_IMPORTS = [
    ("hyper_parallel", ("DTensor", "DeviceMesh", "PipelineStage", "SkipDTensorDispatch", "init_device_mesh",
                        "shard_module")),
    ("hyper_parallel.core.dtensor", ("DTensor",)),
    ("hyper_parallel.core.dtensor.dtensor", ("DTensor", "distribute_tensor")),
    ("hyper_parallel.core.dtensor.placement_types", ("Placement", "Shard", "Replicate", "Partial")),
    ("hyper_parallel.core.dtensor.layout", ("_infer_slice_area_by_rank",)),
    ("hyper_parallel.core.dtensor.redistribute_infer", ("DevMat", "RedistributionOperatorInfer")),
    ("hyper_parallel.core.shard.sharding_plan", ("ShardingPlan",)),
    ("hyper_parallel.core.fully_shard.api", ("HSDPModule", "MixedPrecisionPolicy", "fully_shard")),
    ("hyper_parallel.core.fully_shard.utils", ("OffloadPolicy", "CPUOffloadPolicy")),
    ("hyper_parallel.core.pipeline_parallel", ("Schedule1F1B", "ScheduleInterleaved1F1B", "ScheduleGPipe")),
    ("hyper_parallel.core.pipeline_parallel.scheduler", ("MetaStepType",)),
    ("hyper_parallel.core.pipeline_parallel.hook_coordinator", ("HookCoordinator", "HookRole")),
    ("hyper_parallel.core.pipeline_parallel.comm_compute_overlap", ("CommComputeOverlap",)),
    ("hyper_parallel.core.activation_checkpoint", ("CheckpointPolicy", "SwapManager", "checkpoint_exclude_wrapper",
                                                   "checkpoint_wrapper", "swap_wrapper")),
    ("hyper_parallel.core.context_parallel.context_parallel", ("ContextParallel",)),
    ("hyper_parallel.core.context_parallel.async_context_parallel", ("AsyncContextParallel",)),
    ("hyper_parallel.core.context_parallel.dsa_context_parallel", (
        "DSAIndexerContextParallel", "DSAIndexerLossContextParallel", "DSASequenceReplicateCache",
        "DSASparseAttentionContextParallel")),
    ("hyper_parallel.core.context_parallel.async_dsa_context_parallel", (
        "AsyncDSAIndexerContextParallel", "AsyncDSAIndexerLossContextParallel",
        "AsyncDSASparseAttentionContextParallel")),
    ("hyper_parallel.custom_ops.experimental", (
        "npu_dense_lightning_indexer_grad_kl_loss", "npu_dense_lightning_indexer_softmax_lse", "npu_lightning_indexer",
        "npu_mhc_post", "npu_mhc_pre_sinkhorn", "npu_sparse_flash_mla", "npu_sparse_flash_mla_grad",
        "npu_sparse_lightning_indexer_grad_kl_loss", "npu_sparse_lightning_indexer_kl_loss_grad")),
    ("hyper_parallel.platform", ("get_platform",)),
    ("hyper_parallel.core.distributed_checkpoint", ("get_global_layout", "get_current_layout")),  # mindformers/checkpoint
    ("hyper_parallel.platform.mindspore.autograd_compat", ("enable_mindspore_backward_compat",)),
    ("hyper_parallel.platform.mindspore.pipeline_parallel._utils", ("_MicroBatch",)),
]
IMPORTS = [(module, name) for module, names in MINDFORMERS_IMPORTS for name in names]
PROVIDED = {
    "DTensor": hp.DTensor, "DeviceMesh": hp.DeviceMesh, "PipelineStage": hp.PipelineStage,
    "SkipDTensorDispatch": hp.SkipDTensorDispatch, "init_device_mesh": hp.init_device_mesh,
    "shard_module": hp.shard_module, "distribute_tensor": hp.distribute_tensor, "Placement": hp.Placement,
    "Shard": hp.Shard, "Replicate": hp.Replicate, "Partial": hp.Partial, "ShardingPlan": hp.ShardingPlan,
    "HSDPModule": hp.FSDPModule, "MixedPrecisionPolicy": hp.MixedPrecisionPolicy, "fully_shard": compat_fully_shard,
    "OffloadPolicy": hp.OffloadPolicy, "CPUOffloadPolicy": hp.CPUOffloadPolicy, "Schedule1F1B": _schedules.Schedule1F1B,
    "ScheduleInterleaved1F1B": _schedules.ScheduleInterleaved1F1B, "ScheduleGPipe": _schedules.ScheduleGPipe,
    "ContextParallel": hp.ContextParallel, "AsyncContextParallel": hp.AsyncContextParallel,
    # DeepSeek sparse attention's boundary styles (tests/_dsa_boundaries.py)
    **{name: getattr(hnn, name) for name in (
        "DSAIndexerContextParallel", "DSAIndexerLossContextParallel", "DSASequenceReplicateCache",
        "DSASparseAttentionContextParallel", "AsyncDSAIndexerContextParallel", "AsyncDSAIndexerLossContextParallel",
        "AsyncDSASparseAttentionContextParallel")},
    # the activation-checkpoint face (tests/test_compat_activation.py) and the pipeline data types
    # (tests/test_compat_pipeline.py)
    "CheckpointPolicy": _activation.CheckpointPolicy, "SwapManager": _activation.SwapManager,
    "checkpoint_wrapper": _activation.checkpoint_wrapper, "swap_wrapper": _activation.swap_wrapper,
    "checkpoint_exclude_wrapper": checkpoint_exclude_wrapper, "MetaStepType": _pipeline.MetaStepType,
    "_MicroBatch": _pipeline.MicroBatch,
    # MindFormers' Muon tensor-map helpers (tests/test_compat_redistribute_infer.py)
    "_infer_slice_area_by_rank": _redistribute_infer.infer_slice_area_by_rank, "DevMat": _redistribute_infer.DevMat,
    "RedistributionOperatorInfer": _redistribute_infer.RedistributionOperatorInfer,
    # loss.backward() / param.grad (tests/test_tensor_backward.py)
    "enable_mindspore_backward_compat": enable_mindspore_backward_compat,
    # the two-thread overlap (tests/test_overlap.py)
    "HookCoordinator": pipelining.HookCoordinator, "HookRole": pipelining.HookRole,
    "CommComputeOverlap": pipelining.CommComputeOverlap,
}
# provided under another name's rules (tested below)
SERVED = {"get_platform", "get_global_layout", "get_current_layout"}


@pytest.fixture
def aliased():
    alias_hyper_parallel()
    yield
    _remove_alias()


def test_the_table_covers_every_mindformers_import():
    assert {(m, n) for m, names in HYPER_PARALLEL_NAMES.items() for n in names} >= set(IMPORTS)


@pytest.mark.parametrize("module,name", [i for i in IMPORTS if i[1] in PROVIDED], ids="{0[0]}:{0[1]}".format)
def test_a_mindformers_import_gets_this_librarys_object(aliased, module, name):
    namespace = {}
    exec(f"from {module} import {name}", namespace)
    assert namespace[name] is PROVIDED[name]
    assert getattr(importlib.import_module(module), name) is PROVIDED[name]


@pytest.mark.parametrize("module,name", [i for i in IMPORTS if i[1] not in PROVIDED and i[1] not in SERVED],
                         ids="{0[0]}:{0[1]}".format)
def test_a_name_not_provided_imports_as_a_placeholder_that_refuses_use(aliased, module, name):
    # MindFormers imports (and subclasses) these at import time: the import works, any use raises
    assert HYPER_PARALLEL_NAMES[module][name] is None
    namespace = {}
    exec(f"from {module} import {name}", namespace)
    placeholder = namespace[name]
    message = rf"{module}\.{name} \(HyperParallel\) is not provided by hyper_parallel_ms"
    with pytest.raises(NotProvidedError, match=message):
        placeholder()
    with pytest.raises(NotProvidedError, match=message):
        getattr(placeholder, "anything")
    sub = type("Sub", (placeholder,), {})                   # a subclass is defined, not made
    with pytest.raises(NotProvidedError, match=message):
        sub()


def test_get_platform_serves_its_collectives_and_hooks_and_refuses_the_rest(aliased):
    from hyper_parallel.platform import get_platform  # pylint: disable=import-outside-toplevel
    from hyper_parallel.core.pipeline_parallel.hook_coordinator import HookCoordinator  # pylint: disable=import-outside-toplevel
    platform = get_platform()
    assert isinstance(platform, MindSporePlatform) and get_platform() is platform and platform.name == "mindspore"
    with pytest.raises(ValueError, match="op 'prod' is not one of"):
        platform.differentiable_all_reduce(None, "prod", None)
    with pytest.raises(ValueError, match="sync hook 'E': the hooks are A, B, C, D, D_LAST"):
        platform.differentiable_sync_hook(None, "E", HookCoordinator())
    for name in ("AsyncCollectiveTensor", "wait_async_tensor"):
        with pytest.raises(NotProvidedError, match=name):
            getattr(platform, name)


def test_unknown_paths_and_names_are_refused_by_name(aliased):
    with pytest.raises(ModuleNotFoundError, match=r"hyper_parallel\.core\.nothing \(HyperParallel\) is not provided"):
        importlib.import_module("hyper_parallel.core.nothing")
    with pytest.raises(AttributeError, match="has no attribute 'nothing'"):
        getattr(importlib.import_module("hyper_parallel"), "nothing")


def test_alias_is_idempotent_and_opt_in():
    assert "hyper_parallel" not in sys.modules
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module("hyper_parallel")
    alias_hyper_parallel()
    try:
        alias_hyper_parallel()
        assert sum(type(f).__name__ == "_Finder" for f in sys.meta_path) == 1
        import hyper_parallel  # pylint: disable=import-outside-toplevel
        assert hyper_parallel.DeviceMesh is hp.DeviceMesh and hyper_parallel.core.dtensor.dtensor.DTensor is hp.DTensor
    finally:
        _remove_alias()
    assert "hyper_parallel" not in sys.modules


def test_alias_refuses_an_imported_hyper_parallel(monkeypatch):
    monkeypatch.setitem(sys.modules, "hyper_parallel", types.ModuleType("hyper_parallel"))
    with pytest.raises(RuntimeError, match="already imported"):
        alias_hyper_parallel()


def test_alias_refuses_an_installed_hyper_parallel(monkeypatch, tmp_path):
    (tmp_path / "hyper_parallel").mkdir()
    (tmp_path / "hyper_parallel" / "__init__.py").write_text("")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(RuntimeError, match="is installed .*Uninstall it"):
        alias_hyper_parallel()
    assert "hyper_parallel" not in sys.modules


@pytest.mark.skipif(__import__("tests._mindformers_qwen3", fromlist=["available"]).available() is not None,
                    reason="MindFormers 2.1.0 is not installed")
def test_mindformers_builds_and_wires_its_dsa_context_parallel_styles_on_this_library(aliased):
    """MindFormers' own ``build_hp_dsa_cp_style`` (every method it accepts, synchronous and asynchronous,
    sparse and dense stage) constructs this library's DSA styles with its keywords, and its adapter wires them
    onto a DSA attention's boundary Cells (with the handoff Cells of the asynchronous forms); the wired
    boundaries then compute on a 1-rank cp mesh as unwired ones (on ranks: tests/_dsa_boundaries.py)."""
    import mindspore as ms
    import numpy as np
    from mindspore import nn

    from hyper_parallel_ms.mesh import DeviceMesh
    from mindformers.pynative.distributed.style import build_hp_dsa_cp_style
    from tests._dsa_boundaries import Handoff, Indexer, IndexerLoss, SparseAttention

    mesh = DeviceMesh("cpu", [0], mesh_dim_names=("cp",))
    configs = [(a, True, "colossal") for a in (False, True)] + [(False, False, m) for m in ("colossal", "ulysses")]
    for async_enabled, sparse, method in configs:
        style = build_hp_dsa_cp_style(method, 1, None, "BNSD", async_enabled, sparse)
        want = hnn.AsyncDSAIndexerContextParallel if async_enabled else hnn.DSAIndexerContextParallel
        assert type(style.indexer_style) is want and style.indexer_style.layout == "BSND"
        core = nn.Cell()
        core.indexer, core.indexer_loss = nn.Cell(), nn.Cell()
        core.indexer.compute_sparse_indices, core.indexer.key_handoff = Indexer(), Handoff()
        core.indexer_loss.compute_indexer_loss = IndexerLoss()
        core.sparse_flash_attention, core.dense_flash_attention = SparseAttention(), SparseAttention()
        for name in ("sparse_key_handoff", "sparse_value_handoff", "sparse_key_rope_handoff"):
            setattr(core, name, Handoff())
        module = nn.Cell()
        module.core_attention = core
        assert style._apply(module, mesh) is module
        rng = np.random.default_rng(0)
        q, w = (ms.Tensor(rng.standard_normal(s).astype(np.float32)) for s in ((1, 4, 2, 4), (1, 4, 2)))
        key = core.indexer.key_handoff(q) if async_enabled else q
        np.testing.assert_allclose(core.indexer.compute_sparse_indices(q, key, w).asnumpy(),
                                   Indexer()(q, q, w).asnumpy(), rtol=1e-6)
