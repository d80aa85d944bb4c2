"""The pipeline-parallel path of ``examples/train_tp.py`` (``--pp N``): the Llama example split into
stages over a ("pp", "dp", "tp") mesh, each stage tensor-parallel on ``mesh["tp"]`` (and with
``--fsdp`` fully sharded on ``mesh["dp"]``, else its gradients averaged over dp), run by a
pipeline schedule over ``mesh["pp"]``. With one stage per rank (gpipe, 1f1b), ``--checkpoint-dir``
/ ``--save-every`` / ``--resume`` save and load each rank's stage Cell: its keys are the full
model's, so a checkpoint saved with ``--pp 2`` resumes with ``--pp 1`` (any dp x tp) and back.

``--clip-grad-norm`` clips by the norm of every stage's gradients (``clip_grad_norm`` with the
schedule: one more all-reduce, over pp); ``--activation-checkpoint`` checkpoints each stage's
attention and feed-forward Cells (``attention_core``: the attentions; with ``--fsdp`` the blocks;
``selective`` and ``attention_core`` not with the zero-bubble schedule, whose two backward passes
recompute twice).

``--cp C`` makes the mesh (pp, dp, cp, tp): each step's ids and labels are cut into sequence shards
(:func:`sequence_shards`) and the schedule runs inside that ``context_parallel`` block, so every
stage's attention is context-parallel over its cp group; the gradients (``fully_shard`` with
``--fsdp``) and the loss are averaged over the flattened dp x cp ranks.

Example (4 CPU ranks, pp=2 x tp=2)::

    bash scripts/run_tp.sh --nproc 4 --pp 2 --tp 2 -- --schedule 1f1b --microbatches 2 --clip-grad-norm 1
"""
from __future__ import annotations

import contextlib
import time
from typing import Callable, Dict, Iterator, List, Optional, Tuple

import mindspore as ms
import numpy as np
from mindspore import Tensor, nn

from hyper_parallel_ms import comm, fully_shard, pipelining
from hyper_parallel_ms.mesh import init_device_mesh
from hyper_parallel_ms.nn import GradientReducer, context_parallel, parallelize_module
from hyper_parallel_ms.training import apply_activation_checkpointing, clip_grad_norm

try:
    from examples.checkpoints import resume, save_step
    from examples.llama import Llama, checkpointed, tp_plan
except ImportError:  # run as a script: examples/ is the script's directory
    from checkpoints import resume, save_step
    from llama import Llama, checkpointed, tp_plan

__all__ = ["SCHEDULES", "train_pipeline", "sequence_shards"]

# --schedule name -> (schedule class name, stages per rank)
SCHEDULES = {"gpipe": ("ScheduleGPipe", 1), "1f1b": ("Schedule1F1B", 1),
             "interleaved": ("ScheduleInterleaved1F1B", 2), "zb": ("ScheduleZBVZeroBubble", 2)}
FIRST, LAST = ("tok_embeddings",), ("norm", "output")


@contextlib.contextmanager
def sequence_shards(cp_mesh, ids: Tensor, labels: Tensor) -> Iterator[Tuple[Tensor, Tensor]]:
    """``--cp``: a ``context_parallel`` block over ``cp_mesh`` yielding this rank's load-balanced
    sequence shard of the ``(rows, seq)`` token ids and of the labels (one-hot ``(rows, seq, vocab)`` or
    class indices ``(rows * seq,)``, returned in the same form); attention inside the block computes on
    the shards.

    Example::

        with sequence_shards(mesh["cp"], ids, labels) as (ids, labels):
            loss = step(ids, labels)
    """
    rows, seq = ids.shape
    grid = labels.reshape(rows, seq, -1) if labels.ndim == 3 else labels.reshape(rows, seq)
    with context_parallel(cp_mesh, buffers=[ids, grid], buffer_seq_dims=[1, 1], no_restore_buffers=[ids, grid]):
        yield ids, (grid if labels.ndim == 3 else grid.reshape(-1))


def check_pipeline_config(cfg) -> None:
    """Raise naming the flag to change when ``cfg`` cannot run as a pipeline."""
    if cfg.schedule not in SCHEDULES:
        raise ValueError(f"--schedule must be one of {sorted(SCHEDULES)}, got {cfg.schedule!r}")
    if cfg.mode != "pynative":
        raise ValueError(f"--pp runs the stages in PyNative (the schedule is Python; each stage's forward "
                         f"is kept on an autodiff tape): use --mode pynative, not {cfg.mode!r}")
    stages = cfg.pp * SCHEDULES[cfg.schedule][1]
    if cfg.layers < stages:
        raise ValueError(f"--schedule {cfg.schedule} with --pp {cfg.pp} makes {stages} stages but the model has "
                         f"{cfg.layers} layers: use --layers {stages} or more")
    rows = cfg.batch // cfg.dp
    if rows % cfg.microbatches:
        raise ValueError(f"each dp rank's {rows} rows do not split into --microbatches {cfg.microbatches}: use a "
                         f"--batch that is a multiple of dp x microbatches = {cfg.dp * cfg.microbatches}")
    if cfg.compile_stages and (cfg.fsdp or cfg.loss_parallel):
        raise ValueError("--compile-stages compiles plain and tensor-parallel stages with a one-hot loss: add "
                         "--no-loss-parallel (the vocabulary-parallel loss's target check fails in a compiled "
                         "stage's forward: \"Invalid host tensor size ... for pyexecute\") and drop --fsdp (the "
                         "Llama's styled Cells inside fully_shard units fail to compile for a stage's backward: "
                         "\"The pointer[func_graph->get_return()] is null\")")
    if cfg.hsdp_replicate != 1:
        raise ValueError("--pp does not take --hsdp-replicate yet")
    if cfg.schedule == "zb" and cfg.activation_checkpoint in ("selective", "attention_core"):
        raise ValueError(f"--schedule zb runs a stage's backward in two passes (inputs, then weights), each "
                         f"recomputing a checkpointed Cell, and --activation-checkpoint {cfg.activation_checkpoint} "
                         "hands its kept outputs to one recompute only (the second fails): use --activation-checkpoint "
                         "full or another --schedule")
    if (cfg.checkpoint_dir or cfg.resume) and SCHEDULES[cfg.schedule][1] != 1:
        raise ValueError(f"--pp with --checkpoint-dir / --resume saves one stage Cell per rank: use --schedule gpipe "
                         f"or 1f1b, not {cfg.schedule!r} ({SCHEDULES[cfg.schedule][1]} stages per rank)")


def _stage_plan(cfg) -> dict:
    """``tp_plan`` for this stage: entries of layers another stage runs name this stage's
    ``PassThrough`` Cells, which ``parallelize_module`` skips."""
    local = cfg.activation_checkpoint in ("selective", "attention_core")   # selective policies refuse DTensor inputs
    return tp_plan(cfg.sequence_parallel, cfg.loss_parallel, local)


def _build(cfg, model_config, mesh, dp_mesh):
    """This rank's stages of the Llama (same seed as the single-device model) and its schedule; with
    ``--fsdp`` each stage fully sharded over ``dp_mesh`` (dp, or the flattened dp x cp with ``--cp``)."""
    cls_name, v = SCHEDULES[cfg.schedule]
    pp_mesh = mesh["pp"]
    num_stages = cfg.pp * v
    plan = pipelining.build_plan(cls_name[len("Schedule"):], cfg.pp, cfg.microbatches, stages_per_rank=v)
    stages = []
    for s in plan.stages_of(pp_mesh.get_local_rank()):
        ms.set_seed(cfg.seed)
        model = pipelining.split_blocks(Llama(model_config(cfg)), s, num_stages, first=FIRST, last=LAST)
        if cfg.activation_checkpoint:
            policy = None if cfg.activation_checkpoint == "full" else cfg.activation_checkpoint
            apply_activation_checkpointing(model, policy=policy, check_fn=checkpointed(
                whole_blocks=cfg.fsdp, attention_only=policy == "attention_core"))
        parallelize_module(model, mesh["tp"], _stage_plan(cfg))
        if cfg.fsdp:
            for block in model.layers:
                fully_shard(block, mesh=dp_mesh)
            fully_shard(model, mesh=dp_mesh)
        stages.append(pipelining.PipelineStage(model, s, num_stages, mesh=pp_mesh, jit=cfg.compile_stages))
    return stages


def train_pipeline(cfg, model_config: Callable, batch: Callable, loss_cell: Callable,
                   log: Callable[[str], None], step_line: Callable[..., str]) -> Dict[str, object]:
    """Train ``cfg.steps`` steps on the pp x dp x tp mesh (pp x dp x cp x tp with ``cfg.cp > 1``: each
    step's ids and labels cut into sequence shards by :func:`sequence_shards`, the schedule run inside
    that block, the gradients and the loss averaged over dp x cp); every rank returns the global loss of
    each step, and its stage Cells (``"cells"``).

    Args:
        cfg: the example's ``TrainConfig`` (with ``pp``, ``schedule``, ``microbatches``).
        model_config: ``TrainConfig -> LlamaConfig``.
        batch: ``batch(cfg, step, dp_index, dp_size, onehot)`` as in ``train_tp``.
        loss_cell: ``tp_mesh -> loss Cell`` taking ``(logits, labels)``.
        log: where rank 0's lines go.
        step_line: ``(cfg, label, step, loss, grad norm, tokens/s) -> the logged line``.

    Example::

        result = train_pipeline(replace(cfg, pp=2, schedule="1f1b", microbatches=2), model_config, batch,
                                loss_cell, print, step_line)
    """
    check_pipeline_config(cfg)
    device = "cpu" if ms.get_context("device_target") == "CPU" else "npu"
    cp = getattr(cfg, "cp", 1)
    if cp > 1:      # torchtitan's order; the loss and the gradients averaged over the flattened dp x cp
        mesh = init_device_mesh(device, (cfg.pp, cfg.dp, cp, cfg.tp), mesh_dim_names=("pp", "dp", "cp", "tp"))
        dp_mesh, dp_dim = mesh["dp", "cp"]._flatten("dp_cp"), "dp_cp"
    else:
        mesh = init_device_mesh(device, (cfg.pp, cfg.dp, cfg.tp), mesh_dim_names=("pp", "dp", "tp"))
        dp_mesh, dp_dim = mesh["dp"], "dp"
    stages = _build(cfg, model_config, mesh, dp_mesh)
    loss = loss_cell(mesh["tp"])
    schedule = getattr(pipelining, SCHEDULES[cfg.schedule][0])(
        stages[0] if len(stages) == 1 else stages, cfg.microbatches, loss)
    params = schedule.parameters()
    # fully_shard averages its pieces' gradients over dp (x cp) itself (the styles' gradients are whole over tp)
    averaged = {} if cfg.fsdp or cfg.dp * cp == 1 else {"dp_mesh": dp_mesh, "dp_dim": dp_dim}
    reducer = GradientReducer(params, **averaged)
    optimizer = nn.AdamWeightDecay(params, learning_rate=cfg.lr, weight_decay=0.01)
    cell = schedule.stages[0].submodule                 # one stage per rank when checkpointing (checked)
    start = resume(cell, optimizer, cfg.checkpoint_dir, log) if cfg.resume else 0
    first, last = schedule.stages[0].is_first, schedule.stages[-1].is_last
    dp_index = mesh.get_coordinate()[1]
    onehot = not cfg.loss_parallel
    losses: List[float] = []
    rates: List[float] = []
    norms: List[float] = []
    for i in range(start, cfg.steps):
        ids, labels = batch(cfg, i, dp_index, cfg.dp, onehot)
        began = time.perf_counter()
        mb: list = []
        shards = sequence_shards(mesh["cp"], ids, labels) if cp > 1 else contextlib.nullcontext((ids, labels))
        with shards as (ids, labels):
            schedule.step(*((ids,) if first else ()), target=labels if last else None, losses=mb)
        grads = reducer(schedule.gradients())
        if cfg.clip_grad_norm:      # every stage's gradients in the norm: the schedule adds the pp reduction
            grads, norm = clip_grad_norm(grads, cfg.clip_grad_norm, parameters=schedule)
            norms.append(float(norm.asnumpy()))
        else:
            norms.append(0.0)
        optimizer(grads)
        mine = np.float32(np.mean([float(v.asnumpy()) for v in mb])) if last else np.float32(0)
        value = comm.all_reduce(Tensor(np.array(mine)), mesh, "pp")         # the last stage's loss, everywhere
        if cfg.dp * cp > 1:
            value = comm.all_reduce(value, dp_mesh, 0, op="avg")
        value = float(value.asnumpy())
        seconds = time.perf_counter() - began
        losses.append(value)
        rates.append(cfg.batch * cfg.seq / seconds)
        log(step_line(cfg, "parallel", i, value, norms[-1], rates[-1]))
        if cfg.save_every and (i + 1) % cfg.save_every == 0:     # each rank its stage: full-model keys
            log(f"[parallel] saved {save_step(cell, optimizer, i + 1, cfg.checkpoint_dir)}")
    steps = cfg.steps - start
    return {"losses": losses, "tokens_per_s": rates, "start_step": start, "grad_norms": norms,
            "cells": [stage.submodule for stage in schedule.stages],
            "forwards_per_microbatch": schedule.forward_calls / (len(schedule.stages) * cfg.microbatches * steps)}
