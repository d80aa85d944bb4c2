"""MindFormers 2.1.0's PyNativeQwen3ForCausalLM on this library (through ``alias_hyper_parallel``),
parallelized by MindFormers' own ``parallelize_model``, against the same model on one device.
Module-level functions for the rank pools of tests/test_mindformers.py."""
from __future__ import annotations

import os
import tempfile
from typing import Dict, List, Optional, Tuple

import numpy as np

BATCH, SEQ, VOCAB = 2, 16, 128


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


def config():
    """The issue's Qwen3: 2 layers, hidden 64, 4 heads, vocab 128, sequence 16, all float32; the
    attention core written out (``use_flash_attention=False``: MindFormers casts flash attention's
    float32 inputs to float16, whose rounding differs between layouts)."""
    from mindformers.models.qwen3.configuration_qwen3 import Qwen3Config
    return Qwen3Config(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=4, head_dim=16, max_position_embeddings=SEQ,
                       compute_dtype="float32", params_dtype="float32", layernorm_compute_dtype="float32",
                       rotary_dtype="float32", softmax_compute_dtype="float32", seq_length=SEQ,
                       hidden_dropout=0.0, attention_dropout=0.0, use_flash_attention=False)


def _batch() -> Tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(100)
    return (rng.integers(0, VOCAB, size=(BATCH, SEQ)).astype(np.int32),
            rng.integers(0, VOCAB, size=(BATCH, SEQ)).astype(np.int32))


def _weights(model) -> Dict[str, np.ndarray]:
    """Seeded values for every parameter (MindFormers leaves them to its trainer's initialisation):
    norms' weights 1, matrices N(0, 0.05)."""
    rng = np.random.default_rng(7)
    return {name: (np.ones(p.shape) if len(p.shape) == 1 else rng.normal(0.0, 0.05, tuple(p.shape))).astype(np.float32)
            for name, p in model.parameters_and_names()}


def _train(model, steps: int, rows: slice, sense: float) -> List[float]:
    """``steps`` AdamW steps on the batch's ``rows``; the loss scaled by ``sense`` for the backward
    (MindFormers' trainer's loss sense) and returned unscaled."""
    import mindspore as ms
    from mindspore import nn
    ids, labels = (ms.Tensor(a[rows]) for a in _batch())
    opt = nn.AdamWeightDecay(model.trainable_params(), learning_rate=1e-2, weight_decay=0.0)
    model.set_train(True)

    def forward(ids, labels):
        loss = model(input_ids=ids, labels=labels)
        loss = loss[0] if isinstance(loss, tuple) else loss
        return loss * sense, loss

    grad_fn = ms.value_and_grad(forward, None, opt.parameters, has_aux=True)
    losses = []
    for _ in range(steps):
        (_, loss), grads = grad_fn(ids, labels)
        opt(grads)
        losses.append(float(loss.asnumpy().reshape(-1)[0]))
    return losses


def one_device(steps: int) -> Tuple[List[float], Dict[str, np.ndarray]]:
    """The model on one device (this process), trained on the whole batch."""
    _setup()
    import mindspore as ms
    from mindformers.models.qwen3.modeling_qwen3_train_pynative import PyNativeQwen3ForCausalLM
    from hyper_parallel_ms.testing import cpu_twins
    with cpu_twins():
        model = PyNativeQwen3ForCausalLM(config())
        for name, value in _weights(model).items():
            dict(model.parameters_and_names())[name].set_data(ms.Tensor(value))
        losses = _train(model, steps, slice(None), 1.0)
    return losses, {name: p.asnumpy() for name, p in model.parameters_and_names()}


def parallel(steps: int, tensor_parallel: int) -> Tuple[List[float], Dict[str, np.ndarray]]:
    """The model built on the meta device, parallelized by MindFormers' ``parallelize_model`` for
    ``ParallelismConfig(tensor_parallel=..., sequence_parallel=...)`` over the world (the rest data
    parallel: FSDP), materialised, loaded with the full weights, and trained with MindFormers' loss
    sense, each data-parallel rank on its rows; returns this rank's losses and the full parameters."""
    _setup()
    import mindspore as ms
    from mindspore.communication import get_group_size, get_rank
    from mindspore.ops.communication import set_comm_ops_inplace
    import mindformers.pynative.distributed.parallel_dims as parallel_dims
    from mindformers.models.qwen3.modeling_qwen3_train_pynative import PyNativeQwen3ForCausalLM
    from mindformers.pynative.config.config import (ParallelismConfig, RecomputeCommConfig, RecomputeConfig,
                                                    SwapConfig)
    from mindformers.pynative.distributed.parallel_dims import ParallelDims
    from mindformers.pynative.distributed.parallelize import parallelize_model
    from mindformers.pynative.distributed.utils import get_loss_sense
    from hyper_parallel_ms.checkpoint import StateDictOptions, get_model_state_dict, set_model_state_dict
    from hyper_parallel_ms.testing import cpu_twins

    world, rank = get_group_size(), get_rank()
    parallel_dims.device_type = "cpu"           # MindFormers' meshes are "npu" meshes; these ranks are CPU ones
    set_comm_ops_inplace(False)
    try:
        with cpu_twins():
            with ms.DeviceCtx("meta"):
                model = PyNativeQwen3ForCausalLM(config())
            full = _weights(model)
            parallelism = ParallelismConfig(tensor_parallel=tensor_parallel, sequence_parallel=tensor_parallel > 1)
            parallelism.data_parallel = world // tensor_parallel       # as MindFormers' trainer sets it
            dims = ParallelDims.from_config(parallelism, world)
            model = parallelize_model(model, dims, parallelism, RecomputeConfig(), RecomputeCommConfig(),
                                      SwapConfig())[0][0]
            model.to_empty(device="CPU")
            set_model_state_dict(model, {k: ms.Tensor(v) for k, v in full.items()},
                                 options=StateDictOptions(full_state_dict=True))
            rows_per_rank = BATCH // parallelism.data_parallel
            dp_rank = rank // tensor_parallel
            sense = float(get_loss_sense(parallelism, enable_parallel=True).asnumpy().reshape(-1)[0])
            losses = _train(model, steps, slice(dp_rank * rows_per_rank, (dp_rank + 1) * rows_per_rank), sense)
            state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
            return losses, {k: v.asnumpy() for k, v in state.items()}
    finally:
        set_comm_ops_inplace(True)
        parallel_dims.device_type = "npu"


def run_all(steps: int) -> dict:
    """On each rank of a 2-rank pool: TP=2 with sequence parallelism, FSDP over dp=2, and the model on
    one device (every rank computes it: the ranks would wait for each other otherwise)."""
    return {"tp2_sp": parallel(steps, 2), "fsdp_dp2": parallel(steps, 1), "one_device": one_device(steps)}
