"""The MoE example (``examples/moe.py``) as a training script that :func:`hyper_parallel_ms.simulate` can
run: one ``build(mesh)`` for an (ep, tp) mesh, placed by the example's own ``parallelize_moe``, and a
command line that prints each rank's memory and communication.

``build(mesh)`` is what ``examples/train_moe.py`` does on each rank: the model built under
``no_init_parameters()``, placed by ``parallelize_moe`` (experts over ep by ExpertParallel, or over
(ep, tp) by ExpertTensorParallel; the dense parts over tp), AdamW, and a ``step()``: the loss (token
cross-entropy summed on this rank's rows over the global token count) and its gradients, the dense
gradients summed over ep (ep is borrowed from data parallelism: each ep rank holds its own rows), the
optimizer, and the expert-bias update from the token counts summed over ep.

A simulated rank has no values, so the router's choices are a stated assumption: ``routing``
(``simulate(..., routing=)``), uniform unless given. Each MoE layer's step then sends, per rank, four
exchanges of ``T k (ep - 1) / ep`` rows under uniform routing (``T`` tokens, ``top_k`` = ``k``): the
dispatch and the combine in the forward and their transposes in the backward, plus one all-gather of
the ``E`` token counts (:func:`uniform_all_to_all_bytes`).

Usage::

    python examples/plan_moe.py --ep 4 --experts 8 --dim 1024 --moe-hidden 2816 --seq 4096
    python examples/plan_moe.py --ep 2 --tp 2 --routing 4,1,1,1,1,1,1,1

Example::

    report = simulate(moe_training(MoEConfig(experts=8), micro_batch=2, seq=16), mesh_shape=(4, 1),
                      mesh_dim_names=("ep", "tp"), routing="uniform")
    report[0].comm["all_to_all_single", "ep"].bytes
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Callable, List

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

__all__ = ["moe_training", "uniform_all_to_all_bytes", "expert_bytes", "main"]


def uniform_all_to_all_bytes(*, layers: int, tokens: int, top_k: int, dim: int, ep: int, itemsize: int = 4) -> int:
    """The bytes one rank sends in the all-to-alls of one training step under uniform routing: per MoE
    layer four exchanges (dispatch and combine, forward and backward) of the ``tokens * top_k`` routed
    rows' ``(ep - 1) / ep`` that go to the other ranks, ``dim`` features of ``itemsize`` bytes each.

    Args:
        layers: MoE layers.
        tokens: tokens on the rank per step.
        top_k: experts per token.
        dim: the token's features.
        ep: expert-parallel ranks.
        itemsize: bytes per feature.

    >>> uniform_all_to_all_bytes(layers=2, tokens=32, top_k=2, dim=32, ep=2)
    32768
    """
    return 4 * layers * (tokens * top_k * (ep - 1) // ep) * dim * itemsize


def expert_bytes(config, *, ep: int, tp: int, itemsize: int = 4) -> int:
    """Bytes of one rank's routed-expert weights: ``3 E hidden dim`` per layer over ``ep * tp`` ranks.

    Args:
        config: the :class:`~examples.moe.MoEConfig`.
        ep: expert-parallel ranks.
        tp: tensor-parallel ranks (each expert's hidden features split over them).
        itemsize: bytes per value.

    >>> from types import SimpleNamespace
    >>> expert_bytes(SimpleNamespace(layers=2, experts=8, moe_hidden=32, dim=32), ep=4, tp=1)
    49152
    """
    return config.layers * 3 * config.experts * config.moe_hidden * config.dim * itemsize // (ep * tp)


def moe_training(config, *, micro_batch: int, seq: int) -> Callable:
    """``build(mesh)`` for ``simulate`` on an ``("ep", "tp")`` mesh (see the module docstring): returns
    ``(model, optimizer, step)``; each ep rank trains ``micro_batch`` sequences of ``seq`` tokens.

    Args:
        config: the :class:`~examples.moe.MoEConfig` (``max_seq`` raised to ``seq`` if smaller).
        micro_batch: sequences per ep rank.
        seq: tokens per sequence.

    Example::

        model, optimizer, step = moe_training(MoEConfig(), micro_batch=2, seq=16)(mesh)
    """
    from dataclasses import replace

    import mindspore as ms
    import numpy as np
    from mindspore import nn, ops

    from hyper_parallel_ms import comm, init_parameters, no_init_parameters
    from hyper_parallel_ms.moe import update_expert_bias
    from hyper_parallel_ms.nn import GradientReducer
    try:
        from examples.moe import MoEModel, is_expert_parameter, parallelize_moe
    except ImportError:  # run as a script: examples/ is the script's directory
        from moe import MoEModel, is_expert_parameter, parallelize_moe
    config = replace(config, max_seq=max(config.max_seq, seq))

    def build(mesh):
        ep = mesh.size(mesh.dim_index("ep"))
        with no_init_parameters():
            model = MoEModel(config)
        parallelize_moe(model, mesh)
        init_parameters(model)                # the pieces' values (none on a simulated rank)
        params = model.trainable_params()
        optimizer = nn.AdamWeightDecay(params, learning_rate=1e-3, weight_decay=0.01)
        ids = ms.Tensor(np.zeros((micro_batch, seq), np.int32))
        targets = ms.Tensor(np.zeros((micro_batch, seq, 1), np.int32))
        tokens = float(micro_batch * seq * ep)

        def loss_fn(ids, targets):            # this rank's share of the global mean token cross-entropy
            picked = ops.gather_elements(ops.log_softmax(model(ids), -1), 2, targets)
            return -picked.sum() / tokens
        grad_fn = ms.value_and_grad(loss_fn, None, params)
        partial = GradientReducer(params)     # sums what a style leaves partial
        dense = [ep > 1 and not is_expert_parameter(p.name) for p in params]

        def step():
            loss, grads = grad_fn(ids, targets)
            grads = tuple(comm.all_reduce(g, mesh, "ep") if d else g for g, d in zip(partial(grads), dense))
            optimizer(grads)
            update_expert_bias(model, mesh, mesh_dims=("ep",) if ep > 1 else ())
            return loss
        return model, optimizer, step
    return build


def _routing(text: str):
    if text == "uniform":
        return "uniform"
    try:
        return [float(v) for v in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected 'uniform' or comma-separated shares per expert such as "
                                         f"4,1,1,1, got {text!r}") from None


def main(argv: List[str]) -> int:
    """Simulate one training step of the MoE example on ``--ep x --tp`` ranks and print the report, the
    routed experts' bytes per rank and the all-to-all bytes against the uniform-routing textbook."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for name, default in (("ep", 2), ("tp", 1), ("micro_batch", 1), ("seq", 16), ("vocab", 64), ("dim", 32),
                          ("layers", 2), ("heads", 4), ("moe_hidden", 32), ("experts", 8), ("top_k", 2),
                          ("shared_experts", 1)):
        parser.add_argument(f"--{name.replace('_', '-')}", dest=name, type=int, default=default)
    parser.add_argument("--routing", type=_routing, default="uniform",
                        help="'uniform' (default) or comma-separated shares per expert, e.g. 4,1,1,1,1,1,1,1")
    parser.add_argument("--device-type", choices=["npu", "cpu"], default="npu")
    args = parser.parse_args(argv)
    import mindspore as ms
    if ms.get_context("device_target") != "CPU":
        ms.set_device("CPU")
    from hyper_parallel_ms import simulate
    from hyper_parallel_ms.dryrun import format_bytes
    try:
        from examples.moe import MoEConfig
    except ImportError:
        from moe import MoEConfig
    config = MoEConfig(vocab=args.vocab, dim=args.dim, layers=args.layers, heads=args.heads,
                       moe_hidden=args.moe_hidden, experts=args.experts, top_k=args.top_k,
                       shared_experts=args.shared_experts, max_seq=args.seq)
    report = simulate(moe_training(config, micro_batch=args.micro_batch, seq=args.seq), mesh_shape=(args.ep, args.tp),
                      mesh_dim_names=("ep", "tp"), device_type=args.device_type, routing=args.routing)
    routing = "uniform" if args.routing == "uniform" else ",".join(f"{v:g}" for v in args.routing)
    print(f"MoE example: {args.layers} layers, dim {args.dim}, {args.experts} experts of {args.moe_hidden} hidden, "
          f"top-{args.top_k}, {args.micro_batch} x {args.seq} tokens per ep rank; ep={args.ep} tp={args.tp}; "
          f"routing {routing}")
    print(report.table())
    if not report.ok:
        return 1
    tokens = args.micro_batch * args.seq
    textbook = uniform_all_to_all_bytes(layers=args.layers, tokens=tokens, top_k=args.top_k, dim=args.dim, ep=args.ep)
    experts = expert_bytes(config, ep=args.ep, tp=args.tp)
    print(f"routed experts per rank: {format_bytes(experts)} ({experts} B); uniform-routing textbook all-to-all "
          f"per rank: 4 x {args.layers} layers x {tokens * args.top_k * (args.ep - 1) // args.ep} rows x {args.dim} "
          f"x 4 B = {format_bytes(textbook)} ({textbook} B)")
    for rank in sorted({r.represented_by for r in report}):
        a2a = report[rank].comm.get(("all_to_all_single", "ep"))
        print(f"rank {rank}: all-to-all {0 if a2a is None else a2a.bytes} B in {0 if a2a is None else a2a.calls} "
              f"calls; activations {format_bytes(report[rank].activation_bytes)}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
