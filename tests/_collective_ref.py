"""numpy references for the collectives: forward values and SPMD gradients.

The global loss of a test is ``sum over ranks s of sum(f_s(x) * W_s)``; each function
returns this rank's output and the gradient of that loss with respect to its input
(only the output when ``ws`` is None).
"""
from __future__ import annotations

from typing import List, Sequence, Tuple

import numpy as np


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


def broadcast(xs, ws, me, src):
    if ws is None:
        return xs[src]
    return xs[src], (sum(ws) if me == src else np.zeros_like(xs[me]))
