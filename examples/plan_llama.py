"""The example Llama as a training script that :func:`hyper_parallel_ms.simulate` can run: one
``build(mesh)`` for all parallel dims (pp, dp, tp), fully_shard or not, micro-batches and activation
checkpointing, and the preset shapes of ``scripts/plan_cluster.py``.

``build(mesh)`` is what a training script does on each rank: the Llama built under
``no_init_parameters()`` (split into pipeline stages with ``split_blocks`` when pp > 1), tensor
parallel on ``mesh["tp"]`` (PyTorch's Llama plan with sequence parallelism and a vocabulary-
parallel loss), each block and the root ``fully_shard``-ed over ``mesh["dp"]`` (or gradients
averaged over dp; over dp x cp with context parallelism), optionally each block
activation-checkpointed, an ``AdamWeightDecay`` optimizer, and a ``step()`` that runs one training
step: ``value_and_grad`` of the loss, or the pipeline schedule (1F1B over ``mesh["pp"]``), then the
gradient reduction and the optimizer; with ``cp > 1`` inside ``context_parallel(mesh["cp"])``.

The presets have Llama's shapes on the example's architecture (no bias): ``7B`` (32 layers, dim
4096, ffn 11008, vocab 32000) and ``70B`` (80 layers, dim 8192, ffn 28672, vocab 128256) with
multi-head attention written out and fp32 parameters, as the example was first planned;
``Llama-2-70B`` and ``Llama-3-70B`` as those models are trained: 64 query heads sharing 8 key /
value heads (grouped-query attention), flash attention, bfloat16 (vocab 32000 and 128256).
``DTYPES`` names the parameter dtypes ``scripts/plan_cluster.py`` takes.

Example::

    dims = ParallelDims(pp=2, dp=4, tp=8, fsdp=True, microbatches=4)
    shape, names = dims.mesh
    report = simulate(llama_training(PRESETS["7B"], dims), mesh_shape=shape, mesh_dim_names=names)
"""
from __future__ import annotations

import contextlib
import math
from dataclasses import replace
from typing import Callable, Optional, Tuple

import mindspore as ms
import numpy as np
from mindspore import nn

from hyper_parallel_ms import fully_shard, init_parameters, no_init_parameters, pipelining
from hyper_parallel_ms.nn import GradientReducer, context_parallel, parallelize_module, set_rotate_method
from hyper_parallel_ms.dryrun import ParallelDims
from hyper_parallel_ms.training import apply_activation_checkpointing

try:
    from examples.llama import Block, Llama, LlamaConfig, VocabParallelCrossEntropy, WithLoss, tp_plan
except ImportError:  # run as a script: examples/ is the script's directory
    from llama import Block, Llama, LlamaConfig, VocabParallelCrossEntropy, WithLoss, tp_plan

__all__ = ["PRESETS", "DTYPES", "ParallelDims", "llama_training", "builder", "heads_problem", "context_parallel_problem",
           "describe"]

DTYPES = {"fp32": ms.float32, "bf16": ms.bfloat16, "fp16": ms.float16}
PRESETS = {
    "7B": LlamaConfig(vocab=32000, dim=4096, layers=32, heads=32, hidden=11008, max_seq=4096),
    "70B": LlamaConfig(vocab=128256, dim=8192, layers=80, heads=64, hidden=28672, max_seq=4096),
    "Llama-2-70B": LlamaConfig(vocab=32000, dim=8192, layers=80, heads=64, kv_heads=8, hidden=28672, max_seq=4096,
                               attention="flash", dtype=ms.bfloat16),
    "Llama-3-70B": LlamaConfig(vocab=128256, dim=8192, layers=80, heads=64, kv_heads=8, hidden=28672, max_seq=8192,
                               attention="flash", dtype=ms.bfloat16),
}
FIRST, LAST = ("tok_embeddings",), ("norm", "output")


def heads_problem(heads: int, kv_heads: int, tp: int) -> str:
    """Why ``tp`` tensor-parallel ranks cannot split ``heads`` query and ``kv_heads`` key / value heads
    (each rank holds whole heads), naming both numbers; ``""`` if they can.

    >>> heads_problem(32, 32, 64)
    '64 does not divide the 32 attention heads (heads 32, tp 64): each tensor-parallel rank holds whole heads'
    >>> heads_problem(64, 8, 16)[:48]
    '16 does not divide the 8 key / value heads (kv h'
    """
    if heads % tp:
        return (f"{tp} does not divide the {heads} attention heads (heads {heads}, tp {tp}): each tensor-parallel "
                "rank holds whole heads")
    if kv_heads % tp:
        return (f"{tp} does not divide the {kv_heads} key / value heads (kv heads {kv_heads}, tp {tp}): each "
                "tensor-parallel rank holds whole key / value heads")
    return ""


def context_parallel_problem(seq: int, cp: int, tp: int) -> str:
    """Why sequences of ``seq`` tokens cannot be cut over ``cp`` context-parallel ranks with ``tp``
    tensor-parallel ones (load balancing cuts ``2 cp`` equal chunks; sequence parallelism then splits
    each rank's ``seq / cp`` tokens over tp), naming the numbers; ``""`` if they can. The ring needs
    nothing of the heads.

    >>> context_parallel_problem(4096, 4, 8)
    ''
    >>> context_parallel_problem(4098, 2, 1)[:60]
    'the sequence of 4098 tokens does not cut into 2 x cp = 4 equ'
    """
    if seq % (2 * cp):
        return (f"the sequence of {seq} tokens does not cut into 2 x cp = {2 * cp} equal chunks (load-balanced "
                f"context parallelism over {cp} ranks); use a sequence length that is a multiple of {2 * cp}")
    if (seq // cp) % tp:
        return (f"each context-parallel rank's {seq // cp} tokens (seq {seq} / cp {cp}) do not divide over tp {tp}: "
                f"sequence parallelism splits them evenly; use a sequence length that is a multiple of "
                f"{cp * math.lcm(2, tp)}")
    return ""


def describe(config: LlamaConfig) -> str:
    """The shape in words, e.g. ``80 layers, dim 8192, heads 64, kv heads 8, ffn 28672, vocab 128256, bf16, flash``."""
    dtype = next(k for k, v in DTYPES.items() if v == config.dtype)
    return (f"{config.layers} layers, dim {config.dim}, heads {config.heads}, kv heads {config.key_heads}, ffn "
            f"{config.hidden}, vocab {config.vocab}, {dtype}, {config.attention} attention")


class _Fp32Loss(nn.Cell):
    """The vocabulary-parallel loss on this rank's logits piece cast to float32: with 16-bit parameters
    the loss is computed in float32, as mixed-precision training does (the cast's output is kept for
    the backward, and counted)."""

    def __init__(self, loss: nn.Cell) -> None:
        super().__init__()
        self.loss = loss

    def construct(self, local_logits, targets):
        return self.loss(local_logits.astype(ms.float32), targets)


def _loss(config: LlamaConfig, mesh) -> nn.Cell:
    loss = VocabParallelCrossEntropy(mesh["tp"], config.vocab)
    return loss if config.dtype == ms.float32 else _Fp32Loss(loss)


def _held(model: nn.Cell, name: str) -> bool:
    """Whether this stage holds the layer ``name``: ``split_blocks`` leaves a stand-in without
    parameters where another stage holds it."""
    cell = getattr(model, name)
    return cell is not None and next(iter(cell.get_parameters()), None) is not None


class _Elsewhere(nn.Cell):
    """A block another stage holds, never built (``split_blocks`` drops it)."""


def _blocks_of(layers: int, stage: int, stages: int) -> Tuple[int, int]:
    """[start, stop) of the blocks ``split_blocks`` keeps on ``stage``: contiguous, earlier stages one more."""
    base, extra = divmod(layers, stages)
    start = stage * base + min(stage, extra)
    return start, start + base + (stage < extra)


def _stage(config: LlamaConfig, dims: ParallelDims, mesh, stage: int) -> nn.Cell:
    """Pipeline stage ``stage``'s share of the Llama, parallelised."""
    problem = heads_problem(config.heads, config.key_heads, dims.tp)
    if problem:
        raise ValueError(f"tensor parallelism over {dims.tp} ranks: {problem}")
    with no_init_parameters():
        model = Llama(config if dims.pp == 1 else replace(config, layers=0))
        if dims.pp > 1:           # only this stage's blocks are built: the others' are dropped by split_blocks
            start, stop = _blocks_of(config.layers, stage, dims.pp)
            model.layers = nn.CellList([Block(config) if start <= i < stop else _Elsewhere()
                                        for i in range(config.layers)])
    if dims.pp > 1:
        pipelining.split_blocks(model, stage, dims.pp, first=FIRST, last=LAST)
    plan = {k: v for k, v in tp_plan(sequence_parallel=True, loss_parallel=True).items()
            if k.split(".")[0] not in FIRST + LAST or _held(model, k.split(".")[0])}
    parallelize_module(model, mesh["tp"], plan)
    if dims.checkpointing:
        apply_activation_checkpointing(model, check_fn=lambda cell: isinstance(cell, Block))
    if dims.fsdp:
        data = _data_mesh(mesh, dims)
        for block in model.layers:
            fully_shard(block, mesh=data)
        fully_shard(model, mesh=data)
    init_parameters(model)           # the pieces' values (none on a simulated rank)
    return model


def _data_mesh(mesh, dims: ParallelDims):
    """The ranks that hold the same parameters and see different tokens: ``mesh["dp"]``, or with
    context parallelism dp and cp flattened into ``"dp_cp"`` (torchtitan's FSDP mesh)."""
    return mesh["dp", "cp"]._flatten("dp_cp") if dims.cp > 1 else mesh["dp"]


def _reducer(params, mesh, dims: ParallelDims) -> GradientReducer:
    """Gradients averaged over the data ranks (dp, and cp: each cp rank's loss is its tokens' mean),
    unless fully_shard reduces them."""
    if dims.fsdp or dims.dp * dims.cp == 1:
        return GradientReducer(params)
    if dims.cp == 1:
        return GradientReducer(params, dp_mesh=mesh, dp_dim="dp")
    return GradientReducer(params, dp_mesh=_data_mesh(mesh, dims), dp_dim="dp_cp")


def _in_context(cp_mesh, buffers, method: str = "ring", ulysses_degree: Optional[int] = None):
    """``context_parallel`` over ``cp_mesh`` cutting ``buffers`` (along dim 1, their sequence dim) for
    the block's duration, attention by ``method``; nothing without context parallelism."""
    if cp_mesh is None:
        return contextlib.nullcontext()
    return context_parallel(cp_mesh, buffers=buffers, buffer_seq_dims=[1] * len(buffers), method=method,
                            ulysses_degree=ulysses_degree)


def llama_training(config: LlamaConfig, dims: ParallelDims, *, rotate: str = "allgather",
                   method: str = "ring", ulysses_degree: Optional[int] = None) -> Callable:
    """``build(mesh)`` for ``simulate`` (see the module docstring): returns ``(model, optimizer, step)``.

    With context parallelism (``dims.cp > 1``) the step runs inside
    :func:`~hyper_parallel_ms.nn.context_parallel` over ``mesh["cp"]`` (the token ids and targets cut
    load-balanced, as ``examples/train_tp.py --cp`` does), the attention goes through
    :func:`~hyper_parallel_ms.nn.functional.scaled_dot_product_attention` (the written-out form of
    ``attention="math"`` cannot see the other ranks' keys), so the ring engine computes it with keys and
    values moved by ``rotate``; fully_shard (or the gradient average) spans dp x cp.

    Args:
        config: the model's shape (``max_seq`` is raised to ``dims.seq`` if smaller).
        dims: the job's :class:`~hyper_parallel_ms.dryrun.ParallelDims`.
        rotate: the ring's rotate method with ``cp > 1`` (:func:`~hyper_parallel_ms.nn.set_rotate_method`):
            ``"allgather"`` (default) or ``"alltoall"``.
        method: ``context_parallel``'s attention with ``cp > 1``: ``"ring"`` (default), ``"ulysses"``
            (all-to-alls from sequence shards to head shards and back; the query heads on each tp rank must
            divide by cp, key / value heads that do not are repeated) or ``"hybrid"`` (Ulysses over groups of
            ``ulysses_degree`` cp ranks, the ring across the groups).
        ulysses_degree: with ``method="hybrid"``, the Ulysses group size (dividing cp).

    Example::

        model, optimizer, step = llama_training(PRESETS["7B"], ParallelDims(tp=8))(mesh)
    """
    config = replace(config, max_seq=max(config.max_seq, dims.seq))
    if dims.cp > 1:
        problem = context_parallel_problem(dims.seq, dims.cp, dims.tp)
        if problem:
            raise ValueError(problem)
        config = replace(config, attention="flash")

    def build(mesh):
        if dims.cp > 1:
            set_rotate_method(rotate)
        stage = mesh["pp"].get_local_rank() if dims.pp > 1 else 0
        model = _stage(config, dims, mesh, stage)
        loss = _loss(config, mesh)
        rows = dims.micro_batch * dims.microbatches
        cp_mesh = mesh["cp"] if dims.cp > 1 else None
        ids = ms.Tensor(np.zeros((rows, dims.seq), np.int32))
        grid = ms.Tensor(np.zeros((rows, dims.seq), np.int32))      # the targets of each token, cut like ids
        if dims.pp == 1:
            params = model.trainable_params()
            optimizer = nn.AdamWeightDecay(params, learning_rate=1e-4, weight_decay=0.01)
            reducer = _reducer(params, mesh, dims)
            grad_fn = ms.value_and_grad(WithLoss(model, loss), None, optimizer.parameters)

            def step():
                with _in_context(cp_mesh, [ids, grid], method, ulysses_degree):
                    value, grads = grad_fn(ids, grid.reshape(-1))
                optimizer(reducer(grads))
                return value
            return model, optimizer, step
        schedule = pipelining.Schedule1F1B(pipelining.PipelineStage(model, stage, dims.pp, mesh=mesh["pp"]),
                                           dims.microbatches, loss)
        params = schedule.parameters()
        optimizer = nn.AdamWeightDecay(params, learning_rate=1e-4, weight_decay=0.01)
        reducer = _reducer(params, mesh, dims)
        first, last = stage == 0, stage == dims.pp - 1

        def pipelined_step():
            with _in_context(cp_mesh, ([ids] if first else []) + ([grid] if last else []), method,
                             ulysses_degree):
                schedule.step(*((ids,) if first else ()), target=grid.reshape(-1) if last else None)
            optimizer(reducer(schedule.gradients()))
        return model, optimizer, pipelined_step
    return build


class _Builder:
    """``build(dims, layers)`` of :func:`builder` (a class, so that it pickles for ``search(workers=...)``)."""

    def __init__(self, config: LlamaConfig, rotate: str = "allgather", method: str = "ring",
                 ulysses_degree: Optional[int] = None) -> None:
        self.config, self.rotate, self.method, self.ulysses_degree = config, rotate, method, ulysses_degree

    def __call__(self, dims: ParallelDims, layers: int) -> Callable:
        return llama_training(replace(self.config, layers=layers), dims, rotate=self.rotate, method=self.method,
                              ulysses_degree=self.ulysses_degree)


def builder(config: LlamaConfig, *, rotate: str = "allgather", method: str = "ring",
            ulysses_degree: Optional[int] = None) -> Callable:
    """``build(dims, layers) -> fn(mesh)`` for :func:`hyper_parallel_ms.dryrun.search`: the Llama of
    ``config`` with ``layers`` blocks (it pickles: ``search(..., workers=2)`` takes it).

    Args:
        config: the model's shape.
        rotate: the ring's rotate method of the candidates with context parallelism.
        method: their attention, ``"ring"``, ``"ulysses"`` or ``"hybrid"`` (:func:`llama_training`).
        ulysses_degree: with ``"hybrid"``, the Ulysses group size.

    Example::

        search(builder(PRESETS["7B"]), devices=64, layers=32, cluster=Cluster())
    """
    return _Builder(config, rotate, method, ulysses_degree)
