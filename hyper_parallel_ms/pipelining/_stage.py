"""A pipeline stage: one rank's part of a model (a Cell), its stage index and the "pp" mesh.

:func:`split_blocks` (:mod:`._split`) cuts the common model shape (a Cell list of blocks between
optional first-stage and last-stage layers) into one stage's Cell, a pass-through Cell in place of
each layer of another stage; every kept Parameter keeps the full model's name, so optimizers and
checkpoints see the usual names.

Example::

    model = split_blocks(Model(), stage_index=1, num_stages=2, first=("embed",), last=("head",))
    stage = PipelineStage(model, 1, 2, mesh=init_device_mesh("cpu", (2,), mesh_dim_names=("pp",)))
"""
from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import mindspore as ms
from mindspore import Tensor, nn

from ._compat import either
from ._microbatch import tree_leaves
from ._split import StageCellList, split_blocks

__all__ = ["PipelineStage", "split_blocks", "default_pp_mesh", "StageCellList", "stage_forward", "check_shapes",
           "STAGE_MESH"]

STAGE_MESH = "_hpms_stage_mesh"   # on each stage parameter of a schedule: its pp mesh


def default_pp_mesh():
    """A 1-D mesh named "pp" over every rank of the job (of the current world: this
    process's, or the one a dry run enters).

    Example::

        mesh = default_pp_mesh()           # init_device_mesh("cpu", (world_size,), mesh_dim_names=("pp",))
    """
    from .._cluster import current_world
    from ..mesh import DeviceMesh
    world = current_world()
    return DeviceMesh(world.device_type, list(range(world.size)), mesh_dim_names=("pp",), _world=world)


def _check_device(device: Any, mesh) -> None:
    if device is None:
        return
    kind = str(getattr(device, "type", device)).split(":")[0].lower()
    wanted = mesh.device_type.lower()
    if kind not in (wanted, {"npu": "ascend", "cpu": "cpu"}.get(wanted, wanted)):
        raise ValueError(f"PipelineStage device={device!r}: this rank's pipeline runs on {mesh.device_type!r} devices "
                         "(the mesh's); pass that, or leave device out")


def _shapes_of(args: Any, what: str) -> Optional[Tuple[Tuple[int, ...], ...]]:
    if args is None:
        return None
    items = tree_leaves(args)
    if not all(isinstance(t, Tensor) for t in items):
        hint = " (HyperParallel's fifth positional argument is group: pass group= or mesh= by keyword)" if \
            what == "input_args" and not isinstance(args, (tuple, list, dict)) else ""
        raise TypeError(f"PipelineStage {what} must be a Tensor or a tuple of Tensors (one micro-batch; nested "
                        f"tuples, lists and dicts of Tensors too), got {args!r}{hint}")
    return tuple(tuple(t.shape) for t in items)


def check_shapes(stage: "PipelineStage", values: Any, expected: Optional[Tuple[Tuple[int, ...], ...]],
                 what: str) -> None:
    """Raise if ``values`` (a micro-batch's inputs or outputs, nested tuples, lists and dicts
    flattened) differ from the stage's ``input_args`` / ``output_args`` in their Tensors' ranks or
    non-batch dims (dim 0 may differ: a batch that splits unevenly gives micro-batches of two sizes)."""
    if expected is None:
        return
    got = tuple(tuple(t.shape) if isinstance(t, Tensor) else None for t in tree_leaves(values))
    if [g and (len(g), g[1:]) for g in got] != [e and (len(e), e[1:]) for e in expected]:
        argument = {"inputs": "input_args", "outputs": "output_args"}.get(what, what)
        raise ValueError(f"stage {stage.stage_index}: a micro-batch's {what} have shapes {got}, but the stage was "
                         f"built with {argument} of shapes {expected} (compared but for dim 0, the micro-batch's "
                         f"rows)")


class PipelineStage:
    """Stage ``stage_index`` of ``num_stages``: ``submodule`` runs it on this rank of ``mesh``.

    Args:
        submodule: this stage's ``nn.Cell``; it takes the previous stage's outputs (the batch's
            tensors for stage 0) and returns a Tensor or a tuple of Tensors.
        stage_index: the index of this stage, ``0 <= stage_index < num_stages``.
        num_stages: the number of stages of the whole pipeline.
        device: PyTorch's device argument: ``None`` or a name of this rank's device type (``"cpu"``,
            ``"npu"``, ``"npu:0"``); another type is refused.
        input_args: PyTorch's example inputs of one micro-batch (a Tensor or a tuple of Tensors). Shapes
            travel with each message here, so none are needed; given, every micro-batch's inputs are
            checked against their shapes.
        output_args: as ``input_args``, for the stage's outputs.
        group: PyTorch's process group of the pipeline: here the 1-D pp :class:`DeviceMesh` (as ``mesh``).
        dw_builder: PyTorch's custom weight-gradient builder: not built (refused unless ``None``).
        mesh: the 1-D pipeline :class:`DeviceMesh` (default: every rank, one dim named "pp").
        stage_num: HyperParallel's name of ``num_stages`` (give either).
        has_backward: HyperParallel's: ``False`` makes every schedule holding this stage run forwards only
            (the pp ranks agree on it when the schedule is built), as a schedule without ``loss_fn`` does.
        dyn_shape: HyperParallel's: ``True`` lets the shapes crossing this stage's boundaries change
            from one micro-batch or step to the next. Shapes travel with every message here, so both
            values run any shapes (kept as :attr:`dyn_shape`).
        jit: compile the stage: each micro-batch's forward (with ``loss_fn`` on the last stage)
            runs as one ``ms.jit`` graph, and its backward as the compiled backward graph of that
            forward, reading the activations the forward kept (the forward is not run again);
            the schedule, the transfers and the gradient sums stay in Python. A new input shape
            compiles again (once per shape). Plain, tensor-parallel and fully_shard stages; a
            compiled fully_shard stage reduces its gradients in every micro-batch's backward
            (compiled backwards cannot turn sync off) and sums them. (PyTorch has no such
            argument: one compiles the module given to the stage.)

    HyperParallel's override points, which the schedules call (a subclass may override them):
    :meth:`get_last_stage_sens` (the last stage's backward seed) and :meth:`bwd_send_specs` (the
    input gradients this stage sends back to the previous stage's rank).

    Example::

        stage = PipelineStage(split_blocks(Model(), rank, 2), rank, 2, mesh=mesh)
        schedule = ScheduleGPipe(stage, n_microbatches=4, loss_fn=loss_fn)
    """

    def __init__(self, submodule: nn.Cell, stage_index: int, num_stages: Optional[int] = None, device: Any = None,
                 input_args: Any = None, output_args: Any = None, group: Any = None, dw_builder: Any = None, *,
                 mesh=None, jit: bool = False, stage_num: Optional[int] = None, has_backward: bool = True,
                 dyn_shape: bool = False) -> None:
        if not isinstance(submodule, nn.Cell):
            raise TypeError(f"PipelineStage needs an nn.Cell as submodule, got {type(submodule).__name__}")
        num_stages = either("PipelineStage", "num_stages", num_stages, "stage_num", stage_num, required=True)
        if not isinstance(has_backward, bool):
            raise TypeError(f"PipelineStage has_backward must be True or False, got {has_backward!r}")
        for name, value in (("num_stages", num_stages), ("stage_index", stage_index)):
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(f"PipelineStage {name} must be an int, got {value!r}")
        if not isinstance(jit, bool):
            raise TypeError(f"PipelineStage jit must be True or False, got {jit!r}")
        if not isinstance(dyn_shape, bool):
            raise TypeError(f"PipelineStage dyn_shape must be True or False, got {dyn_shape!r}")
        if num_stages < 1:
            raise ValueError(f"PipelineStage num_stages must be a positive int, the number of stages of the whole "
                             f"pipeline (e.g. the pp size for one stage per rank), got {num_stages}")
        if not 0 <= stage_index < num_stages:
            raise ValueError(f"PipelineStage stage_index must be in 0..{num_stages - 1} (num_stages={num_stages}), "
                             f"got {stage_index}; pass this rank's stage, e.g. its pp rank for one stage per rank")
        if dw_builder is not None:
            raise NotImplementedError("PipelineStage(dw_builder=...): a custom weight-gradient builder is not built; "
                                      "the zero-bubble schedules (ScheduleZBVZeroBubble, ScheduleInterleavedZeroBubble, "
                                      "ScheduleDualPipeV) split the backward themselves")
        if isinstance(group, str) and mesh is not None and mesh.ndim == 1 and group == mesh.get_group():
            group = None                # HyperParallel's group name of the pp mesh given with it
        if group is not None:
            if mesh is not None and group is not mesh and group != mesh:
                raise ValueError("PipelineStage got both group= and mesh=, and they differ; give the pp mesh once")
            mesh = group
        mesh = default_pp_mesh() if mesh is None else mesh
        if mesh.ndim != 1:
            raise ValueError(f"PipelineStage needs the 1-D pipeline mesh (e.g. mesh['pp']), got a {mesh.ndim}-D mesh "
                             f"{mesh}")
        _check_device(device, mesh)
        self.input_shapes = _shapes_of(input_args, "input_args")
        self.output_shapes = _shapes_of(output_args, "output_args")
        self.submodule = submodule
        self.stage_index = stage_index
        self.num_stages = num_stages
        self.mesh = mesh
        self.jit = jit
        self.has_backward = has_backward
        self.dyn_shape = dyn_shape
        self.bwd_cache: Dict[int, Tuple[Tensor, ...]] = {}    # micro-batch -> input gradients to send back

    @property
    def is_first(self) -> bool:
        """Whether this is stage 0 (it reads the batch)."""
        return self.stage_index == 0

    @property
    def is_last(self) -> bool:
        """Whether this is the last stage (it applies the loss)."""
        return self.stage_index == self.num_stages - 1

    @property
    def _has_backward(self) -> bool:
        """HyperParallel's name of :attr:`has_backward` (subclasses read it)."""
        return self.has_backward

    def get_last_stage_sens(self, last_stage_outputs: Any) -> Any:
        """The backward seed of the last stage's loss for one micro-batch (HyperParallel's override
        point; the schedules call it on the last stage, once per micro-batch): ones shaped like the
        loss. The schedule multiplies it by the micro-batch's weight (``1 / n_microbatches`` with
        ``scale_grads=True``, the default; ``1`` with ``scale_grads=False``, HyperParallel's sum).
        Gradients of a DTensor loss here are whole, not each replica's share: no ``1 / repeat_num``.

        Args:
            last_stage_outputs: the loss of the micro-batch (what ``loss_fn`` returned).

        Example::

            class Scaled(PipelineStage):
                def get_last_stage_sens(self, loss):
                    return super().get_last_stage_sens(loss) * 0.5      # half of every gradient
        """
        if isinstance(last_stage_outputs, (list, tuple)):
            return [ms.ops.ones(tuple(o.shape), o.dtype) for o in last_stage_outputs]
        return ms.ops.ones(tuple(last_stage_outputs.shape), last_stage_outputs.dtype)

    def bwd_send_specs(self, micro_index: int) -> List[Tensor]:
        """The input gradients of micro-batch ``micro_index`` this stage sends to the previous
        stage's rank (HyperParallel's override point; the schedules call it at each backward send),
        one per floating input, in order; taken from :attr:`bwd_cache`.

        Args:
            micro_index: the micro-batch.

        Example::

            class Clipped(PipelineStage):
                def bwd_send_specs(self, micro_index):
                    return [ops.clip_by_value(g, -1.0, 1.0) for g in super().bwd_send_specs(micro_index)]
        """
        if micro_index not in self.bwd_cache:
            raise KeyError(f"stage {self.stage_index} holds no input gradients of micro-batch {micro_index} to send "
                           f"(its backward has not run)")
        return list(self.bwd_cache.pop(micro_index))

    @property
    def submod(self) -> nn.Cell:
        """PyTorch's name of :attr:`submodule` (this stage's Cell)."""
        return self.submodule

    def parameters(self) -> List[ms.Parameter]:
        """The stage's trainable parameters (full-model names)."""
        return list(self.submodule.trainable_params())

    def sharded_units(self) -> List[nn.Cell]:
        """The Cells of this stage that :func:`~hyper_parallel_ms.fsdp.fully_shard` / ``hsdp`` sharded.

        Example::

            fully_shard(stage.submodule.layers[0], mesh=mesh["dp"])
            stage.sharded_units()            # [that block]
        """
        from ..fsdp import FSDPModule
        return [cell for _, cell in self.submodule.cells_and_names() if isinstance(cell, FSDPModule)]

    def set_requires_gradient_sync(self, requires_gradient_sync: bool) -> None:
        """Turn the data-parallel gradient reduction of this stage's sharded units on or off.

        The schedules call it: off for every backward of a step but the stage's last, so the
        gradients summed over the micro-batches are reduced once per step (FSDP2's gradient
        accumulation). A stage without sharded units ignores it, and so does a compiled stage
        (``jit=True``): a compiled backward reduces every time, so its micro-batches' reduced
        gradients are summed instead (the same sum, one reduction per micro-batch).

        Args:
            requires_gradient_sync: ``True`` reduces in the next backward (with what accumulated).

        Example::

            stage.set_requires_gradient_sync(False)    # backward of micro-batch 0: accumulate
            stage.set_requires_gradient_sync(True)     # last backward: one reduce-scatter per unit
        """
        if self.jit:
            return
        for unit in self.sharded_units():
            unit.set_requires_gradient_sync(requires_gradient_sync, recurse=False)

    def __repr__(self) -> str:
        compiled = ", jit" if self.jit else ""
        return f"PipelineStage({type(self.submodule).__name__}, stage {self.stage_index} of {self.num_stages}{compiled})"


def stage_forward(stage: PipelineStage, loss_fn: Optional[Callable]) -> Callable:
    """The function one micro-batch's forward runs: ``forward(*inputs)`` -> outputs, and on the
    last stage with a ``loss_fn`` ``forward(*inputs, target)`` -> ``(outputs, loss_fn(outputs, target))``; under
    ``ms.jit`` when ``stage.jit``. The runtime records it as one top graph
    (:func:`~hyper_parallel_ms._mindspore.taped_call`), so a compiled forward keeps what its
    backward graph reads.

    Example::

        forward = stage_forward(last_stage, loss_fn)
        out, loss = taped_call(forward, x_microbatch, target_microbatch)
    """
    cell = stage.submodule
    if stage.is_last and loss_fn is not None:
        def forward(*args, **kwargs):
            out = cell(*args[:-1], **kwargs)
            return out, loss_fn(out, args[-1])
    else:
        def forward(*args, **kwargs):
            return cell(*args, **kwargs)
    return ms.jit(forward) if stage.jit else forward


def stage_cells(stages: Sequence[PipelineStage]) -> Optional[str]:
    """Why ``stages`` cannot run together on one rank (None when they can)."""
    if not stages:
        return "no stages given"
    bad = [type(s).__name__ for s in stages if not isinstance(s, PipelineStage)]
    if bad:
        return f"expected PipelineStage objects, got {bad}"
    if len({s.mesh for s in stages}) != 1:
        return "the stages of one rank must share one pp mesh"
    if len({s.num_stages for s in stages}) != 1:
        return f"the stages disagree on num_stages: {[s.num_stages for s in stages]}"
    if len({s.stage_index for s in stages}) != len(stages):
        return f"a stage index is listed twice: {[s.stage_index for s in stages]}"
    return None
