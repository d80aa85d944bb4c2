"""A small DeepSeek-style mixture-of-experts transformer built from MindSpore Cells, and its parallel plans.

Token embedding, ``layers`` blocks of RMSNorm + causal multi-head attention + RMSNorm + a dropless
:class:`~hyper_parallel_ms.moe.MoE` (sigmoid router with normalised top-k scores, aux-loss-free balancing by
an expert bias, one shared expert), a final RMSNorm and an output head (as DeepSeek-V3's MoE blocks, without
its multi-head latent attention). :func:`parallelize_moe` spreads the experts over ``ep`` ranks
(:class:`~hyper_parallel_ms.moe.ExpertParallel`; with ``tp`` > 1 also each expert's hidden features,
:class:`~hyper_parallel_ms.moe.ExpertTensorParallel`) and splits the dense parts (attention heads, the
shared expert, embedding and head) over ``tp`` as the Llama example's plan does.

Example::

    model = MoEModel(MoEConfig(vocab=64, dim=32, layers=2, heads=4))
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("ep", "tp"))
    parallelize_moe(model, mesh)
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from mindspore import nn
from mindspore.common.initializer import Normal, initializer

from hyper_parallel_ms.moe import ExpertParallel, ExpertTensorParallel, MoE, TensorParallel
from hyper_parallel_ms.nn import ColwiseParallel, PrepareModuleInput, RowwiseParallel, parallelize_module
from hyper_parallel_ms.placement import Replicate

try:
    from examples.llama import Attention, LlamaConfig, RMSNorm
except ImportError:  # run as a script: examples/ is the script's directory
    from llama import Attention, LlamaConfig, RMSNorm

__all__ = ["MoEConfig", "MoEModel", "parallelize_moe", "is_expert_parameter"]


@dataclass(frozen=True)
class MoEConfig:
    """The model's shape: ``experts`` routed experts of ``moe_hidden`` features each, ``top_k`` per token,
    ``shared_experts`` shared ones; ``load_balance_coeff`` the expert bias's step (``None``: no bias)."""
    vocab: int = 64
    dim: int = 32
    layers: int = 2
    heads: int = 4
    moe_hidden: int = 32
    experts: int = 4
    top_k: int = 2
    shared_experts: int = 1
    max_seq: int = 16
    load_balance_coeff: Optional[float] = 1e-3

    def attention_config(self) -> LlamaConfig:
        return LlamaConfig(vocab=self.vocab, dim=self.dim, layers=self.layers, heads=self.heads,
                           hidden=self.moe_hidden, max_seq=self.max_seq)


class MoEBlock(nn.Cell):
    """``h = x + attention(norm(x)); h + moe(norm(h))``."""

    def __init__(self, config: MoEConfig) -> None:
        super().__init__()
        self.attention_norm = RMSNorm(config.dim)
        self.attention = Attention(config.attention_config())
        self.ffn_norm = RMSNorm(config.dim)
        self.moe = MoE(config.dim, config.moe_hidden, config.experts, config.top_k,
                       num_shared_experts=config.shared_experts, score_func="sigmoid", route_norm=True,
                       load_balance_coeff=config.load_balance_coeff)

    def construct(self, x):
        h = x + self.attention(self.attention_norm(x))
        return h + self.moe(self.ffn_norm(h))


class MoEModel(nn.Cell):
    """Embedding, :class:`MoEBlock` layers, RMSNorm and the output head: ``ids (b, s) -> logits (b, s, vocab)``."""

    def __init__(self, config: MoEConfig) -> None:
        super().__init__()
        self.tok_embeddings = nn.Embedding(config.vocab, config.dim,
                                           embedding_table=initializer(Normal(0.01), [config.vocab, config.dim]))
        self.layers = nn.CellList([MoEBlock(config) for _ in range(config.layers)])
        self.norm = RMSNorm(config.dim)
        self.output = nn.Dense(config.dim, config.vocab, has_bias=False)

    def construct(self, ids):
        h = self.tok_embeddings(ids)
        for layer in self.layers:
            h = layer(h)
        return self.output(self.norm(h))


def is_expert_parameter(name: str) -> bool:
    """Whether a parameter is a routed expert's stacked weight (placed over ep: each rank's gradient is already
    its experts' whole gradient; every other parameter is replicated over ep)."""
    return ".moe.experts.w" in name


def dense_tp_plan() -> dict:
    """The dense parts over tp (no sequence parallelism, so the MoE sees whole tokens): attention heads and the
    shared expert's hidden features by Colwise / Rowwise, embedding by rows, the head gathering the logits."""
    rep = Replicate()
    return {
        "tok_embeddings": RowwiseParallel(input_layouts=rep),
        "layers.*.attention": PrepareModuleInput(input_layouts=(rep,), desired_input_layouts=(rep,),
                                                 defer_colwise_grads=True),
        "layers.*.attention.w[qkv]": ColwiseParallel(),
        "layers.*.attention.wo": RowwiseParallel(),
        "layers.*.moe.shared_experts": PrepareModuleInput(input_layouts=(rep,), desired_input_layouts=(rep,),
                                                          defer_colwise_grads=True),
        "layers.*.moe.shared_experts.w[13]": ColwiseParallel(),
        "layers.*.moe.shared_experts.w2": RowwiseParallel(),
        "output": ColwiseParallel(output_layouts=rep),
    }


def parallelize_moe(model: MoEModel, mesh) -> MoEModel:
    """Place ``model`` on a ``(ep, tp)`` mesh (dims named ``"ep"`` and ``"tp"``; either may have size one): the
    dense parts tensor-parallel over tp (:func:`dense_tp_plan`), the routed experts by ExpertParallel over ep
    (tp = 1), ExpertTensorParallel over (ep, tp), or TensorParallel over tp (ep = 1). The ranks of an ep
    group hold different tokens, those of a tp group the same."""
    ep, tp = mesh.size(mesh.dim_index("ep")), mesh.size(mesh.dim_index("tp"))
    if tp > 1:
        parallelize_module(model, mesh["tp"], dense_tp_plan())
    if ep > 1 and tp > 1:
        parallelize_module(model, mesh, {"layers.*.moe.experts": ExpertTensorParallel()})
    elif ep > 1:
        parallelize_module(model, mesh["ep"], {"layers.*.moe.experts": ExpertParallel()})
    elif tp > 1:
        parallelize_module(model, mesh["tp"], {"layers.*.moe.experts": TensorParallel()})
    return model
