"""MindFormers 2.1.0's PyNative MoE model (PyNativeDeepseekV3ForCausalLM at tiny sizes) on this library,
parallelized by MindFormers' own ``parallelize_model`` with its expert parallelism, against the same model
on one device. Module-level functions for the rank pool of tests/test_mindformers.py."""
from __future__ import annotations

from typing import Dict, List, Tuple

import numpy as np

EXPERTS, TOP_K = 4, 2
# DeepSeek's aux-loss-free balancing bias: routes with it (noaux_tc), is not trained (MindFormers' trainer
# updates it outside the step); nonzero so that the routing depends on it
EXPERT_BIAS = np.array([0.02, -0.01, 0.0, 0.01], np.float32)


def moe_config(permute_fusion: bool = False):
    """DeepSeek-V3 at tiny sizes, float32: 2 MoE layers (``first_k_dense_replace=0``), hidden 64, 4 heads
    (multi-latent attention: q and kv ranks 32, rope dim 8), 4 routed experts of hidden 32 with top-2
    sigmoid routing through the expert bias (``noaux_tc``, one group), one shared expert, vocab 128,
    sequence 16; no multi-token prediction; the attention core written out (``use_flash_attention=False``).
    ``pad_token_id`` outside the vocabulary: MindFormers' GPT model leaves the pad id's tokens out of the
    loss (its default 0 is a token of the test batch, and each rank's loss would then be a mean over
    another number of tokens than the one-device loss). ``permute_fusion``: MindFormers' fused token
    permutation (``ops.moe_token_permute`` / ``moe_token_unpermute``) in place of its sort and gathers."""
    from mindformers.models.deepseek3.configuration_deepseek_v3 import DeepseekV3Config
    from mindformers.modules.transformer.transformer import TransformerOpParallelConfig
    from tests._mindformers_qwen3 import SEQ, VOCAB
    return DeepseekV3Config(parallel_config=TransformerOpParallelConfig(),
                            vocab_size=VOCAB, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                            num_hidden_layers=2, first_k_dense_replace=0, num_nextn_predict_layers=0,
                            num_attention_heads=4, num_key_value_heads=4, q_lora_rank=32, kv_lora_rank=32,
                            qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16,
                            n_routed_experts=EXPERTS, num_experts_per_tok=TOP_K, n_shared_experts=1,
                            routed_scaling_factor=1.0, topk_method="noaux_tc", n_group=1, topk_group=1,
                            moe_grouped_gemm=True, max_position_embeddings=SEQ, seq_length=SEQ, pad_token_id=VOCAB,
                            compute_dtype="float32", params_dtype="float32", layernorm_compute_dtype="float32",
                            rotary_dtype="float32", softmax_compute_dtype="float32", router_dense_type="float32",
                            hidden_dropout=0.0, attention_dropout=0.0, use_flash_attention=False,
                            moe_permute_fusion=permute_fusion)


def moe_buffers(model) -> Dict[str, np.ndarray]:
    """Initial values of a MoE layer's non-trained parameters: ``expert_bias`` (:data:`EXPERT_BIAS`) and
    ``tokens_per_expert`` (zero: it counts the tokens routed to each expert)."""
    out = {}
    for name, p in model.parameters_and_names():
        if name.endswith(".expert_bias"):
            out[name] = EXPERT_BIAS.copy()
        elif name.endswith(".tokens_per_expert"):
            out[name] = np.zeros(tuple(p.shape), np.float32)
    return out


def _update_expert_bias(model, dims=None) -> None:
    """What MindFormers' trainer does after each step of a model with an expert bias (its loss callback):
    ``_update_expert_bias`` over the loss mesh (dp x cp: the ranks' token counts summed), which moves each
    expert's bias by ``moe_router_bias_update_rate`` towards balance and zeroes the counts."""
    if dims is None:
        model._update_expert_bias(None, 1)
    else:
        loss_mesh = dims.get_mesh("loss")
        model._update_expert_bias(loss_mesh.get_group(), loss_mesh.size())


def one_device(steps: int, permute_fusion: bool = False) -> Tuple[List[float], Dict[str, np.ndarray]]:
    """The MoE model on one device (this process), trained on the whole batch."""
    from tests._mindformers_qwen3 import _setup, _train, _weights
    _setup()
    import mindspore as ms
    from mindformers.models.deepseek3.modeling_deepseek_v3_pynative import PyNativeDeepseekV3ForCausalLM
    from hyper_parallel_ms.testing import cpu_twins
    with cpu_twins():
        model = PyNativeDeepseekV3ForCausalLM(moe_config(permute_fusion))
        params = dict(model.parameters_and_names())
        for name, value in _weights(model).items():
            params[name].set_data(ms.Tensor(value))
        losses = _train(model, steps, slice(None), 1.0, after_step=_update_expert_bias)
    return losses, {name: p.asnumpy() for name, p in model.parameters_and_names()}


def expert_parallel(steps: int, permute_fusion: bool = False,
                    tensor_parallel: int = 1) -> Tuple[List[float], Dict[str, np.ndarray], dict]:
    """``ParallelismConfig(expert_parallel=world, tensor_parallel=...)``, the rest of the world data
    parallel (MindFormers borrows ep from the dp x tp ranks): the experts sharded over ep by MindFormers'
    ``ExpertParallel`` (tokens exchanged by ``mindspore.ops.communication``'s all-to-alls), the dense
    parameters sharded over tp (with sequence parallelism) and fully sharded over dp; each dp rank trained
    on its rows, the expert bias updated after each step as MindFormers' trainer does. Returns this rank's
    losses, the full parameters and what ran (the experts' local shapes, the all-to-alls)."""
    from tests._mindformers_qwen3 import BATCH, _setup, _train_parallelized
    _setup()
    from mindspore.communication import get_group_size, get_rank
    from mindformers.models.deepseek3.modeling_deepseek_v3_pynative import PyNativeDeepseekV3ForCausalLM
    from mindformers.pynative.config.config import ParallelismConfig
    from hyper_parallel_ms.comm.debug import CommDebugMode
    world, rank = get_group_size(), get_rank()
    parallelism = ParallelismConfig(expert_parallel=world, tensor_parallel=tensor_parallel,
                                    sequence_parallel=tensor_parallel > 1)
    parallelism.data_parallel = world // tensor_parallel           # as MindFormers' trainer sets it
    rows, dp_rank = BATCH // parallelism.data_parallel, rank // tensor_parallel
    with CommDebugMode() as comms:
        model, losses, params = _train_parallelized(steps, parallelism, moe_config(permute_fusion),
                                                    slice(dp_rank * rows, (dp_rank + 1) * rows),
                                                    model_class=PyNativeDeepseekV3ForCausalLM,
                                                    after_step=_update_expert_bias)
    applied = {name: tuple(p.shape) for name, p in model.parameters_and_names() if ".experts.weight" in name}
    applied["all_to_all_single"] = comms.get_comm_counts().get("all_to_all_single", 0)
    return losses, params, applied
