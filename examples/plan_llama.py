"""The example Llama as a training script that :func:`hyper_parallel_ms.simulate` can run: one
``build(mesh)`` for all parallel dims (pp, dp, tp), fully_shard or not, micro-batches and activation
checkpointing, and the preset shapes of ``scripts/plan_cluster.py``.

``build(mesh)`` is what a training script does on each rank: the Llama built under
``no_init_parameters()`` (split into pipeline stages with ``split_blocks`` when pp > 1), tensor
parallel on ``mesh["tp"]`` (PyTorch's Llama plan with sequence parallelism and a vocabulary-
parallel loss), each block and the root ``fully_shard``-ed over ``mesh["dp"]`` (or gradients
averaged over dp), optionally each block activation-checkpointed, an ``AdamWeightDecay``
optimizer, and a ``step()`` that runs one training step: ``value_and_grad`` of the loss, or the
pipeline schedule (1F1B over ``mesh["pp"]``), then the gradient reduction and the optimizer.

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

from dataclasses import replace
from typing import Callable, Tuple

import mindspore as ms
import numpy as np
from mindspore import nn

from hyper_parallel_ms import fully_shard, init_parameters, no_init_parameters, pipelining
from hyper_parallel_ms.nn import GradientReducer, parallelize_module
from hyper_parallel_ms.dryrun import ParallelDims
from hyper_parallel_ms.training import apply_activation_checkpointing

try:
    from examples.llama import Block, Llama, LlamaConfig, VocabParallelCrossEntropy, WithLoss, tp_plan
except ImportError:  # run as a script: examples/ is the script's directory
    from llama import Block, Llama, LlamaConfig, VocabParallelCrossEntropy, WithLoss, tp_plan

__all__ = ["PRESETS", "DTYPES", "ParallelDims", "llama_training", "builder", "heads_problem", "describe"]

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
        for block in model.layers:
            fully_shard(block, mesh=mesh["dp"])
        fully_shard(model, mesh=mesh["dp"])
    init_parameters(model)           # the pieces' values (none on a simulated rank)
    return model


def llama_training(config: LlamaConfig, dims: ParallelDims) -> Callable:
    """``build(mesh)`` for ``simulate`` (see the module docstring): returns ``(model, optimizer, step)``.

    Args:
        config: the model's shape (``max_seq`` is raised to ``dims.seq`` if smaller).
        dims: the job's :class:`~hyper_parallel_ms.dryrun.ParallelDims`.

    Example::

        model, optimizer, step = llama_training(PRESETS["7B"], ParallelDims(tp=8))(mesh)
    """
    config = replace(config, max_seq=max(config.max_seq, dims.seq))

    def build(mesh):
        stage = mesh["pp"].get_local_rank() if dims.pp > 1 else 0
        model = _stage(config, dims, mesh, stage)
        loss = _loss(config, mesh)
        rows = dims.micro_batch * dims.microbatches
        ids = ms.Tensor(np.zeros((rows, dims.seq), np.int32))
        targets = ms.Tensor(np.zeros((rows * dims.seq,), np.int32))
        if dims.pp == 1:
            params = model.trainable_params()
            optimizer = nn.AdamWeightDecay(params, learning_rate=1e-4, weight_decay=0.01)
            reducer = GradientReducer(params, **({} if dims.fsdp or dims.dp == 1 else
                                                 {"dp_mesh": mesh, "dp_dim": "dp"}))
            grad_fn = ms.value_and_grad(WithLoss(model, loss), None, optimizer.parameters)

            def step():
                value, grads = grad_fn(ids, targets)
                optimizer(reducer(grads))
                return value
            return model, optimizer, step
        schedule = pipelining.Schedule1F1B(pipelining.PipelineStage(model, stage, dims.pp, mesh=mesh["pp"]),
                                           dims.microbatches, loss)
        params = schedule.parameters()
        optimizer = nn.AdamWeightDecay(params, learning_rate=1e-4, weight_decay=0.01)
        reducer = GradientReducer(params, **({} if dims.fsdp or dims.dp == 1 else
                                             {"dp_mesh": mesh, "dp_dim": "dp"}))
        first, last = stage == 0, stage == dims.pp - 1

        def pipelined_step():
            schedule.step(*((ids,) if first else ()), target=targets if last else None)
            optimizer(reducer(schedule.gradients()))
        return model, optimizer, pipelined_step
    return build


class _Builder:
    """``build(dims, layers)`` of :func:`builder` (a class, so that it pickles for ``search(workers=...)``)."""

    def __init__(self, config: LlamaConfig) -> None:
        self.config = config

    def __call__(self, dims: ParallelDims, layers: int) -> Callable:
        return llama_training(replace(self.config, layers=layers), dims)


def builder(config: LlamaConfig) -> Callable:
    """``build(dims, layers) -> fn(mesh)`` for :func:`hyper_parallel_ms.dryrun.search`: the Llama of
    ``config`` with ``layers`` blocks (it pickles: ``search(..., workers=2)`` takes it).

    Args:
        config: the model's shape.

    Example::

        search(builder(PRESETS["7B"]), devices=64, layers=32, cluster=Cluster())
    """
    return _Builder(config)
