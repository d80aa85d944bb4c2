"""Train the small DeepSeek-style MoE (``examples/moe.py``) with expert parallelism (and tensor parallelism of
the dense parts), then check the losses and every parameter against a single-device run of the same steps.

Launch on ``ep x tp`` ranks with msrun (``bash scripts/run_tp.sh --ep 2`` or ``--ep 2 --tp 2`` does it)::

    bash scripts/msrun.sh --worker_num=4 --local_worker_num=4 --join=True examples/train_moe.py --ep 2 --tp 2

The ep ranks hold different rows of the batch (ep borrowed from data parallelism, as torchtitan lays it
out), the tp ranks of an ep group the same rows. Each step: the loss (token cross-entropy summed on this
rank's rows, divided by the global token count), its gradients, the dense gradients summed over ep (the
experts' arrive whole: each rank's experts received every rank's tokens), AdamW, and the aux-loss-free
expert-bias update from the token counts summed over ep. PyNative (the token moves follow the router's
counts). ``--activation-checkpoint full|selective`` checkpoints each block of the parallel model
(``apply_activation_checkpointing``): the backward runs the block again, its expert dispatch included (the
single-device run is not checkpointed, so the check shows the recompute exact). The last line says whether
the losses and the parameters (sharded ones gathered) matched.
"""
from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass
from typing import Callable, Dict, List

import mindspore as ms
import numpy as np
from mindspore import communication, nn, ops

from hyper_parallel_ms import comm
from hyper_parallel_ms.mesh import init_device_mesh
from hyper_parallel_ms.moe import update_expert_bias
from hyper_parallel_ms.nn import GradientReducer, as_dtensor, parameter_sharding
from hyper_parallel_ms.training import (CheckpointWrapper, TotalGradNorm, apply_activation_checkpointing,
                                        checkpoint_stats)

try:
    from examples.moe import MoEBlock, MoEConfig, MoEModel, is_expert_parameter, parallelize_moe
except ImportError:  # run as a script: examples/ is the script's directory
    from moe import MoEBlock, MoEConfig, MoEModel, is_expert_parameter, parallelize_moe

__all__ = ["MoETrainConfig", "train", "main"]


@dataclass(frozen=True)
class MoETrainConfig:
    ep: int = 2
    tp: int = 1
    steps: int = 3
    batch: int = 4                     # global batch (split over ep)
    seq: int = 8
    vocab: int = 64
    dim: int = 32
    layers: int = 2
    heads: int = 4
    moe_hidden: int = 32
    experts: int = 4
    top_k: int = 2
    lr: float = 3e-3
    seed: int = 0
    activation_checkpoint: str = ""    # "" (none), "full" or "selective": each block of the parallel model
    check: bool = True                 # also train a single-device model and compare
    tolerance: float = 1e-5            # relative, losses and gradient norms
    param_tolerance: float = 1e-5      # absolute, parameters (see tests/test_train_moe_example.py)


def model_config(cfg: MoETrainConfig) -> MoEConfig:
    return MoEConfig(vocab=cfg.vocab, dim=cfg.dim, layers=cfg.layers, heads=cfg.heads, moe_hidden=cfg.moe_hidden,
                     experts=cfg.experts, top_k=cfg.top_k, max_seq=cfg.seq)


def batch(cfg: MoETrainConfig, step: int, ep_index: int = 0, ep_size: int = 1):
    """Step ``step``'s synthetic tokens (random starts, then ``t -> (3 t + 1) mod vocab``): this ep rank's rows
    as ids ``(rows, seq)`` and one-hot labels ``(rows, seq, vocab)``."""
    start = np.random.default_rng(cfg.seed * 1000 + step).integers(0, cfg.vocab, (cfg.batch, 1))
    tokens = [start]
    for _ in range(cfg.seq):
        tokens.append((3 * tokens[-1] + 1) % cfg.vocab)
    tokens = np.concatenate(tokens, 1)
    rows = cfg.batch // ep_size
    part = tokens[ep_index * rows:(ep_index + 1) * rows]
    return ms.Tensor(part[:, :-1].astype(np.int32)), ms.Tensor(np.eye(cfg.vocab, dtype=np.float32)[part[:, 1:]])


def _new_model(cfg: MoETrainConfig) -> MoEModel:
    np.random.seed(cfg.seed)
    ms.set_seed(cfg.seed)
    return MoEModel(model_config(cfg))


def _run(cfg: MoETrainConfig, model: MoEModel, mesh, ep_index: int, ep_size: int, log: Callable[[str], None],
         label: str) -> Dict[str, List[float]]:
    params = model.trainable_params()
    optimizer = nn.AdamWeightDecay(params, learning_rate=cfg.lr, weight_decay=0.01)
    tokens = float(cfg.batch * cfg.seq)

    def loss_fn(ids, labels):          # this rank's share of the global mean token cross-entropy
        return -(ops.log_softmax(model(ids), -1) * labels).sum() / tokens
    grad_fn = ms.value_and_grad(loss_fn, None, params)
    partial = GradientReducer(params)                  # sums the gradients a style leaves partial (none here)
    norm = TotalGradNorm(params)                       # the whole gradient's norm (sharded pieces combined)
    dense = [mesh is not None and ep_size > 1 and not is_expert_parameter(p.name) for p in params]
    losses, seconds, norms = [], [], []
    for i in range(cfg.steps):
        ids, labels = batch(cfg, i, ep_index, ep_size)
        began = time.perf_counter()
        loss, grads = grad_fn(ids, labels)
        grads = tuple(comm.all_reduce(g, mesh, "ep") if d else g for g, d in zip(partial(grads), dense))
        norms.append(float(norm(grads).asnumpy()))
        optimizer(grads)
        update_expert_bias(model, mesh, mesh_dims=("ep",) if ep_size > 1 else ())
        if mesh is not None and ep_size > 1:
            loss = comm.all_reduce(loss, mesh, "ep")
        losses.append(float(loss.asnumpy()))
        seconds.append(time.perf_counter() - began)
        log(f"[{label}] step {i + 1}/{cfg.steps} loss {losses[-1]:.6f} grad norm {norms[-1]:.6f} "
            f"tokens/s {tokens / seconds[-1]:.0f}")
    return {"losses": losses, "seconds": seconds, "grad_norms": norms}


def whole_parameters(model: nn.Cell) -> Dict[str, np.ndarray]:
    """Every parameter of ``model`` (the expert bias and counters included), sharded ones gathered whole."""
    return {p.name: (as_dtensor(p).full_tensor() if parameter_sharding(p) is not None else p.value()).asnumpy()
            for p in model.get_parameters()}


def train(cfg: MoETrainConfig, log: Callable[[str], None] = print) -> Dict[str, object]:
    """Train on ``cfg.ep x cfg.tp`` ranks (and, with ``cfg.check``, on one device); returns the losses, step
    seconds, gradient norms, and the largest relative loss and gradient-norm and absolute parameter differences."""
    if cfg.batch % cfg.ep or cfg.heads % cfg.tp or cfg.experts % cfg.ep or cfg.moe_hidden % cfg.tp:
        raise ValueError(f"batch {cfg.batch} and experts {cfg.experts} must divide by ep={cfg.ep}, heads "
                         f"{cfg.heads} and moe_hidden {cfg.moe_hidden} by tp={cfg.tp}")
    if cfg.activation_checkpoint not in ("", "full", "selective"):
        raise ValueError(f"--activation-checkpoint must be full or selective, got {cfg.activation_checkpoint!r}")
    if ms.get_context("mode") != ms.PYNATIVE_MODE:
        raise ValueError("the MoE example runs in PyNative: expert parallelism moves tokens by the router's "
                         "run-time counts, which GRAPH_MODE cannot compile")
    device = "cpu" if ms.get_context("device_target") == "CPU" else "npu"
    mesh = init_device_mesh(device, (cfg.ep, cfg.tp), mesh_dim_names=("ep", "tp"))
    ep_index = mesh.get_coordinate()[0]
    model = parallelize_moe(_new_model(cfg), mesh)
    if cfg.activation_checkpoint:
        policy = None if cfg.activation_checkpoint == "full" else cfg.activation_checkpoint
        apply_activation_checkpointing(model, check_fn=lambda cell: isinstance(cell, MoEBlock), policy=policy)
    result: Dict[str, object] = dict(_run(cfg, model, mesh, ep_index, cfg.ep, log, "parallel"))
    checkpointed = [cell for _, cell in model.cells_and_names() if isinstance(cell, CheckpointWrapper)]
    result["recomputes"] = sum(checkpoint_stats(cell).recomputes for cell in checkpointed)   # blocks x steps
    if not cfg.check:
        return result
    mine = whole_parameters(model)
    single = _new_model(cfg)
    ref = _run(cfg, single, None, 0, 1, log, "single device")
    theirs = whole_parameters(single)
    if sorted(mine) != sorted(theirs):
        raise AssertionError(f"parameter names differ: {sorted(set(mine) ^ set(theirs))}")
    result["reference_losses"] = ref["losses"]
    got, want = np.array(result["losses"]), np.array(ref["losses"])
    result["max_relative_difference"] = float(np.max(np.abs(got - want) / np.abs(want)))
    result["reference_grad_norms"] = ref["grad_norms"]
    got, want = np.array(result["grad_norms"]), np.array(ref["grad_norms"])
    result["max_relative_norm_difference"] = float(np.max(np.abs(got - want) / np.abs(want)))
    diffs = {name: float(np.max(np.abs(mine[name] - theirs[name]))) for name in theirs}
    worst = max(diffs, key=diffs.get)
    result["max_parameter_difference"], result["worst_parameter"] = diffs[worst], worst
    result["parameters_checked"] = len(diffs)
    return result


def parse_args(argv: List[str]) -> MoETrainConfig:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    defaults = MoETrainConfig()
    for name in ("ep", "tp", "steps", "batch", "seq", "vocab", "dim", "layers", "heads", "moe_hidden", "experts",
                 "top_k", "seed"):
        parser.add_argument(f"--{name.replace('_', '-')}", dest=name, type=int, default=getattr(defaults, name))
    parser.add_argument("--lr", type=float, default=defaults.lr)
    parser.add_argument("--activation-checkpoint", choices=["full", "selective"], default="")
    parser.add_argument("--no-check", action="store_true")
    parser.add_argument("--device", choices=["CPU", "Ascend"], default="CPU")
    args = parser.parse_args(argv)
    ms.set_device(args.device)
    fields = {k: getattr(args, k) for k in ("ep", "tp", "steps", "batch", "seq", "vocab", "dim", "layers", "heads",
                                             "moe_hidden", "experts", "top_k", "seed", "lr")}
    return MoETrainConfig(check=not args.no_check, activation_checkpoint=args.activation_checkpoint, **fields)


def main(argv: List[str]) -> int:
    cfg = parse_args(argv)
    communication.init()
    rank, world = communication.get_rank(), communication.get_group_size()
    if world != cfg.ep * cfg.tp:
        print(f"train_moe: {world} ranks but ep x tp = {cfg.ep} x {cfg.tp}", flush=True)
        return 2

    def log(line: str) -> None:
        if rank == 0:
            print(line, flush=True)
    result = train(cfg, log)
    step = float(np.median(result["seconds"][1:] or result["seconds"]))
    checkpointed = f" activation_checkpoint={cfg.activation_checkpoint}" if cfg.activation_checkpoint else ""
    summary = (f"train_moe: rank {rank} of {world}, ep={cfg.ep} tp={cfg.tp} experts={cfg.experts} top_k={cfg.top_k} "
               f"mode=pynative{checkpointed}: steps 1-{cfg.steps}, "
               f"loss {result['losses'][0]:.4f} -> {result['losses'][-1]:.4f}, "
               f"median step {step * 1e3:.0f} ms")
    ok = True
    if cfg.check:
        ok = max(result["max_relative_difference"], result["max_relative_norm_difference"]) <= cfg.tolerance and \
            result["max_parameter_difference"] <= cfg.param_tolerance
        summary += (f"; single-device check: max relative loss difference {result['max_relative_difference']:.2e}, "
                    f"gradient norm {result['max_relative_norm_difference']:.2e} "
                    f"(tolerance {cfg.tolerance:.0e}), "
                    f"max parameter difference {result['max_parameter_difference']:.2e} "
                    f"over {result['parameters_checked']} parameters (tolerance {cfg.param_tolerance:.0e}) "
                    f"{'OK' if ok else 'FAILED'}")
    print(summary, flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
