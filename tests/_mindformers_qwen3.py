"""MindFormers 2.1.0's PyNativeQwen3ForCausalLM on this library (through ``alias_hyper_parallel``),
parallelized by MindFormers' own ``parallelize_model``, against the same model on one device.
Module-level functions for the rank pools of tests/test_mindformers.py."""
from __future__ import annotations

import os
import tempfile
from typing import Callable, Dict, List, Optional, Tuple

import numpy as np

BATCH, SEQ, VOCAB = 2, 16, 128
CP_SEQ = 2048       # MindFormers' compressed causal mask is (2048, 2048): it refuses shorter sequences


def available() -> Optional[str]:
    """``None`` when MindFormers' PyNative stack can be imported here, else why not."""
    try:
        import mindformers  # noqa: F401
    except ImportError as err:
        return (f"mindformers is not installed ({err}); scripts/setup_env.sh installs "
                "scripts/requirements-mindformers.txt")
    return None


def _setup() -> None:
    """What a MindFormers run on CPU ranks with this library needs, before MindFormers is imported:
    its logs out of the working directory, the alias, and (MindSpore 2.10) the not-in-place
    ``mindspore.ops.communication`` calls MindFormers' styles make (MindSpore 2.11's default)."""
    out = os.environ.setdefault("LOCAL_DEFAULT_PATH", tempfile.mkdtemp(prefix="hpms_mindformers_"))
    os.environ.setdefault("LOG_MF_PATH", os.path.join(out, "log"))
    from hyper_parallel_ms.compat import alias_hyper_parallel
    alias_hyper_parallel()


def config(context_parallel: bool = False):
    """The issue's Qwen3: 2 layers, hidden 64, 4 heads, vocab 128, sequence 16, all float32; the
    attention core written out (``use_flash_attention=False``: MindFormers casts flash attention's
    float32 inputs to float16, whose rounding differs between layouts). ``context_parallel``: what
    MindFormers' context parallelism requires: flash attention with the compressed causal mask
    (``use_attn_mask_compression``, sparse mode 2), so a sequence of 2048."""
    from mindformers.models.qwen3.configuration_qwen3 import Qwen3Config
    from mindformers.modules.transformer.transformer import TransformerOpParallelConfig
    seq = CP_SEQ if context_parallel else SEQ
    # a parallel_config of its own: the default is one object shared by every config of the process,
    # which MindFormers' attach_context_parallel_runtime_hints changes (context_parallel=2 would reach
    # the next configs built here)
    return Qwen3Config(parallel_config=TransformerOpParallelConfig(),
                       vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=4, head_dim=16, max_position_embeddings=seq,
                       compute_dtype="float32", params_dtype="float32", layernorm_compute_dtype="float32",
                       rotary_dtype="float32", softmax_compute_dtype="float32", seq_length=seq,
                       hidden_dropout=0.0, attention_dropout=0.0, use_flash_attention=context_parallel,
                       use_attn_mask_compression=context_parallel)


def _float32_attention(model) -> None:
    """Keep flash attention's inputs float32: MindFormers' attention casts float32 q, k and v to
    float16 for the kernel; under context parallelism the float16 gradients of k and v are then summed
    over the ranks in float16 (one rounding more than on one device: 1e-3 relative in the gradients,
    measured, which AdamW turns into steps of lr on small elements). The twin computes in float32."""
    import mindspore as ms
    from mindspore import ops

    def cast(x, dtype):
        return x if dtype == ms.float16 and x.dtype == ms.float32 else ops.cast(x, dtype)
    patched = 0
    for name, cell in model.cells_and_names():
        if name.endswith("self_attention"):
            cell.cast = cast
            patched += 1
    if not patched:
        raise RuntimeError("no self_attention Cell found in the model: MindFormers' attention changed")


def _batch(batch: int = BATCH, seq: int = SEQ) -> Tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(100)
    return (rng.integers(0, VOCAB, size=(batch, seq)).astype(np.int32),
            rng.integers(0, VOCAB, size=(batch, seq)).astype(np.int32))


def _weights(model) -> Dict[str, np.ndarray]:
    """Seeded values for every parameter (MindFormers leaves them to its trainer's initialisation):
    norms' weights 1, matrices N(0, 0.05); a MoE layer's buffers (``moe_buffers``)."""
    from tests._mindformers_moe import moe_buffers
    buffers = moe_buffers(model)
    rng = np.random.default_rng(7)
    return {name: buffers[name] if name in buffers else
            (np.ones(p.shape) if len(p.shape) == 1 else rng.normal(0.0, 0.05, tuple(p.shape))).astype(np.float32)
            for name, p in model.parameters_and_names()}


def _train(model, steps: int, rows: slice, sense: float, context_parallel: bool = False,
           after_step: Optional[Callable] = None) -> List[float]:
    """``steps`` AdamW steps on the batch's ``rows``; the loss scaled by ``sense`` for the backward
    (MindFormers' trainer's loss sense) and returned unscaled. ``context_parallel``: one sequence of
    2048 with its ``position_ids`` (MindFormers' context parallelism cuts them with the tokens).
    ``after_step(model)``: called after each optimizer step (what MindFormers' trainer does then)."""
    import mindspore as ms
    from mindspore import nn
    ids, labels = (ms.Tensor(a[rows]) for a in (_batch(1, CP_SEQ) if context_parallel else _batch()))
    extra = {"position_ids": ms.Tensor(np.arange(CP_SEQ, dtype=np.int32)[None])} if context_parallel else {}
    opt = nn.AdamWeightDecay(model.trainable_params(), learning_rate=1e-2, weight_decay=0.0)
    model.set_train(True)

    def forward(ids, labels):
        loss = model(input_ids=ids, labels=labels, **extra)
        loss = loss[0] if isinstance(loss, tuple) else loss
        return loss * sense, loss

    grad_fn = ms.value_and_grad(forward, None, opt.parameters, has_aux=True)
    losses = []
    for _ in range(steps):
        (_, loss), grads = grad_fn(ids, labels)
        opt(grads)
        if after_step is not None:
            after_step(model)
        losses.append(float(loss.asnumpy().reshape(-1)[0]))
    return losses


def one_device(steps: int, context_parallel: bool = False) -> Tuple[List[float], Dict[str, np.ndarray]]:
    """The model on one device (this process), trained on the whole batch (``context_parallel``: the
    configuration and the sequence of :func:`context_parallel`'s runs)."""
    _setup()
    import mindspore as ms
    from mindformers.models.qwen3.modeling_qwen3_train_pynative import PyNativeQwen3ForCausalLM
    from hyper_parallel_ms.testing import cpu_twins
    with cpu_twins():
        model = PyNativeQwen3ForCausalLM(config(context_parallel))
        if context_parallel:
            _float32_attention(model)
        for name, value in _weights(model).items():
            dict(model.parameters_and_names())[name].set_data(ms.Tensor(value))
        losses = _train(model, steps, slice(None), 1.0, context_parallel)
    return losses, {name: p.asnumpy() for name, p in model.parameters_and_names()}


def _train_parallelized(steps: int, parallelism, model_config, rows: slice, float32_attention: bool = False,
                        context_parallel: bool = False, model_class=None, after_step=None):
    """The model (``model_class``, default PyNativeQwen3ForCausalLM) built on the meta device from
    ``model_config``, parallelized by MindFormers' ``parallelize_model`` for ``parallelism``, materialised,
    loaded with the full weights and trained on ``rows`` with MindFormers' loss sense (``after_step(model,
    dims)`` after each step); returns the model, this rank's losses and the full parameters."""
    import mindspore as ms
    from mindspore.communication import get_group_size
    from mindspore.ops.communication import set_comm_ops_inplace
    import mindformers.pynative.distributed.parallel_dims as parallel_dims
    from mindformers.models.qwen3.modeling_qwen3_train_pynative import PyNativeQwen3ForCausalLM
    from mindformers.pynative.config.config import RecomputeCommConfig, RecomputeConfig, SwapConfig
    from mindformers.pynative.distributed.parallel_dims import ParallelDims
    from mindformers.pynative.distributed.parallelize import parallelize_model
    from mindformers.pynative.distributed.utils import get_loss_sense
    from hyper_parallel_ms.checkpoint import StateDictOptions, get_model_state_dict, set_model_state_dict
    from hyper_parallel_ms.testing import cpu_twins

    parallel_dims.device_type = "cpu"           # MindFormers' meshes are "npu" meshes; these ranks are CPU ones
    set_comm_ops_inplace(False)
    try:
        with cpu_twins():
            with ms.DeviceCtx("meta"):
                model = (model_class or PyNativeQwen3ForCausalLM)(model_config)
            if float32_attention:
                _float32_attention(model)
            full = _weights(model)
            dims = ParallelDims.from_config(parallelism, get_group_size())
            model = parallelize_model(model, dims, parallelism, RecomputeConfig(), RecomputeCommConfig(),
                                      SwapConfig())[0][0]
            model.to_empty(device="CPU")                # MindSpore 2.10: to_empty() without a device stays meta
            set_model_state_dict(model, {k: ms.Tensor(v) for k, v in full.items()},
                                 options=StateDictOptions(full_state_dict=True))
            sense = float(get_loss_sense(parallelism, enable_parallel=True).asnumpy().reshape(-1)[0])
            losses = _train(model, steps, rows, sense, context_parallel=context_parallel,
                            after_step=None if after_step is None else lambda m: after_step(m, dims))
            state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
            return model, losses, {k: v.asnumpy() for k, v in state.items()}
    finally:
        set_comm_ops_inplace(True)
        parallel_dims.device_type = "npu"


def parallel(steps: int, tensor_parallel: int) -> Tuple[List[float], Dict[str, np.ndarray]]:
    """``ParallelismConfig(tensor_parallel=..., sequence_parallel=...)`` over the world (the rest data
    parallel: FSDP), each data-parallel rank trained on its rows; returns this rank's losses and the
    full parameters."""
    _setup()
    from mindspore.communication import get_group_size, get_rank
    from mindformers.pynative.config.config import ParallelismConfig
    world, rank = get_group_size(), get_rank()
    parallelism = ParallelismConfig(tensor_parallel=tensor_parallel, sequence_parallel=tensor_parallel > 1)
    parallelism.data_parallel = world // tensor_parallel       # as MindFormers' trainer sets it
    rows = BATCH // parallelism.data_parallel
    dp_rank = rank // tensor_parallel
    _, losses, params = _train_parallelized(steps, parallelism, config(),
                                            slice(dp_rank * rows, (dp_rank + 1) * rows))
    return losses, params


def context_parallel(steps: int, method: str) -> Tuple[List[float], Dict[str, np.ndarray], Tuple[str, int]]:
    """``ParallelismConfig(context_parallel=world, context_parallel_method=method)``, the config given the
    fields MindFormers' trainer sets for it (``attach_context_parallel_runtime_hints``: colossal's ``BSH``
    layout), trained on one sequence of 2048 that MindFormers' input hook cuts into each rank's piece;
    returns this rank's losses (the mean of its piece), the full parameters, and the method and Ulysses
    degree MindFormers applied."""
    _setup()
    from mindspore.communication import get_group_size
    from mindformers.pynative.config.config import ParallelismConfig
    from mindformers.pynative.distributed.context_parallel import attach_context_parallel_runtime_hints
    parallelism = ParallelismConfig(context_parallel=get_group_size(), context_parallel_method=method)
    parallelism.data_parallel = 1
    model_config = attach_context_parallel_runtime_hints(config(context_parallel=True), parallelism)
    model, losses, params = _train_parallelized(steps, parallelism, model_config, slice(None),
                                                float32_attention=True, context_parallel=True)
    return losses, params, _applied_context_parallel(model)


def _applied_context_parallel(model) -> Tuple[str, int]:
    """The method and Ulysses degree MindFormers' ``parallelize_model`` recorded on the model's config
    when it applied its context-parallel styles."""
    for _, cell in model.cells_and_names():
        cfg = getattr(cell, "config", None)
        if hasattr(cfg, "_mf_runtime_context_parallel_method"):
            return cfg._mf_runtime_context_parallel_method, int(cfg._mf_runtime_ulysses_degree_in_cp)
    raise RuntimeError("parallelize_model applied no context parallelism to the model")


def run_all(steps: int) -> dict:
    """On each rank of a 2-rank pool: TP=2 with sequence parallelism, FSDP over dp=2, context
    parallelism cp=2 (colossal and Ulysses), MindFormers' MoE (DeepSeek-V3, tiny) with expert
    parallelism ep=2 (its token permutation written out, and fused; and ep=2 over the ranks of tp=2
    with sequence parallelism), MindFormers' Muon optimizer on sharded weights (2 steps, its point-to-point
    strategy), MindFormers' trainer step by ``loss.backward()`` (TP=2 + SP, FSDP over dp=2); rank 0 also
    the model on one device for each configuration (the tests read rank 0's; rank 1 waits for it at its
    next collective, idle)."""
    from mindspore.communication import get_rank
    from tests import _mindformers_backward as backward
    from tests import _mindformers_moe as moe
    from tests import _mindformers_muon as muon
    out = {**backward.run_all(steps), "tp2_sp": parallel(steps, 2), "fsdp_dp2": parallel(steps, 1),
           "cp2_colossal": context_parallel(steps, "colossal"), "cp2_ulysses": context_parallel(steps, "ulysses"),
           "moe_ep2": moe.expert_parallel(steps), "moe_ep2_fused": moe.expert_parallel(steps, permute_fusion=True),
           "moe_tp2_sp_ep2": moe.expert_parallel(steps, tensor_parallel=2), "muon_deredundancy": muon.deredundancy(2)}
    if get_rank() == 0:
        out.update(one_device=one_device(steps), one_device_cp=one_device(steps, context_parallel=True),
                   one_device_moe=moe.one_device(steps), one_device_moe_fused=moe.one_device(steps, permute_fusion=True))
    return out
