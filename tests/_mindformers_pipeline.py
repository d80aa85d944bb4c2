"""MindFormers' pipeline path on this library: its ``parallelize_model`` for
``ParallelismConfig(pipeline_parallel=2)`` builds each rank's stage of its DeepSeek-V3 (tiny, MoE) with
its ``StageModelBuilder`` and ``ScaledLossPipelineStage``, and its schedule through HyperParallel's
``Schedule1F1B`` (served by ``hyper_parallel_ms.compat._schedules``); the step is its trainer's
``training_pp_step``: ``schedule.run(**batch)`` on every pp rank, its clipped global norm on
``param.grad``, its AdamW, ``param.grad = None``, the expert bias updated. Module-level functions for
the rank pool of tests/test_mindformers.py."""
from __future__ import annotations

from typing import Dict, List, Tuple

import numpy as np

MICRO_BATCHES = 2


def pipeline(steps: int) -> Tuple[List[float], List[float], Dict[str, np.ndarray], dict]:
    """``steps`` trainer steps of the pipelined DeepSeek-V3 (2 stages, 2 micro-batches of one row): the
    losses on the last stage's rank (the mean over the micro-batches, as MindFormers' ``compute_pp_loss``;
    ``[]`` elsewhere), MindFormers' global norms, this rank's full parameters and what ran."""
    from tests._mindformers_qwen3 import _batch, _setup, _weights
    _setup()
    import mindspore as ms
    from mindspore.communication import get_group_size
    from mindspore.graph.api import _no_grad
    from mindspore.ops.communication import set_comm_ops_inplace
    import mindformers.pynative.distributed.parallel_dims as parallel_dims
    from hyper_parallel.platform.mindspore.autograd_compat import enable_mindspore_backward_compat
    from mindformers.models.deepseek3.modeling_deepseek_v3_pynative import PyNativeDeepseekV3ForCausalLM
    from mindformers.pynative.config.config import (ParallelismConfig, RecomputeCommConfig, RecomputeConfig,
                                                    SwapConfig)
    from mindformers.pynative.distributed.parallel_dims import ParallelDims
    from mindformers.pynative.distributed.parallelize import parallelize_model
    from mindformers.pynative.optimizer.adamw import AdamW
    from mindformers.pynative.trainer.utils import _calculate_global_grad_norm
    from hyper_parallel_ms.checkpoint import StateDictOptions, get_model_state_dict, set_model_state_dict
    from hyper_parallel_ms.testing import cpu_twins
    from hyper_parallel_ms.training import disable_mindspore_backward_compat
    from tests._mindformers_backward import MAX_NORM
    from tests._mindformers_moe import moe_config

    parallel_dims.device_type = "cpu"
    set_comm_ops_inplace(False)
    full_names = {}
    try:
        with cpu_twins():
            with ms.DeviceCtx("meta"):
                model = PyNativeDeepseekV3ForCausalLM(moe_config())
            full = _weights(model)
            parallelism = ParallelismConfig(pipeline_parallel=2, pipeline_parallel_microbatch_size=MICRO_BATCHES)
            parallelism.data_parallel = 1
            dims = ParallelDims.from_config(parallelism, get_group_size())
            parts, schedule, _, has_last = parallelize_model(model, dims, parallelism, RecomputeConfig(),
                                                             RecomputeCommConfig(), SwapConfig(),
                                                             gradient_accumulation_steps=MICRO_BATCHES)
            for part in parts:
                part.to_empty(device="CPU")
                names = [n for n, _ in part.parameters_and_names()]
                set_model_state_dict(part, {n: ms.Tensor(full[n]) for n in names},
                                     options=StateDictOptions(full_state_dict=True))
                part.set_train(True)
                full_names.update(dict.fromkeys(names))
            ids, labels = (ms.Tensor(a) for a in _batch())
            params = [p for part in parts for p in part.trainable_params()]
            opt = AdamW(params, learning_rate=1e-2, weight_decay=0.0)
            loss_mesh = dims.get_mesh("loss")
            enable_mindspore_backward_compat()
            losses, norms = [], []
            try:
                for _ in range(steps):
                    outputs = schedule.run(input_ids=ids, labels=labels)
                    norm, grads = _calculate_global_grad_norm(opt.parameters, enable_parallel=True, max_norm=MAX_NORM)
                    if len(grads) != len(params):
                        raise RuntimeError(f"{len(params) - len(grads)} parameters got no gradient")
                    with _no_grad():
                        opt(grads)
                    for p in params:
                        p.grad = None
                    for part in parts:
                        part._update_expert_bias(loss_mesh.get_group(), loss_mesh.size())
                    if has_last:
                        losses.append(float(np.mean([(o[0] if isinstance(o, (tuple, list)) else o).asnumpy()
                                                     for o in outputs])))
                    norms.append(float(norm.asnumpy()))
            finally:
                disable_mindspore_backward_compat()
            state = {}
            for part in parts:
                state.update({k: v.asnumpy() for k, v in get_model_state_dict(
                    part, options=StateDictOptions(full_state_dict=True)).items()})
            applied = {"schedule": type(schedule).__name__, "stages": [type(s).__name__ for s in schedule.stages],
                       "layers": sorted({n.split(".")[3] for n in full_names if ".layers." in n})}
            return losses, norms, state, applied
    finally:
        set_comm_ops_inplace(True)
        parallel_dims.device_type = "npu"
