"""Sharding over data parallelism: ``fully_shard`` (PyTorch FSDP2) and ``hsdp`` (HyperParallel).

Design (MindSpore 2.10; compiled code: :mod:`._compiled`). Each sharded parameter is replaced by a plain
``Parameter`` holding this rank's dim-0 piece: the optimizer, its state and the
gradients all have the pieces' shapes. The Cell's pre-forward hook flattens its pieces,
all-gathers them in one collective through a Cell with an explicit ``bprop`` and writes
the full values into the Cells' parameter tables; the post-forward hook writes the
pieces back. The gather is part of the differentiated computation, so MindSpore's
autodiff takes the gradient of the loss with respect to the pieces through the
collective's backward, which is the reduce-scatter (averaged over dp, in
``reduce_dtype``): gradients are exact by construction, and no step wrapper or optimizer
change is needed. Measured alternatives: ``set_data`` of a Parameter in a hook changes
the value but autodiff then differentiates with respect to the full Parameter, whose
gradient must be cut by hand; a recomputing backward would re-gather but runs the
Cell's forward twice.

Memory, stated plainly: parameters, gradients and optimizer state held between steps are
1/N (plus parameters kept whole). During a PyNative step, ``reshard_after_forward=True``
(or an int) frees a Cell's gathered values when its forward ends: the autodiff tape keeps a
small record instead and the backward all-gathers the Cell's group again when it first reads
one of its values (:mod:`._reshard`; two all-gathers per Cell and step, as FSDP2; one for a
Cell whose backward reads none, an embedding table); ``False`` keeps them on the tape until
the backward (one all-gather); an int ``k`` keeps ``1/k`` of them and gathers over ``k`` ranks
in the backward. The methods the sharded Cell gains are :mod:`._module`'s ``FSDPModule``. The
forward hooks do their work in PyNative only; inside
``ms.jit`` or GRAPH_MODE each sharded attribute is a property that gathers the piece in the
graph itself (:mod:`._compiled`).

Example::

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    parallelize_module(model, mesh["tp"], plan)
    for block in model.layers:
        fully_shard(block, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
"""
from ._fully_shard import fully_shard
from ._module import FSDPModule, UnshardHandle, register_fsdp_forward_method
from ._hsdp import HSDPCell, hsdp, hsdp_sync_stream, hsdp_wait_grad_handle
from ._init import init_parameters
from ._policy import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy

__all__ = ["fully_shard", "FSDPModule", "UnshardHandle", "MixedPrecisionPolicy", "OffloadPolicy", "CPUOffloadPolicy",
           "register_fsdp_forward_method", "hsdp", "HSDPCell", "hsdp_sync_stream", "hsdp_wait_grad_handle",
           "init_parameters"]
