"""Plan a cluster job on a laptop: simulate the example Llama (examples/llama.py) at a preset shape
on a (pp, dp, tp) mesh of simulated ranks, or (pp, dp, cp, tp) with context parallelism, print each
rank's memory and communication and the estimated step time, or search the parallel dims of N
devices for the fastest that fits.

Usage::

    python scripts/plan_cluster.py --model 7B --pp 2 --dp 4 --tp 8 --microbatches 4
    python scripts/plan_cluster.py --model 70B --pp 8 --dp 16 --tp 8 --microbatches 8 --json
    python scripts/plan_cluster.py --model 7B --search --devices 64 --device-memory 64GiB --top 10
    python scripts/plan_cluster.py --model Llama-3-70B --search --devices 1024 --device-memory 64GiB
    python scripts/plan_cluster.py --model 70B --dtype bf16 --attention flash --kv-heads 8 --pp 8 --dp 16
    python scripts/plan_cluster.py --model Llama-3-70B --seq 32768 --pp 8 --dp 4 --cp 4 --tp 8
    python scripts/plan_cluster.py --model Llama-3-70B --seq 32768 --search --devices 256

Nothing is computed: parameters get no values and the step runs on shapes only
(hyper_parallel_ms.simulate). The step time comes from the alpha-beta model of
hyper_parallel_ms.dryrun.Cluster (defaults: public Atlas 800T A2 / Ascend 910B figures).

Context parallelism (--cp C): each sequence is cut load-balanced over C ranks (2 C chunks) and the
step runs inside hyper_parallel_ms.context_parallel, as examples/train_tp.py --cp does: every layer
works on the rank's seq / C tokens; the attention goes through scaled_dot_product_attention to the
ring engine, which keeps the local key / value shard, the output and its float32 log-sum-exp, and
moves the keys and values by --rotate: "allgather" (default: one all-gather of the key / value shard
in the forward, again in the backward, and a reduce-scatter of the float32 key / value gradients) or
"alltoall" (send / recv one shard per ring step); --cp-method ulysses runs Ulysses instead (all-to-alls
of q, k, v and the output between sequence and head shards, forward and backward), and --cp-method hybrid
--ulysses-degree U Ulysses over groups of U cp ranks with the ring across them. fully_shard spans dp x cp. A search tries cp > 1
where each cp rank keeps at least --min-cp-tokens tokens (default 4096) and 2 cp divides --seq.
"""
from __future__ import annotations

import argparse
import math
import os
import re
import sys
from dataclasses import replace
from pathlib import Path
from typing import List, Optional

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

_UNITS = {"": 1, "b": 1, "kib": 2 ** 10, "mib": 2 ** 20, "gib": 2 ** 30, "tib": 2 ** 40, "kb": 10 ** 3, "mb": 10 ** 6,
          "gb": 10 ** 9, "tb": 10 ** 12}
_SEARCH_ONLY = ("devices", "top", "workers", "min_cp_tokens")
_DIMS_ONLY = ("pp", "dp", "cp", "tp", "microbatches", "ranks", "no_fsdp", "checkpointing", "json")
_DEFAULTS = {"pp": 1, "dp": 1, "cp": 1, "tp": 8, "top": 10, "min_cp_tokens": 4096}
MODELS = ("7B", "70B", "Llama-2-70B", "Llama-3-70B")      # examples/plan_llama.py's PRESETS
DTYPES = ("bf16", "fp16", "fp32")                          # examples/plan_llama.py's DTYPES


def parse_bytes(text: str) -> int:
    """``"64GiB"`` -> 68719476736 (binary and decimal units); a size that is not positive is refused.

    >>> parse_bytes("64GiB"), parse_bytes("1.5 GB")
    (68719476736, 1500000000)
    """
    match = re.fullmatch(r"\s*([-+]?[0-9.]+)\s*([a-zA-Z]*)\s*", text)
    if not match or match.group(2).lower() not in _UNITS:
        raise argparse.ArgumentTypeError(f"expected a size such as 64GiB or 32GB, got {text!r}")
    try:
        size = int(float(match.group(1)) * _UNITS[match.group(2).lower()])
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a size such as 64GiB or 32GB, got {text!r}") from None
    if size <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive size such as 64GiB, got {text!r}")
    return size


def positive_int(text: str) -> int:
    """An argument that must be an integer of 1 or more.

    >>> positive_int("8")
    8
    """
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an integer of 1 or more, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be an integer of 1 or more, got {text!r}")
    return value


def _real(text: str, low: float, what: str, high: float = math.inf, open_low: bool = True) -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and (value > low if open_low else value >= low) and value <= high):
        raise argparse.ArgumentTypeError(f"must be {what}, got {text!r}")
    return value


def positive_float(text: str) -> float:
    """A rate that must be a finite number above 0.

    >>> positive_float("25e9")
    25000000000.0
    """
    return _real(text, 0.0, "a finite number above 0")


def latency(text: str) -> float:
    """A latency: a finite number of seconds, 0 or more.

    >>> latency("5e-6")
    5e-06
    """
    return _real(text, 0.0, "a finite number of seconds, 0 or more", open_low=False)


def fraction(text: str) -> float:
    """A share of the peak: above 0, at most 1.

    >>> fraction("0.4")
    0.4
    """
    return _real(text, 0.0, "a fraction above 0 and at most 1 (the achieved share of the peak FLOPS)", 1.0)


def _joined(argv: List[str]) -> List[str]:
    """``--flag -1GiB`` as ``--flag=-1GiB``: argparse takes a value that starts with ``-`` and is not a
    plain number for an option, and would say "expected one argument" instead of why the value is bad."""
    out: List[str] = []
    for token in argv:
        if out and re.match(r"-[0-9.]", token) and out[-1].startswith("--") and "=" not in out[-1]:
            out[-1] = f"{out[-1]}={token}"
        else:
            out.append(token)
    return out


def _flag(dest: str) -> str:
    return "--" + dest.replace("_", "-")


def default_workers() -> int:
    """The processes a search simulates on by default: the CPUs this process may use, at most 4 (each
    holds MindSpore and a model's shapes, about 1 GiB).

    >>> 1 <= default_workers() <= 4
    True
    """
    return max(1, min(4, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1))


def check_args(args: argparse.Namespace) -> None:
    """Refuse flags that do not go together or that name ranks outside the mesh (before anything
    is built or simulated), naming the flag and the fix; fill in the defaults of the flags left out.

    Args:
        args: what :func:`parse_args` parsed (each value already checked on its own).

    Raises:
        ValueError: naming the flag.

    >>> check_args(argparse.Namespace(search=False, devices=None, top=None, pp=2, dp=None, tp=1,
    ...                               microbatches=None, ranks="0,2", no_fsdp=False, checkpointing=False, json=False))
    Traceback (most recent call last):
    ...
    ValueError: argument --ranks: rank 2 is outside the 2-rank mesh pp=2 x dp=1 x tp=1 (ranks 0..1); pass ranks below 2
    """
    if args.search:
        if args.devices is None:
            raise ValueError("argument --search: needs --devices N, the number of devices whose parallel dims to try")
        for dest in _DIMS_ONLY:
            if getattr(args, dest, None) not in (None, False):
                raise ValueError(f"argument {_flag(dest)}: does not apply to --search, which tries all parallel "
                                 f"dims of --devices; drop {_flag(dest)}, or drop --search to simulate those dims")
    else:
        for dest in _SEARCH_ONLY:
            if getattr(args, dest, None) is not None:
                raise ValueError(f"argument {_flag(dest)}: applies to --search only (one job runs on "
                                 f"--pp x --dp x --cp x --tp ranks); add --search or drop {_flag(dest)}")
    if getattr(args, "ulysses_degree", None) is not None and getattr(args, "cp_method", "ring") != "hybrid":
        raise ValueError(f"argument --ulysses-degree: sizes the Ulysses groups of --cp-method hybrid, not "
                         f"{getattr(args, 'cp_method', 'ring')}; add --cp-method hybrid or drop --ulysses-degree")
    for dest, value in _DEFAULTS.items():
        if getattr(args, dest, None) is None:
            setattr(args, dest, value)
    if args.search and args.workers is None:
        args.workers = default_workers()
    if args.search:
        return
    if args.microbatches is None:
        args.microbatches = args.pp
    elif args.pp > 1 and args.microbatches < args.pp:
        raise ValueError(f"argument --microbatches: the 1F1B pipeline of --pp {args.pp} stages needs at least "
                         f"{args.pp} micro-batches, got {args.microbatches}; pass --microbatches {args.pp} or more")
    if args.ranks is not None:
        world = args.pp * args.dp * args.cp * args.tp
        try:
            ranks = [int(r) for r in args.ranks.split(",")]
        except ValueError:
            raise ValueError(f"argument --ranks: expected comma-separated ranks such as 0,8, got {args.ranks!r}") \
                from None
        outside = [r for r in ranks if not 0 <= r < world]
        if outside:
            cp = f" x cp={args.cp}" if args.cp > 1 else ""
            raise ValueError(f"argument --ranks: rank {outside[0]} is outside the {world}-rank mesh pp={args.pp} x "
                             f"dp={args.dp}{cp} x tp={args.tp} (ranks 0..{world - 1}); pass ranks below {world}")
        args.ranks = ranks


def _divisors(n: int) -> List[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def dims_problem(config, *, pp: int, tp: int, seq: int, kv_flag: bool = False, cp: int = 1,
                 cp_method: str = "ring", ulysses_degree: Optional[int] = None) -> str:
    """Why the example Llama of ``config`` cannot run with ``pp`` stages, ``cp`` context-parallel and
    ``tp`` tensor-parallel ranks on sequences of ``seq`` tokens, naming the flags and the fix (``""``:
    it can). The ring needs nothing of the heads; the sequence must cut into ``2 cp`` load-balanced
    chunks and each cp rank's ``seq / cp`` tokens over tp (sequence parallelism).

    Args:
        config: the model's shape (its ``heads``, ``key_heads`` and ``layers``).
        pp: pipeline stages.
        tp: tensor-parallel ranks.
        seq: tokens per sequence.
        kv_flag: the key / value heads came from ``--kv-heads`` (a mismatch names that flag too).
        cp: context-parallel ranks.
        cp_method: ``"ring"``, ``"ulysses"`` (which moves heads: each tp rank's query heads must divide
            by cp; key / value heads that do not are repeated, one per query head) or ``"hybrid"`` (Ulysses
            over groups of ``ulysses_degree`` cp ranks, which must divide cp and those heads).
        ulysses_degree: the Ulysses group size of ``"hybrid"``.

    >>> from types import SimpleNamespace
    >>> dims_problem(SimpleNamespace(heads=32, key_heads=32, layers=4), pp=1, tp=64, seq=64)[:40]
    'argument --tp: 64 does not divide the 32'
    """
    heads = config.heads
    kv = getattr(config, "key_heads", heads)
    if heads % tp:
        return (f"argument --tp: {tp} does not divide the {heads} attention heads (heads {heads}, tp {tp}): each "
                f"tensor-parallel rank holds whole heads; pass a --tp among {_divisors(heads)}")
    if kv % tp:
        return (f"argument --tp: {tp} does not divide the {kv} key / value heads (kv heads {kv}, tp {tp}): each "
                f"tensor-parallel rank holds whole key / value heads; pass a --tp among {_divisors(kv)}"
                + (" or more --kv-heads" if kv_flag else ""))
    if cp > 1 and cp_method == "ulysses" and heads // tp % cp:
        return (f"argument --cp: Ulysses moves whole heads to the {cp} context-parallel ranks, and each tp rank's "
                f"{heads // tp} query heads (heads {heads}, tp {tp}) do not divide by {cp}; pass a --cp dividing "
                f"{heads // tp}, or --cp-method ring")
    if cp > 1 and cp_method == "hybrid":
        u = ulysses_degree or 0
        if u < 2 or cp % u or heads // tp % u:
            return (f"argument --ulysses-degree: hybrid runs Ulysses over groups of --ulysses-degree ranks, which "
                    f"must be at least 2 and divide --cp {cp} and each tp rank's {heads // tp} query heads (heads "
                    f"{heads}, tp {tp}); got {ulysses_degree}")
    if cp > 1 and seq % (2 * cp):
        return (f"argument --seq: {seq} does not cut into 2 x --cp = {2 * cp} equal chunks (load-balanced context "
                f"parallelism over {cp} ranks); pass a multiple of {2 * cp}, or another --cp")
    if (seq // cp) % tp:
        if cp > 1:
            return (f"argument --seq: each of the --cp {cp} ranks holds {seq // cp} tokens, not divisible by --tp "
                    f"{tp}: sequence parallelism splits them evenly over the tp ranks; pass a multiple of "
                    f"{cp * math.lcm(2, tp)}")
        return (f"argument --seq: {seq} is not divisible by --tp {tp}: sequence parallelism splits each sequence "
                f"evenly over the tp ranks; pass a multiple of {tp}")
    if config.layers < pp:
        return (f"argument --pp: {pp} stages need at least {pp} blocks, the model has {config.layers} (--layers); "
                f"pass --pp {config.layers} or less, or more --layers")
    return ""


def model_config(args: argparse.Namespace, presets: dict, dtypes: dict):
    """The model's shape: the preset ``--model`` with ``--layers``, ``--dtype``, ``--attention`` and
    ``--kv-heads`` applied, or the reason it cannot be, naming the flag and the fix.

    Args:
        args: the parsed flags.
        presets: ``examples/plan_llama.py``'s ``PRESETS``.
        dtypes: its ``DTYPES`` (``"bf16"`` -> ``mindspore.bfloat16``, ...).

    Returns:
        ``(config, "")``, or ``(None, problem)``.

    Example::

        config, problem = model_config(parse_args(["--model", "70B", "--dtype", "bf16"]), PRESETS, DTYPES)
    """
    base = presets[args.model]
    changes = {name: value for name, value in (("layers", args.layers), ("kv_heads", args.kv_heads),
                                                ("attention", args.attention)) if value is not None}
    if args.dtype is not None:
        changes["dtype"] = dtypes[args.dtype]
    if args.kv_heads is not None and (args.kv_heads > base.heads or base.heads % args.kv_heads):
        return None, (f"argument --kv-heads: {args.kv_heads} does not divide the {base.heads} attention heads of "
                      f"{args.model} (each key / value head serves heads / kv-heads query heads); pass a --kv-heads "
                      f"among {_divisors(base.heads)}")
    config = replace(base, **changes)
    if (getattr(args, "cp", None) or 1) > 1 and args.attention == "math":
        return None, ("argument --attention: with --cp the attention runs on sequence shards through "
                      "scaled_dot_product_attention (the ring engine keeps no scores); the written-out math "
                      "attention masks only its own shard's scores: drop --attention math")
    dtype = next(name for name, value in dtypes.items() if value == config.dtype)
    if config.attention == "flash" and dtype == "fp32":
        flag = "--dtype" if args.dtype is not None else "--attention"
        return None, (f"argument {flag}: flash attention (Ascend's fused kernel) takes bf16 or fp16; in fp32 the "
                      "attention is computed from its definition and keeps its seq x seq scores: pass --dtype bf16 "
                      "(or fp16), or --attention math")
    if config.attention == "flash" and args.device_type == "cpu":
        return None, ("argument --device-type: flash attention is Ascend's fused kernel; on cpu the attention is "
                      "computed from its definition and keeps its seq x seq scores: pass --device-type npu, or "
                      "--attention math")
    return config, ""


def parse_args(argv: List[str]) -> argparse.Namespace:
    """The flags (see ``--help``), each checked; a bad one exits with status 2 naming it (argparse's
    usage error), before anything is imported, built or simulated.

    Example::

        parse_args(["--model", "70B", "--pp", "8", "--dp", "16"]).tp          # 8
    """
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=MODELS, default="7B",
                        help="the preset shape of the example Llama (7B, 70B: fp32, math attention, no GQA; "
                             "Llama-2-70B, Llama-3-70B: bf16, flash attention, 8 kv heads)")
    parser.add_argument("--layers", type=positive_int, default=None, help="override the preset's number of blocks")
    parser.add_argument("--dtype", choices=DTYPES, default=None,
                        help="parameter and activation dtype (default: the preset's); the loss is computed in fp32")
    parser.add_argument("--attention", choices=["flash", "math"], default=None,
                        help="flash: the fused kernel, no seq x seq scores kept (bf16 / fp16); math: scores, mask "
                             "and softmax written out (default: the preset's)")
    parser.add_argument("--kv-heads", type=positive_int, default=None,
                        help="key / value heads, grouped-query attention (default: the preset's)")
    parser.add_argument("--seq", type=positive_int, default=4096)
    parser.add_argument("--micro-batch", type=positive_int, default=1, help="sequences per micro-batch on each dp rank")
    parser.add_argument("--pp", type=positive_int, default=None, help="pipeline stages (default 1)")
    parser.add_argument("--dp", type=positive_int, default=None, help="data-parallel ranks (default 1)")
    parser.add_argument("--cp", type=positive_int, default=None,
                        help="context-parallel ranks: each sequence cut over them, the attention on the ring "
                             "(default 1)")
    parser.add_argument("--tp", type=positive_int, default=None, help="tensor-parallel ranks (default 8)")
    parser.add_argument("--cp-method", choices=["ring", "ulysses", "hybrid"], default="ring",
                        help="the attention with cp > 1 (default ring; ulysses: all-to-alls from sequence shards to "
                             "head shards and back, each tp rank's query heads divisible by cp; hybrid: Ulysses "
                             "over --ulysses-degree ranks, the ring across)")
    parser.add_argument("--ulysses-degree", type=positive_int, default=None,
                        help="with --cp-method hybrid: the Ulysses group size (dividing --cp)")
    parser.add_argument("--rotate", choices=["allgather", "alltoall"], default="allgather",
                        help="how the ring moves keys and values with cp > 1 (default allgather: one all-gather "
                             "forward, again backward, gradients reduce-scattered; alltoall: send / recv per step)")
    parser.add_argument("--microbatches", type=positive_int, default=None, help="micro-batches per step (default: pp)")
    parser.add_argument("--no-fsdp", action="store_true", help="average gradients over dp instead of fully_shard")
    parser.add_argument("--checkpointing", action="store_true", help="activation checkpointing of every block")
    parser.add_argument("--ranks", default=None, help="comma-separated ranks to run (default: one per class)")
    parser.add_argument("--device-type", choices=["npu", "cpu"], default="npu")
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    parser.add_argument("--search", action="store_true", help="rank the parallel dims of --devices that fit")
    parser.add_argument("--devices", type=positive_int, default=None, help="the devices to lay out (--search)")
    parser.add_argument("--top", type=positive_int, default=None, help="candidates to list (--search; default 10)")
    parser.add_argument("--workers", type=positive_int, default=None,
                        help="processes that simulate (--search; default: the CPUs, at most 4)")
    parser.add_argument("--min-cp-tokens", type=positive_int, default=None,
                        help="--search tries cp > 1 where each cp rank keeps at least this many tokens of a "
                             "sequence (default 4096)")
    parser.add_argument("--device-memory", type=parse_bytes, default="64GiB")
    parser.add_argument("--devices-per-node", type=positive_int, default=8)
    parser.add_argument("--intra-bandwidth", type=positive_float, default=196e9,
                        help="bytes/s one device sends in a node")
    parser.add_argument("--inter-bandwidth", type=positive_float, default=25e9,
                        help="bytes/s one device sends across nodes")
    parser.add_argument("--intra-latency", type=latency, default=5e-6)
    parser.add_argument("--inter-latency", type=latency, default=15e-6)
    parser.add_argument("--device-flops", type=positive_float, default=313e12)
    parser.add_argument("--efficiency", type=fraction, default=0.4, help="achieved share of the peak FLOPS")
    args = parser.parse_args(_joined(list(argv)))
    try:
        check_args(args)
    except ValueError as exc:
        parser.error(str(exc))
    return args


def _size_flag(n: int) -> str:
    """``n`` bytes rounded up to a ``--device-memory`` value (two decimals of GiB, or of MiB below 1 GiB)."""
    unit, size = ("GiB", 2 ** 30) if n >= 2 ** 30 else ("MiB", 2 ** 20)
    return f"{math.ceil(n / size * 100) / 100:.2f}".rstrip("0").rstrip(".") + unit


def memory_floor(model_state_bytes: int, devices: int) -> int:
    """The least per-device memory any parallel dims of ``devices`` can need: every job holds each
    parameter, its gradient and its optimizer state at least once somewhere, and the fullest device
    holds at least the average (activations come on top).

    Args:
        model_state_bytes: the unsharded model's parameters, gradients and optimizer state.
        devices: the devices.

    >>> memory_floor(100, 8)
    13
    """
    return -(-model_state_bytes // devices)


def nothing_fits(ranked, device_memory: int) -> str:
    """The message when no candidate of a search fits: the smallest memory that any candidate needed.

    Args:
        ranked: the priced :class:`~hyper_parallel_ms.dryrun.Candidate` s.
        device_memory: the memory asked for.

    Example::

        print(nothing_fits(search(...), 2 ** 30))
    """
    from hyper_parallel_ms.dryrun import format_bytes
    ran = [c for c in ranked if not c.problem]
    if not ran:
        return "no candidate could be simulated (see the problems above)"
    best = min(ran, key=lambda c: c.max_bytes)
    dims = " ".join(best.dims.describe().split())
    return (f"no candidate fits in {format_bytes(device_memory)} per device; the smallest that any candidate needs "
            f"is {format_bytes(best.max_bytes)} ({dims}): pass --device-memory "
            f"{_size_flag(best.max_bytes)} or more, or more --devices")


def _state_bytes(config) -> int:
    """The unsharded example Llama's parameters, gradients and AdamW state (the optimizer of
    examples/plan_llama.py), read from the model and optimizer built without values."""
    from mindspore import nn
    from examples.llama import Llama
    from hyper_parallel_ms import no_init_parameters
    from hyper_parallel_ms.dryrun._memory import memory_of
    with no_init_parameters():
        model = Llama(config)
        optimizer = nn.AdamWeightDecay(model.trainable_params())
    held = memory_of(model, optimizer)
    return held.param_bytes + held.grad_bytes + held.optimizer_bytes


def _cp_attention(args) -> str:
    """How the attention runs with cp > 1, in words ("ring over cp, rotate allgather" / "Ulysses over cp").

    >>> _cp_attention(argparse.Namespace(cp_method="ulysses", rotate="allgather"))
    'Ulysses over cp'
    """
    if args.cp_method == "hybrid":
        return f"hybrid over cp, Ulysses over {args.ulysses_degree}, ring across, rotate {args.rotate}"
    return "Ulysses over cp" if args.cp_method == "ulysses" else f"ring over cp, rotate {args.rotate}"


def _search(args, config, cluster) -> int:
    from examples.plan_llama import builder
    from hyper_parallel_ms.dryrun import format_bytes, parallel_dims_of, search
    floor = memory_floor(_state_bytes(config), args.devices)
    if args.device_memory < floor:
        print(f"plan_cluster.py: error: argument --device-memory: no parallel dims of {args.devices} devices fit in "
              f"{format_bytes(args.device_memory)}: the {args.model} model's parameters, gradients and AdamW state "
              f"alone need {format_bytes(floor)} per device at least (activations come on top); pass "
              f"--device-memory {_size_flag(floor)} or more, or more --devices", file=sys.stderr)
        return 2
    every = parallel_dims_of(args.devices, layers=config.layers, devices_per_node=cluster.devices_per_node,
                             micro_batch=args.micro_batch, seq=args.seq, min_cp_tokens=args.min_cp_tokens)
    tried = [c for c in every if not dims_problem(config, pp=c.pp, tp=c.tp, seq=c.seq, cp=c.cp,
                                                  cp_method=args.cp_method, ulysses_degree=args.ulysses_degree)]
    if len(tried) < len(every):
        print(f"  skipped {len(every) - len(tried)} candidates whose tp does not divide the {config.heads} heads, the "
              f"{config.key_heads} key / value heads or each cp rank's share of the sequence of {args.seq} tokens",
              file=sys.stderr)
    if args.attention == "math" and any(c.cp > 1 for c in tried):
        tried = [c for c in tried if c.cp == 1]
        print("  context parallelism not tried: --attention math (the ring runs the attention through "
              "scaled_dot_product_attention)", file=sys.stderr)
    cps = sorted({c.cp for c in tried})
    print(f"  context parallelism tried: cp in {cps} (cp > 1 where 2 cp divides --seq {args.seq} and each cp rank "
          f"keeps at least --min-cp-tokens {args.min_cp_tokens} tokens; {_cp_attention(args)})", file=sys.stderr)

    def progress(c):
        print(f"  {c.dims.describe():<42} peak {format_bytes(c.max_bytes):>11} "
              f"{'fits' if c.fits else 'too big':<8} {c.tokens_per_second:>10.0f} tokens/s {c.problem[:60]}",
              file=sys.stderr, flush=True)
    ranked = search(builder(config, rotate=args.rotate, method=args.cp_method, ulysses_degree=args.ulysses_degree),
                    devices=args.devices,
                    layers=config.layers, cluster=cluster,
                    micro_batch=args.micro_batch, seq=args.seq, candidates=tried, device_type=args.device_type,
                    progress=progress, workers=args.workers)
    fitting = [c for c in ranked if c.fits]
    print(f"{args.model} on {args.devices} devices, {format_bytes(args.device_memory)} each: {len(fitting)} of "
          f"{len(ranked)} candidates fit")
    if not fitting:
        print(nothing_fits(ranked, args.device_memory))
        return 1
    print(f"{'#':>3}  {'parallel dims':<42}{'peak memory':>13}{'step':>10}{'tokens/s':>12}")
    for i, c in enumerate(fitting[:args.top], 1):
        print(f"{i:>3}  {c.dims.describe():<42}{format_bytes(c.max_bytes):>13}{c.step_seconds:>9.2f}s"
              f"{c.tokens_per_second:>12.0f}")
    return 0


def main(argv: List[str]) -> int:
    args = parse_args(argv)
    import mindspore as ms
    if ms.get_context("device_target") != "CPU":       # set_device fails once a kernel ran
        ms.set_device("CPU")
    from examples.plan_llama import DTYPES as dtypes, PRESETS, describe, llama_training
    from hyper_parallel_ms import simulate
    from hyper_parallel_ms.pipelining import build_plan
    from hyper_parallel_ms.dryrun import Cluster, ParallelDims, format_bytes, step_seconds
    config, problem = model_config(args, PRESETS, dtypes)
    if problem:
        print(f"plan_cluster.py: error: {problem}", file=sys.stderr)
        return 2
    cluster = Cluster(args.devices_per_node, args.intra_bandwidth, args.inter_bandwidth, args.intra_latency,
                      args.inter_latency, args.device_flops, args.efficiency, args.device_memory)
    if args.search:
        return _search(args, config, cluster)
    problem = dims_problem(config, pp=args.pp, tp=args.tp, seq=args.seq, kv_flag=args.kv_heads is not None,
                           cp=args.cp, cp_method=args.cp_method, ulysses_degree=args.ulysses_degree)
    if problem:
        print(f"plan_cluster.py: error: {problem}", file=sys.stderr)
        return 2
    dims = ParallelDims(args.pp, args.dp, args.tp, not args.no_fsdp, args.microbatches, args.checkpointing,
                        args.micro_batch, args.seq, args.cp)
    shape, names = dims.mesh
    report = simulate(llama_training(config, dims, rotate=args.rotate, method=args.cp_method,
                                     ulysses_degree=args.ulysses_degree), mesh_shape=shape, mesh_dim_names=names,
                      ranks=args.ranks, device_type=args.device_type)
    if args.json:
        print(report.to_json(indent=1))
        return 0 if report.ok else 1
    bubble = build_plan("1F1B", dims.pp, dims.microbatches).bubble_fraction() if dims.pp > 1 else 0.0
    shape_text = describe(config)
    if dims.cp > 1:          # the attention is the ring engine's, whatever the preset's
        shape_text = (shape_text.rsplit(", ", 1)[0] + f", attention on {dims.seq // dims.cp}-token sequence shards: "
                      f"{_cp_attention(args).replace('cp', f'cp={dims.cp}', 1)}")
    print(f"{args.model} ({shape_text}), seq {dims.seq}, {dims.describe()}")
    print(report.table())
    if report.ok and all(r.flops is not None for r in report):
        step_time = step_seconds(report, cluster, bubble)
        print(f"estimated step: {step_time:.2f} s, {dims.tokens / step_time:.0f} tokens/s "
              f"({dims.tokens} tokens per step, pipeline bubble {bubble:.0%}); fits in "
              f"{format_bytes(args.device_memory)}: {'yes' if report.max_total_bytes() <= args.device_memory else 'no'}")
        largest = max(report, key=lambda r: r.largest_temporary_bytes or 0)
        if largest.largest_temporary_bytes:
            print(f"largest single temporary: {format_bytes(largest.largest_temporary_bytes)} (rank "
                  f"{largest.rank}; on top of the totals while it lives: the biggest op output of the step)")
    return 0 if report.ok else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
