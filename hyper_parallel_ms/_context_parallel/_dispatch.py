"""What ``scaled_dot_product_attention`` computes inside :func:`~hyper_parallel_ms.nn.context_parallel`:
the active context (a stack entered by the context manager), the checked description of one call
(:class:`AttentionSpec`), and the Cell computing it (:class:`ContextParallelAttention`).

Methods over a cp mesh of ``n`` ranks (rank ``c`` holding sequence shard ``c``, see :mod:`._balance`):

- ``"ring"``: the engine (:mod:`._engine`) over the cp mesh, keys and values moved by the rotate
  method (:func:`set_rotate_method`).
- ``"ulysses"`` (DeepSpeed-Ulysses): an all-to-all turns sequence shards into head shards (each rank
  then holds the whole sequence for ``heads / n`` heads), attention runs locally, and an all-to-all
  turns the output back; the heads must divide by ``n``.
- ``"hybrid"``: Ulysses inside groups of ``ulysses_degree`` consecutive ranks, the ring across the
  groups (rank ``c`` is in Ulysses group ``c // u`` and ring ``c % u``).

Grouped-query attention moves the key heads only (fewer bytes); where the Ulysses degree does not
divide the key heads, the keys and values are repeated to the query heads first.

Example::

    spec = attention_spec(state_id, q.shape, k.shape, v.shape, q.dtype, None, None, 0.0, True, None, False)
    out = context_parallel_attention(spec)(q, k, v, None)
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache
from typing import Any, List, Optional, Tuple

import numpy as np
from mindspore import nn, ops
from mindspore.common import dtype as mstype

from .. import comm
from .._mindspore import cell_per_call_site, constant_id, constant_of, run_in_python
from ..mesh import DeviceMesh, mesh_world
from ._balance import check_sequence_length, shard_positions
from ._blocks import expand_heads
from ._engine import ROTATE_METHODS, RingSpec, no_bias, ring_attention

__all__ = ["ContextParallelState", "AttentionSpec", "ContextParallelAttention", "METHODS", "entered", "left",
           "active_context", "attention_spec", "context_parallel_attention", "set_rotate_method", "rotate_method",
           "hybrid_mesh"]

METHODS = ("ring", "ulysses", "hybrid")


@dataclass(frozen=True)
class ContextParallelState:
    """One entered :func:`~hyper_parallel_ms.nn.context_parallel`: the 1-D cp mesh, the method, the
    Ulysses degree (1: ring only; the mesh size: Ulysses only) and the sequence order."""

    mesh: DeviceMesh
    method: str
    ulysses_degree: int
    load_balance: bool


_ACTIVE: List[ContextParallelState] = []     # the entered contexts, innermost last


class _Options:
    """PyTorch's ``_cp_options``: the ring's rotate method (changed by :func:`set_rotate_method`)."""

    rotate_method = "allgather"


def set_rotate_method(rotate_method: str) -> None:
    """How the ring moves keys and values between the cp ranks, for the calls made after it (PyTorch's
    ``torch.distributed.tensor.experimental._attention.set_rotate_method``).

    ``"allgather"`` (the default): one all-gather of the keys and values, gathered again in the
    backward (which keeps only the local shard) and the gradients reduce-scattered. ``"alltoall"``:
    the keys and values pass from rank to rank with point-to-point send / recv, one shard per
    step, and their gradients travel back with them; inside ``ms.jit`` (no point-to-point kernel in
    graphs) it runs as ``"allgather"``.

    Args:
        rotate_method: ``"allgather"`` or ``"alltoall"``.

    Example::

        set_rotate_method("alltoall")
        with context_parallel(mesh["cp"], buffers=[q, k, v], buffer_seq_dims=[2, 2, 2]):
            out = scaled_dot_product_attention(q, k, v, is_causal=True)
    """
    if rotate_method not in ROTATE_METHODS:
        raise NotImplementedError(f"set_rotate_method: rotate_method must be one of {ROTATE_METHODS}, "
                                  f"got {rotate_method!r}")
    _Options.rotate_method = rotate_method


def rotate_method() -> str:
    """The rotate method :func:`set_rotate_method` set (``"allgather"`` until then).

    >>> rotate_method() in ("allgather", "alltoall")
    True
    """
    return _Options.rotate_method


def entered(state: ContextParallelState) -> None:
    """Make ``state`` the active context (the context manager's entry)."""
    _ACTIVE.append(state)


def left(state: ContextParallelState) -> None:
    """Leave ``state`` (the context manager's exit)."""
    _ACTIVE.remove(state)


@run_in_python
def active_context() -> int:
    """The :func:`~hyper_parallel_ms._mindspore.constant_id` of the innermost entered context, ``-1``
    when none (a constant in compiled code: the graph keeps the context it was compiled in).

    >>> active_context()
    -1
    """
    return constant_id(_ACTIVE[-1]) if _ACTIVE else -1


@lru_cache(maxsize=None)
def hybrid_mesh(mesh: DeviceMesh, ulysses_degree: int) -> DeviceMesh:
    """The cp mesh's ranks as a 2-D mesh ``("ring", "ulysses")``: groups of ``ulysses_degree``
    consecutive ranks along ``"ulysses"``, the groups along ``"ring"``."""
    n = mesh.size()
    return DeviceMesh(mesh.device_type, np.asarray(mesh.mesh).reshape(n // ulysses_degree, ulysses_degree),
                      mesh_dim_names=("ring", "ulysses"), _world=mesh_world(mesh))


@dataclass(frozen=True)
class AttentionSpec:
    """One checked attention call inside a context: the ring's :class:`~._engine.RingSpec`, the
    Ulysses all-to-all's mesh and dim (``None``: no all-to-all), the key heads repeated before it,
    and the key-padding mask's form."""

    ring: RingSpec
    a2a_mesh: Any
    a2a_dim: Any
    ulysses_degree: int
    ulysses_index: int
    repeat_kv: int
    mask_ndim: int          # 0: no mask
    mask_bool: bool
    mask_heads: int         # the mask's head dim (1, or the query heads before the all-to-all)


def _check(cond: bool, message: str) -> None:
    if not cond:
        raise ValueError(f"scaled_dot_product_attention inside context_parallel: {message}")


def _positions(length: int, state: ContextParallelState, causal: bool) -> Tuple[Tuple[int, ...], ...]:
    """The global positions of each cp rank's ``length`` tokens (any order when not causal)."""
    n = state.mesh.size()
    if not causal:
        return tuple(tuple(range(c * length, (c + 1) * length)) for c in range(n))
    return tuple(tuple(int(p) for p in shard_positions(length * n, n, c, state.load_balance)) for c in range(n))


@run_in_python
def attention_spec(state_id: int, q_shape, k_shape, v_shape, dtype, mask_shape, mask_dtype, dropout_p: float,
                   is_causal: bool, scale: Optional[float], enable_gqa: bool) -> int:
    """Check one call and return the :func:`~hyper_parallel_ms._mindspore.constant_id` of its
    :class:`AttentionSpec` (run in Python, also while MindSpore compiles)."""
    state: ContextParallelState = constant_of(state_id)
    _check(len(q_shape) == 4 and len(k_shape) == 4 and len(v_shape) == 4,
           f"query, key and value must be [batch, heads, seq, head_dim] shards, got {q_shape}, {k_shape}, {v_shape}")
    _check(dropout_p == 0.0, f"dropout_p={dropout_p}: each rank would draw its own mask for its blocks, not one "
                             "device's; use dropout_p=0.0")
    _check(k_shape[:3] == v_shape[:3], f"key {k_shape} and value {v_shape} must agree but for head_dim")
    _check(q_shape[0] == k_shape[0] and q_shape[3] == k_shape[3],
           f"query {q_shape} and key {k_shape} must have the same batch and head_dim")
    heads, kv_heads = q_shape[1], k_shape[1]
    if heads != kv_heads:
        _check(enable_gqa, f"query has {heads} heads and key {kv_heads}: pass enable_gqa=True for grouped-query "
                           "attention")
        _check(heads % kv_heads == 0, f"the {heads} query heads must divide by the {kv_heads} key heads")
    if is_causal:
        _check(q_shape[2] == k_shape[2], f"is_causal=True needs query and key shards of one length, got "
                                         f"{q_shape[2]} and {k_shape[2]}")
        check_sequence_length(q_shape[2] * state.mesh.size(), state.mesh.size(), state.load_balance,
                              "the attended sequence")
    mask_ndim, mask_heads = 0, 1
    if mask_shape is not None:
        _check(mask_dtype == mstype.bool_ or mask_dtype in (mstype.float16, mstype.float32, mstype.bfloat16),
               f"attn_mask must be bool (True: attend) or float (added), got {mask_dtype}")
        _check(not is_causal, "give attn_mask or is_causal=True, not both (as PyTorch)")
        full = (1,) * (4 - len(mask_shape)) + tuple(mask_shape)
        _check(len(mask_shape) <= 4 and full[2] == 1 and full[3] == k_shape[2] and full[0] in (1, q_shape[0])
               and full[1] in (1, heads),
               f"attn_mask {tuple(mask_shape)} must be a key-padding mask [batch | 1, heads | 1, 1, {k_shape[2]}] "
               "sharded like the keys (pass it in context_parallel's buffers with its last dim as sequence dim); "
               "a mask over query and key positions cannot follow the sequence shards: use is_causal=True")
        mask_ndim, mask_heads = len(mask_shape), full[1]
    n = state.mesh.size()
    u, c = state.ulysses_degree, state.mesh.get_local_rank(0)
    groups, repeat = heads // kv_heads, 1
    if u > 1:
        if heads % u:
            raise ValueError(f"scaled_dot_product_attention inside context_parallel(method={state.method!r}): the "
                             f"{heads} query heads do not divide by the Ulysses degree {u}; use a Ulysses degree "
                             f"dividing {heads} (ulysses_degree=, or method='ring')")
        if kv_heads % u:
            repeat, groups = groups, 1          # too few key heads to cut: every query head gets its own
        if u == n:      # a ring of one member (its mesh only tells whether this rank is simulated)
            a2a_mesh, a2a_dim, ring_mesh, ring_dim = state.mesh, 0, state.mesh, 0
        else:
            mesh2 = hybrid_mesh(state.mesh, u)
            a2a_mesh, a2a_dim, ring_mesh, ring_dim = mesh2, 1, mesh2, 0
    else:
        a2a_mesh, a2a_dim, ring_mesh, ring_dim = None, 0, state.mesh, 0
    q_pos, kv_pos = _positions(q_shape[2], state, is_causal), _positions(k_shape[2], state, is_causal)
    size = n // u
    ring = RingSpec(ring_mesh, ring_dim, size, c // u, _Options.rotate_method,
                    sum((q_pos[(c // u) * u + b] for b in range(u)), ()),
                    tuple(sum((kv_pos[g * u + b] for b in range(u)), ()) for g in range(size)),
                    bool(is_causal), float(1.0 / math.sqrt(q_shape[3]) if scale is None else scale), groups,
                    mask_shape is not None)
    return constant_id(AttentionSpec(ring, a2a_mesh, a2a_dim, u, c % u, repeat, mask_ndim,
                                     mask_dtype == mstype.bool_, mask_heads))


class ContextParallelAttention(nn.Cell):
    """One attention call on sequence shards (see the module docstring): the Ulysses all-to-alls
    around the ring engine, the key-padding mask turned into the bias travelling with the keys.

    Args:
        spec: the :class:`AttentionSpec`.
    """

    def __init__(self, spec: AttentionSpec) -> None:
        super().__init__()
        self.ring = ring_attention(spec.ring)
        self.mesh, self.dim, self.u = spec.a2a_mesh, spec.a2a_dim, spec.ulysses_degree
        self.repeat, self.mask_ndim, self.mask_bool = spec.repeat_kv, spec.mask_ndim, spec.mask_bool
        self.mask_heads, self.u_index = spec.mask_heads, spec.ulysses_index

    def _seq_to_heads(self, x):
        return comm.all_to_all(x, self.mesh, self.dim, split_dim=1, concat_dim=2)

    def _bias(self, mask):
        """The additive float32 key-padding bias ``[B | 1, H | 1, 1, S]`` of ``mask`` (no gradient)."""
        mask = ops.stop_gradient(mask)
        if self.mask_ndim < 4:
            mask = mask.reshape((1,) * (4 - self.mask_ndim) + mask.shape)
        if self.mask_bool:
            return ops.masked_fill(ops.zeros(mask.shape, mstype.float32), ops.logical_not(mask), float("-inf"))
        return mask.astype(mstype.float32)

    def construct(self, q, k, v, mask):
        if self.repeat > 1:
            k, v = expand_heads(k, self.repeat), expand_heads(v, self.repeat)
        bias = no_bias() if self.mask_ndim == 0 else self._bias(mask)
        if self.u > 1:
            q, k, v = self._seq_to_heads(q), self._seq_to_heads(k), self._seq_to_heads(v)
            if self.mask_ndim > 0:
                bias = comm.all_gather(bias, self.mesh, self.dim, dim=3)
                if self.mask_heads > 1:
                    local = self.mask_heads // self.u
                    bias = ops.narrow(bias, 1, self.u_index * local, local)
        out, _ = self.ring(q, k, v, bias)
        if self.u > 1:
            out = comm.all_to_all(out, self.mesh, self.dim, split_dim=2, concat_dim=1)
        return out


@cell_per_call_site
def context_parallel_attention(spec: int) -> ContextParallelAttention:
    """The :class:`ContextParallelAttention` of the spec numbered ``spec`` (:func:`attention_spec`).

    Example::

        out = context_parallel_attention(spec)(q, k, v, None)
    """
    return ContextParallelAttention(constant_of(spec))
