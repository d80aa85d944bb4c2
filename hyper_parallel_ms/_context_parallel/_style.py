"""HyperParallel's face of context parallelism: ``ContextParallel`` and ``AsyncContextParallel``, styles
applied to an attention Cell (MindFormers' core attention) whose forward takes this rank's sequence
shards of q, k and v (positions ``qkv_indices``, or keywords ``qkv_kwarg_names``) and computes
attention on them. Hooks make that forward context-parallel, by the Ulysses degree ``u`` of a cp mesh
of ``n`` ranks (HyperParallel's three modes, MindFormers' methods):

- ``u == 1`` (MindFormers' ``"colossal"``): q becomes a DTensor sharded on ``seq_dim``, k and v
  DTensors all-gathered (Replicate); the Cell computes on DTensors (each op by its sharding rule:
  the causal mask follows the query shard's offset), and its output comes back as the local shard.
- ``u == n`` (``"ulysses"``, the default ``None``): an all-to-all turns q, k and v into the whole
  sequence for ``heads / n`` heads, the Cell computes plain attention, and an all-to-all turns its
  output back into sequence shards.
- ``1 < u < n`` (``"hybrid"``): Ulysses inside groups of ``u`` consecutive ranks, then the colossal
  conversion across the groups.

The shards must be contiguous (MindFormers' cut, rank ``r`` holding the ``r``-th piece), and the Cell
must compute with ops that have sharding rules (:func:`~hyper_parallel_ms.nn.functional.scaled_dot_product_attention`,
``ops.flash_attention_score``, matmul, softmax, masks ...). PyNative only (DTensors); compiled
(``ms.jit``), such a Cell raises when MindSpore compiles it.

Example::

    style = ContextParallel(seq_dim=2, head_dim=1, ulysses_degree=1)
    style.apply(model.layers[0].attention.core_attention, mesh["cp"])
"""
from __future__ import annotations

from typing import Any, Dict, Optional, Sequence, Tuple

from mindspore import Tensor, nn

from .. import comm
from .._mindspore import refuse_while_compiling
from ..dtensor import DTensor
from ..mesh import DeviceMesh
from ..nn._parallelize import ParallelStyle
from ..placement import Replicate, Shard
from ._compose import holds_cp, place_cp
from ._dispatch import hybrid_mesh

__all__ = ["ContextParallel", "AsyncContextParallel"]

_COMPILED = ("ContextParallel converts q, k and v to DTensors in PyNative forward hooks; a compiled (ms.jit / "
             "GRAPH_MODE) attention Cell cannot hold them: run the model in PyNative, or use "
             "hyper_parallel_ms.nn.context_parallel with scaled_dot_product_attention, which compiles")


class _Meshes:
    """The meshes one application uses: the Ulysses all-to-all's (mesh, dim) and the colossal
    conversion's (mesh, dim) with the placement of the heads on the other dim of a 2-D mesh."""

    def __init__(self, mesh: DeviceMesh, degree: int) -> None:
        n = mesh.size()
        self.a2a: Optional[Tuple[DeviceMesh, int]] = None
        self.ring: Optional[DeviceMesh] = None
        if degree == n:
            self.a2a = (mesh, 0)
        elif degree == 1:
            self.ring = mesh
        else:
            two = mesh if mesh.ndim == 2 else hybrid_mesh(mesh, degree)
            self.a2a, self.ring = (two, 1), two


class ContextParallel(ParallelStyle):
    """Context parallelism on an attention Cell, HyperParallel's ``ContextParallel`` (see the module
    docstring for the three modes).

    Args:
        seq_dim: the sequence dim of q, k and v (1 for ``[B, S, H]`` / BSND, 2 for BNSD).
        head_dim: the head dim (2 for BSND, 1 for BNSD; for ``[B, S, H]`` the hidden dim, cut by heads).
        ulysses_degree: the Ulysses group size: ``None`` (the cp size: Ulysses only), ``1`` (colossal:
            keys and values all-gathered) or a divisor of the cp size (hybrid).
        qkv_indices: the positions of q, k and v among the Cell's arguments.
        qkv_kwarg_names: their keyword names, where they come as keywords.
        use_local_output: return the output as this rank's local shard (default True); False keeps a
            colossal output as a DTensor.
        load_balance: HyperParallel's head-tail exchange of query halves; not provided (use
            :func:`hyper_parallel_ms.nn.context_parallel`, load-balanced by default).

    Example::

        ContextParallel(seq_dim=1, head_dim=2, ulysses_degree=1).apply(core_attention, mesh["cp"])
    """

    def __init__(self, seq_dim: int = 1, head_dim: int = 2, ulysses_degree: Optional[int] = None,
                 qkv_indices: Sequence[int] = (0, 1, 2), qkv_kwarg_names: Sequence[str] = (),
                 use_local_output: bool = True, load_balance: bool = False) -> None:
        name = type(self).__name__
        for what, value in (("seq_dim", seq_dim), ("head_dim", head_dim)):
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(f"{name}: {what} must be an int, got {value!r}")
        if seq_dim == head_dim:
            raise ValueError(f"{name}: seq_dim and head_dim must differ, got {seq_dim} for both")
        if ulysses_degree is not None and (isinstance(ulysses_degree, bool) or not isinstance(ulysses_degree, int)
                                           or ulysses_degree < 1):
            raise ValueError(f"{name}: ulysses_degree must be None or a positive int, got {ulysses_degree!r}")
        indices, names = tuple(qkv_indices), tuple(qkv_kwarg_names)
        if len(indices) != 3 or any(isinstance(i, bool) or not isinstance(i, int) or i < 0 for i in indices):
            raise ValueError(f"{name}: qkv_indices must be three argument positions, got {qkv_indices!r}")
        if names and (len(names) != 3 or not all(isinstance(n, str) for n in names)):
            raise ValueError(f"{name}: qkv_kwarg_names must be three keyword names, got {qkv_kwarg_names!r}")
        if load_balance:
            raise NotImplementedError(
                f"{name}(load_balance=True): HyperParallel's head-tail exchange of query halves is not provided; "
                "hyper_parallel_ms.nn.context_parallel shards load-balanced by default (causal work equal per rank)")
        self.seq_dim, self.head_dim, self.ulysses_degree = seq_dim, head_dim, ulysses_degree
        self.qkv_indices, self.qkv_kwarg_names = indices, names
        self.use_local_output, self.load_balance = bool(use_local_output), False

    # ------------------------------------------------------------------ applying
    def _degree(self, mesh: DeviceMesh) -> int:
        name = type(self).__name__
        if not isinstance(mesh, DeviceMesh) or mesh.ndim not in (1, 2):
            raise TypeError(f"{name}.apply needs the cp DeviceMesh (1-D, or 2-D (ring, ulysses) for hybrid), got "
                            f"{mesh!r}")
        n = mesh.size()
        degree = n if self.ulysses_degree is None else self.ulysses_degree
        if n % degree:
            raise ValueError(f"{name}: the cp size {n} must divide by ulysses_degree {degree}")
        if mesh.ndim == 2 and mesh.shape[1] != degree:
            raise ValueError(f"{name}: a 2-D cp mesh {mesh.shape} must have the Ulysses degree {degree} as its second "
                             "dim")
        return degree

    def apply(self, module: nn.Cell, device_mesh: DeviceMesh) -> nn.Cell:
        """Register the hooks on ``module`` (the attention Cell) and return it.

        Args:
            module: the attention Cell taking q, k and v.
            device_mesh: the cp mesh (1-D; 2-D ``(ring, ulysses)`` for hybrid).

        Example::

            ContextParallel(ulysses_degree=1).apply(core_attention, mesh["cp"])
        """
        meshes = _Meshes(device_mesh, self._degree(device_mesh))
        self._hook(module, lambda args, kwargs: self._inputs(args, kwargs, meshes, {}), meshes)
        return module

    def _hook(self, module: nn.Cell, inputs, meshes: _Meshes) -> None:
        """Register ``inputs(args, kwargs) -> (args, kwargs)`` before ``module``'s forward and the output
        conversion after it (hooks taking keywords only where q, k and v may come as keywords: MindSpore
        compiles no keyword hook, and a plain one reaches the refusal of a compiled Cell)."""
        if self.qkv_kwarg_names:
            module.register_forward_pre_hook(lambda cell, args, kwargs: inputs(args, kwargs), with_kwargs=True)
            module.register_forward_hook(lambda cell, args, kwargs, out: self._outputs(out, meshes), with_kwargs=True)
            return

        def pre(cell, args):
            refuse_while_compiling(_COMPILED)
            return inputs(args, {})[0]

        def post(cell, args, output):
            return self._outputs(output, meshes)
        module.register_forward_pre_hook(pre)
        module.register_forward_hook(post)

    _apply = apply          # PyTorch's and MindFormers' name of a style's entry point

    # ------------------------------------------------------------------ conversions
    def _ulysses(self, x, meshes: _Meshes, forward: bool = True):
        """Sequence shards -> head shards over the Ulysses dim (``forward``), or back."""
        mesh, dim = meshes.a2a
        if forward and x.shape[self.head_dim] % mesh.size(dim):
            raise ValueError(f"{type(self).__name__}: the {x.shape[self.head_dim]} heads along head_dim "
                             f"{self.head_dim} do not divide by the Ulysses degree {mesh.size(dim)}")
        split, concat = (self.head_dim, self.seq_dim) if forward else (self.seq_dim, self.head_dim)
        return comm.all_to_all(x, mesh, dim, split_dim=split, concat_dim=concat)

    def _placements(self, meshes: _Meshes, seq) -> tuple:
        """The colossal mesh's placements: ``seq`` on the ring dim, the heads on the Ulysses dim (2-D)."""
        return (seq, Shard(self.head_dim)) if meshes.ring.ndim == 2 else (seq,)

    def _convert(self, x, role: int, meshes: _Meshes):
        """One of q (``role`` 0), k or v, this rank's sequence shard, as the Cell computes on it."""
        if isinstance(x, DTensor):
            return self._placed(x, role, meshes)
        if not isinstance(x, Tensor):
            return x
        refuse_while_compiling(_COMPILED)
        if meshes.a2a is not None:
            x = self._ulysses(x, meshes)
        if meshes.ring is None:
            return x
        dt = DTensor.from_local(x, meshes.ring, self._placements(meshes, Shard(self.seq_dim)))
        return dt if role == 0 else dt.redistribute(meshes.ring, self._placements(meshes, Replicate()))

    def _placed(self, x: DTensor, role: int, meshes: _Meshes) -> DTensor:
        """A DTensor q, k or v: colossal on a 1-D cp mesh, placed on the cp dim of its mesh (which must hold
        it); any other case is refused (computing on it as given would treat a sequence piece as whole)."""
        ring = meshes.ring
        if meshes.a2a is None and ring is not None and ring.ndim == 1 and holds_cp(x.device_mesh, ring):
            return place_cp(x, ring, Shard(self.seq_dim) if role == 0 else Replicate())
        raise ValueError(f"{type(self).__name__}: {'qkv'[role]} is a DTensor on {x.device_mesh!r} with placements "
                         f"{tuple(x.placements)}; the hooks take this rank's sequence piece as a Tensor (or, colossal "
                         "on a 1-D cp mesh, a DTensor on a mesh holding the cp dim): pass its local piece (to_local())")

    def _inputs(self, args, kwargs, meshes: _Meshes, ready: Dict[int, Any]):
        """The Cell's arguments with q, k and v converted (``ready``: those converted already, by role)."""
        args, kwargs = list(args), dict(kwargs)
        for role, index in enumerate(self.qkv_indices):
            if index < len(args):
                args[index] = ready[role] if role in ready else self._convert(args[index], role, meshes)
        for role, key in enumerate(self.qkv_kwarg_names):
            if key in kwargs:
                kwargs[key] = ready[role] if role in ready else self._convert(kwargs[key], role, meshes)
        return tuple(args), kwargs

    def _outputs(self, output, meshes: _Meshes):
        def back(out):
            if isinstance(out, DTensor):
                if not self.use_local_output and meshes.a2a is None:
                    return out
                out = out.to_local()
            if isinstance(out, Tensor) and meshes.a2a is not None:
                out = self._ulysses(out, meshes, forward=False)
            return out
        if isinstance(output, (tuple, list)):
            return type(output)(back(o) for o in output)
        return back(output)


class AsyncContextParallel(ContextParallel):
    """HyperParallel's ``AsyncContextParallel``: :class:`ContextParallel` whose collectives start at the
    Cells producing q, k and v (``q_proj``, ``k_proj``, ``v_proj`` given to :meth:`apply`, whose outputs
    must reach the attention Cell unchanged), where an asynchronous backend overlaps them with the
    projections. MindSpore's collectives here complete before they return, so the result is
    :class:`ContextParallel`'s, in the same order of collectives; without the three Cells it is
    :class:`ContextParallel`.

    Args:
        seq_dim: the sequence dim of q, k and v.
        head_dim: the head dim.
        ulysses_degree: the Ulysses group size (``None``: the cp size; ``1``: colossal).
        qkv_indices: the positions of q, k and v among the attention Cell's arguments.
        qkv_kwarg_names: their keyword names.
        use_local_output: return a colossal output as this rank's local shard; default False (as
            HyperParallel's: the DTensor is kept; Ulysses and hybrid outputs are local shards either way).
        load_balance: not provided (as :class:`ContextParallel`).

    Example::

        AsyncContextParallel(seq_dim=2, head_dim=1).apply(core, mesh["cp"], q_proj=qh, k_proj=kh, v_proj=vh)
    """

    def __init__(self, seq_dim: int = 1, head_dim: int = 2, ulysses_degree: Optional[int] = None,
                 qkv_indices: Sequence[int] = (0, 1, 2), qkv_kwarg_names: Sequence[str] = (),
                 use_local_output: bool = False, load_balance: bool = False) -> None:
        super().__init__(seq_dim, head_dim, ulysses_degree, qkv_indices, qkv_kwarg_names, use_local_output,
                         load_balance)

    def apply(self, module: nn.Cell, device_mesh: DeviceMesh, q_proj: Optional[nn.Cell] = None,
              k_proj: Optional[nn.Cell] = None, v_proj: Optional[nn.Cell] = None) -> nn.Cell:
        """Register the hooks (on the three producing Cells too, when given) and return ``module``.

        Args:
            module: the attention Cell.
            device_mesh: the cp mesh.
            q_proj: the Cell whose output is the attention's q (and ``k_proj``, ``v_proj`` for k, v).
            k_proj: see ``q_proj``.
            v_proj: see ``q_proj``.

        Example::

            AsyncContextParallel().apply(core, mesh["cp"], q_proj=qh, k_proj=kh, v_proj=vh)
        """
        producers = (q_proj, k_proj, v_proj)
        if any(p is None for p in producers):
            return super().apply(module, device_mesh)
        meshes = _Meshes(device_mesh, self._degree(device_mesh))
        started: Dict[int, Any] = {}        # role -> (what the producer returned, its conversion)

        def producer_hook(role):
            def hook(cell, args, output):
                started[role] = (output, self._convert(output, role, meshes))
                return output
            return hook
        for role, producer in enumerate(producers):
            producer.register_forward_hook(producer_hook(role))

        def pre(args, kwargs):
            given = [args[i] if i < len(args) else None for i in self.qkv_indices]
            given = [kwargs.get(k, g) for k, g in zip(self.qkv_kwarg_names, given)] if self.qkv_kwarg_names else given
            ready = {}
            for role, x in enumerate(given):
                made = started.pop(role, None)
                if made is not None and made[0] is not x:
                    raise ValueError(f"AsyncContextParallel: the attention's {'qkv'[role]} is not what its producer "
                                     "Cell returned (an op runs between them); pass the Cell whose output reaches "
                                     "the attention unchanged, or apply ContextParallel")
                if made is not None:
                    ready[role] = made[1]
            return self._inputs(args, kwargs, meshes, ready)
        self._hook(module, pre, meshes)
        return module

    _apply = apply
