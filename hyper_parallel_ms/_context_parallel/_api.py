"""PyTorch's face of context parallelism: ``context_parallel`` (shard buffers along their sequence
dims, make attention inside context-parallel), ``context_parallel_unshard`` (the whole sequence
back, in its own order) and ``set_rotate_method`` (:mod:`._dispatch`).

Example::

    with context_parallel(mesh["cp"], buffers=[q, k, v], buffer_seq_dims=[2, 2, 2]):
        out = scaled_dot_product_attention(q, k, v, is_causal=True)      # q, k, v: this rank's shards
        (full,) = context_parallel_unshard(mesh["cp"], [out], [2])
"""
from __future__ import annotations

import contextlib
from typing import Iterator, List, Optional, Sequence

from mindspore import Parameter, Tensor, ops

from .. import comm
from ..comm._tensor import narrow, owned_copy
from ..mesh import DeviceMesh
from ._balance import check_sequence_length, rank_chunks
from ._dispatch import METHODS, ContextParallelState, entered, left

__all__ = ["context_parallel", "context_parallel_unshard"]


def _check_mesh(mesh, what: str) -> int:
    if not isinstance(mesh, DeviceMesh):
        raise TypeError(f"{what}: mesh must be a DeviceMesh (the cp mesh, e.g. mesh['cp']), got {type(mesh).__name__}")
    if mesh.ndim != 1:
        raise ValueError(f"{what}: mesh must be 1-D (the cp dim, e.g. mesh['cp']), got a {mesh.ndim}-D mesh "
                         f"{mesh.mesh_dim_names or mesh.shape}")
    return mesh.size()


def _ulysses_degree(method: str, ulysses_degree: Optional[int], n: int) -> int:
    if method not in METHODS:
        raise ValueError(f"context_parallel: method must be one of {METHODS}, got {method!r}")
    if ulysses_degree is not None and (isinstance(ulysses_degree, bool) or not isinstance(ulysses_degree, int)):
        raise TypeError(f"context_parallel: ulysses_degree must be an int or None, got {ulysses_degree!r}")
    if method == "ring":
        if ulysses_degree not in (None, 1):
            raise ValueError(f"context_parallel(method='ring') takes no ulysses_degree (got {ulysses_degree}); use "
                             "method='hybrid' for Ulysses inside a ring")
        return 1
    if method == "ulysses":
        if ulysses_degree not in (None, n):
            raise ValueError(f"context_parallel(method='ulysses') runs Ulysses over the whole cp mesh of {n} ranks, "
                             f"got ulysses_degree={ulysses_degree}; use method='hybrid' for a smaller degree")
        return n
    if ulysses_degree is None or ulysses_degree < 1 or n % ulysses_degree:
        raise ValueError(f"context_parallel(method='hybrid') needs a ulysses_degree dividing the {n} ranks of the cp "
                         f"mesh, got {ulysses_degree}")
    return ulysses_degree


def _check_buffers(buffers, seq_dims, what: str):
    buffers = [] if buffers is None else list(buffers)
    seq_dims = [] if seq_dims is None else list(seq_dims)
    if len(buffers) != len(seq_dims):
        raise ValueError(f"{what}: {len(buffers)} buffers but {len(seq_dims)} sequence dims; give one dim per buffer")
    dims = []
    for i, (b, d) in enumerate(zip(buffers, seq_dims)):
        if not isinstance(b, Tensor) or hasattr(b, "placements"):
            raise TypeError(f"{what}: buffers[{i}] must be a plain MindSpore Tensor (the whole sequence), got "
                            f"{type(b).__name__}")
        if isinstance(d, bool) or not isinstance(d, int) or not -b.ndim <= d < b.ndim:
            raise ValueError(f"{what}: sequence dim {d!r} of buffers[{i}] is out of range for its shape {b.shape}")
        dims.append(d % b.ndim)
    return buffers, dims


def _shard(x: Tensor, dim: int, n: int, rank: int, load_balance: bool) -> Tensor:
    """This rank's shard of ``x`` along ``dim`` (its chunks concatenated), a tensor of its own."""
    chunk = x.shape[dim] // (2 * n if load_balance else n)
    parts = [narrow(x, dim, c * chunk, chunk) for c in rank_chunks(n, load_balance)[rank]]
    return owned_copy(parts[0] if len(parts) == 1 else ops.cat(parts, dim))


def _replace(buffer: Tensor, value: Tensor) -> None:
    """Give ``buffer`` (a Tensor or a Parameter) the shape and values of ``value`` (a tensor of its own),
    in place: ``Tensor.set_`` takes its storage (``assign_value`` refuses a tensor that was an input of a
    gradient call, MindSpore 2.10)."""
    if isinstance(buffer, Parameter):
        buffer.set_data(value)
    elif hasattr(buffer, "set_"):
        buffer.set_(value)
    else:
        buffer.assign_value(value)


@contextlib.contextmanager
def context_parallel(mesh: DeviceMesh, *, buffers: Optional[Sequence[Tensor]] = None,
                     buffer_seq_dims: Optional[Sequence[int]] = None, no_restore_buffers=None,
                     method: str = "ring", ulysses_degree: Optional[int] = None,
                     load_balance: bool = True) -> Iterator[None]:
    """Context parallelism over the 1-D cp ``mesh`` (PyTorch's
    ``torch.distributed.tensor.experimental.context_parallel``): each buffer is cut in place into this
    rank's shard along its sequence dim, and inside the block
    :func:`hyper_parallel_ms.nn.functional.scaled_dot_product_attention` computes attention of this
    rank's query shard on the keys of every rank (plain tensors in, this rank's output shard out, the
    same numbers and gradients as one device). On leaving, the buffers get their whole values back,
    except those in ``no_restore_buffers``.

    Load balancing (default, as PyTorch's): the sequence is cut into ``2 * cp`` chunks and rank ``r``
    holds chunks ``r`` and ``2 * cp - 1 - r``, so that causal attention costs every rank the same;
    :func:`context_parallel_unshard` puts the chunks back in order. Every layer but attention works on
    its shard unchanged; positions (rotary embeddings) must be taken at each token's global position
    (shard a position buffer alongside).

    Args:
        mesh: the 1-D cp mesh.
        buffers: tensors holding the whole sequence (inputs, labels, position ids, ...), cut in place.
        buffer_seq_dims: the sequence dim of each buffer.
        no_restore_buffers: buffers left as shards on leaving (compared by identity).
        method: ``"ring"`` (PyTorch's; keys and values moved by :func:`set_rotate_method`'s method),
            ``"ulysses"`` (all-to-all between sequence and head shards; the heads must divide by the
            cp size) or ``"hybrid"`` (Ulysses inside groups of ``ulysses_degree`` consecutive ranks,
            the ring across them). This library's addition.
        ulysses_degree: the Ulysses group size of ``"hybrid"`` (dividing the cp size).
        load_balance: cut the sequence into head and tail chunks (default True) or into contiguous
            shards. This library's addition (PyTorch's ``_cp_options.enable_load_balance``).

    Example::

        with context_parallel(mesh["cp"], buffers=[q, k, v], buffer_seq_dims=[2, 2, 2]):
            out = scaled_dot_product_attention(q, k, v, is_causal=True)
    """
    what = "context_parallel"
    n = _check_mesh(mesh, what)
    u = _ulysses_degree(method, ulysses_degree, n)
    if not isinstance(load_balance, bool):
        raise TypeError(f"{what}: load_balance must be a bool, got {load_balance!r}")
    buffers, dims = _check_buffers(buffers, buffer_seq_dims, what)
    for i, (b, d) in enumerate(zip(buffers, dims)):
        check_sequence_length(b.shape[d], n, load_balance, f"{what}: buffers[{i}] (shape {b.shape}, sequence dim {d})")
    keep = [] if no_restore_buffers is None else list(no_restore_buffers)
    rank = mesh.get_local_rank(0)
    originals = [None if any(b is k for k in keep) else owned_copy(b) for b in buffers]
    for b, d in zip(buffers, dims):
        _replace(b, _shard(b, d, n, rank, load_balance))
    state = ContextParallelState(mesh, method, u, load_balance)
    entered(state)
    try:
        yield
    finally:
        left(state)
        for b, original in zip(buffers, originals):
            if original is not None:
                _replace(b, original)


def context_parallel_unshard(mesh: DeviceMesh, buffers: Sequence[Tensor], seq_dims: Sequence[int], *,
                             load_balance: bool = True) -> List[Tensor]:
    """The whole sequence of each buffer from this rank's shard (all-gathered over ``mesh``, the
    load-balanced chunks put back in order), as PyTorch's ``context_parallel_unshard``.

    Args:
        mesh: the 1-D cp mesh.
        buffers: this rank's shards (e.g. an attention output, a gradient).
        seq_dims: the sequence dim of each.
        load_balance: whether the shards were cut load-balanced (as :func:`context_parallel`'s).

    Returns:
        A list of new tensors, the whole sequence each.

    Example::

        (out,) = context_parallel_unshard(mesh["cp"], [out_shard], [2])
    """
    what = "context_parallel_unshard"
    n = _check_mesh(mesh, what)
    buffers, dims = _check_buffers(buffers, seq_dims, what)
    out = []
    for b, d in zip(buffers, dims):
        full = comm.all_gather(b, mesh, 0, dim=d)
        if load_balance and n > 1:
            chunk = b.shape[d] // 2
            slots = [c for held in rank_chunks(n, True) for c in held]      # the chunk at each gathered slot
            full = ops.cat([narrow(full, d, slots.index(c) * chunk, chunk) for c in range(2 * n)], d)
        out.append(full)
    return out
