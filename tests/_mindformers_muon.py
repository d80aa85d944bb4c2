"""MindFormers 2.1.0's Muon optimizer (``mindformers.pynative.optimizer.muon.Muon``) on DTensor parameters of
this library over 2 CPU ranks, with its ``allgather_deredundency`` strategy: each 2-D weight's Newton-Schulz runs
on one owner rank, its shards gathered there and the result scattered back by point-to-point ops that MindFormers
plans with HyperParallel's ``RedistributionOperatorInfer`` / ``DevMat`` / ``_infer_slice_area_by_rank`` on the
DTensors' layouts (``tensor_map``, ``rank_list``, ``set_placements`` on a deep copy, ...); and with its default
``allgather`` strategy (every rank gathers, runs Newton-Schulz, keeps its piece through ``distribute_tensor``).
Against the same optimizer on plain parameters of one device. Module-level functions for the rank pool of tests/test_mindformers.py.

What Muon needs beyond the parameters is the model's config and Newton-Schulz split functions: a model object
answering with MindFormers' own ``GPTModel.get_gpt_transformer_config`` / ``make_model_muon_fns`` on a small MLA
config stands in for a built DeepSeek model (Muon reads nothing else of it with ``qk_clip_enabled=False``)."""
from __future__ import annotations

import contextlib
import os
import types
from typing import Dict, Iterator

import numpy as np

# one weight per layout of a 1-D mesh of 2 ranks; linear_qb.weight is split by MindFormers' "periodic" rule
# (per head: 4 rows of q, 2 of rope) before Newton-Schulz, so its gathered rows must be in order
SHAPES = {"decoder.layers.0.self_attention.linear_qb.weight": (12, 8),
          "decoder.layers.0.mlp.linear_fc2.weight": (8, 16),
          "decoder.layers.0.self_attention.linear_proj.weight": (8, 8)}
SHARDS = {"decoder.layers.0.self_attention.linear_qb.weight": 0, "decoder.layers.0.mlp.linear_fc2.weight": 1,
          "decoder.layers.0.self_attention.linear_proj.weight": None}


@contextlib.contextmanager
def _muon_context() -> Iterator[None]:
    """What Muon checks before it runs, undone afterwards (the pool's later tasks see MindFormers, the
    environment and MindSpore as before): MindFormers' context with ``use_legacy=False`` (Muon refuses legacy
    models; building it sets environment variables), and MindSpore 2.11's
    ``device_context.ascend.op_precision.cube_math_type`` where MindSpore 2.10 lacks it (Muon sets the Ascend cube
    unit's float32 epilogue; the CPU has no cube unit, so a setting that does nothing)."""
    from mindspore.device_context.ascend import op_precision
    from mindformers.core.context.build_context import MFContextOperator
    from mindformers.tools.register import MindFormerConfig
    saved, environ = MFContextOperator._instance, dict(os.environ)
    added = not hasattr(op_precision, "cube_math_type")
    if added:
        op_precision.cube_math_type = lambda mode: None
    MFContextOperator._instance = None
    MFContextOperator(MindFormerConfig(use_legacy=False))
    try:
        yield
    finally:
        MFContextOperator._instance = saved
        os.environ.clear()
        os.environ.update(environ)
        if added:
            del op_precision.cube_math_type


def _model():
    from mindformers.pynative.base_models.gpt.gpt_model import GPTModel
    config = types.SimpleNamespace(multi_latent_attention=True, num_moe_experts=2, hidden_size=8,
                                   moe_ffn_hidden_size=8, qk_head_dim=4, qk_pos_emb_head_dim=2, num_attention_heads=2,
                                   kv_lora_rank=4, v_head_dim=4, q_lora_rank=None)
    return types.SimpleNamespace(config=config,
                                 get_gpt_transformer_config=types.MethodType(GPTModel.get_gpt_transformer_config,
                                                                             types.SimpleNamespace(config=config)),
                                 make_model_muon_fns=types.MethodType(GPTModel.make_model_muon_fns,
                                                                      types.SimpleNamespace(config=config)))


# on a 2 x 2 mesh (4 ranks): a weight sharded over both mesh dims on one tensor dim, one on two tensor dims, and
# one sharded on one mesh dim and replicated over the other
SHARDS_2D = {"decoder.layers.0.self_attention.linear_qb.weight": (0, 0),
             "decoder.layers.0.mlp.linear_fc2.weight": (0, 1),
             "decoder.layers.0.self_attention.linear_proj.weight": (None, 1)}


def deredundancy(steps: int, mesh_shape=(2,)) -> Dict[str, object]:
    """``steps`` Muon steps (``allgather_deredundency``) of the weights sharded over a mesh of ``mesh_shape``
    (``(2,)``: as :data:`SHARDS`; ``(2, 2)``: as :data:`SHARDS_2D`, each a weight's Shard dims per mesh dim) and,
    on each rank, of the same weights on one device (Muon's default ``allgather`` strategy, no DTensor); the same
    gradients (seeded, whole on one device, distributed as the weights). Returns per weight the largest
    difference to one device and the largest change of the weight, MindFormers' layout decision and op list."""
    from tests._mindformers_qwen3 import _setup
    _setup()
    import mindspore as ms
    from mindspore import Parameter
    from hyper_parallel_ms import DTensor, Layout, Replicate, Shard, init_device_mesh
    from hyper_parallel_ms.testing import cpu_twins

    def shard(full: np.ndarray, placements) -> DTensor:
        # this rank's piece, placed without a broadcast: distribute_tensor's broadcast cell, when first built
        # under the meta device context of the MindFormers models built before in the same pool, keeps a meta
        # tensor (comm/_broadcast.py's `sends`) and fails here off meta
        piece = full[Layout(mesh.shape, placements).local_slices(full.shape, mesh.get_coordinate())]
        return DTensor.from_local(ms.Tensor(np.ascontiguousarray(piece)), mesh, placements)

    if tuple(mesh_shape) == (2,):
        mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
        place = {n: [Replicate()] if d is None else [Shard(d)] for n, d in SHARDS.items()}
    else:
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        place = {n: [Replicate() if d is None else Shard(d) for d in dims] for n, dims in SHARDS_2D.items()}
    rng = np.random.default_rng(7)
    init = {n: rng.standard_normal(s).astype(np.float32) for n, s in SHAPES.items()}
    grads = [{n: rng.standard_normal(s).astype(np.float32) for n, s in SHAPES.items()} for _ in range(steps)]
    with _muon_context(), cpu_twins():
        from mindformers.pynative.optimizer.muon import Muon
        sharded = [Parameter(shard(init[n], place[n]), name=n) for n in SHAPES]
        gathering = [Parameter(shard(init[n], place[n]), name=n) for n in SHAPES]
        whole = [Parameter(ms.Tensor(init[n]), name=n) for n in SHAPES]
        opt = Muon(sharded, learning_rate=1e-2, model=_model(), qk_clip_enabled=False,
                   comm_strategy="allgather_deredundency")
        # its default strategy on the same DTensors: every rank gathers each weight, runs Newton-Schulz and
        # keeps its piece of the bfloat16 result through distribute_tensor (a bfloat16 broadcast)
        everyone = Muon(gathering, learning_rate=1e-2, model=_model(), qk_clip_enabled=False)
        reference = Muon(whole, learning_rate=1e-2, model=_model(), qk_clip_enabled=False)
        for grad in grads:
            opt(tuple(shard(grad[n], place[n]) for n in SHAPES))
            everyone(tuple(shard(grad[n], place[n]) for n in SHAPES))
            reference(tuple(ms.Tensor(grad[n]) for n in SHAPES))
        got = {p.name: p.full_tensor().asnumpy() for p in sharded}
        gathered = {p.name: p.full_tensor().asnumpy() for p in gathering}
        # MindFormers' all-gather fallback (for layouts its point-to-point path declines): the inferred ops, a
        # group from get_platform().create_group, mint.distributed.all_gather_into_tensor
        from mindformers.pynative.optimizer import muon
        fc2 = "decoder.layers.0.mlp.linear_fc2.weight"
        rows_place = [Shard(0)] + [Replicate()] * (mesh.ndim - 1)          # rows sharded: one all_concat on dim 0
        rows = shard(init[fc2].T.copy(), rows_place).to_local()
        from mindspore.communication import get_rank
        pending = muon._start_full_tensor_async(rows, mesh, rows_place, get_rank())
        fallback = pending.wait().asnumpy() if pending is not None else None
        local = {p.name: p.to_local().asnumpy() for p in sharded}
    want = {p.name: p.asnumpy() for p in whole}
    meta = {opt.param_name_tuple[i]: (m["layout_decision"], m["p2p_op_list"]) for i, m in opt._muon_param_meta.items()}
    return {"difference": {n: float(np.abs(got[n] - want[n]).max()) for n in SHAPES},
            "allgather_difference": {n: float(np.abs(gathered[n] - want[n]).max()) for n in SHAPES},
            "change": {n: float(np.abs(want[n] - init[n]).max()) for n in SHAPES},
            "local_shapes": {n: local[n].shape for n in SHAPES}, "decisions": meta,
            "fallback_gather": None if fallback is None else float(np.abs(fallback - init[fc2].T).max()),
            "owners": {opt.param_name_tuple[i]: r for i, r in opt._muon_assigned_rank.items()}}
