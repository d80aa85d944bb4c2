"""Train a small Llama-style model with tensor (and data) parallelism, then check the losses
against a single-device run of the same steps.

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
(``examples/train_pp.py``; PyNative).

``--fsdp`` also shards parameters, gradients and optimizer state over dp with
``fully_shard`` per block and at the root (FSDP x TP); ``--hsdp-replicate R`` makes it HSDP
with R replicas of dp/R-way shards.
Checkpoints: ``--checkpoint-dir DIR --save-every N`` saves the model, the optimizer and the
step to ``DIR/step_K`` every N steps; ``--resume`` continues from the latest one (on any
dp x tp layout), and the check compares the resumed steps with the uninterrupted
single-device run.
"""
from __future__ import annotations

import argparse
import os
import re
import sys
import time
from dataclasses import dataclass, replace
from typing import Callable, Dict, List, Optional

import mindspore as ms
import numpy as np
from mindspore import communication, nn

from hyper_parallel_ms import checkpoint, comm, fully_shard
from hyper_parallel_ms.mesh import init_device_mesh
from hyper_parallel_ms.nn import GradientReducer, parallelize_module

try:
    from examples.llama import Llama, LlamaConfig, VocabParallelCrossEntropy, WithLoss, cross_entropy, tp_plan
    from examples.train_pp import SCHEDULES, train_pipeline
except ImportError:  # run as a script: examples/ is the script's directory
    from llama import Llama, LlamaConfig, VocabParallelCrossEntropy, WithLoss, cross_entropy, tp_plan
    from train_pp import SCHEDULES, train_pipeline

__all__ = ["TrainConfig", "train", "main"]


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


def model_config(cfg: TrainConfig) -> LlamaConfig:
    return LlamaConfig(vocab=cfg.vocab, dim=cfg.dim, layers=cfg.layers, heads=cfg.heads, hidden=cfg.hidden,
                       max_seq=cfg.seq)


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


class TrainStep(nn.Cell):
    """Loss, gradients, gradient reduction and the optimizer update (a Cell for GRAPH_MODE)."""

    def __init__(self, model: nn.Cell, loss: nn.Cell, optimizer: nn.Optimizer, reducer: nn.Cell, dp_mesh=None,
                 dp_dims: tuple = ("dp",)) -> None:
        super().__init__()
        self.with_loss = WithLoss(model, loss)
        self.optimizer, self.reducer, self.dp_mesh, self.dp_dims = optimizer, reducer, dp_mesh, dp_dims
        self.grad_fn = ms.value_and_grad(self.with_loss, None, optimizer.parameters)

    def construct(self, ids, labels):
        loss, grads = self.grad_fn(ids, labels)
        self.optimizer(self.reducer(grads))
        if self.dp_mesh is not None:
            for dim in self.dp_dims:
                loss = comm.all_reduce(loss, self.dp_mesh, dim, op="avg")
        return loss


def _runner(cfg: TrainConfig, step_cell: TrainStep) -> Callable:
    if cfg.mode == "pynative":
        return step_cell
    if cfg.mode == "jit":
        return ms.jit(step_cell.construct)
    return step_cell                   # GRAPH_MODE compiles the Cell


def latest_checkpoint(directory: str) -> Optional[str]:
    """The committed ``step_K`` checkpoint with the largest K in ``directory``, or ``None``."""
    steps = [int(m.group(1)) for m in (re.fullmatch(r"step_(\d+)", d) for d in
                                       (os.listdir(directory) if os.path.isdir(directory) else [])) if m]
    return os.path.join(directory, f"step_{max(steps)}") if steps else None


def _checkpoint_state(model: nn.Cell, optimizer: nn.Optimizer, step: int) -> Dict[str, object]:
    model_sd, optim_sd = checkpoint.get_state_dict(model, optimizer)
    return {"model": model_sd, "optim": optim_sd, "step": step}


def _resume(cfg: TrainConfig, model: nn.Cell, optimizer: nn.Optimizer, log: Callable[[str], None]) -> int:
    """Load the latest checkpoint into the model and optimizer (in place); the step to start at."""
    path = latest_checkpoint(cfg.checkpoint_dir)
    if path is None:
        raise FileNotFoundError(f"--resume: no step_K checkpoint in {cfg.checkpoint_dir}")
    state = _checkpoint_state(model, optimizer, 0)
    checkpoint.load(state, checkpoint_id=path)
    log(f"[parallel] resumed from {path} at step {state['step']}")
    return int(state["step"])


def _run(cfg: TrainConfig, model: nn.Cell, loss: nn.Cell, reducer: nn.Cell, dp_mesh, dp_index: int, dp_size: int,
         log: Callable[[str], None], label: str, dp_dims: tuple = ("dp",),
         checkpoints: bool = False) -> Dict[str, List[float]]:
    optimizer = nn.AdamWeightDecay(model.trainable_params(), learning_rate=cfg.lr, weight_decay=0.01)
    start = _resume(cfg, model, optimizer, log) if checkpoints and cfg.resume else 0
    step = _runner(cfg, TrainStep(model, loss, optimizer, reducer, dp_mesh, dp_dims))
    onehot = isinstance(loss, OneHotCrossEntropy)
    losses, rates = [], []
    for i in range(start, cfg.steps):
        ids, labels = batch(cfg, i, dp_index, dp_size, onehot)
        began = time.perf_counter()
        value = float(step(ids, labels).asnumpy())
        seconds = time.perf_counter() - began
        losses.append(value)
        rates.append(cfg.batch * cfg.seq / seconds)
        log(f"[{label}] step {i + 1}/{cfg.steps} loss {value:.6f} tokens/s {rates[-1]:.0f}")
        if checkpoints and cfg.save_every and (i + 1) % cfg.save_every == 0:
            path = os.path.join(cfg.checkpoint_dir, f"step_{i + 1}")
            checkpoint.save(_checkpoint_state(model, optimizer, i + 1), checkpoint_id=path)
            log(f"[{label}] saved {path}")
    return {"losses": losses, "tokens_per_s": rates, "start_step": start}


def train(cfg: TrainConfig, log: Callable[[str], None] = print) -> Dict[str, object]:
    """Train the parallel model (and, with ``cfg.check``, the single-device one); returns the
    losses, tokens/s and the largest relative loss difference."""
    if cfg.mode not in ("pynative", "jit", "graph"):
        raise ValueError(f"mode must be pynative, jit or graph, got {cfg.mode!r}")
    if (cfg.save_every or cfg.resume) and not cfg.checkpoint_dir:
        raise ValueError("--save-every and --resume need --checkpoint-dir")
    if cfg.batch % cfg.dp or cfg.seq % cfg.tp or cfg.heads % cfg.tp:
        raise ValueError(f"batch {cfg.batch} must divide by dp={cfg.dp}, seq {cfg.seq} and heads {cfg.heads} by "
                         f"tp={cfg.tp}")
    if cfg.pp > 1:
        result = train_pipeline(cfg, model_config, batch, _loss_cell(cfg), log)
        return _checked(cfg, result, log)
    if cfg.fsdp:
        mesh, dp_dims, dp_index = _fsdp_mesh(cfg)
    else:
        mesh, dp_dims = init_device_mesh("cpu" if ms.get_context("device_target") == "CPU" else "npu",
                                         (cfg.dp, cfg.tp), mesh_dim_names=("dp", "tp")), ("dp",)
        dp_index = mesh.get_coordinate()[0]
    ms.set_seed(cfg.seed)
    model = Llama(model_config(cfg))
    parallelize_module(model, mesh["tp"], tp_plan(cfg.sequence_parallel, cfg.loss_parallel))
    loss = VocabParallelCrossEntropy(mesh["tp"], cfg.vocab) if cfg.loss_parallel else OneHotCrossEntropy()
    dp_mesh = mesh if cfg.dp > 1 else None
    if cfg.fsdp:
        _fully_shard(model, mesh[dp_dims])
        # fully_shard averages gradients over dp; the reducer keeps only the tp sums (sequence parallelism)
        reducer = GradientReducer(model.trainable_params())
    else:
        reducer = GradientReducer(model.trainable_params(), dp_mesh=dp_mesh, dp_dim="dp" if dp_mesh else None)
    if cfg.mode == "graph":
        ms.set_context(mode=ms.GRAPH_MODE)
    try:
        result: Dict[str, object] = dict(_run(cfg, model, loss, reducer, dp_mesh, dp_index, cfg.dp, log, "parallel",
                                              dp_dims, checkpoints=True))
        result = _checked(cfg, result, log)
    finally:
        ms.set_context(mode=ms.PYNATIVE_MODE)
    return result


def _loss_cell(cfg: TrainConfig) -> Callable:
    """``tp_mesh -> the loss Cell`` of ``cfg`` (vocabulary-parallel or one-hot cross-entropy)."""
    if cfg.loss_parallel:
        return lambda tp_mesh: VocabParallelCrossEntropy(tp_mesh, cfg.vocab)
    return lambda tp_mesh: OneHotCrossEntropy()


def _checked(cfg: TrainConfig, result: Dict[str, object], log: Callable[[str], None]) -> Dict[str, object]:
    """With ``cfg.check``: the single-device run's losses and the largest relative difference added."""
    if not cfg.check:
        return result
    ms.set_seed(cfg.seed)
    single = Llama(model_config(cfg))
    ref = _run(cfg, single, OneHotCrossEntropy(), _Identity(), None, 0, 1, log, "single device")
    parallel = np.array(result["losses"])
    reference = np.array(ref["losses"][result["start_step"]:])
    result["reference_losses"] = ref["losses"][result["start_step"]:]
    result["max_relative_difference"] = float(np.max(np.abs(parallel - reference) / np.abs(reference)))
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
    for name in ("pp", "microbatches", "dp", "tp", "steps", "batch", "seq", "vocab", "dim", "layers", "heads", "hidden", "seed"):
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
    args = parser.parse_args(argv)
    ms.set_device(args.device)
    cfg = TrainConfig(**{k: getattr(args, k) for k in ("pp", "microbatches", "schedule", "dp", "tp", "steps", "batch", "seq", "vocab", "dim",
                                                       "layers", "heads", "hidden", "seed", "lr", "mode")})
    return replace(cfg, sequence_parallel=not args.no_sequence_parallel, loss_parallel=not args.no_loss_parallel,
                   check=not args.no_check, fsdp=args.fsdp,
                   hsdp_replicate=args.hsdp_replicate, checkpoint_dir=args.checkpoint_dir,
                   save_every=args.save_every, resume=args.resume)


def main(argv: List[str]) -> int:
    cfg = parse_args(argv)
    communication.init()
    rank, world = communication.get_rank(), communication.get_group_size()
    if world != cfg.pp * cfg.dp * cfg.tp:
        print(f"train_tp: {world} ranks but pp x dp x tp = {cfg.pp} x {cfg.dp} x {cfg.tp}", flush=True)
        return 2

    def log(line: str) -> None:
        if rank == 0:
            print(line, flush=True)
    result = train(cfg, log)
    rate = float(np.median(result["tokens_per_s"][1:] or result["tokens_per_s"]))
    pipeline = f"pp={cfg.pp} schedule={cfg.schedule} microbatches={cfg.microbatches} " if cfg.pp > 1 else ""
    summary = (f"train_tp: rank {rank} of {world}, {pipeline}dp={cfg.dp} tp={cfg.tp} mode={cfg.mode} "
               f"{'fsdp' + (f' hsdp x{cfg.hsdp_replicate} ' if cfg.hsdp_replicate > 1 else ' ') if cfg.fsdp else ''}"
               f"sp={cfg.sequence_parallel} loss_parallel={cfg.loss_parallel}: "
               f"steps {result['start_step'] + 1}-{cfg.steps}, "
               f"loss {result['losses'][0]:.4f} -> {result['losses'][-1]:.4f}, median {rate:.0f} tokens/s")
    ok = True
    if cfg.check:
        diff = result["max_relative_difference"]
        ok = diff <= cfg.tolerance
        summary += (f"; single-device check: max relative loss difference {diff:.2e} (tolerance "
                    f"{cfg.tolerance:.0e}) {'OK' if ok else 'FAILED'}")
    print(summary, flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
