"""PyTorch's other names for the activation wrappers: the composable ``checkpoint(module)``
(``torch.distributed._composable.checkpoint``) and ``offload_wrapper(module)``. Both wrap in place
and return the module, as :func:`checkpoint_wrapper` and :func:`swap_wrapper` do here (PyTorch's
``offload_wrapper`` returns a new wrapper module with ``_checkpoint_wrapped_module.`` in its
parameter names; here names and paths stay as they were).

Example::

    from hyper_parallel_ms.training import checkpoint, offload_wrapper
    checkpoint(model.layers[0])            # its forward runs again in the backward
    offload_wrapper(model.layers[1])       # its saved activations kept on the host
"""
from __future__ import annotations

import functools
from typing import Callable, Optional

from mindspore import nn

from ._recompute import Policy, checkpoint_wrapper, create_selective_checkpoint_contexts
from ._swap import swap_wrapper

__all__ = ["checkpoint", "offload_wrapper"]

_DETERMINISM = ("default", "none")


def _policy_of(context_fn: Optional[Callable]) -> Policy:
    """The op policy of a ``context_fn`` made by :func:`create_selective_checkpoint_contexts`
    (called, or a ``functools.partial`` of it as PyTorch's examples write it)."""
    if context_fn is None:
        return None
    if isinstance(context_fn, functools.partial) and context_fn.func is create_selective_checkpoint_contexts:
        context_fn = context_fn()
    policy = getattr(context_fn, "_hpms_policy", None)
    if policy is None:
        raise NotImplementedError(
            "checkpoint(context_fn=...): only a context_fn made by create_selective_checkpoint_contexts is taken "
            "(its op policy is used; random ops are always replayed); for another context pass policy= (a collection "
            "of MindSpore primitive names or a callable op_name -> bool) instead")
    return policy


def checkpoint(module: nn.Cell, *, use_reentrant: bool = False, preserve_rng_state: bool = True,
               context_fn: Optional[Callable] = None, determinism_check: str = "default", debug: bool = False,
               policy: Policy = None) -> nn.Cell:
    """PyTorch's composable activation checkpointing (``torch.distributed._composable.checkpoint``):
    ``module`` itself keeps no activations of its forward and runs it again in the backward; its
    class, parameter names and path are unchanged. Returns ``module``. The same machinery as
    :func:`checkpoint_wrapper` (PyNative: MindSpore's non-reentrant recompute; ``ms.jit`` /
    GRAPH_MODE: the graph recompute pass; keyword arguments forwarded).

    Args:
        module: the Cell to checkpoint (no checkpointed Cell under it or around it).
        use_reentrant: ``False`` only, as in PyTorch (``True`` raises).
        preserve_rng_state: PyTorch's keyword; the random state is always replayed here.
        context_fn: ``None``, or one made by :func:`create_selective_checkpoint_contexts` (or a
            ``functools.partial`` of it): its op policy is used (PyNative only).
        determinism_check: ``"default"`` or ``"none"`` (PyTorch's values); the recompute runs the
            same ops (a selective policy checks them: a different op raises).
        debug: PyTorch's keyword; accepted, nothing more is logged.
        policy: this package's way to choose what to keep (see :func:`checkpoint_wrapper`); not
            together with ``context_fn``.

    Example::

        checkpoint(model.layers[0])
        loss, grads = ms.value_and_grad(loss_fn, None, model.trainable_params())(x)   # layer 0 runs twice
    """
    if use_reentrant is not False:
        raise NotImplementedError(f"checkpoint(use_reentrant={use_reentrant!r}): the composable checkpoint is "
                                  "non-reentrant (as PyTorch's); leave use_reentrant=False, or use checkpoint_wrapper")
    if determinism_check not in _DETERMINISM:
        raise ValueError(f"checkpoint(determinism_check=...) must be one of {_DETERMINISM}, got {determinism_check!r}")
    if not isinstance(debug, bool):
        raise TypeError(f"checkpoint(debug=...) must be a bool, got {debug!r}")
    if context_fn is not None and policy is not None:
        raise ValueError("checkpoint: pass either context_fn or policy, not both")
    if context_fn is not None and not callable(context_fn):
        raise TypeError(f"checkpoint(context_fn=...) must be a callable or None, got {context_fn!r}")
    chosen = _policy_of(context_fn) if context_fn is not None else policy
    return checkpoint_wrapper(module, policy=chosen, preserve_rng_state=preserve_rng_state)


def offload_wrapper(module: nn.Cell) -> nn.Cell:
    """PyTorch's ``offload_wrapper``: the activations ``module``'s forward saves for the backward are
    kept on the host and read back in the backward (:func:`swap_wrapper` with every saved tensor
    but the Parameters). Wraps in place and returns ``module``; PyNative only (ms.jit / GRAPH_MODE
    refuse it while compiling, naming checkpoint_wrapper).

    Args:
        module: the Cell (no swapped or checkpointed Cell under it).

    Example::

        offload_wrapper(model.layers[0])
        swap_stats(model.layers[0]).tensors      # saved tensors moved, after a forward under a gradient call
    """
    return swap_wrapper(module)
