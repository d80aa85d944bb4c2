"""DTensor: a MindSpore Tensor holding this rank's piece of a global tensor.

The object *is* the local tensor (it shares storage with it, so MindSpore's autodiff and
optimizers see the local data) and carries a :class:`DTensorSpec`: the mesh, the
placements and the global shape. ``shape``, ``size()`` and ``numel()`` are global;
``local_shape`` and :meth:`to_local` give the piece. Operators applied to a DTensor act on
the global tensor: MindSpore calls the DTensor's tensor hook, which runs
:mod:`hyper_parallel_ms.ops`' sharding propagation (imported on the first op). DTensors are
PyNative objects: ``ms.jit`` functions and GRAPH_MODE Cells refuse them as arguments (pass
``to_local()`` pieces).

Gradients follow PyTorch: the gradient of a tensor laid out as L is laid out as L with
Partial placements read as Replicate. ``redistribute``'s backward moves the gradient
from the target layout to the source layout (Partial as Replicate); ``to_local`` takes
the gradient of the local tensor as laid out by ``grad_placements`` (default: the
DTensor's own placements, so the gradient of a Partial DTensor's local tensor is summed
over the Partial mesh dims).

Example::

    dt = DTensor.from_local(local, mesh, [Shard(0), Replicate()])
    dt.shape, dt.local_shape                     # (8, 4), (4, 4) on a (2, 2) mesh
    full = dt.redistribute(mesh, [Replicate(), Replicate()]).to_local()
"""
from __future__ import annotations

from math import prod
from typing import Optional, Sequence, Tuple

import mindspore as ms
import numpy as np
from mindspore import Tensor

from .. import _mindspore as _ms_seam
from ..placement import Placement, Replicate
from ..redistribute import gradient_layout, redistribution, replicate_partials
from ._layout_view import tensor_layout
from ._optimizer import elementwise_step_on_pieces
from ._run_check import check_local_shapes, check_replicas_equal
from ._sharding_record import ParameterSharding, attach_record
from ._spec import DTensorSpec, to_layout

__all__ = ["DTensor"]

# on a DTensor: the grad_placements ``to_local()`` uses when given none (fully_shard's HyperParallel
# convention sets it on the parameters it puts back for the forward; see fsdp/_dparams.as_placed)
LOCAL_GRAD_PLACEMENTS = "_hpms_local_grad_placements"


_local_view = _ms_seam.plain_view   # a plain Tensor sharing storage (and the autodiff node) with ``t``


def _local_tensor(t: "DTensor") -> Tensor:
    """``t``'s piece as a plain Tensor that autodiff links to ``t``: a view (:func:`_local_view`),
    or for a ``Parameter(DTensor)`` a view made by an op on the Parameter itself (autodiff tracks a
    weight by its Parameter: a plain view of one got no gradient, so ``nn.LayerNorm``'s
    ``gamma.astype(x.dtype)`` left gamma untrained)."""
    if not isinstance(t, ms.Parameter):
        return _local_view(t)
    with _ms_seam.no_hook():
        return t.reshape(t.shape)


def _dispatch(func, args: tuple, kwargs: dict):
    """Sharding propagation for one op (the ops package, imported on the first op so that importing
    DTensor loads no op rules; it does not import this module: it reads DTensors through
    ``spec_of`` and makes them with the static ``_adopt``)."""
    from ..ops._dispatch import dispatch
    return dispatch(func, args, kwargs)


def _reflected(name: str):
    """``other <op> dtensor``: Python tries the subclass's reflected method first, so that
    ``plain + dtensor`` reaches the dispatcher too."""
    def method(self, other):
        return getattr(ms.ops, name)(other, self)
    method.__name__ = f"__r{name}__"
    return _ms_seam.keep_hook_errors(method)


@_ms_seam.keeps_hook_errors
def _refuse_empty_piece(spec: DTensorSpec) -> None:
    """``Parameter(dtensor)`` where some rank's piece is empty raises on every rank (decided from
    the layout and global shape): MindSpore's optimizers cannot hold an empty Parameter, so that
    rank alone failed when an optimizer was built ("For 'initializer' ... shape must be positive")
    while the others went on to their next collective."""
    empty = spec.layout.empty_piece(spec.shape)
    if empty is not None:
        raise ValueError(
            f"Parameter(DTensor) of global shape {tuple(spec.shape)} placed {tuple(spec.layout.placements)} on the "
            f"mesh {tuple(spec.layout.mesh_shape)} leaves a rank the empty piece {empty} (torch.chunk pieces), which "
            "MindSpore's optimizers cannot hold (that rank alone would fail). Use a size that gives every rank at "
            "least one slice (a multiple of the mesh size), a smaller mesh, or another placement")


class DTensor(Tensor):
    """A distributed tensor: the local piece of a global tensor, with its mesh and placements.

    Build one with :meth:`from_local`, :func:`distribute_tensor` or a factory
    (``zeros``, ``ones``, ``full``, ``empty``, ``rand``, ``randn``).

    Args:
        local: this rank's piece (a plain Tensor; storage is shared, not copied).
        spec: its :class:`DTensorSpec` (mesh, layout, global shape); ``None`` only when
            MindSpore re-creates a DTensor (``Parameter(dtensor)``).

    Example::

        dt = DTensor.from_local(ms.ops.ones((2, 3)), mesh, [Shard(0)])   # 2 ranks: global (4, 3)
    """

    def __new__(cls, local: Tensor, spec: Optional[DTensorSpec] = None):
        if spec is None:  # Parameter(dtensor) re-creates the object: optimizers update it in place,
            spec = local._dt_spec  # which needs storage of its own (a view would not be updated)
            _refuse_empty_piece(spec)
            local = _local_view(local)
            # a meta piece (a model built under DeviceCtx("meta")) has no storage to copy
            local = _ms_seam.meta_empty(local.shape, local.dtype) if _ms_seam.is_meta(local) else local.copy()
        _ms_seam.guard_mindspore_for(DTensor, elementwise_step_on_pieces)
        obj = _ms_seam.as_subclass(cls, local)
        obj._dt_spec = spec
        return obj

    @staticmethod
    def _adopt(result: Tensor, spec: DTensorSpec) -> "DTensor":
        """Turn a fresh op result into a DTensor in place (no copy and, unlike building a new
        object, no wait for the op to finish). A static method: ``dtensor._adopt`` on any DTensor
        (a ``Parameter(DTensor)`` too) makes a DTensor, so the ops dispatcher needs no import of
        this class."""
        result = _ms_seam.adopt(result, DTensor)
        result._dt_spec = spec
        return result

    # ------------------------------------------------------------ op hooks
    __fallback__ = _ms_seam.tensor_hook(_dispatch)

    def __getitem__(self, index):
        """Indexing (MindSpore's indexing does not always reach the tensor hook)."""
        from ..ops._rules.indexing import GetItem, index_key
        return _dispatch(GetItem, (self, index_key(index, len(self._dt_spec.shape))), {})

    def __setitem__(self, index, value) -> None:
        """``self[index] = value`` on the global tensor (PyTorch's meaning; a piece's own indexing
        would write the wrong rows): the whole tensor is gathered, updated and cut again into this
        rank's piece (a Partial keeps PyTorch's partition of it). Every rank must call it.

        Example::

            dt[0] = 5.0          # global row 0, wherever it lives
        """
        spec = self._dt_spec

        def whole(x):
            return x.full_tensor() if isinstance(x, DTensor) else x
        index = tuple(whole(i) for i in index) if isinstance(index, tuple) else whole(index)
        value = whole(value)
        full = self.full_tensor().copy()
        full[index] = value
        piece = spec.piece_of(full)
        with _ms_seam.no_hook():
            self.copy_(piece)

    __radd__ = _reflected("add")
    __rsub__ = _reflected("sub")
    __rmul__ = _reflected("mul")
    __rtruediv__ = _reflected("div")
    __rmatmul__ = _reflected("matmul")

    # ------------------------------------------------------------- creation
    @staticmethod
    def from_local(local_tensor: Tensor, device_mesh=None, placements: Optional[Sequence] = None, *,
                   run_check: bool = False, shape: Optional[Sequence[int]] = None,
                   stride: Optional[Sequence[int]] = None) -> "DTensor":
        """Wrap this rank's piece ``local_tensor``. Without ``shape``, every sharded dim is assumed
        even (global = local x shards, as in PyTorch); give ``shape`` for uneven pieces
        (``stride``, PyTorch's companion of ``shape``, must be the contiguous strides of ``shape``).
        ``run_check`` all-gathers the local shapes and dtypes and checks them against the layout,
        and checks that the pieces of every Replicate mesh dim are equal (PyTorch broadcasts
        them instead); every rank raises the same error. ``device_mesh`` defaults to the current
        mesh (``with mesh:``), ``placements`` to Replicate.

        Example::

            dt = DTensor.from_local(piece, mesh, [Shard(0)], shape=(5, 3))   # 5 rows on 4 ranks
        """
        if not isinstance(local_tensor, Tensor) or isinstance(local_tensor, DTensor):
            raise TypeError(f"from_local needs a plain mindspore Tensor, got {type(local_tensor).__name__}")
        device_mesh, placements = mesh_and_placements(device_mesh, placements, "from_local")
        if stride is not None:
            if shape is None:
                raise ValueError("from_local: stride needs shape (the global shape it describes)")
            if list(stride) != _contiguous_strides(tuple(shape)):
                raise ValueError(f"from_local: stride {tuple(stride)} is not the contiguous stride "
                                 f"{tuple(_contiguous_strides(tuple(shape)))} of shape {tuple(shape)}; DTensors here "
                                 "are contiguous")
        coord = device_mesh.coordinate
        layout = to_layout(device_mesh, placements, local_tensor.ndim)
        local_shape = tuple(local_tensor.shape)
        if shape is None:
            shape = layout.even_global_shape(local_shape)
        else:
            shape = tuple(shape)
            if len(shape) != local_tensor.ndim:
                raise ValueError(f"shape {shape} has {len(shape)} dims but the local tensor has {local_tensor.ndim}")
            expected = layout.local_shape(shape, coord)
            if expected != local_shape and not run_check:      # run_check: every rank raises below
                raise ValueError(f"local tensor of shape {local_shape} does not fit global shape {shape} with "
                                 f"placements {layout}: rank at mesh coordinate {coord} should hold {expected}")
        spec = DTensorSpec(device_mesh, layout, shape)
        if run_check:
            check_local_shapes(spec, local_shape, local_tensor.dtype)
            check_replicas_equal(spec, local_tensor)
        return DTensor(local_tensor, spec)

    # ----------------------------------------------------------- properties
    @property
    def shape(self) -> Tuple[int, ...]:
        """The global shape (the local one while an op computes on the piece, inside ``no_hook``:
        MindSpore ops written in Python read it to size their results)."""
        if _ms_seam.hooks_off():
            return tuple(Tensor.shape.fget(self))
        return self._dt_spec.shape

    @property
    def size(self) -> "_Size":
        """PyTorch's ``size()`` / ``size(dim)`` (the global shape) and MindSpore's ``size`` (the number
        of elements) at once: an int that can be called.

        Example::

            dt.size(), dt.size(0), dt.size + 0       # (8, 4), 8, 32
        """
        return _Size(self.shape)

    def numel(self) -> int:
        """Elements of the global tensor."""
        return prod(self.shape)

    nelement = numel

    def stride(self, dim: Optional[int] = None):
        """The strides of the global tensor, contiguous (PyTorch's ``DTensor.stride()``), as a list like
        MindSpore's ``Tensor.stride``; ``dim``: one of them.

        Example::

            dt.stride()        # [6, 1] for a (4, 6) DTensor, whatever its placements
        """
        strides = _contiguous_strides(self.shape)
        return strides if dim is None else strides[dim]

    @property
    def requires_grad(self) -> bool:
        """PyTorch's flag, recorded (``requires_grad_()``, the factories' ``requires_grad=``): MindSpore's
        autodiff is functional (``ms.grad`` differentiates what it is asked to), so it changes nothing else.
        A ``Parameter(DTensor)`` answers with the Parameter's own flag."""
        if isinstance(self, ms.Parameter):
            return ms.Parameter.requires_grad.fget(self)
        return self.__dict__.get("_hpms_requires_grad", False)

    @requires_grad.setter
    def requires_grad(self, value: bool) -> None:
        if isinstance(self, ms.Parameter):
            ms.Parameter.requires_grad.fset(self, value)
        else:
            self.__dict__["_hpms_requires_grad"] = bool(value)

    def requires_grad_(self, requires_grad: bool = True) -> "DTensor":
        """Set :attr:`requires_grad`; returns this DTensor (PyTorch's in-place form)."""
        self.requires_grad = requires_grad
        return self

    def __reduce__(self):
        """Pickled as its local piece (a numpy array) and its spec: loaded in a process of the same
        job (the mesh's groups exist there), it is the same DTensor."""
        return (_unpickled, (_local_view(self).asnumpy(), str(self.dtype), self._dt_spec))

    @property
    def local_shape(self) -> Tuple[int, ...]:
        return tuple(Tensor.shape.fget(self))

    @property
    def placements(self) -> Tuple[Placement, ...]:
        return self._dt_spec.placements

    @property
    def device_mesh(self):
        return self._dt_spec.mesh

    @property
    def layout(self):
        """The :class:`~hyper_parallel_ms.layout.Layout` (placements, shard order), bound to the
        mesh and global shape for HyperParallel's queries (``rank_list``, ``get_split_id``, ...)."""
        spec = self._dt_spec
        return tensor_layout(spec.layout, spec.mesh, spec.shape)

    @property
    def spec(self) -> DTensorSpec:
        return self._dt_spec

    def clone(self, *args, **kwargs):
        """A copy: a DTensor of the same layout holding a copy of this rank's piece (PyTorch's; the
        gradient passes through). For a ``Parameter(DTensor)``, ``Parameter.clone(init)``'s new
        Parameter holding this rank's piece, with the DTensor's layout recorded on it (an optimizer's
        states are laid out like their parameters).

        Example::

            copy = dt.clone()                             # copy.placements == dt.placements
            state = model.fc1.weight.clone("zeros")      # parameter_spec(state) == model.fc1.weight.spec
        """
        if not isinstance(self, ms.Parameter):
            if args or kwargs:
                raise TypeError(f"DTensor.clone() takes no arguments, got {args} {kwargs}")
            return DTensor._adopt(ms.ops.deepcopy(self.to_local()), self._dt_spec)
        out = super().clone(*args, **kwargs)
        if isinstance(out, ms.Parameter) and not isinstance(out, DTensor):
            attach_record(out, ParameterSharding(self._dt_spec))
        return out

    # ---------------------------------------------------------- conversions
    def to_local(self, *, grad_placements: Optional[Sequence] = None) -> Tensor:
        """This rank's piece as a plain Tensor (no copy). Its gradient is read as laid out
        by ``grad_placements`` (default: this DTensor's placements).

        Example::

            local = partial_dt.to_local(grad_placements=[Replicate()])   # no all-reduce in backward
        """
        spec = self._dt_spec
        if grad_placements is None:         # a placed parameter may say how its local gradient arrives
            grad_placements = self.__dict__.get(LOCAL_GRAD_PLACEMENTS)
        grad_layout = spec.layout if grad_placements is None else to_layout(spec.mesh, grad_placements, self.ndim)
        if grad_layout == gradient_layout(spec.layout):
            return _local_tensor(self)
        cell = redistribution(spec.mesh, spec.layout, spec.layout, spec.shape, grad_src=grad_layout)
        return _local_view(cell(_local_tensor(self)))

    def redistribute(self, device_mesh=None, placements: Optional[Sequence] = None, *, async_op: bool = False,
                     forward_dtype=None, backward_dtype=None) -> "DTensor":
        """The same global tensor with new placements, moved with the fewest bytes. PyTorch's
        keywords: ``async_op`` is accepted (collectives here complete before the call returns);
        ``forward_dtype`` casts before moving (the result has that dtype); ``backward_dtype``
        is refused unless it is the tensor's dtype (a gradient moved in another dtype is not built).

        Example::

            dt.redistribute(mesh, [Replicate(), Shard(1)])
        """
        if backward_dtype is not None and backward_dtype != self.dtype:
            raise NotImplementedError(f"redistribute(backward_dtype={backward_dtype}) on a {self.dtype} DTensor: "
                                      "moving the gradient in another dtype is not built; cast the DTensor instead")
        if forward_dtype is not None and forward_dtype != self.dtype:
            return self.to(forward_dtype).redistribute(device_mesh, placements)
        spec = self._dt_spec
        if placements is None:
            raise ValueError("redistribute needs placements")
        if device_mesh is not None and device_mesh != spec.mesh:
            if sorted(device_mesh.rank_list) != sorted(spec.mesh.rank_list):
                raise ValueError(f"cannot redistribute from {spec.mesh!r} to {device_mesh!r}: a DTensor moves "
                                 "only onto a mesh over the same ranks")
            # another layout of the same ranks: every rank takes the whole tensor, then its new piece
            # through a redistribution, whose backward gathers the gradient (a plain cut of the
            # whole tensor handed each rank the gradient of its new piece only)
            new = DTensorSpec.build(device_mesh, placements, spec.shape)
            whole = to_layout(device_mesh, [Replicate()] * device_mesh.ndim, self.ndim)
            out = redistribution(device_mesh, whole, new.layout, spec.shape)(self.full_tensor())
            return DTensor(out.copy(), new)     # own storage: a view would alias the whole tensor
        layout = to_layout(spec.mesh, placements, self.ndim)
        if layout == spec.layout:
            return self
        out = redistribution(spec.mesh, spec.layout, layout, spec.shape)(_local_tensor(self))
        return DTensor._adopt(out, spec.with_layout(layout))

    def full_tensor(self, *, grad_placements: Optional[Sequence] = None) -> Tensor:
        """The whole global tensor on every rank, as a plain Tensor."""
        replicated = self.redistribute(placements=[Replicate()] * self._dt_spec.mesh.ndim)
        return replicated.to_local(grad_placements=grad_placements)

    def reduce_partial(self) -> "DTensor":
        """Reduce every Partial mesh dim (Partial -> Replicate); other placements are kept."""
        return self.redistribute(placements=replicate_partials(self._dt_spec.layout).placements)

    def to(self, dtype) -> "DTensor":
        """Cast the local piece; placements are kept, except that a Partial(sum / avg) is reduced
        before a cast to an integer or bool type (the sum of rounded pieces is not the rounded sum)."""
        rounding = not str(dtype).lower().startswith(("float", "bfloat"))
        if rounding and any(p.is_partial("sum") or p.is_partial("avg") for p in self._dt_spec.placements):
            return self.reduce_partial().to(dtype)
        if dtype == self.dtype:
            return self
        return DTensor._adopt(_local_tensor(self).astype(dtype), self._dt_spec)

    def float(self) -> "DTensor":
        """Cast to float32."""
        return self.to(ms.float32)

    def _item(self):
        """The value of a one-element DTensor: what ``item()``, ``float()``, ``int()`` and ``bool()``
        read. Refused where this rank's piece is not the value: a Partial DTensor (its piece is this
        rank's share: ``full_tensor().item()`` on every rank gives the value), or more than one
        element in the global tensor (one device raises too)."""
        spec = self._dt_spec
        if prod(spec.shape) != 1:
            raise ValueError(f"Only one element tensors can be converted to Python scalars: a DTensor of global shape "
                             f"{spec.shape}")
        self._refuse_partial("item() / float() / int() / bool()")
        if prod(self.local_shape) != 1:
            raise ValueError(f"this rank holds an empty piece of the one-element DTensor ({self.placements}): call "
                             f"full_tensor().item() on every rank")
        return super()._item()

    def _tolist(self):
        """``tolist()``: this rank's piece as lists (as ``asnumpy``), refused for a Partial DTensor."""
        self._refuse_partial("tolist()")
        return super()._tolist()

    def _refuse_partial(self, what: str) -> None:
        placements = self._dt_spec.placements
        if any(p.is_partial() for p in placements):
            raise RuntimeError(f"DTensor.{what} of a DTensor placed {tuple(placements)}: this rank holds only its "
                               f"share of the value, not the value; call .full_tensor() (on every rank) or "
                               f".redistribute(placements=[Replicate(), ...]) first")

    def __repr__(self) -> str:
        spec = self._dt_spec
        placements = "(" + ", ".join(str(p) for p in spec.placements) + ")"
        return (f"DTensor(shape={spec.shape}, placements={placements}, local_shape={self.local_shape}, "
                f"dtype={self.dtype}, mesh={spec.mesh.shape})")

    __str__ = __repr__


def mesh_and_placements(device_mesh, placements: Optional[Sequence], what: str):
    """PyTorch's defaults for the mesh and placements of a new DTensor: the current mesh (``with
    mesh:``) and ``Replicate()`` on every mesh dim; a rank outside the mesh is refused (a DTensor has
    no piece there).

    Args:
        device_mesh: the mesh given, or ``None``.
        placements: the placements given, or ``None``.
        what: the caller, named in errors.

    Example::

        mesh, placements = mesh_and_placements(None, None, "zeros")     # inside ``with mesh:``
    """
    from ..mesh import current_mesh
    mesh = device_mesh if device_mesh is not None else current_mesh()
    if mesh is None:
        raise ValueError(f"{what} got no device_mesh and no mesh is current: pass device_mesh=, or call it inside "
                         "`with mesh:`")
    if mesh.coordinate is None:
        raise ValueError(f"{what}: rank {mesh.get_rank()} is not in {mesh!r}; call it on the mesh's ranks only "
                         "(a DTensor has no piece on other ranks here)")
    return mesh, (placements if placements is not None else [Replicate()] * mesh.ndim)


class _Size(int):
    """The number of elements, callable as PyTorch's ``size()``: ``()`` gives the shape, ``(dim)`` one size.

    >>> s = _Size((8, 4))
    >>> int(s), s(), s(-1)
    (32, (8, 4), 4)
    """

    def __new__(cls, shape: Tuple[int, ...]) -> "_Size":
        obj = super().__new__(cls, prod(shape))
        obj.dims = tuple(shape)
        return obj

    def __call__(self, dim: Optional[int] = None):
        return self.dims if dim is None else self.dims[dim]


def _contiguous_strides(shape: Tuple[int, ...]) -> list:
    """The strides of a contiguous tensor of ``shape`` (a list, as MindSpore's ``Tensor.stride``)."""
    strides, step = [], 1
    for size in reversed(shape):
        strides.insert(0, step)
        step *= max(size, 1)
    return strides


def _unpickled(array: np.ndarray, dtype: str, spec: DTensorSpec) -> "DTensor":
    return DTensor(Tensor(array, dtype=getattr(ms, dtype.lower(), None)), spec)
