"""A small Llama-style transformer built from MindSpore Cells, and its tensor-parallel plans.

Token embedding, ``layers`` blocks of RMSNorm + causal multi-head attention + SwiGLU MLP,
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

import numpy as np
from mindspore import Parameter, Tensor, nn, ops

from hyper_parallel_ms.nn import ColwiseParallel, ParallelCrossEntropy, PrepareModuleInput, RowwiseParallel, SequenceParallel
from hyper_parallel_ms.placement import Replicate, Shard

__all__ = ["LlamaConfig", "Llama", "tp_plan", "cross_entropy", "checkpointed", "causal_mask", "VocabParallelCrossEntropy",
           "WithLoss"]


@dataclass(frozen=True)
class LlamaConfig:
    vocab: int = 128
    dim: int = 64
    layers: int = 2
    heads: int = 4
    hidden: int = 128
    max_seq: int = 64


class RMSNorm(nn.Cell):
    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = Parameter(Tensor(np.ones(dim, np.float32)), name="weight")
        self.eps = eps

    def construct(self, x):
        return x * ops.rsqrt((x * x).mean(-1, keep_dims=True) + self.eps) * self.weight


@lru_cache(maxsize=8)
def causal_mask(max_seq: int) -> Tensor:
    """The additive causal mask (``-1e9`` above the diagonal), one Tensor shared by every layer."""
    return Tensor(np.triu(np.full((max_seq, max_seq), -1e9, np.float32), 1))


class Attention(nn.Cell):
    """Causal self-attention; ``reshape(b, s, -1, head_dim)`` keeps the heads this rank holds."""

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        dim = config.dim
        self.wq = nn.Dense(dim, dim, has_bias=False)
        self.wk = nn.Dense(dim, dim, has_bias=False)
        self.wv = nn.Dense(dim, dim, has_bias=False)
        self.wo = nn.Dense(dim, dim, has_bias=False)
        self.head_dim = dim // config.heads
        self.scale = 1.0 / float(np.sqrt(self.head_dim))
        self.mask = causal_mask(config.max_seq)

    def construct(self, x):
        b, s = x.shape[0], x.shape[1]
        q = self.wq(x).reshape(b, s, -1, self.head_dim).transpose(0, 2, 1, 3)
        k = self.wk(x).reshape(b, s, -1, self.head_dim).transpose(0, 2, 1, 3)
        v = self.wv(x).reshape(b, s, -1, self.head_dim).transpose(0, 2, 1, 3)
        scores = ops.matmul(q, k.transpose(0, 1, 3, 2)) * self.scale + self.mask[:s, :s]
        out = ops.matmul(ops.softmax(scores, -1), v).transpose(0, 2, 1, 3).reshape(b, s, -1)
        return self.wo(out)


class FeedForward(nn.Cell):
    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.w1 = nn.Dense(config.dim, config.hidden, has_bias=False)
        self.w3 = nn.Dense(config.dim, config.hidden, has_bias=False)
        self.w2 = nn.Dense(config.hidden, config.dim, has_bias=False)

    def construct(self, x):
        return self.w2(ops.silu(self.w1(x)) * self.w3(x))


class Block(nn.Cell):
    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.attention_norm = RMSNorm(config.dim)
        self.attention = Attention(config)
        self.ffn_norm = RMSNorm(config.dim)
        self.feed_forward = FeedForward(config)

    def construct(self, x):
        h = x + self.attention(self.attention_norm(x))
        return h + self.feed_forward(self.ffn_norm(h))


class Llama(nn.Cell):
    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.tok_embeddings = nn.Embedding(config.vocab, config.dim)
        self.layers = nn.CellList([Block(config) for _ in range(config.layers)])
        self.norm = RMSNorm(config.dim)
        self.output = nn.Dense(config.dim, config.vocab, has_bias=False)

    def construct(self, ids):
        # a pipeline stage cut by hyper_parallel_ms.pipelining.split_blocks holds pass-through Cells for the
        # layers of other stages; the None checks serve stages whose layers were set to None by hand
        h = ids if self.tok_embeddings is None else self.tok_embeddings(ids)
        for layer in self.layers:
            h = layer(h)
        return h if self.output is None else self.output(self.norm(h))


def checkpointed(whole_blocks: bool = False):
    """``apply_activation_checkpointing``'s ``check_fn``: each block's attention and feed-forward
    (whole blocks under sequence parallelism do not compile under jit), or with ``whole_blocks``
    the blocks (fully_shard units must be checkpointed whole: a Cell inside a unit is refused)."""
    kinds = (Block,) if whole_blocks else (Attention, FeedForward)
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
