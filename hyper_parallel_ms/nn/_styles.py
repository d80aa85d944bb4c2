"""Parallel styles, as in ``torch.distributed.tensor.parallel``: how one Cell is split over
a 1-D mesh (its parameters, and the layouts of its inputs and outputs).

A style only *plans*: :meth:`ParallelStyle.plan` validates the Cell and returns a
:class:`~._edit.ModuleEdit` (new parameters, conversions with their gradient layouts, a class
swap) without touching it, so that :func:`parallelize_module` can check a whole plan before
changing anything. Gradient layouts come from :mod:`hyper_parallel_ms.redistribute._gradient`.

Parameters become plain Parameters holding this rank's piece (see :mod:`._parameter`);
the layer computes on local tensors and the hooks move activations between layouts, so the
same model runs in PyNative and in graph mode.

=====================  ==============================  ====================  ===================
style                  parameters                      input (default)       output (default)
=====================  ==============================  ====================  ===================
ColwiseParallel        Dense/Linear weight S(0), bias  Replicate             Shard(-1)
                       S(0); Embedding table S(1)
RowwiseParallel        Dense/Linear weight S(1), bias  Shard(-1) (Embedding  Replicate (from
                       R; Embedding table S(0)         ids: Replicate)       Partial)
SequenceParallel       replicated                      Shard(sequence_dim)   Shard(sequence_dim)
=====================  ==============================  ====================  ===================

Example::

    parallelize_module(mlp, mesh, {"up": ColwiseParallel(), "down": RowwiseParallel()})
"""
from __future__ import annotations

from typing import Dict, List, Optional, Tuple

from mindspore import mint, nn

from ..placement import Partial, Placement, Replicate, Shard
from ..redistribute._gradient import gradient_placements, shared_dims
from ._adapter import own_parameters
from ._dropout import check_dropout_seeded, dropouts_inside, is_dropout, sharded_dropout_class
from ._edit import ConversionSpec, InputSpec, ModuleEdit, OutputSpec
from ._hooks import masked_rows_class, unflattened_dense_class
from ._parameter import ParameterPlacement
from ._parallelize import ParallelStyle
from ._targets import check_mesh

__all__ = ["ParallelStyle", "ColwiseParallel", "RowwiseParallel", "SequenceParallel", "PrepareModuleInput",
           "PrepareModuleOutput", "PrepareModuleInputOutput"]

_LINEAR_TYPES = (nn.Dense, mint.nn.Linear)
_EMBEDDING_TYPES = (nn.Embedding, mint.nn.Embedding)


def _where(path: str) -> str:
    return f"'{path}'" if path else "the root Cell"


def _check_mesh(style: "ParallelStyle", path: str, mesh) -> None:
    check_mesh(mesh, f"{type(style).__name__} on {_where(path)}", ndim=1)


def _one_placement(value, what: str, allowed: Tuple[type, ...], default: Placement) -> Placement:
    if value is None:
        return default
    if isinstance(value, (tuple, list)) and len(value) == 1:
        value = value[0]
    if not isinstance(value, allowed):
        names = " or ".join(t.__name__ for t in allowed)
        raise TypeError(f"{what} must be a {names} placement for a 1-D mesh, got {value!r}")
    return value


def _check_bool(value, what: str) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"{what} must be True or False, got {value!r}")
    return value


def _layer_kind(style: "ParallelStyle", path: str, cell: nn.Cell) -> str:
    if isinstance(cell, _LINEAR_TYPES):
        return "linear"
    if isinstance(cell, _EMBEDDING_TYPES):
        return "embedding"
    raise TypeError(f"{type(style).__name__} supports nn.Dense, mint.nn.Linear, nn.Embedding and mint.nn.Embedding; "
                    f"{_where(path)} is a {type(cell).__name__}")


def _unflattened(cell: nn.Cell) -> Optional[type]:
    """An ``nn.Dense``'s class computing on its input unreshaped in PyNative (see
    :func:`~._hooks.unflattened_dense_class`); other layers, and subclasses of ``nn.Dense`` with a
    ``construct`` of their own, keep theirs."""
    if isinstance(cell, nn.Dense) and type(cell).construct is nn.Dense.construct:
        return unflattened_dense_class(type(cell))
    return None


def _weight_name(cell: nn.Cell) -> str:
    return "embedding_table" if isinstance(cell, nn.Embedding) else "weight"


class _LayerStyle(ParallelStyle):
    """Colwise / Rowwise: one input and one output layout (a Placement each), ``use_local_output``."""

    default_input: Placement = Replicate()
    default_output: Placement = Replicate()

    def __init__(self, *, input_layouts: Optional[Placement] = None, output_layouts: Optional[Placement] = None,
                 use_local_output: bool = True) -> None:
        name = type(self).__name__
        self.input_layouts = (_one_placement(input_layouts, f"{name} input_layouts", (Shard, Replicate),
                                             self.default_input),)
        self.output_layouts = (_one_placement(output_layouts, f"{name} output_layouts", (Shard, Replicate),
                                              self.default_output),)
        self.use_local_output = _check_bool(use_local_output, "use_local_output")


class ColwiseParallel(_LayerStyle):
    """Split a Dense/Linear by output features (an Embedding by embedding dim); features need
    not divide the mesh size (pieces as ``torch.chunk`` cuts them).

    Args:
        input_layouts: the layout the input arrives in (default ``Replicate()``; e.g.
            ``Shard(1)`` for a sequence-sharded input, gathered first).
        output_layouts: the layout the output leaves in (default ``Shard(-1)``, the local
            features; ``Replicate()`` gathers them).
        use_local_output: return the local piece (default True); False returns a DTensor in
            PyNative (graphs always keep local pieces).

    Example::

        parallelize_module(model, mesh["tp"], {"attn.q": ColwiseParallel()})
    """

    default_input, default_output = Replicate(), Shard(-1)
    desired_input_layouts = (Replicate(),)

    def plan(self, path, cell, mesh, src_data_rank=0) -> ModuleEdit:
        _check_mesh(self, path, mesh)
        kind = _layer_kind(self, path, cell)
        edit = ModuleEdit(path, cell)
        params = own_parameters(cell)
        weight = params[_weight_name(cell)]
        if kind == "linear":
            by_rows = (Shard(0),)
            edit.swap_class = _unflattened(cell)
            edit.parameters[_weight_name(cell)] = ParameterPlacement(mesh, by_rows, src_data_rank=src_data_rank)
            if params.get("bias") is not None:
                edit.parameters["bias"] = ParameterPlacement(mesh, by_rows, src_data_rank=src_data_rank)
            # the replicated input meets a split weight: each rank's gradient is its share
            desired = self.desired_input_layouts
            grad = gradient_placements(desired, shared_dims(desired, by_rows))
        else:
            if self.input_layouts[0] != Replicate():
                raise ValueError(f"ColwiseParallel on the embedding {_where(path)} takes replicated ids, got "
                                 f"input_layouts={self.input_layouts[0]}")
            placement = ParameterPlacement(mesh, (Shard(1),), src_data_rank=src_data_rank)
            edit.parameters[_weight_name(cell)] = placement
            if isinstance(cell, nn.Embedding):      # its lookup reshapes to (..., embedding_size)
                edit.attributes["embedding_size"] = placement.piece(weight.shape)[1][1]
            grad = None
        features = ((-1, weight.shape[0] if kind == "linear" else weight.shape[1]),)   # may be split unevenly
        where = _where(path)
        if kind == "linear" or self.input_layouts != self.desired_input_layouts:
            edit.inputs = InputSpec({0: ConversionSpec(mesh, self.input_layouts, self.desired_input_layouts, grad,
                                                       where=where)})
        edit.outputs = OutputSpec({0: ConversionSpec(mesh, (Shard(-1),), self.output_layouts,
                                                     to_dtensor=not self.use_local_output, dim_sizes=features,
                                                     where=where)})
        return edit


class RowwiseParallel(_LayerStyle):
    """Split a Dense/Linear by input features (an Embedding by rows); the output is reduced.
    Features and vocabulary need not divide the mesh size (``torch.chunk`` pieces).

    Args:
        input_layouts: the layout the input arrives in (default ``Shard(-1)``, as a
            ColwiseParallel layer leaves it; ``Replicate()`` for an Embedding's ids or a whole
            input, cut here).
        output_layouts: the layout of the reduced output (default ``Replicate()``, an
            all-reduce; ``Shard(1)`` a reduce-scatter over the sequence).
        use_local_output: return the local piece (default True); False returns a DTensor in
            PyNative.

    Example::

        parallelize_module(model, mesh["tp"], {"attn.out": RowwiseParallel()})
    """

    default_input, default_output = Shard(-1), Replicate()

    def plan(self, path, cell, mesh, src_data_rank=0) -> ModuleEdit:
        _check_mesh(self, path, mesh)
        kind = _layer_kind(self, path, cell)
        edit = ModuleEdit(path, cell)
        params = own_parameters(cell)
        name = _weight_name(cell)
        weight = params[name]
        where = _where(path)
        output = {0: ConversionSpec(mesh, (Partial(),), self.output_layouts, to_dtensor=not self.use_local_output,
                                    where=where)}
        if kind == "linear":
            if getattr(cell, "activation_flag", False):
                raise ValueError(f"RowwiseParallel on {_where(path)}: the Dense applies an activation to a partial "
                                 "sum; move the activation out of the Dense (activation=None)")
            edit.parameters[name] = ParameterPlacement(mesh, (Shard(1),), src_data_rank=src_data_rank)
            edit.swap_class = _unflattened(cell)
            has_bias = params.get("bias") is not None
            bias_sum = None
            if has_bias:
                # added after the reduction: on sharded outputs each rank adds it to its piece only,
                # so its gradient there is this rank's share, summed over the tp ranks in the backward
                replicated = (Replicate(),)
                edit.parameters["bias"] = ParameterPlacement(mesh, replicated, src_data_rank=src_data_rank)
                if shared_dims(replicated, self.output_layouts):
                    bias_sum = mesh
            edit.inputs = InputSpec({0: ConversionSpec(mesh, self.input_layouts, (Shard(-1),),
                                                       dim_sizes=((-1, weight.shape[1]),), where=where)})
            edit.outputs = OutputSpec(output, add_bias=has_bias, bias_sum=bias_sum)
        else:
            if self.input_layouts[0] != Replicate():
                raise ValueError(f"RowwiseParallel on the embedding {_where(path)} takes replicated ids: pass "
                                 f"input_layouts=Replicate(), got {self.input_layouts[0]}")
            placement = ParameterPlacement(mesh, (Shard(0),), src_data_rank=src_data_rank)
            edit.parameters[name] = placement
            offset, local = placement.piece(weight.shape)
            edit.attributes["hpms_row_start"], edit.attributes["hpms_rows"] = offset[0], local[0]
            if isinstance(cell, nn.Embedding):      # its one-hot lookup counts the rows
                edit.attributes["vocab_size"] = local[0]
            edit.swap_class = masked_rows_class(type(cell))
            edit.outputs = OutputSpec(output)
        return edit


class SequenceParallel(ParallelStyle):
    """Run a Cell (a norm, a dropout) on sequence-sharded activations with replicated
    parameters; each parameter is read through an identity whose backward sums its gradient over
    the tp ranks (each rank's share: it meets the rank's sequence piece only), as PyTorch's DTensor
    autograd does.

    Inputs and outputs are ``Shard(sequence_dim)`` pieces (a DTensor input is brought there);
    an input without a sequence dim before its features raises. A dropout Cell (``nn.Dropout``,
    ``mint.nn.Dropout``) returns its piece of the mask one device draws for the whole
    activation with the same seed (PyNative and compiled); any dimension may serve as
    ``sequence_dim`` there (the heads of attention probabilities, the features between a
    Colwise and a Rowwise layer). A Cell with a dropout Cell inside is refused (its dropout
    would see pieces it cannot place): give the dropout Cell the style itself.

    Args:
        sequence_dim: the tensor dim of the sequence (default 1: ``(batch, seq, features)``).
        use_local_output: False (default) returns a DTensor in PyNative, True the local piece.

    Example::

        parallelize_module(block, mesh["tp"], {"norm": SequenceParallel()})
    """

    def __init__(self, *, sequence_dim: int = 1, use_local_output: bool = False) -> None:
        if isinstance(sequence_dim, bool) or not isinstance(sequence_dim, int):
            raise TypeError(f"sequence_dim must be an int, got {sequence_dim!r}")
        self.sequence_dim = sequence_dim
        self.use_local_output = _check_bool(use_local_output, "use_local_output")

    def plan(self, path, cell, mesh, src_data_rank=0) -> ModuleEdit:
        _check_mesh(self, path, mesh)
        edit = ModuleEdit(path, cell)
        layout, replicated = (Shard(self.sequence_dim),), (Replicate(),)
        where = _where(path)
        d = self.sequence_dim
        if is_dropout(cell):         # element-wise: any dim of the input
            min_ndim = d + 1 if d >= 0 else -d
        elif d == -1:
            raise ValueError(f"SequenceParallel on {where}: sequence_dim=-1 is the feature dim, which a norm (or any "
                             "Cell but dropout) reads whole; give the sequence dim's index (1 for (batch, seq, "
                             "features), -2 from the end)")
        else:                        # a feature dim after the sequence dim
            min_ndim = d + 2 if d >= 0 else -d
        for name in own_parameters(cell):   # replicated, used on sequence pieces: gradients summed when read
            edit.parameters[name] = ParameterPlacement(mesh, replicated, src_data_rank=src_data_rank)
            edit.summed_reads[name] = mesh
        if is_dropout(cell):
            check_dropout_seeded(cell, f"SequenceParallel on {where}")
            edit.swap_class = sharded_dropout_class(type(cell))
            edit.attributes.update(hpms_dropout_dim=self.sequence_dim, hpms_dropout_parts=mesh.size(0),
                                   hpms_dropout_index=mesh.coordinate[0])
        else:
            inner = dropouts_inside(cell)
            if inner:
                raise ValueError(f"SequenceParallel on {where}: the dropout Cells {list(inner)} inside it would draw "
                                 "masks for sequence pieces as if they were whole tensors (not the single device's "
                                 "masks); apply SequenceParallel to each dropout Cell itself instead")
        edit.inputs = InputSpec({0: ConversionSpec(mesh, layout, layout, where=where)}, min_ndim=min_ndim, where=where)
        edit.outputs = OutputSpec({0: ConversionSpec(mesh, layout, layout, to_dtensor=not self.use_local_output,
                                                     where=where)})
        return edit


def _layouts(value, what: str) -> Optional[Tuple[Optional[Placement], ...]]:
    if value is None:
        return None
    entries = (value,) if isinstance(value, Placement) else value
    if not isinstance(entries, (tuple, list)):
        raise TypeError(f"{what} must be a Placement or a tuple of Placement / None, got {value!r}")
    for e in entries:
        if e is not None and not isinstance(e, Placement):
            raise TypeError(f"{what} entries must be Placement or None, got {e!r}")
    return tuple(entries)


def _converted(layouts, desired) -> List[Tuple[int, Placement, Placement]]:
    """(position, from, to) for the positions with a layout (``None`` desired: keep it)."""
    return [(i, src, dst or src) for i, (src, dst) in enumerate(zip(layouts or (), desired or ())) if src is not None]


def _kwarg_layouts(value, what: str) -> Dict[str, Placement]:
    if value is None:
        return {}
    if not isinstance(value, dict) or not all(isinstance(k, str) and isinstance(v, Placement)
                                              for k, v in value.items()):
        raise TypeError(f"{what} must map keyword names to Placements, got {value!r}")
    return dict(value)


class PrepareModuleInput(ParallelStyle):
    """Convert a Cell's inputs (positional, and keyword in PyNative) from ``input_layouts`` to
    ``desired_input_layouts`` before its forward; ``None`` leaves an input alone.

    Args:
        input_layouts: one layout per positional input, the layout it arrives in (a plain
            tensor is this rank's piece of it); more positional inputs than layouts raise, as in
            PyTorch.
        desired_input_layouts: the layout the Cell computes on, one per positional input.
        input_kwarg_layouts: ``{keyword: layout}`` of keyword inputs as they arrive (PyNative
            only: a compiled call raises).
        desired_input_kwarg_layouts: ``{keyword: layout}`` the Cell computes on.
        use_local_output: False (default) hands the Cell DTensors in PyNative, True local
            pieces (graphs always hand local pieces).
        defer_colwise_grads: True (an addition to PyTorch's arguments) when the replicated
            inputs reach only ColwiseParallel layers inside the Cell (as the attention and MLP
            inputs of a transformer do): the gradient of such an input then arrives here
            unreduced and is reduced once (one reduce-scatter after a sequence-parallel
            gather), as PyTorch's DTensor and Megatron-LM do, and the reduction each layer
            inside would perform on it is dropped (the rule of
            :func:`~hyper_parallel_ms.redistribute._gradient.reduction_taken_over`: only layers
            reading the input as this Cell hands it on). Any other use of such an input inside
            the Cell would get its gradient counted once per rank.

    Example::

        PrepareModuleInput(input_layouts=(Shard(1), None), desired_input_layouts=(Replicate(), None))
    """

    def __init__(self, *, input_layouts=None, desired_input_layouts=None, input_kwarg_layouts=None,
                 desired_input_kwarg_layouts=None, use_local_output: bool = False,
                 defer_colwise_grads: bool = False) -> None:
        self.defer_colwise_grads = _check_bool(defer_colwise_grads, "defer_colwise_grads")
        self.input_layouts = _layouts(input_layouts, "input_layouts")
        self.desired_input_layouts = _layouts(desired_input_layouts, "desired_input_layouts")
        if (self.input_layouts is None) != (self.desired_input_layouts is None) or (
                self.input_layouts is not None and len(self.input_layouts) != len(self.desired_input_layouts)):
            raise ValueError(f"input_layouts {self.input_layouts} and desired_input_layouts "
                             f"{self.desired_input_layouts} must have the same length")
        self.input_kwarg_layouts = _kwarg_layouts(input_kwarg_layouts, "input_kwarg_layouts")
        self.desired_input_kwarg_layouts = _kwarg_layouts(desired_input_kwarg_layouts, "desired_input_kwarg_layouts")
        missing = set(self.input_kwarg_layouts) ^ set(self.desired_input_kwarg_layouts)
        if missing:
            raise ValueError(f"input_kwarg_layouts and desired_input_kwarg_layouts must name the same keywords; "
                             f"only one names {sorted(missing)}")
        self.use_local_output = _check_bool(use_local_output, "use_local_output")
        if self.defer_colwise_grads and not any(dst == Replicate() for _, _, dst in
                                                _converted(self.input_layouts, self.desired_input_layouts)):
            raise ValueError("PrepareModuleInput(defer_colwise_grads=True) needs an input brought to Replicate()")

    def plan(self, path, cell, mesh, src_data_rank=0) -> ModuleEdit:
        _check_mesh(self, path, mesh)
        edit = ModuleEdit(path, cell)
        to_dtensor, where = not self.use_local_output, _where(path)
        convs = {}
        for i, src, dst in _converted(self.input_layouts, self.desired_input_layouts):
            takes = self.defer_colwise_grads and dst == Replicate()
            # deferred: the Colwise layers using it split the mesh dim, each hands back its share
            grad = gradient_placements((dst,), shared=(0,)) if takes else None
            convs[i] = ConversionSpec(mesh, (src,), (dst,), grad, to_dtensor=to_dtensor, where=where,
                                      takes_enclosed_reductions=takes)
        if convs or self.input_layouts is not None:
            edit.inputs = InputSpec(convs, max_inputs=len(self.input_layouts or ()), where=where)
        edit.kwarg_inputs = {k: ConversionSpec(mesh, (v,), (self.desired_input_kwarg_layouts[k],),
                                               to_dtensor=to_dtensor, where=where)
                             for k, v in self.input_kwarg_layouts.items()}
        return edit


class PrepareModuleOutput(ParallelStyle):
    """Convert a Cell's outputs from ``output_layouts`` to ``desired_output_layouts`` after its forward.

    Args:
        output_layouts: the layout each output leaves the Cell in (``None`` leaves one alone).
        desired_output_layouts: the layout handed on.
        use_local_output: return local pieces (default True); False returns DTensors in PyNative.

    Example::

        PrepareModuleOutput(output_layouts=Replicate(), desired_output_layouts=Shard(0))
    """

    def __init__(self, *, output_layouts, desired_output_layouts, use_local_output: bool = True) -> None:
        self.output_layouts = _layouts(output_layouts, "output_layouts")
        self.desired_output_layouts = _layouts(desired_output_layouts, "desired_output_layouts")
        if self.output_layouts is None or self.desired_output_layouts is None or \
                len(self.output_layouts) != len(self.desired_output_layouts):
            raise ValueError(f"output_layouts {self.output_layouts} and desired_output_layouts "
                             f"{self.desired_output_layouts} must be given with the same length")
        self.use_local_output = _check_bool(use_local_output, "use_local_output")

    def plan(self, path, cell, mesh, src_data_rank=0) -> ModuleEdit:
        _check_mesh(self, path, mesh)
        convs = {i: ConversionSpec(mesh, (src,), (dst,), to_dtensor=not self.use_local_output, where=_where(path))
                 for i, src, dst in _converted(self.output_layouts, self.desired_output_layouts)}
        return ModuleEdit(path, cell, outputs=OutputSpec(convs))


class PrepareModuleInputOutput(ParallelStyle):
    """:class:`PrepareModuleInput` and :class:`PrepareModuleOutput` on one Cell.

    Args:
        input_layouts, desired_input_layouts, input_kwarg_layouts, desired_input_kwarg_layouts:
            as in :class:`PrepareModuleInput`.
        use_local_input: hand the Cell local pieces (True) or DTensors in PyNative (False,
            default): :class:`PrepareModuleInput`'s ``use_local_output``.
        output_layouts, desired_output_layouts, use_local_output: as in :class:`PrepareModuleOutput`.
        defer_colwise_grads: as in :class:`PrepareModuleInput`.

    Example::

        PrepareModuleInputOutput(input_layouts=Shard(0), desired_input_layouts=Replicate(),
                                 output_layouts=Replicate(), desired_output_layouts=Shard(0))
    """

    def __init__(self, *, input_layouts=None, desired_input_layouts=None, input_kwarg_layouts=None,
                 desired_input_kwarg_layouts=None, use_local_input: bool = False, output_layouts=None,
                 desired_output_layouts=None, use_local_output: bool = True, defer_colwise_grads: bool = False) -> None:
        self.prepare_input = PrepareModuleInput(
            input_layouts=input_layouts, desired_input_layouts=desired_input_layouts,
            input_kwarg_layouts=input_kwarg_layouts, desired_input_kwarg_layouts=desired_input_kwarg_layouts,
            use_local_output=use_local_input, defer_colwise_grads=defer_colwise_grads)
        self.prepare_output = PrepareModuleOutput(output_layouts=output_layouts,
                                                  desired_output_layouts=desired_output_layouts,
                                                  use_local_output=use_local_output)

    def plan(self, path, cell, mesh, src_data_rank=0) -> ModuleEdit:
        edit = self.prepare_input.plan(path, cell, mesh, src_data_rank)
        edit.outputs = self.prepare_output.plan(path, cell, mesh, src_data_rank).outputs
        return edit


