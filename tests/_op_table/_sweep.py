"""The op sweep's rank function: every entry on DTensors under every placement of its inputs,
compared with the single-device op (values and gradients)."""
from __future__ import annotations

import zlib
from typing import Any, Dict, List, Optional, Sequence, Tuple

import mindspore as ms
import numpy as np
from mindspore import Tensor, ops

from hyper_parallel_ms.dtensor import DTensor, distribute_tensor
from hyper_parallel_ms.mesh import init_device_mesh
from hyper_parallel_ms.placement import Partial, Placement, Replicate, Shard

from ._base import Arg, OpCase
from ._cases import CASES


def _array(arg: Arg, rng) -> np.ndarray:
    kind, shape = arg.kind, arg.shape
    if kind == "f":
        return rng.standard_normal(shape).astype(np.float32)
    if kind == "pos":
        return (np.abs(rng.standard_normal(shape)) + 0.5).astype(np.float32)
    if kind == "unit":
        return rng.uniform(-0.9, 0.9, shape).astype(np.float32)
    if kind == "b":
        return rng.random(shape) > 0.5
    signed, kind = kind.startswith("z"), kind[1:]
    dtype, high = (np.int32, int(kind[3:])) if kind.startswith("32-") else (np.int64, int(kind[1:]))
    return rng.integers(-high if signed else 0, high, shape).astype(dtype)


def _options(arg: Arg, mesh_shape: Tuple[int, ...]) -> List[Tuple[Placement, ...]]:
    """The placements ``arg`` takes: on a 1-D mesh every one (Partial(sum) too for floats); on
    a 2-D mesh three, chosen for what a 1-D mesh cannot show: a dim sharded over both mesh
    dims (5 rows on 4 ranks: 2, 2, 1, 0, so an empty piece), two dims sharded, one replicated."""
    if arg.shard == "rep":
        return [(Replicate(),) * len(mesh_shape)]
    dims = range(len(arg.shape)) if arg.shard in ("all", "tied") else arg.shard
    per_dim: List[Placement] = [Replicate()] + [Shard(d) for d in dims]
    if len(mesh_shape) == 1:
        return [(p,) for p in per_dim] + ([(Partial(),)] if arg.kind in ("f", "pos", "unit") else [])
    first, last = Shard(min(dims)), Shard(max(dims))    # on a 2-D mesh, the costly cases only:
    return [(first, first), (last, first), (Replicate(), last)]   # nested (empty pieces), 2-D, 1-D


def _combos(c: OpCase, mesh_shape) -> List[Tuple[Tuple[Placement, ...], ...]]:
    """Every placement of each input: the input with the most placements takes all of them;
    each other input runs through all of its own alongside (cycled); "tied" inputs (masks,
    indices) follow the first other input."""
    options = [_options(a, mesh_shape) for a in c.inputs]
    count = max(len(o) for o in options)
    leader = next(j for j, a in enumerate(c.inputs) if a.shard != "tied")
    combos = []
    for k in range(count):
        combo = [opts[(k * (j + 1) + j) % len(opts)] for j, opts in enumerate(options)]
        for j, arg in enumerate(c.inputs):
            if arg.shard == "tied":
                same = arg.shape == c.inputs[leader].shape
                combo[j] = tuple(Replicate() if p.is_partial() or not same else p for p in combo[leader])
        combos.append(tuple(combo))
    return list(dict.fromkeys(combos))


def _outputs(result) -> Tuple[Any, ...]:
    return tuple(result) if isinstance(result, (tuple, list)) else (result,)


def _is_float(t) -> bool:
    return t.dtype in (ms.float32, ms.float16, ms.float64, ms.bfloat16)


def _numpy(t) -> np.ndarray:
    """Float values as float32 (compared with a tolerance), integers and bools as they are
    (compared exactly, dtype included)."""
    return t.astype(ms.float32).asnumpy() if _is_float(t) else t.asnumpy()


def _differs(got: np.ndarray, want: np.ndarray) -> Optional[str]:
    if got.shape != want.shape or got.dtype != want.dtype:
        return f"shape {got.shape} {got.dtype}, want {want.shape} {want.dtype}"
    if want.dtype.kind in "biu":
        return None if np.array_equal(got, want) else f"{int(np.sum(got != want))} elements differ (exact)"
    return None if np.allclose(got, want, rtol=1e-5, atol=1e-5, equal_nan=True) else \
        f"max error {np.max(np.abs(got - want))}"


def _reference(c: OpCase, arrays):
    full = [Tensor(a) for a in arrays]
    outs = _outputs(c.fn(*full))
    floats = tuple(i for i, a in enumerate(c.inputs) if a.kind in ("f", "pos", "unit"))
    weights = [Tensor(np.random.default_rng(7 + i).standard_normal(o.shape).astype(np.float32))
               for i, o in enumerate(outs)]
    grads = None
    if c.grad and floats:
        def loss(*args):
            return sum((o.astype(ms.float32) * w).sum() for o, w in zip(_outputs(c.fn(*args)), weights)
                       if _is_float(o))
        grads = ms.grad(loss, grad_position=floats)(*full)
        grads = grads if isinstance(grads, tuple) else (grads,)
    return [_numpy(o) for o in outs], weights, floats, grads


class _NotDTensor(Exception):
    """An output of the op on DTensors that is not one."""


def _check(c: OpCase, mesh, combo, arrays, ref) -> Optional[str]:
    ref_outs, weights, floats, ref_grads = ref
    dts = [distribute_tensor(Tensor(a), mesh, p, src_data_rank=None) for a, p in zip(arrays, combo)]
    seen = {}

    def forward(args):
        outs = _outputs(c.fn(*args))
        for o in outs:
            if not isinstance(o, DTensor):
                raise _NotDTensor(f"returned a {type(o).__name__}, not a DTensor")
        seen["outs"], seen["full"] = outs, [o.full_tensor() for o in outs]
        return seen["full"]

    def loss(*pieces):          # one PyNative forward serves the values and the gradient
        args = list(dts)
        for i, piece in zip(floats, pieces):
            args[i] = DTensor.from_local(piece, mesh, dts[i].layout, shape=dts[i].shape)
        return sum((full * w).sum() for full, w in zip(forward(args), weights) if _is_float(full))

    try:
        if ref_grads is None:
            forward(dts)
        else:
            grads = ms.grad(loss, grad_position=tuple(range(len(floats))))(*[dts[i].to_local() for i in floats])
    except _NotDTensor as err:
        return str(err)
    for o, full, want in zip(seen["outs"], seen["full"], ref_outs):
        problem = _differs((full.astype(ms.float32) if _is_float(full) else full).asnumpy(), want)
        if problem:
            return f"value differs: placements {o.placements}, {problem}"
    if ref_grads is None:
        return None
    grads = grads if isinstance(grads, tuple) else (grads,)
    coord = mesh.get_coordinate()
    for i, g, rg in zip(floats, grads, ref_grads):
        d = dts[i]
        layout = d.layout.with_placements(tuple(Replicate() if p.is_partial() else p for p in d.layout.placements))
        want = rg.asnumpy()[layout.local_slices(d.shape, coord)]
        if g.shape != want.shape or not np.allclose(g.asnumpy(), want, rtol=1e-5, atol=1e-5):
            return f"gradient of input {i} differs"
    return None


def sweep(mesh_shape: Tuple[int, ...], names: Optional[Sequence[str]] = None,
          trace: Optional[str] = None, skip_families: Sequence[str] = ()) -> Dict[str, Any]:
    """Run the table on this rank's mesh; return {"failures": [...], "checked": n, "cases": n}.
    ``names``: only these entries; ``trace``: a path prefix to which each rank logs each check;
    ``skip_families``: families left out."""
    from hyper_parallel_ms.ops import registered_ops
    mesh = init_device_mesh("cpu", mesh_shape, mesh_dim_names=tuple(f"d{i}" for i in range(len(mesh_shape))))
    failures: List[str] = []
    checked = 0
    for c in CASES:
        if (names is not None and c.name not in names) or c.family in skip_families:
            continue
        rng = np.random.default_rng(zlib.crc32(c.name.encode()))
        arrays = [_array(a, rng) for a in c.inputs]
        if c.status == "open":              # a known wrong result, listed in docs/dtensor.md; not run
            continue
        if c.status == "cpu_kernel":
            if c.prim not in registered_ops():
                failures.append(f"{c.name}: no rule for {c.prim}")
            continue
        if c.status == "bypass":
            dts = [distribute_tensor(Tensor(a), mesh, [Replicate()] * len(mesh_shape), src_data_rank=None)
                   for a in arrays]
            if isinstance(c.fn(*dts), DTensor):
                failures.append(f"{c.name}: now reaches the dispatcher; make it an ordinary entry")
            continue
        if c.status == "unsupported":
            dts = [distribute_tensor(Tensor(a), mesh, [Shard(0)] * len(mesh_shape), src_data_rank=None)
                   for a in arrays]
            try:
                c.fn(*dts)
                failures.append(f"{c.name}: expected NotImplementedError")
            except NotImplementedError as err:
                if "no sharding rule" not in str(err):
                    failures.append(f"{c.name}: unclear error {err}")
            continue
        try:
            ref = _reference(c, arrays)
        except Exception as err:  # noqa: BLE001
            failures.append(f"{c.name}: the single-device op failed: {str(err).strip().splitlines()[-1][:200]}")
            continue
        for combo in _combos(c, mesh_shape):
            checked += 1
            if trace:
                with open(f"{trace}.{mesh.get_coordinate()}", "a") as log:
                    log.write(f"{c.name} {combo}\n")
            try:
                problem = _check(c, mesh, combo, arrays, ref)
            except Exception as err:  # noqa: BLE001  (collected and reported by the test)
                problem = f"{type(err).__name__}: {str(err).splitlines()[0][:300]}"
            if problem:
                failures.append(f"{c.name} {[tuple(map(str, p)) for p in combo]}: {problem}")
    return {"failures": failures, "checked": checked, "cases": len(CASES)}
