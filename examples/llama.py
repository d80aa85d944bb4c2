"""A small Llama-style transformer built from MindSpore Cells, and its tensor-parallel plans.

Token embedding, ``layers`` blocks of RMSNorm + causal multi-head (or grouped-query) attention + SwiGLU MLP,
a final RMSNorm and an output head. :func:`tp_plan` is PyTorch's Llama plan for
``parallelize_module``: heads and MLP columns split by Colwise / Rowwise, and (with
``sequence_parallel``) norms on sequence-sharded activations between the blocks. The
attention and MLP inputs reach only their Colwise layers, so their gradients are reduced
once per block half (``defer_colwise_grads=True``), as in Megatron-LM.

Example::

    model = Llama(LlamaConfig(vocab=64, dim=32, layers=2, heads=4))
    parallelize_module(model, mesh["tp"], tp_plan(sequence_parallel=True))
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import Any, Optional

import numpy as np
from mindspore import Parameter, Tensor, nn, ops
from mindspore.common import dtype as mstype
from mindspore.common.initializer import Normal, initializer

from hyper_parallel_ms.nn import ColwiseParallel, ParallelCrossEntropy, PrepareModuleInput, RowwiseParallel, SequenceParallel
from hyper_parallel_ms.nn.functional import scaled_dot_product_attention
from hyper_parallel_ms.placement import Replicate, Shard

__all__ = ["LlamaConfig", "Llama", "tp_plan", "cross_entropy", "checkpointed", "causal_mask", "VocabParallelCrossEntropy",
           "WithLoss"]


@dataclass(frozen=True)
class LlamaConfig:
    """The model's shape. ``kv_heads``: key / value heads (grouped-query attention, each serving
    ``heads // kv_heads`` consecutive query heads; ``None``: as many as ``heads``); ``attention``:
    ``"math"`` (scores, mask and softmax written out: the scores are kept for the backward) or
    ``"flash"`` (:func:`~hyper_parallel_ms.nn.functional.scaled_dot_product_attention`, the fused
    flash-attention kernel on Ascend in float16 / bfloat16, keeping no scores; its definition
    elsewhere); ``dtype``: the parameters' (and so the activations') dtype."""
    vocab: int = 128
    dim: int = 64
    layers: int = 2
    heads: int = 4
    hidden: int = 128
    max_seq: int = 64
    kv_heads: Optional[int] = None
    attention: str = "math"
    dtype: Any = mstype.float32

    def __post_init__(self) -> None:
        if self.attention not in ("math", "flash"):
            raise ValueError(f"LlamaConfig: attention must be 'math' or 'flash', got {self.attention!r}")
        if self.kv_heads is not None and (self.kv_heads < 1 or self.heads % self.kv_heads):
            raise ValueError(f"LlamaConfig: kv_heads {self.kv_heads} must divide the {self.heads} heads (each key / "
                             "value head serves heads // kv_heads query heads)")

    @property
    def key_heads(self) -> int:
        """The key / value heads (``kv_heads``, else ``heads``)."""
        return self.heads if self.kv_heads is None else self.kv_heads


class RMSNorm(nn.Cell):
    def __init__(self, dim: int, eps: float = 1e-6, dtype: Any = mstype.float32) -> None:
        super().__init__()
        self.weight = Parameter(initializer("ones", (dim,), dtype), name="weight")
        self.eps = eps

    def construct(self, x):
        return x * ops.rsqrt((x * x).mean(-1, keep_dims=True) + self.eps) * self.weight


@lru_cache(maxsize=8)
def causal_mask(max_seq: int, dtype: Any = mstype.float32) -> Tensor:
    """The additive causal mask (``-1e9`` above the diagonal, in ``dtype``), one Tensor shared by every layer."""
    return Tensor(np.triu(np.full((max_seq, max_seq), -1e9, np.float32), 1), dtype)


class Attention(nn.Cell):
    """Causal self-attention; ``reshape(b, s, -1, head_dim)`` keeps the heads this rank holds."""

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        dim, dtype = config.dim, config.dtype
        self.head_dim = dim // config.heads
        kv_dim = config.key_heads * self.head_dim
        self.wq = nn.Dense(dim, dim, has_bias=False, dtype=dtype)
        self.wk = nn.Dense(dim, kv_dim, has_bias=False, dtype=dtype)
        self.wv = nn.Dense(dim, kv_dim, has_bias=False, dtype=dtype)
        self.wo = nn.Dense(dim, dim, has_bias=False, dtype=dtype)
        self.groups = config.heads // config.key_heads
        self.flash = config.attention == "flash"
        self.scale = 1.0 / float(np.sqrt(self.head_dim))
        self.mask = None if self.flash else causal_mask(config.max_seq, dtype)

    def construct(self, x):
        b, s = x.shape[0], x.shape[1]
        q = self.wq(x).reshape(b, s, -1, self.head_dim).transpose(0, 2, 1, 3)
        k = self.wk(x).reshape(b, s, -1, self.head_dim).transpose(0, 2, 1, 3)
        v = self.wv(x).reshape(b, s, -1, self.head_dim).transpose(0, 2, 1, 3)
        if self.flash:
            out = scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.scale, enable_gqa=self.groups > 1)
        else:
            k, v = _repeat_kv(k, self.groups), _repeat_kv(v, self.groups)
            mask = self.mask if s == self.mask.shape[0] else self.mask[:s, :s]
            scores = ops.matmul(q, k.transpose(0, 1, 3, 2)) * self.scale + mask
            out = ops.matmul(ops.softmax(scores, -1), v)
        return self.wo(out.transpose(0, 2, 1, 3).reshape(b, s, -1))


def _repeat_kv(x, groups: int):
    """``[b, kv_heads, s, d]`` -> ``[b, kv_heads * groups, s, d]``: each key / value head serves ``groups``
    consecutive query heads (grouped-query attention)."""
    if groups == 1:
        return x
    b, n, s, d = x.shape
    return ops.broadcast_to(x.expand_dims(2), (b, n, groups, s, d)).reshape(b, n * groups, s, d)


class FeedForward(nn.Cell):
    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.w1 = nn.Dense(config.dim, config.hidden, has_bias=False, dtype=config.dtype)
        self.w3 = nn.Dense(config.dim, config.hidden, has_bias=False, dtype=config.dtype)
        self.w2 = nn.Dense(config.hidden, config.dim, has_bias=False, dtype=config.dtype)

    def construct(self, x):
        return self.w2(ops.silu(self.w1(x)) * self.w3(x))


class Block(nn.Cell):
    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.attention_norm = RMSNorm(config.dim, dtype=config.dtype)
        self.attention = Attention(config)
        self.ffn_norm = RMSNorm(config.dim, dtype=config.dtype)
        self.feed_forward = FeedForward(config)

    def construct(self, x):
        h = x + self.attention(self.attention_norm(x))
        return h + self.feed_forward(self.ffn_norm(h))


class Llama(nn.Cell):
    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.tok_embeddings = nn.Embedding(config.vocab, config.dim,
                                           embedding_table=initializer(Normal(0.01), [config.vocab, config.dim],
                                                                       config.dtype))
        self.layers = nn.CellList([Block(config) for _ in range(config.layers)])
        self.norm = RMSNorm(config.dim, dtype=config.dtype)
        self.output = nn.Dense(config.dim, config.vocab, has_bias=False, dtype=config.dtype)

    def construct(self, ids):
        # a pipeline stage cut by hyper_parallel_ms.pipelining.split_blocks holds pass-through Cells for the
        # layers of other stages; the None checks serve stages whose layers were set to None by hand
        h = ids if self.tok_embeddings is None else self.tok_embeddings(ids)
        for layer in self.layers:
            h = layer(h)
        return h if self.output is None else self.output(self.norm(h))


def checkpointed(whole_blocks: bool = False, attention_only: bool = False):
    """``apply_activation_checkpointing``'s ``check_fn``: each block's attention and feed-forward
    (whole blocks under sequence parallelism do not compile under jit), or with ``whole_blocks``
    the blocks (fully_shard units must be checkpointed whole: a Cell inside a unit is refused);
    ``attention_only`` (and not ``whole_blocks``): the attentions alone, for the
    ``"attention_core"`` policy (Korthikanti et al.'s selective recomputation)."""
    kinds = (Block,) if whole_blocks else (Attention,) if attention_only else (Attention, FeedForward)
    return lambda cell: isinstance(cell, kinds)


def cross_entropy(logits, labels_onehot):
    """Mean token cross-entropy of ``logits`` (b, s, vocab) against one-hot labels."""
    return -(ops.log_softmax(logits, -1) * labels_onehot).sum(-1).mean()


class VocabParallelCrossEntropy(nn.Cell):
    """Mean token cross-entropy of this rank's ``(b, s, vocab / tp)`` logits piece against
    ``(b * s,)`` class indices, by :class:`ParallelCrossEntropy` over ``tp_mesh``."""

    def __init__(self, tp_mesh, vocab: int) -> None:
        super().__init__()
        self.loss = ParallelCrossEntropy(tp_mesh, num_classes=vocab)

    def construct(self, local_logits, targets):
        return self.loss(local_logits.reshape(-1, local_logits.shape[-1]), targets)


class WithLoss(nn.Cell):
    """``loss(model(ids), labels)``: the Cell a train step differentiates."""

    def __init__(self, model: nn.Cell, loss: nn.Cell) -> None:
        super().__init__()
        self.model, self.loss = model, loss

    def construct(self, ids, labels):
        return self.loss(self.model(ids), labels)


def tp_plan(sequence_parallel: bool = True, loss_parallel: bool = False, local_inputs: bool = False) -> dict:
    """PyTorch's Llama tensor-parallel plan (``sequence_parallel``: norms on sequence shards;
    ``loss_parallel``: the head returns this rank's vocabulary piece of the logits, ``Shard(-1)``,
    for :class:`hyper_parallel_ms.nn.ParallelCrossEntropy`, instead of gathering them;
    ``local_inputs``: the norms hand on, and attention and feed-forward get, local pieces in
    PyNative rather than DTensors, as a selective activation checkpoint needs)."""
    rep, seq = Replicate(), Shard(1)
    logits = Shard(-1) if loss_parallel else rep
    if not sequence_parallel:
        return {
            "tok_embeddings": RowwiseParallel(input_layouts=rep),
            "layers.*.attention": PrepareModuleInput(input_layouts=(rep,), desired_input_layouts=(rep,),
                                                     defer_colwise_grads=True, use_local_output=local_inputs),
            "layers.*.feed_forward": PrepareModuleInput(input_layouts=(rep,), desired_input_layouts=(rep,),
                                                        defer_colwise_grads=True, use_local_output=local_inputs),
            "layers.*.attention.w[qkv]": ColwiseParallel(),
            "layers.*.attention.wo": RowwiseParallel(),
            "layers.*.feed_forward.w[13]": ColwiseParallel(),
            "layers.*.feed_forward.w2": RowwiseParallel(),
            "output": ColwiseParallel(output_layouts=logits),
        }
    return {
        "tok_embeddings": RowwiseParallel(input_layouts=rep, output_layouts=seq),
        "layers.*": {
            "attention_norm": SequenceParallel(use_local_output=local_inputs),
            "attention": PrepareModuleInput(input_layouts=(seq,), desired_input_layouts=(rep,),
                                            defer_colwise_grads=True, use_local_output=local_inputs),
            "attention.w[qkv]": ColwiseParallel(),
            "attention.wo": RowwiseParallel(output_layouts=seq),
            "ffn_norm": SequenceParallel(use_local_output=local_inputs),
            "feed_forward": PrepareModuleInput(input_layouts=(seq,), desired_input_layouts=(rep,),
                                               defer_colwise_grads=True, use_local_output=local_inputs),
            "feed_forward.w[13]": ColwiseParallel(),
            "feed_forward.w2": RowwiseParallel(output_layouts=seq),
        },
        "norm": SequenceParallel(use_local_output=local_inputs),
        "output": ColwiseParallel(input_layouts=seq, output_layouts=logits),
    }
