"""Train a small Llama-style model with tensor (and data) parallelism, then check the losses
against a single-device run of the same steps (run eagerly).

Launch on N ranks with msrun (``scripts/run_tp.sh`` does it), e.g. 4 CPU ranks as dp=2 x tp=2::

    bash scripts/msrun.sh --worker_num=4 --local_worker_num=4 --join=True examples/train_tp.py --dp 2 --tp 2 --mode graph

``--mode pynative`` runs eagerly, ``--mode jit`` compiles the train step with ``ms.jit``,
``--mode graph`` sets GRAPH_MODE and runs a train-step Cell. Each step logs the loss and
tokens/s; the last line says whether every loss matched the single-device run.

The output head keeps the logits split over the vocabulary (``Shard(-1)``) and the loss is
``ParallelCrossEntropy`` on each rank's piece (loss parallelism: the logits are never gathered);
``--no-loss-parallel`` gathers them and takes the one-hot cross-entropy instead.

``--pp N --schedule gpipe|1f1b|interleaved|zb --microbatches M`` adds pipeline parallelism: the
model is split by layers into stages over a (pp, dp, tp) mesh, each stage tensor-parallel on tp
(``examples/train_pp.py``; PyNative); ``--compile-stages`` compiles each stage's forward and
backward (``PipelineStage(..., jit=True)``; plain or tensor-parallel stages with --no-loss-parallel, no
--fsdp).

``--clip-grad-norm X`` clips the gradients by the norm of the whole model's gradient
(``clip_grad_norm``; the single-device run uses MindSpore's ``ops.clip_by_global_norm``) and
logs that norm; ``--activation-checkpoint full|selective`` checkpoints each block's attention
and feed-forward, with ``--fsdp`` each block (``apply_activation_checkpointing``; selective in
PyNative only); ``--activation-checkpoint attention_core`` recomputes only each attention's
scores and probabilities (Korthikanti et al.'s selective recomputation, PyNative only).

``--cp C`` splits each sequence over C context-parallel ranks (a (pp, dp, cp, tp) mesh, PyNative): the
token ids and labels cut inside ``context_parallel`` each step (load-balanced shards), the attention
through ``scaled_dot_product_attention``, the loss and gradients averaged over the flattened dp x cp
ranks (each rank's loss is the mean of as many tokens); with ``--fsdp`` parameters, gradients and
optimizer state are sharded over dp x cp (torchtitan's FSDP mesh); with ``--pp`` each stage has its cp
group and the schedule runs inside the step's ``context_parallel`` block; ``--activation-checkpoint``
recomputes the context-parallel attention (and its collectives) in the backward; checkpoints save and
resume on any layout. Not with ``--hsdp-replicate`` or ``--compile-stages`` (refused naming the flag).
With ``--cp`` the check also compares every parameter (gathered whole) with the single-device model's.

``--fsdp`` also shards parameters, gradients and optimizer state over dp with
``fully_shard`` per block and at the root (FSDP x TP); ``--hsdp-replicate R`` makes it HSDP
with R replicas of dp/R-way shards.
Checkpoints: ``--checkpoint-dir DIR --save-every N`` saves the model, the optimizer and the
step to ``DIR/step_K`` every N steps; ``--resume`` continues from the latest one (on any
pp x dp x tp layout; with ``--pp``, schedules of one stage per rank), and the check compares
the resumed steps with the uninterrupted single-device run.
"""
from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass, replace
from typing import Callable, Dict, List, Optional, Union

import mindspore as ms
import numpy as np
from mindspore import communication, nn, ops

from hyper_parallel_ms import comm, fully_shard
from hyper_parallel_ms.mesh import init_device_mesh
from hyper_parallel_ms.nn import GradientReducer, as_dtensor, parallelize_module, parameter_sharding
from hyper_parallel_ms.training import (CheckpointWrapper, TotalGradNorm, apply_activation_checkpointing,
                                        checkpoint_stats, clip_grad_norm)

try:
    from examples.checkpoints import latest_checkpoint, resume, save_step
    from examples.llama import (Llama, LlamaConfig, VocabParallelCrossEntropy, WithLoss, checkpointed, cross_entropy,
                                tp_plan)
    from examples.train_pp import SCHEDULES, sequence_shards, train_pipeline
except ImportError:  # run as a script: examples/ is the script's directory
    from checkpoints import latest_checkpoint, resume, save_step
    from llama import Llama, LlamaConfig, VocabParallelCrossEntropy, WithLoss, checkpointed, cross_entropy, tp_plan
    from train_pp import SCHEDULES, sequence_shards, train_pipeline

__all__ = ["TrainConfig", "train", "main", "latest_checkpoint"]


@dataclass(frozen=True)
class TrainConfig:
    dp: int = 1
    tp: int = 2
    mode: str = "jit"                  # pynative | jit | graph
    steps: int = 10
    batch: int = 4                     # global batch (split over dp)
    seq: int = 16
    vocab: int = 128
    dim: int = 64
    layers: int = 2
    heads: int = 4
    hidden: int = 128
    lr: float = 3e-3
    seed: int = 0
    sequence_parallel: bool = True
    loss_parallel: bool = True         # vocabulary-sharded logits and ParallelCrossEntropy (tp > 1)
    check: bool = True                 # also train a single-device model and compare the losses
    tolerance: float = 1e-4
    fsdp: bool = False                 # fully_shard per block and at the root over dp
    hsdp_replicate: int = 1            # with fsdp: dp = replicate x shard (HSDP)
    checkpoint_dir: Optional[str] = None
    save_every: int = 0                # save to checkpoint_dir/step_K every save_every steps (0: never)
    resume: bool = False               # continue from the latest checkpoint in checkpoint_dir
    pp: int = 1                        # pipeline stages' ranks (pp x dp x tp ranks in all)
    schedule: str = "1f1b"             # with pp > 1: gpipe | 1f1b | interleaved | zb
    microbatches: int = 2              # with pp > 1: micro-batches per step
    compile_stages: bool = False       # with pp > 1: each stage's forward and backward compiled (ms.jit)
    activation_checkpoint: str = ""    # "" (none), "full", "selective" or "attention_core" (see the module docstring)
    clip_grad_norm: float = 0.0        # > 0: clip the gradients to this global norm
    cp: int = 1                        # context parallelism: the sequence over cp ranks (pp x dp x cp x tp; PyNative)
    # with cp > 1: absolute, the parameters against the single-device model's. AdamW divides each gradient by
    # its root mean square (+ eps 1e-6), so an element whose gradient is near eps moves by lr x its rounding / eps:
    # measured 8.9e-6 on --tp 2 and 2.4e-5 on --cp 2 (both at the same embedding element), against lr = 3e-3 per step
    param_tolerance: float = 1e-4


def model_config(cfg: TrainConfig) -> LlamaConfig:
    # context parallelism: attention through scaled_dot_product_attention (the one that computes on shards)
    return LlamaConfig(vocab=cfg.vocab, dim=cfg.dim, layers=cfg.layers, heads=cfg.heads, hidden=cfg.hidden,
                       max_seq=cfg.seq, attention="flash" if getattr(cfg, "cp", 1) > 1 else "math")


def batch(cfg: TrainConfig, step: int, dp_index: int = 0, dp_size: int = 1, onehot: bool = True):
    """Synthetic tokens for ``step`` (fixed seed): random starts, then ``t -> (3 t + 1) mod vocab``
    (a rule the model can learn); this data-parallel rank's inputs and labels: one-hot
    ``(rows, seq, vocab)``, or with ``onehot=False`` class indices ``(rows * seq,)``."""
    start = np.random.default_rng(cfg.seed * 1000 + step).integers(0, cfg.vocab, (cfg.batch, 1))
    tokens = [start]
    for _ in range(cfg.seq):
        tokens.append((3 * tokens[-1] + 1) % cfg.vocab)
    tokens = np.concatenate(tokens, 1)
    rows = cfg.batch // dp_size
    part = tokens[dp_index * rows:(dp_index + 1) * rows]
    targets = part[:, 1:]
    labels = np.eye(cfg.vocab, dtype=np.float32)[targets] if onehot else targets.reshape(-1).astype(np.int32)
    return ms.Tensor(part[:, :-1].astype(np.int32)), ms.Tensor(labels)


class OneHotCrossEntropy(nn.Cell):
    """Mean token cross-entropy of whole ``(b, s, vocab)`` logits against one-hot labels."""

    def construct(self, logits, onehot):
        return cross_entropy(logits, onehot)


class Clip(nn.Cell):
    """``grads -> (grads clipped to max_norm by the whole model's gradient norm, that norm)`` from
    this rank's reduced gradients (``clip_grad_norm`` with a :class:`TotalGradNorm` built outside)."""

    def __init__(self, norm: TotalGradNorm, max_norm: float) -> None:
        super().__init__()
        self.norm, self.max_norm = norm, max_norm

    def construct(self, grads):
        return clip_grad_norm(grads, self.max_norm, parameters=self.norm)


class OneDeviceClip(nn.Cell):
    """The single-device run's clip: MindSpore's ``ops.clip_by_global_norm``, and the norm."""

    def __init__(self, max_norm: float) -> None:
        super().__init__()
        self.max_norm = max_norm

    def construct(self, grads):
        total = ops.zeros((), ms.float32)
        for g in grads:
            total = total + (g * g).sum()
        return ops.clip_by_global_norm(grads, self.max_norm), ops.sqrt(total)


class NoClip(nn.Cell):
    def construct(self, grads):
        return grads, ops.zeros((), ms.float32)


class TrainStep(nn.Cell):
    """Loss, gradients, gradient reduction, clipping and the optimizer update (a Cell for GRAPH_MODE);
    returns the loss and the gradient norm (0 without clipping)."""

    def __init__(self, model: nn.Cell, loss: nn.Cell, optimizer: nn.Optimizer, reducer: nn.Cell, dp_mesh=None,
                 dp_dims: tuple = ("dp",), clip: Optional[nn.Cell] = None) -> None:
        super().__init__()
        self.with_loss = WithLoss(model, loss)
        self.optimizer, self.reducer, self.dp_mesh, self.dp_dims = optimizer, reducer, dp_mesh, dp_dims
        self.clip = NoClip() if clip is None else clip
        self.grad_fn = ms.value_and_grad(self.with_loss, None, optimizer.parameters)

    def construct(self, ids, labels):
        loss, grads = self.grad_fn(ids, labels)
        grads, norm = self.clip(self.reducer(grads))
        self.optimizer(grads)
        if self.dp_mesh is not None:
            for dim in self.dp_dims:
                loss = comm.all_reduce(loss, self.dp_mesh, dim, op="avg")
        return loss, norm


def _runner(cfg: TrainConfig, step_cell: TrainStep) -> Callable:
    if cfg.mode == "pynative":
        return step_cell
    if cfg.mode == "jit":
        return ms.jit(step_cell.construct)
    return step_cell                   # GRAPH_MODE compiles the Cell


def step_line(cfg: TrainConfig, label: str, i: int, loss: float, norm: float, rate: float) -> str:
    """One logged step (the gradient norm before clipping, when clipping)."""
    clipped = f" grad norm {norm:.6f}" if cfg.clip_grad_norm else ""
    return f"[{label}] step {i + 1}/{cfg.steps} loss {loss:.6f}{clipped} tokens/s {rate:.0f}"


def _run(cfg: TrainConfig, model: nn.Cell, loss: nn.Cell, reducer: nn.Cell, dp_mesh, dp_index: int, dp_size: int,
         log: Callable[[str], None], label: str, dp_dims: tuple = ("dp",),
         checkpoints: bool = False, clip: Optional[Callable[[List], nn.Cell]] = None,
         cp_mesh=None) -> Dict[str, List[float]]:
    params = model.trainable_params()
    optimizer = nn.AdamWeightDecay(params, learning_rate=cfg.lr, weight_decay=0.01)
    start = resume(model, optimizer, cfg.checkpoint_dir, log) if checkpoints and cfg.resume else 0
    step = _runner(cfg, TrainStep(model, loss, optimizer, reducer, dp_mesh, dp_dims,
                                  clip(params) if cfg.clip_grad_norm and clip is not None else None))
    onehot = isinstance(loss, OneHotCrossEntropy)
    losses, rates, norms = [], [], []
    for i in range(start, cfg.steps):
        ids, labels = batch(cfg, i, dp_index, dp_size, onehot)
        began = time.perf_counter()
        if cp_mesh is not None:
            value, norm = _context_parallel_step(step, ids, labels, cp_mesh)
        else:
            value, norm = (float(v.asnumpy()) for v in step(ids, labels))
        seconds = time.perf_counter() - began
        losses.append(value)
        norms.append(norm)
        rates.append(cfg.batch * cfg.seq / seconds)
        log(step_line(cfg, label, i, value, norm, rates[-1]))
        if checkpoints and cfg.save_every and (i + 1) % cfg.save_every == 0:
            log(f"[{label}] saved {save_step(model, optimizer, i + 1, cfg.checkpoint_dir)}")
    return {"losses": losses, "tokens_per_s": rates, "start_step": start, "grad_norms": norms}


def _context_parallel_step(step: Callable, ids, labels, cp_mesh) -> tuple:
    """One step on this cp rank's load-balanced sequence shard: the inputs and labels cut inside
    ``context_parallel`` (the attention computes on shards there, its recomputation in the backward
    too), the loss averaged over dp x cp by the step."""
    with sequence_shards(cp_mesh, ids, labels) as (local_ids, local_labels):
        return tuple(float(v.asnumpy()) for v in step(local_ids, local_labels))


def check_context_parallel(cfg: TrainConfig) -> None:
    """Raise naming the flag to change when ``cfg``'s context parallelism (``--cp``) cannot run."""
    if cfg.cp < 1:
        raise ValueError(f"--cp must be a positive number of ranks, got {cfg.cp}")
    if cfg.cp == 1:
        return
    if cfg.pp > 1 and cfg.compile_stages:
        raise ValueError("--cp runs the pipeline stages in PyNative (each step cuts its inputs in a context_parallel "
                         "block, which a stage compiled once would not see again): drop --compile-stages")
    if cfg.hsdp_replicate != 1:
        raise ValueError("--cp with --fsdp shards over the flattened dp x cp ranks (no HSDP replicas yet): drop "
                         "--hsdp-replicate")
    if cfg.mode != "pynative":
        raise ValueError(f"--cp runs in --mode pynative (each step cuts its inputs in a context_parallel block), "
                         f"not {cfg.mode!r}")
    if cfg.batch % cfg.dp:
        raise ValueError(f"--batch {cfg.batch} must divide by --dp {cfg.dp}")
    if cfg.seq % (2 * cfg.cp) or (cfg.seq // cfg.cp) % cfg.tp or cfg.heads % cfg.tp:
        raise ValueError(f"--seq {cfg.seq} must divide by 2 x cp = {2 * cfg.cp} (load-balanced chunks), each "
                         f"rank's {cfg.seq // cfg.cp} tokens and the {cfg.heads} heads by tp={cfg.tp}")


def check_training_config(cfg: TrainConfig) -> None:
    """Raise naming the flag to change when ``cfg``'s checkpointing or clipping cannot run."""
    if cfg.activation_checkpoint not in ("", "full", "selective", "attention_core"):
        raise ValueError(f"--activation-checkpoint must be full or selective (or attention_core), got "
                         f"{cfg.activation_checkpoint!r}")
    if cfg.activation_checkpoint in ("selective", "attention_core") and cfg.mode != "pynative":
        raise ValueError(f"--activation-checkpoint {cfg.activation_checkpoint} chooses the ops to keep in PyNative "
                         f"(MindSpore's graph recompute has no per-op choice): use --mode pynative, not {cfg.mode!r}, "
                         "or full")
    if cfg.activation_checkpoint and cfg.fsdp and cfg.mode != "pynative":
        raise ValueError("--activation-checkpoint with --fsdp (checkpointed blocks, its units) runs in --mode pynative: "
                         "compiled, MindSpore fails to launch the recomputed parameter gathers (\"Launch kernel "
                         "failed: recompute_...\")")
    if not cfg.clip_grad_norm >= 0:
        raise ValueError(f"--clip-grad-norm must be a positive norm (0: no clipping), got {cfg.clip_grad_norm!r}")


def plan(cfg) -> dict:
    """The example's tensor-parallel plan (local inputs for a selective checkpoint, which refuses DTensors)."""
    return tp_plan(cfg.sequence_parallel, cfg.loss_parallel, local_inputs=cfg.activation_checkpoint in ("selective", "attention_core"))


def checkpoint_activations(model: nn.Cell, cfg: TrainConfig) -> None:
    """``--activation-checkpoint``: wrap each block's attention and feed-forward, or with ``--fsdp``
    the blocks, which are its units (names unchanged)."""
    if cfg.activation_checkpoint:
        policy = None if cfg.activation_checkpoint == "full" else cfg.activation_checkpoint
        check_fn = checkpointed(whole_blocks=cfg.fsdp, attention_only=policy == "attention_core")
        apply_activation_checkpointing(model, check_fn=check_fn, policy=policy)


def train(cfg: TrainConfig, log: Callable[[str], None] = print) -> Dict[str, object]:
    """Train the parallel model (and, with ``cfg.check``, the single-device one); returns the
    losses, tokens/s and the largest relative loss difference."""
    if cfg.mode not in ("pynative", "jit", "graph"):
        raise ValueError(f"mode must be pynative, jit or graph, got {cfg.mode!r}")
    if (cfg.save_every or cfg.resume) and not cfg.checkpoint_dir:
        raise ValueError("--save-every and --resume need --checkpoint-dir")
    check_training_config(cfg)
    check_context_parallel(cfg)
    if cfg.cp > 1 and cfg.pp == 1:
        return _train_context_parallel(cfg, log)
    if cfg.batch % cfg.dp or cfg.seq % cfg.tp or cfg.heads % cfg.tp:
        raise ValueError(f"batch {cfg.batch} must divide by dp={cfg.dp}, seq {cfg.seq} and heads {cfg.heads} by "
                         f"tp={cfg.tp}")
    if cfg.pp > 1:
        result = train_pipeline(cfg, model_config, batch, _loss_cell(cfg), log, step_line)
        cells = result.pop("cells")
        if cfg.cp > 1:
            result["recomputes"] = sum(_recomputes(cell) for cell in cells)
        return _checked(cfg, result, log, cells if cfg.cp > 1 else None)
    if cfg.fsdp:
        mesh, dp_dims, dp_index = _fsdp_mesh(cfg)
    else:
        mesh, dp_dims = init_device_mesh("cpu" if ms.get_context("device_target") == "CPU" else "npu",
                                         (cfg.dp, cfg.tp), mesh_dim_names=("dp", "tp")), ("dp",)
        dp_index = mesh.get_coordinate()[0]
    ms.set_seed(cfg.seed)
    model = Llama(model_config(cfg))
    checkpoint_activations(model, cfg)
    parallelize_module(model, mesh["tp"], plan(cfg))
    loss = VocabParallelCrossEntropy(mesh["tp"], cfg.vocab) if cfg.loss_parallel else OneHotCrossEntropy()
    dp_mesh = mesh if cfg.dp > 1 else None
    if cfg.fsdp:
        _fully_shard(model, mesh[dp_dims])
        # fully_shard averages gradients over dp (the styles' gradients are whole over tp)
        reducer = GradientReducer(model.trainable_params())
    else:
        reducer = GradientReducer(model.trainable_params(), dp_mesh=dp_mesh, dp_dim="dp" if dp_mesh else None)
    if cfg.mode == "graph":
        ms.set_context(mode=ms.GRAPH_MODE)
    try:
        result: Dict[str, object] = dict(_run(cfg, model, loss, reducer, dp_mesh, dp_index, cfg.dp, log, "parallel",
                                              dp_dims, checkpoints=True,
                                              clip=lambda params: Clip(TotalGradNorm(params), cfg.clip_grad_norm)))
    finally:
        ms.set_context(mode=ms.PYNATIVE_MODE)
    return _checked(cfg, result, log)


def _train_context_parallel(cfg: TrainConfig, log: Callable[[str], None]) -> Dict[str, object]:
    """``--cp``: a (dp, cp, tp) mesh (torchtitan's order); each step on this rank's sequence shard of its
    dp rows, tensor parallelism over tp. The loss of each rank is the mean of as many tokens, so the
    average over dp x cp is the global mean: the loss and the gradients are averaged over the flattened
    ``dp_cp`` dims, by a :class:`GradientReducer` or, with ``--fsdp``, by ``fully_shard`` over ``dp_cp``
    (parameters, gradients and optimizer state sharded over dp x cp, torchtitan's FSDP mesh)."""
    mesh = init_device_mesh("cpu" if ms.get_context("device_target") == "CPU" else "npu", (cfg.dp, cfg.cp, cfg.tp),
                            mesh_dim_names=("dp", "cp", "tp"))
    dp_cp = mesh["dp", "cp"]._flatten("dp_cp")
    ms.set_seed(cfg.seed)
    model = Llama(model_config(cfg))
    checkpoint_activations(model, cfg)
    parallelize_module(model, mesh["tp"], plan(cfg))
    loss = VocabParallelCrossEntropy(mesh["tp"], cfg.vocab) if cfg.loss_parallel else OneHotCrossEntropy()
    if cfg.fsdp:
        _fully_shard(model, dp_cp)        # fully_shard averages the gradients over dp x cp
        reducer = GradientReducer(model.trainable_params())
    else:
        reducer = GradientReducer(model.trainable_params(), dp_mesh=dp_cp, dp_dim="dp_cp")
    result = _run(cfg, model, loss, reducer, dp_cp, mesh.get_coordinate()[0], cfg.dp, log, "parallel", ("dp_cp",),
                  checkpoints=True, clip=lambda params: Clip(TotalGradNorm(params), cfg.clip_grad_norm),
                  cp_mesh=mesh["cp"])
    result["recomputes"] = _recomputes(model)
    result["saved_ops"] = _saved_ops(model)
    return _checked(cfg, result, log, model)


def _recomputes(model: nn.Cell) -> int:
    """How many times the checkpointed Cells of ``model`` ran their forward again in a backward."""
    return sum(checkpoint_stats(cell).recomputes for _, cell in model.cells_and_names()
               if isinstance(cell, CheckpointWrapper))


def _saved_ops(model: nn.Cell) -> Dict[str, int]:
    """The op names whose outputs the checkpointed Cells of ``model`` kept for their recompute (selective
    policies), with how many times."""
    kept: Dict[str, int] = {}
    for _, cell in model.cells_and_names():
        if isinstance(cell, CheckpointWrapper):
            for name, count in checkpoint_stats(cell).saved.items():
                kept[name] = kept.get(name, 0) + count
    return kept


def whole_parameters(model: nn.Cell) -> Dict[str, np.ndarray]:
    """Every trainable parameter of ``model`` by its path (a pipeline stage's are the whole model's),
    tensor-parallel and fully-sharded ones gathered whole."""
    return {name: (as_dtensor(p).full_tensor() if parameter_sharding(p) is not None else p.value()).asnumpy()
            for name, p in model.parameters_and_names() if p.requires_grad}


def _loss_cell(cfg: TrainConfig) -> Callable:
    """``tp_mesh -> the loss Cell`` of ``cfg`` (vocabulary-parallel or one-hot cross-entropy)."""
    if cfg.loss_parallel:
        return lambda tp_mesh: VocabParallelCrossEntropy(tp_mesh, cfg.vocab)
    return lambda tp_mesh: OneHotCrossEntropy()


def _checked(cfg: TrainConfig, result: Dict[str, object], log: Callable[[str], None],
             model: Union[None, nn.Cell, List[nn.Cell]] = None) -> Dict[str, object]:
    """With ``cfg.check``: the single-device run's losses and the largest relative difference added;
    given the trained ``model`` (or this rank's pipeline stages), also the largest absolute difference
    of its parameters (gathered whole) from the single-device model's (``max_parameter_difference``)."""
    if not cfg.check:
        return result
    mine = None
    if model is not None:           # every rank gathers its pieces (collectives over its tp / fsdp groups)
        cells = model if isinstance(model, list) else [model]
        mine = {k: v for cell in cells for k, v in whole_parameters(cell).items()}
    ms.set_seed(cfg.seed)
    single = Llama(model_config(cfg))
    eager = replace(cfg, mode="pynative")     # the single-device run is eager, the parallel one compiled or not
    ref = _run(eager, single, OneHotCrossEntropy(), _Identity(), None, 0, 1, log, "single device",
               clip=lambda params: OneDeviceClip(cfg.clip_grad_norm))
    if mine is not None:
        theirs = whole_parameters(single)
        if not mine or set(mine) - set(theirs) or (not isinstance(model, list) and set(mine) != set(theirs)):
            raise AssertionError(f"parameter names differ from the single-device model's: "
                                 f"{sorted(set(mine) ^ set(theirs))}")
        diffs = {k: float(np.max(np.abs(mine[k] - theirs[k]))) for k in mine}
        result["worst_parameter"] = max(diffs, key=diffs.get)
        result["max_parameter_difference"] = diffs[result["worst_parameter"]]
    start = result["start_step"]
    for key, out, diff in (("losses", "reference_losses", "max_relative_difference"),
                           ("grad_norms", "reference_grad_norms", "max_relative_norm_difference")):
        mine, theirs = np.array(result[key]), np.array(ref[key][start:])
        result[out] = ref[key][start:]
        result[diff] = float(np.max(np.abs(mine - theirs) / np.maximum(np.abs(theirs), 1e-30)))
    return result


def _fsdp_mesh(cfg: TrainConfig):
    """(mesh with dims dp (or dp_replicate, dp_shard) and tp, the dp dim names, this rank's dp index)."""
    if cfg.mode != "pynative" and cfg.sequence_parallel:
        raise ValueError("--fsdp with sequence parallelism runs in --mode pynative: compiled, MindSpore's graph "
                         "compiler fails on the sequence-parallel conversions of fully-sharded blocks (\"The func "
                         "graph is empty ... all_gather\"); add --no-sequence-parallel to compile it")
    if cfg.dp % cfg.hsdp_replicate:
        raise ValueError(f"--hsdp-replicate {cfg.hsdp_replicate} must divide dp={cfg.dp}")
    device = "cpu" if ms.get_context("device_target") == "CPU" else "npu"
    if cfg.hsdp_replicate == 1:
        mesh = init_device_mesh(device, (cfg.dp, cfg.tp), mesh_dim_names=("dp", "tp"))
        return mesh, ("dp",), mesh.get_coordinate()[0]
    shard = cfg.dp // cfg.hsdp_replicate
    mesh = init_device_mesh(device, (cfg.hsdp_replicate, shard, cfg.tp),
                            mesh_dim_names=("dp_replicate", "dp_shard", "tp"))
    coord = mesh.get_coordinate()
    return mesh, ("dp_replicate", "dp_shard"), coord[0] * shard + coord[1]


def _fully_shard(model: nn.Cell, dp_mesh) -> None:
    for block in model.layers:
        fully_shard(block, mesh=dp_mesh)
    fully_shard(model, mesh=dp_mesh)


class _Identity(nn.Cell):
    def construct(self, grads):
        return grads


def parse_args(argv: List[str]) -> TrainConfig:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    defaults = TrainConfig()
    for name in ("pp", "microbatches", "dp", "tp", "cp", "steps", "batch", "seq", "vocab", "dim", "layers", "heads", "hidden", "seed"):
        parser.add_argument(f"--{name}", type=int, default=getattr(defaults, name))
    parser.add_argument("--lr", type=float, default=defaults.lr)
    parser.add_argument("--mode", choices=["pynative", "jit", "graph"], default=defaults.mode)
    parser.add_argument("--no-sequence-parallel", action="store_true")
    parser.add_argument("--no-loss-parallel", action="store_true",
                        help="gather the logits and take the one-hot cross-entropy (no loss parallelism)")
    parser.add_argument("--no-check", action="store_true")
    parser.add_argument("--device", choices=["CPU", "Ascend"], default="CPU")
    parser.add_argument("--fsdp", action="store_true", help="fully_shard per block and at the root over dp")
    parser.add_argument("--hsdp-replicate", type=int, default=1, help="with --fsdp: HSDP with this many replicas")
    parser.add_argument("--checkpoint-dir", default=None, help="where step_K checkpoints are saved and resumed from")
    parser.add_argument("--save-every", type=int, default=0, help="save a checkpoint every N steps (0: never)")
    parser.add_argument("--resume", action="store_true", help="continue from the latest checkpoint")
    parser.add_argument("--schedule", choices=sorted(SCHEDULES), default=defaults.schedule,
                        help="with --pp > 1: the pipeline schedule")
    parser.add_argument("--compile-stages", action="store_true",
                        help="with --pp > 1: compile each stage's forward and backward (--no-loss-parallel, no --fsdp)")
    parser.add_argument("--activation-checkpoint", choices=["full", "selective", "attention_core"], default="",
                        help="checkpoint each block's attention and feed-forward (selective: PyNative); "
                             "attention_core: recompute each attention's scores only (PyNative)")
    parser.add_argument("--clip-grad-norm", type=float, default=defaults.clip_grad_norm,
                        help="clip the gradients to this global norm (0: no clipping)")
    args = parser.parse_args(argv)
    ms.set_device(args.device)
    cfg = TrainConfig(**{k: getattr(args, k) for k in ("pp", "microbatches", "schedule", "dp", "tp", "cp", "steps", "batch", "seq", "vocab", "dim",
                                                       "layers", "heads", "hidden", "seed", "lr", "mode")})
    return replace(cfg, sequence_parallel=not args.no_sequence_parallel, loss_parallel=not args.no_loss_parallel,
                   check=not args.no_check, fsdp=args.fsdp,
                   hsdp_replicate=args.hsdp_replicate, checkpoint_dir=args.checkpoint_dir,
                   save_every=args.save_every, resume=args.resume, compile_stages=args.compile_stages,
                   activation_checkpoint=args.activation_checkpoint, clip_grad_norm=args.clip_grad_norm)


def main(argv: List[str]) -> int:
    cfg = parse_args(argv)
    communication.init()
    rank, world = communication.get_rank(), communication.get_group_size()
    if world != cfg.pp * cfg.dp * cfg.cp * cfg.tp:
        print(f"train_tp: {world} ranks but pp x dp x cp x tp = {cfg.pp} x {cfg.dp} x {cfg.cp} x {cfg.tp}", flush=True)
        return 2

    def log(line: str) -> None:
        if rank == 0:
            print(line, flush=True)
    result = train(cfg, log)
    rate = float(np.median(result["tokens_per_s"][1:] or result["tokens_per_s"]))
    pipeline = f"pp={cfg.pp} schedule={cfg.schedule} microbatches={cfg.microbatches} " if cfg.pp > 1 else ""
    pipeline += f"cp={cfg.cp} " if cfg.cp > 1 else ""
    summary = (f"train_tp: rank {rank} of {world}, {pipeline}dp={cfg.dp} tp={cfg.tp} mode={cfg.mode} "
               f"{'fsdp' + (f' hsdp x{cfg.hsdp_replicate} ' if cfg.hsdp_replicate > 1 else ' ') if cfg.fsdp else ''}"
               f"sp={cfg.sequence_parallel} loss_parallel={cfg.loss_parallel}"
               f"{f' ac={cfg.activation_checkpoint}' if cfg.activation_checkpoint else ''}"
               f"{f' clip={cfg.clip_grad_norm:g}' if cfg.clip_grad_norm else ''}: "
               f"steps {result['start_step'] + 1}-{cfg.steps}, "
               f"loss {result['losses'][0]:.4f} -> {result['losses'][-1]:.4f}, median {rate:.0f} tokens/s")
    ok = True
    if cfg.check:
        diff = result["max_relative_difference"]
        ok = diff <= cfg.tolerance
        norms = ""
        if cfg.clip_grad_norm:
            ok = ok and result["max_relative_norm_difference"] <= cfg.tolerance
            norms = f", grad norm {result['max_relative_norm_difference']:.2e}"
        params = ""
        if "max_parameter_difference" in result:
            ok = ok and result["max_parameter_difference"] <= cfg.param_tolerance
            params = (f", max absolute parameter difference {result['max_parameter_difference']:.2e} "
                      f"({result['worst_parameter']}, tolerance {cfg.param_tolerance:.0e})")
        summary += (f"; single-device check: max relative loss difference {diff:.2e}{norms} (tolerance "
                    f"{cfg.tolerance:.0e}){params} {'OK' if ok else 'FAILED'}")
    print(summary, flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
