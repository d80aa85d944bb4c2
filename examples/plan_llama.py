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

The presets have Llama's shapes (7B: 32 layers, dim 4096, ffn 11008, vocab 32000; 70B: 80
layers, dim 8192, ffn 28672, vocab 128256) on the example's architecture: multi-head attention
(Llama 70B's grouped-query attention has smaller k / v projections), no bias, fp32 parameters.

Example::

    dims = ParallelDims(pp=2, dp=4, tp=8, fsdp=True, microbatches=4)
    shape, names = dims.mesh
    report = simulate(llama_training(PRESETS["7B"], dims), mesh_shape=shape, mesh_dim_names=names)
"""
from __future__ import annotations

from dataclasses import replace
from typing import Callable

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

__all__ = ["PRESETS", "ParallelDims", "llama_training", "builder"]

PRESETS = {
    "7B": LlamaConfig(vocab=32000, dim=4096, layers=32, heads=32, hidden=11008, max_seq=4096),
    "70B": LlamaConfig(vocab=128256, dim=8192, layers=80, heads=64, hidden=28672, max_seq=4096),
}
FIRST, LAST = ("tok_embeddings",), ("norm", "output")


def _held(model: nn.Cell, name: str) -> bool:
    """Whether this stage holds the layer ``name``: ``split_blocks`` leaves a stand-in without
    parameters where another stage holds it."""
    cell = getattr(model, name)
    return cell is not None and next(iter(cell.get_parameters()), None) is not None


def _stage(config: LlamaConfig, dims: ParallelDims, mesh, stage: int) -> nn.Cell:
    """Pipeline stage ``stage``'s share of the Llama, parallelised."""
    with no_init_parameters():
        model = Llama(config)
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
        loss = VocabParallelCrossEntropy(mesh["tp"], config.vocab)
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


def builder(config: LlamaConfig) -> Callable:
    """``build(dims, layers) -> fn(mesh)`` for :func:`hyper_parallel_ms.dryrun.search`: the Llama of
    ``config`` with ``layers`` blocks.

    Args:
        config: the model's shape.

    Example::

        search(builder(PRESETS["7B"]), devices=64, layers=32, cluster=Cluster())
    """
    return lambda dims, layers: llama_training(replace(config, layers=layers), dims)
