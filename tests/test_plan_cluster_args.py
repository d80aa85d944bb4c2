"""scripts/plan_cluster.py refuses every bad flag naming it and the fix, before any simulation:
values on their own (argparse types), flags that do not go together or ranks outside the mesh
(``check_args``), shapes the model cannot take (``dims_problem``: heads not divisible by tp, a
sequence tp cannot split, fewer blocks than stages), and a device memory below what any parallel dims can
need (``memory_floor``); a search where nothing fits says the smallest memory that any candidate needed."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
GiB = 2 ** 30


def _script():
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        import plan_cluster
    finally:
        sys.path.remove(str(ROOT / "scripts"))
    return plan_cluster


@pytest.mark.parametrize("argv, flag, fix", [
    (["--microbatches", "0"], "--microbatches", "integer of 1 or more, got '0'"),
    (["--pp", "3", "--microbatches", "2"], "--microbatches", "pass --microbatches 3 or more"),
    (["--tp", "0"], "--tp", "integer of 1 or more"),
    (["--dp", "-2"], "--dp", "integer of 1 or more, got '-2'"),
    (["--pp", "two"], "--pp", "integer of 1 or more, got 'two'"),
    (["--tp", "2", "--ranks", "5"], "--ranks", "rank 5 is outside the 2-rank mesh pp=1 x dp=1 x tp=2 (ranks 0..1)"),
    (["--ranks", "0,a"], "--ranks", "comma-separated ranks"),
    (["--micro-batch", "0"], "--micro-batch", "integer of 1 or more"),
    (["--seq", "0"], "--seq", "integer of 1 or more"),
    (["--layers", "0"], "--layers", "integer of 1 or more"),
    (["--device-memory", "-1GiB"], "--device-memory", "positive size such as 64GiB, got '-1GiB'"),
    (["--device-memory=-1GiB"], "--device-memory", "positive size"),
    (["--device-memory", "0"], "--device-memory", "positive size"),
    (["--device-memory", "64 bananas"], "--device-memory", "a size such as 64GiB"),
    (["--devices", "0"], "--devices", "integer of 1 or more"),
    (["--search", "--devices", "0"], "--devices", "integer of 1 or more"),
    (["--search"], "--search", "needs --devices N"),
    (["--devices", "8"], "--devices", "applies to --search only"),
    (["--top", "3"], "--top", "applies to --search only"),
    (["--search", "--devices", "8", "--top", "0"], "--top", "integer of 1 or more"),
    (["--search", "--devices", "8", "--tp", "8"], "--tp", "does not apply to --search"),
    (["--search", "--devices", "8", "--no-fsdp"], "--no-fsdp", "does not apply to --search"),
    (["--search", "--devices", "8", "--json"], "--json", "does not apply to --search"),
    (["--efficiency", "2"], "--efficiency", "at most 1"),
    (["--efficiency", "0"], "--efficiency", "above 0"),
    (["--intra-bandwidth", "0"], "--intra-bandwidth", "above 0"),
    (["--device-flops", "nan"], "--device-flops", "finite number above 0"),
    (["--inter-latency", "-1e-6"], "--inter-latency", "0 or more"),
    (["--devices-per-node", "0"], "--devices-per-node", "integer of 1 or more"),
    (["--dtype", "fp8"], "--dtype", "invalid choice: 'fp8'"),
    (["--attention", "sparse"], "--attention", "invalid choice: 'sparse'"),
    (["--kv-heads", "0"], "--kv-heads", "integer of 1 or more"),
    (["--model", "Llama-3-8B"], "--model", "invalid choice: 'Llama-3-8B'"),
])
def test_a_bad_flag_is_refused_naming_it_and_the_fix(argv, flag, fix, capsys):
    plan_cluster = _script()
    with pytest.raises(SystemExit) as exit_:
        plan_cluster.parse_args(argv)
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert f"error: argument {flag}: " in err and fix in err, err


def test_flags_left_out_get_their_defaults():
    plan_cluster = _script()
    args = plan_cluster.parse_args([])
    assert (args.pp, args.dp, args.tp, args.microbatches, args.ranks, args.top) == (1, 1, 8, 1, None, 10)
    args = plan_cluster.parse_args(["--pp", "4", "--tp", "2", "--ranks", "0,7", "--device-memory", "1.5GB"])
    assert (args.pp, args.microbatches, args.ranks, args.device_memory) == (4, 4, [0, 7], 1_500_000_000)
    args = plan_cluster.parse_args(["--search", "--devices", "16"])
    assert (args.devices, args.top, args.tp) == (16, 10, 8)


def test_shapes_the_model_cannot_take_name_the_flags():
    from types import SimpleNamespace
    plan_cluster = _script()
    config = SimpleNamespace(heads=32, key_heads=32, layers=2)
    problem = plan_cluster.dims_problem(config, pp=1, tp=64, seq=4096)
    assert problem.startswith("argument --tp:") and "heads 32, tp 64" in problem and "[1, 2, 4, 8, 16, 32]" in problem
    problem = plan_cluster.dims_problem(config, pp=1, tp=8, seq=60)
    assert problem.startswith("argument --seq:") and "multiple of 8" in problem
    problem = plan_cluster.dims_problem(config, pp=3, tp=8, seq=64)
    assert problem.startswith("argument --pp:") and "pass --pp 2 or less" in problem
    assert plan_cluster.dims_problem(config, pp=2, tp=8, seq=64) == ""
    gqa = SimpleNamespace(heads=64, key_heads=8, layers=80)             # tp must divide the key / value heads too
    problem = plan_cluster.dims_problem(gqa, pp=1, tp=16, seq=4096, kv_flag=True)
    assert problem.startswith("argument --tp: 16 does not divide the 8 key / value heads")
    assert "[1, 2, 4, 8] or more --kv-heads" in problem and "--seq" not in problem
    assert plan_cluster.dims_problem(gqa, pp=8, tp=8, seq=4096) == ""


def test_presets_and_the_dtype_attention_and_kv_heads_flags():
    """The presets have the real models' shapes: parameters counted from the model built without values
    (Llama-2-70B 68,976,648,192 and Llama-3-70B 70,553,706,496, as published); the flags change the
    preset, and combinations the example cannot honour are refused naming the flag."""
    plan_cluster = _script()
    from mindspore import bfloat16, float32
    from examples.llama import Llama
    from examples.plan_llama import DTYPES, PRESETS, describe
    from hyper_parallel_ms import no_init_parameters
    assert plan_cluster.MODELS == tuple(PRESETS) and set(plan_cluster.DTYPES) == set(DTYPES)

    def config(argv):
        return plan_cluster.model_config(plan_cluster.parse_args(argv), PRESETS, DTYPES)
    for name, params in (("Llama-2-70B", 68_976_648_192), ("Llama-3-70B", 70_553_706_496)):
        shape, problem = config(["--model", name])
        assert problem == "" and (shape.heads, shape.key_heads, shape.attention, shape.dtype) == (64, 8, "flash", bfloat16)
        with no_init_parameters():
            model = Llama(shape)
        assert sum(p.size for p in model.get_parameters()) == params, name
    shape, problem = config(["--model", "70B", "--dtype", "bf16", "--attention", "flash", "--kv-heads", "8",
                             "--layers", "4"])
    assert problem == "" and describe(shape) == ("4 layers, dim 8192, heads 64, kv heads 8, ffn 28672, vocab 128256, "
                                                 "bf16, flash attention")
    assert config(["--model", "Llama-3-70B", "--dtype", "fp32", "--attention", "math"])[0].dtype == float32
    for argv, flag, detail in ((["--model", "70B", "--kv-heads", "3"], "--kv-heads", "among [1, 2, 4, 8, 16, 32, 64]"),
                               (["--kv-heads", "64"], "--kv-heads", "does not divide the 32 attention heads of 7B"),
                               (["--model", "Llama-2-70B", "--dtype", "fp32"], "--dtype", "takes bf16 or fp16"),
                               (["--model", "70B", "--attention", "flash"], "--attention", "pass --dtype bf16"),
                               (["--model", "Llama-3-70B", "--device-type", "cpu"], "--device-type", "Ascend")):
        shape, problem = config(argv)
        assert shape is None and problem.startswith(f"argument {flag}: ") and detail in problem, (argv, problem)


def test_model_problems_and_a_memory_below_the_floor_are_refused_before_any_simulation(monkeypatch, capsys):
    plan_cluster = _script()
    import hyper_parallel_ms
    import hyper_parallel_ms.dryrun
    from hyper_parallel_ms.dryrun import format_bytes

    def never(*args, **kwargs):
        raise AssertionError("simulated although a flag is bad")
    monkeypatch.setattr(hyper_parallel_ms, "simulate", never)
    monkeypatch.setattr(hyper_parallel_ms.dryrun, "search", never)
    for argv, flag, detail in ((["--tp", "64"], "--tp", "heads 32, tp 64"),
                               (["--layers", "2", "--seq", "60"], "--seq", "not divisible by --tp 8"),
                               (["--layers", "2", "--pp", "3", "--tp", "2"], "--pp", "the model has 2"),
                               (["--model", "Llama-3-70B", "--tp", "16"], "--tp", "the 8 key / value heads"),
                               (["--model", "70B", "--kv-heads", "5"], "--kv-heads", "does not divide the 64"),
                               (["--model", "Llama-2-70B", "--dtype", "fp32"], "--dtype", "flash attention"),
                               (["--model", "Llama-3-70B", "--search", "--devices", "8", "--dtype", "fp32"],
                                "--dtype", "flash attention")):
        assert plan_cluster.main(argv) == 2
        err = capsys.readouterr().err
        assert f"error: argument {flag}: " in err and detail in err, err
    # 7B with 2 blocks: 2 * vocab * dim + blocks * (4 dim^2 + 3 dim ffn + 2 dim) + dim parameters, each fp32 with
    # its gradient and two AdamW moments: 16 bytes; 8 devices hold that at least once between them
    params = 2 * 32000 * 4096 + 2 * (4 * 4096 ** 2 + 3 * 4096 * 11008 + 2 * 4096) + 4096
    floor = 16 * params // 8
    assert plan_cluster.main(["--layers", "2", "--device-memory", "1MiB", "--search", "--devices", "8"]) == 2
    err = capsys.readouterr().err
    assert "error: argument --device-memory: no parallel dims of 8 devices fit in 1.00 MiB" in err, err
    assert f"need {format_bytes(floor)} per device at least" in err and "--device-memory 1.25GiB or more" in err
    assert floor / GiB == pytest.approx(1.24, abs=0.005)


def test_a_search_where_nothing_fits_names_the_smallest_memory_any_candidate_needed():
    plan_cluster = _script()
    from hyper_parallel_ms.dryrun import Candidate, ParallelDims
    ranked = [Candidate(ParallelDims(1, 2, 4), 3 * GiB + 1, False, 1.0, 1.0),
              Candidate(ParallelDims(2, 1, 4, microbatches=2), int(2.5 * GiB), False, 1.0, 1.0),
              Candidate(ParallelDims(1, 1, 8), 0, False, float("inf"), 0.0, "ValueError: x")]
    message = plan_cluster.nothing_fits(ranked, 2 * GiB)
    assert message == ("no candidate fits in 2.00 GiB per device; the smallest that any candidate needs is 2.50 GiB "
                       "(pp=2 dp=1 tp=4 fsdp mb=2 --): pass --device-memory 2.5GiB or more, or more --devices")
    assert "could be simulated" in plan_cluster.nothing_fits(ranked[2:], 2 * GiB)
    assert plan_cluster.memory_floor(100, 8) == 13 and plan_cluster._size_flag(int(12.551 * GiB)) == "12.56GiB"


def test_a_bad_flag_is_refused_before_mindspore_is_imported():
    code = ("import sys; sys.path.insert(0, 'scripts'); import plan_cluster\n"
            "try:\n    plan_cluster.main(['--search', '--devices', '0'])\n"
            "except SystemExit as e:\n    print(e.code, 'mindspore' in sys.modules)\n")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.stdout.split() == ["2", "False"], done.stdout + done.stderr
    assert "argument --devices: must be an integer of 1 or more, got '0'" in done.stderr
