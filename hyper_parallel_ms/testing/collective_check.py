"""Check a collective on a live mesh against numpy: forward values and SPMD gradients.

The references below compute, for the member ``me`` of a group whose inputs are ``xs``,
its output and the gradient of the global loss ``sum over members s of sum(f_s(x) * W_s)``
with respect to its input (only the output when ``ws`` is None). :func:`check_collective`
runs one collective through :mod:`hyper_parallel_ms.comm` in PyNative or ``ms.jit``
and compares both; the test suite and ``scripts/comm_selfcheck.py`` use it.

Example (on every rank of a 4-rank job)::

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    check_collective("all_to_all", mesh, "tp", mode="jit", pieces="uneven")
"""
from __future__ import annotations

from typing import Callable, List, Sequence, Tuple

import numpy as np

__all__ = ["check_collective", "chunk_bounds", "split_matrix", "KINDS", "PIECES"]

KINDS = ("all_gather", "all_reduce", "reduce_scatter", "all_to_all", "all_to_all_single", "broadcast")


def chunk_bounds(size: int, n: int) -> List[Tuple[int, int]]:
    """``torch.chunk`` pieces of ``range(size)`` as (start, stop), brute force."""
    step = -(-size // n)
    idx = list(range(size))
    out = []
    for i in range(n):
        piece = idx[i * step:(i + 1) * step]
        out.append((piece[0], piece[-1] + 1) if piece else (size, size))
    return out


def _take(a: np.ndarray, dim: int, start: int, stop: int) -> np.ndarray:
    index = [slice(None)] * a.ndim
    index[dim] = slice(start, stop)
    return a[tuple(index)]


def all_gather(xs: Sequence[np.ndarray], ws: Sequence[np.ndarray], me: int, dim: int):
    out = np.concatenate(xs, dim)
    if ws is None:
        return out
    offsets = np.cumsum([0] + [x.shape[dim] for x in xs])
    grad = sum(_take(w, dim, offsets[me], offsets[me + 1]) for w in ws)
    return out, grad


def reduce(xs, op):
    stack = np.stack(xs)
    return {"sum": stack.sum(0), "avg": stack.mean(0), "max": stack.max(0), "min": stack.min(0)}[op]


def all_reduce(xs, ws, me, op):
    out = reduce(xs, op)
    if ws is None:
        return out
    if op in ("sum", "avg"):
        return out, sum(ws) * (1.0 / len(xs) if op == "avg" else 1.0)
    return out, sum(ws) * (xs[me] == out)


def reduce_scatter(xs, ws, me, dim, op):
    full = reduce(xs, op)
    bounds = chunk_bounds(xs[0].shape[dim], len(xs))
    out = _take(full, dim, *bounds[me])
    if ws is None:
        return out
    # d full / d x_me is (1 | 1/n | indicator) per element; rank s's loss sees chunk s
    dfull = np.zeros_like(full)
    for s, (a, b) in enumerate(bounds):
        index = [slice(None)] * full.ndim
        index[dim] = slice(a, b)
        dfull[tuple(index)] = ws[s]
    if op == "sum":
        return out, dfull
    if op == "avg":
        return out, dfull / len(xs)
    return out, dfull * (xs[me] == full)


def all_to_all(xs, ws, me, split_dim, concat_dim):
    n = len(xs)
    bounds = chunk_bounds(xs[0].shape[split_dim], n)
    out = np.concatenate([_take(x, split_dim, *bounds[me]) for x in xs], concat_dim)
    if ws is None:
        return out
    grad = np.zeros_like(xs[me])
    for s, (a, b) in enumerate(bounds):
        offsets = np.cumsum([0] + [x.shape[concat_dim] for x in xs])
        piece = _take(ws[s], concat_dim, offsets[me], offsets[me + 1])
        index = [slice(None)] * grad.ndim
        index[split_dim] = slice(a, b)
        grad[tuple(index)] = piece
    return out, grad


def split_matrix(n: int, pieces: str) -> List[List[int]]:
    """The rows member ``i`` sends to member ``j`` in the ``all_to_all_single`` checks: ``even`` 2 each;
    ``uneven`` ``(i + j) % n`` plus one to member 0 (zeros included, every member sending as many rows);
    ``empty`` 2 each but none to the last member."""
    if pieces == "even":
        return [[2] * n for _ in range(n)]
    if pieces == "uneven":
        return [[(i + j) % n + (j == 0) for j in range(n)] for i in range(n)]
    return [[0 if j == n - 1 else 2 for j in range(n)] for _ in range(n)]


def all_to_all_single(xs, ws, me, matrix):
    n = len(xs)
    starts = [np.cumsum([0] + list(row)) for row in matrix]       # starts[i][j]: where i's block for j begins
    out = np.concatenate([xs[i][starts[i][me]:starts[i][me + 1]] for i in range(n)], 0)
    if ws is None:
        return out
    grad = np.zeros_like(xs[me])
    for j in range(n):
        at = sum(matrix[k][j] for k in range(me))                  # where my block sits in j's output
        grad[starts[me][j]:starts[me][j + 1]] = ws[j][at:at + matrix[me][j]]
    return out, grad


def broadcast(xs, ws, me, src):
    if ws is None:
        return xs[src]
    return xs[src], (sum(ws) if me == src else np.zeros_like(xs[me]))


PIECES = ("even", "uneven", "empty")


def _input(kind: str, member: int, n: int, pieces: str, dim: int, seed: int) -> np.ndarray:
    """Member ``member``'s 2-D input, its varying axis at ``dim``. ``pieces``: ``even``,
    ``uneven`` (sizes differ, none empty) or ``empty`` (some rank's piece is empty). Shapes
    depend only on the member, so every rank can rebuild every input."""
    rng = np.random.default_rng(seed + member)
    uneven_rows = {"even": 2 * n, "uneven": 2 * n - 1, "empty": n - 1}[pieces]   # torch.chunk over n
    if kind == "all_gather":
        rows = {"even": 2, "uneven": 3 - member % 3, "empty": 0 if member == n - 1 else 2}[pieces]
        shape = (rows, 4)
    elif kind == "all_to_all":
        shape = (uneven_rows, 2 - (pieces != "even" and member == n - 1))
    elif kind == "all_to_all_single":
        shape = (sum(split_matrix(n, pieces)[member]), 3)
    elif kind == "reduce_scatter":
        shape = (uneven_rows, 3)
    else:
        shape = (4, 3)
    x = rng.standard_normal(shape).astype(np.float32)
    return x if dim == 0 else np.ascontiguousarray(x.T)


def _collective(kind: str, mesh, mesh_dim, xs: List[np.ndarray], op: str, src: int,
                dim: int, pieces: str = "even") -> Tuple[Callable, Callable]:
    """(the collective on a tensor, its reference ``(ws, member) -> out[, grad]``)."""
    from .. import comm

    other = 1 - dim
    if kind == "all_gather":
        sizes = tuple(x.shape[dim] for x in xs)

        def run(t):
            return comm.all_gather(t, mesh, mesh_dim, dim=dim, sizes=sizes)
        return run, lambda ws, m: all_gather(xs, ws, m, dim)
    if kind == "all_reduce":
        def run(t):
            return comm.all_reduce(t, mesh, mesh_dim, op=op)
        return run, lambda ws, m: all_reduce(xs, ws, m, op)
    if kind == "reduce_scatter":
        def run(t):
            return comm.reduce_scatter(t, mesh, mesh_dim, dim=dim, op=op)
        return run, lambda ws, m: reduce_scatter(xs, ws, m, dim, op)
    if kind == "all_to_all":
        sizes = tuple(x.shape[other] for x in xs)

        def run(t):
            return comm.all_to_all(t, mesh, mesh_dim, split_dim=dim, concat_dim=other, concat_sizes=sizes)
        return run, lambda ws, m: all_to_all(xs, ws, m, dim, other)
    if kind == "all_to_all_single":
        if dim != 0:
            raise ValueError(f"all_to_all_single exchanges rows of dim 0, got dim={dim}")
        matrix = split_matrix(len(xs), pieces)
        me = mesh.comm_group(mesh_dim).rank
        outputs = tuple(row[me] for row in matrix)

        def run(t):
            return comm.all_to_all_single(t, outputs, tuple(matrix[me]), mesh, mesh_dim)
        return run, lambda ws, m: all_to_all_single(xs, ws, m, matrix)
    if kind == "broadcast":
        def run(t):
            return comm.broadcast(t, mesh, mesh_dim, src=src)
        return run, lambda ws, m: broadcast(xs, ws, m, src)
    raise ValueError(f"unknown collective {kind!r}; expected one of {KINDS}")


def check_collective(kind: str, mesh, mesh_dim, *, mode: str = "pynative", pieces: str = "even",
                     op: str = "sum", src: int = 0, dim: int = 0, grad: bool = True,
                     seed: int = 7) -> Tuple[int, ...]:
    """Run ``kind`` over ``mesh_dim`` and assert its output (and input gradient) match numpy
    within 1e-5; return the output shape. Call it on every rank of the mesh.

    ``mode`` is ``"pynative"`` or ``"jit"``; ``pieces`` is ``"even"``, ``"uneven"`` or ``"empty"``;
    ``dim`` (0 or 1) is the gathered / scattered / split dim of the 2-D inputs.
    """
    import mindspore as ms

    if mode not in ("pynative", "jit"):
        raise ValueError(f"mode must be 'pynative' or 'jit', got {mode!r}")
    group = mesh.comm_group(mesh_dim)
    n, me = group.size, group.rank
    if pieces not in PIECES:
        raise ValueError(f"pieces must be one of {PIECES}, got {pieces!r}")
    if dim not in (0, 1):
        raise ValueError(f"dim must be 0 or 1 (the inputs are 2-D), got {dim!r}")
    xs = [_input(kind, m, n, pieces, dim, seed) for m in range(n)]
    run, want = _collective(kind, mesh, mesh_dim, xs, op, src, dim, pieces)
    forward = ms.jit(run) if mode == "jit" else run
    x = ms.Tensor(xs[me])
    out = forward(x)
    np.testing.assert_allclose(out.asnumpy(), want(None, me), rtol=1e-5, atol=1e-5)
    if grad:
        rngs = [np.random.default_rng(seed + 100 + r) for r in group.ranks]
        ws = [rng.standard_normal(want(None, m).shape).astype(np.float32) for m, rng in enumerate(rngs)]
        w_mine = ms.Tensor(ws[me])

        def loss(t):
            return (run(t) * w_mine).sum()
        backward = ms.jit(ms.grad(loss)) if mode == "jit" else ms.grad(loss)
        np.testing.assert_allclose(backward(x).asnumpy(), want(ws, me)[1], rtol=1e-5, atol=1e-5)
    return tuple(out.shape)
