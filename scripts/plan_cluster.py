"""Plan a cluster job on a laptop: simulate the example Llama (examples/llama.py) at a preset shape
on a (pp, dp, tp) mesh of simulated ranks, print each rank's memory and communication and the
estimated step time, or search the layouts of N devices for the fastest that fits.

Usage::

    python scripts/plan_cluster.py --model 7B --pp 2 --dp 4 --tp 8 --microbatches 4
    python scripts/plan_cluster.py --model 70B --pp 8 --dp 16 --tp 8 --microbatches 8 --json
    python scripts/plan_cluster.py --model 7B --search --devices 64 --device-memory 64GiB --top 10

Nothing is computed: parameters get no values and the step runs on shapes only
(hyper_parallel_ms.simulate). The step time comes from the alpha-beta model of
hyper_parallel_ms.plan.Cluster (defaults: public Atlas 800T A2 / Ascend 910B figures).
"""
from __future__ import annotations

import argparse
import re
import sys
from dataclasses import replace
from pathlib import Path
from typing import List

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

_UNITS = {"": 1, "b": 1, "kib": 2 ** 10, "mib": 2 ** 20, "gib": 2 ** 30, "tib": 2 ** 40, "kb": 10 ** 3, "mb": 10 ** 6,
          "gb": 10 ** 9, "tb": 10 ** 12}


def parse_bytes(text: str) -> int:
    """``"64GiB"`` -> 68719476736 (binary and decimal units).

    >>> parse_bytes("64GiB"), parse_bytes("1.5 GB")
    (68719476736, 1500000000)
    """
    match = re.fullmatch(r"\s*([0-9.]+)\s*([a-zA-Z]*)\s*", text)
    if not match or match.group(2).lower() not in _UNITS:
        raise argparse.ArgumentTypeError(f"expected a size such as 64GiB or 32GB, got {text!r}")
    return int(float(match.group(1)) * _UNITS[match.group(2).lower()])


def parse_args(argv: List[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=["7B", "70B"], default="7B", help="the preset shape of the example Llama")
    parser.add_argument("--layers", type=int, default=None, help="override the preset's number of blocks")
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--micro-batch", type=int, default=1, help="sequences per micro-batch on each dp rank")
    parser.add_argument("--pp", type=int, default=1)
    parser.add_argument("--dp", type=int, default=1)
    parser.add_argument("--tp", type=int, default=8)
    parser.add_argument("--microbatches", type=int, default=None, help="micro-batches per step (default: pp)")
    parser.add_argument("--no-fsdp", action="store_true", help="average gradients over dp instead of fully_shard")
    parser.add_argument("--checkpointing", action="store_true", help="activation checkpointing of every block")
    parser.add_argument("--ranks", default=None, help="comma-separated ranks to run (default: one per class)")
    parser.add_argument("--device-type", choices=["npu", "cpu"], default="npu")
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    parser.add_argument("--search", action="store_true", help="rank the layouts of --devices that fit")
    parser.add_argument("--devices", type=int, default=None)
    parser.add_argument("--top", type=int, default=10)
    parser.add_argument("--device-memory", type=parse_bytes, default="64GiB")
    parser.add_argument("--devices-per-node", type=int, default=8)
    parser.add_argument("--intra-bandwidth", type=float, default=196e9, help="bytes/s one device sends in a node")
    parser.add_argument("--inter-bandwidth", type=float, default=25e9, help="bytes/s one device sends across nodes")
    parser.add_argument("--intra-latency", type=float, default=5e-6)
    parser.add_argument("--inter-latency", type=float, default=15e-6)
    parser.add_argument("--device-flops", type=float, default=313e12)
    parser.add_argument("--efficiency", type=float, default=0.4, help="achieved share of the peak FLOPS")
    return parser.parse_args(argv)


def main(argv: List[str]) -> int:
    args = parse_args(argv)
    import mindspore as ms
    if ms.get_context("device_target") != "CPU":       # set_device fails once a kernel ran
        ms.set_device("CPU")
    from examples.plan_llama import PRESETS, builder, llama_training
    from hyper_parallel_ms import simulate
    from hyper_parallel_ms.pipelining import build_plan
    from hyper_parallel_ms.plan import Cluster, Layout, format_bytes, search, step_seconds
    config = PRESETS[args.model] if args.layers is None else replace(PRESETS[args.model], layers=args.layers)
    cluster = Cluster(args.devices_per_node, args.intra_bandwidth, args.inter_bandwidth, args.intra_latency,
                      args.inter_latency, args.device_flops, args.efficiency, args.device_memory)
    if args.search:
        if not args.devices:
            print("plan_cluster: --search needs --devices N", file=sys.stderr)
            return 2

        def progress(c):
            print(f"  {c.layout.describe():<36} peak {format_bytes(c.max_bytes):>11} "
                  f"{'fits' if c.fits else 'too big':<8} {c.tokens_per_second:>10.0f} tokens/s {c.problem[:60]}",
                  file=sys.stderr, flush=True)
        ranked = search(builder(config), devices=args.devices, layers=config.layers, cluster=cluster,
                        micro_batch=args.micro_batch, seq=args.seq, device_type=args.device_type, progress=progress)
        fitting = [c for c in ranked if c.fits]
        print(f"{args.model} on {args.devices} devices, {format_bytes(args.device_memory)} each: {len(fitting)} of "
              f"{len(ranked)} layouts fit")
        print(f"{'#':>3}  {'layout':<36}{'peak memory':>13}{'step':>10}{'tokens/s':>12}")
        for i, c in enumerate(fitting[:args.top], 1):
            print(f"{i:>3}  {c.layout.describe():<36}{format_bytes(c.max_bytes):>13}{c.step_seconds:>9.2f}s"
                  f"{c.tokens_per_second:>12.0f}")
        return 0
    layout = Layout(args.pp, args.dp, args.tp, not args.no_fsdp, args.microbatches or args.pp, args.checkpointing,
                    args.micro_batch, args.seq)
    shape, names = layout.mesh
    ranks = None if args.ranks is None else [int(r) for r in args.ranks.split(",")]
    report = simulate(llama_training(config, layout), mesh_shape=shape, mesh_dim_names=names, ranks=ranks,
                      device_type=args.device_type)
    if args.json:
        print(report.to_json(indent=1))
        return 0 if report.ok else 1
    bubble = build_plan("1F1B", layout.pp, layout.microbatches).bubble_fraction() if layout.pp > 1 else 0.0
    print(f"{args.model} ({config.layers} layers, dim {config.dim}, ffn {config.hidden}, vocab {config.vocab}), "
          f"seq {layout.seq}, {layout.describe()}")
    print(report.table())
    if report.ok and all(r.flops is not None for r in report):
        seconds = step_seconds(report, cluster, bubble)
        print(f"estimated step: {seconds:.2f} s, {layout.tokens / seconds:.0f} tokens/s "
              f"({layout.tokens} tokens per step, pipeline bubble {bubble:.0%}); fits in "
              f"{format_bytes(args.device_memory)}: {'yes' if report.max_total_bytes() <= args.device_memory else 'no'}")
    return 0 if report.ok else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
