"""HyperParallel 1.0's activation-checkpoint face (``hyper_parallel.core.activation_checkpoint``)
on this library's :mod:`hyper_parallel_ms.training` wrappers.

- ``checkpoint_wrapper(module, context_fn=, early_stop=, output_recompute=)``: a Cell is
  checkpointed in place by :func:`hyper_parallel_ms.training.checkpoint_wrapper` (full
  recompute, ``context_fn`` entered around the forward and the recompute); any other callable
  (a function, a bound method, a Primitive) comes back as a Cell that calls it, checkpointed.
- ``swap_wrapper(module, policy_fn=)``: :func:`hyper_parallel_ms.training.swap_wrapper`, with a
  ``policy_fn`` answering a :class:`CheckpointPolicy` per saved tensor (``MUST_SWAP``: to the
  host; ``MUST_SAVE`` / ``PREFER_SAVE``: kept on the device).
- ``SwapManager().set_forward_prefetch_layer(first, second)``: the backward of ``second`` reads
  ``first``'s host copies back before ``first``'s backward uses them.
- ``checkpoint_exclude_wrapper``: :func:`hyper_parallel_ms.training.checkpoint_exclude_wrapper`.

Example::

    alias_hyper_parallel()
    from hyper_parallel.core.activation_checkpoint import CheckpointPolicy, checkpoint_wrapper
    model.layers[0] = checkpoint_wrapper(model.layers[0], early_stop=False)
"""
from __future__ import annotations

import enum
import threading
import weakref
from typing import Any, Callable, List, Optional, Tuple

from mindspore import Tensor, nn

from ..training import checkpoint_wrapper as _checkpoint_cell
from ..training import swap_wrapper as _swap_cell
from ..training._swap import prefetch_swapped, swapped_cells

__all__ = ["CheckpointPolicy", "SwapManager", "checkpoint_wrapper", "swap_wrapper"]


class CheckpointPolicy(enum.Enum):
    """HyperParallel's answer for one saved tensor (PyTorch's selective-checkpoint policies and
    ``MUST_SWAP``). A :func:`swap_wrapper` ``policy_fn`` answers ``MUST_SWAP`` (kept on the host,
    read back for the backward) or ``MUST_SAVE`` / ``PREFER_SAVE`` (kept on the device); the
    recompute answers are refused there (a swapping Cell recomputes nothing).

    Args:
        value: a member's value, as any ``Enum`` takes it (use the members by name).

    >>> CheckpointPolicy.MUST_SWAP.value
    4
    """

    MUST_SAVE = 0
    PREFER_SAVE = 1
    MUST_RECOMPUTE = 2
    PREFER_RECOMPUTE = 3
    MUST_SWAP = 4


class _CallableCell(nn.Cell):
    """A Cell calling a function, bound method or Primitive (its parameters stay its owner's)."""

    def __init__(self, fn: Callable[..., Any]) -> None:
        super().__init__(auto_prefix=False)
        object.__setattr__(self, "_hpms_fn", fn)

    def construct(self, *args, **kwargs):
        return self._hpms_fn(*args, **kwargs)


def _as_cell(module: Any, who: str) -> nn.Cell:
    if isinstance(module, nn.Cell):
        return module
    if not callable(module):
        raise TypeError(f"{who} needs a mindspore.nn.Cell or a callable, got {type(module).__name__}")
    return _CallableCell(module)


def checkpoint_wrapper(module: Any, checkpoint_fn: Optional[Callable] = None, *,
                       context_fn: Optional[Callable[[], Tuple[Any, Any]]] = None, early_stop: bool = True,
                       output_recompute: bool = False, use_reentrant: bool = False,
                       policy_fn: Optional[Callable] = None, swap_inputs: bool = False) -> nn.Cell:
    """HyperParallel's ``checkpoint_wrapper``: ``module``'s forward keeps no activations and runs
    again in the backward. A Cell is wrapped in place (names and paths unchanged) and returned;
    another callable comes back as a checkpointed Cell that calls it.

    Args:
        module: an ``nn.Cell``, or a function / bound method / Primitive.
        checkpoint_fn: HyperParallel's custom checkpoint function: ``None`` only.
        context_fn: ``None``, or a callable returning ``(forward_ctx, recompute_ctx)``, entered
            around each forward and around its recompute (PyNative).
        early_stop: HyperParallel's keyword, either value: the recompute here always runs to the
            end of the forward (hooks after its last saved tensor run too); values are the same.
        output_recompute: HyperParallel's keyword, either value: the output's consumers keep it
            as MindSpore's recompute does by default; values are the same.
        use_reentrant: either value: the recompute is MindSpore's non-reentrant one.
        policy_fn: HyperParallel's per-op selective policy: not taken here (``None`` only); use
            :func:`hyper_parallel_ms.training.checkpoint_wrapper` with ``policy=``.
        swap_inputs: HyperParallel's input swapping: ``False`` only (use :func:`swap_wrapper`).

    Example::

        model.layers[0] = checkpoint_wrapper(model.layers[0], context_fn=my_context_fn)
        layer.act = checkpoint_wrapper(layer.act, output_recompute=True)     # a function attribute
    """
    if checkpoint_fn is not None:
        raise NotImplementedError("checkpoint_wrapper(checkpoint_fn=...): a custom checkpoint function is not taken; "
                                  "the wrapper recomputes through hyper_parallel_ms.training.checkpoint_wrapper")
    if policy_fn is not None:
        raise NotImplementedError("checkpoint_wrapper(policy_fn=...): HyperParallel's per-op policy is not served; use "
                                  "hyper_parallel_ms.training.checkpoint_wrapper(cell, policy=<MindSpore primitive "
                                  "names to keep, or op_name -> bool>)")
    if swap_inputs:
        raise NotImplementedError("checkpoint_wrapper(swap_inputs=True): swapping a checkpoint's inputs is not built; "
                                  "swap a Cell's saved activations with swap_wrapper instead")
    for name, value in (("early_stop", early_stop), ("output_recompute", output_recompute),
                        ("use_reentrant", use_reentrant)):
        if not isinstance(value, bool):
            raise TypeError(f"checkpoint_wrapper({name}=...) must be a bool, got {value!r}")
    return _checkpoint_cell(_as_cell(module, "checkpoint_wrapper"), context_fn=context_fn)


def _swap_answer(policy_fn: Callable[[Tensor], Any]) -> Callable[[Tensor], bool]:
    def swap(t: Tensor) -> bool:
        answer = policy_fn(t)
        if isinstance(answer, bool):
            return answer
        if answer is CheckpointPolicy.MUST_SWAP:
            return True
        if answer in (CheckpointPolicy.MUST_SAVE, CheckpointPolicy.PREFER_SAVE):
            return False
        if isinstance(answer, CheckpointPolicy):
            raise ValueError(f"swap_wrapper policy_fn answered {answer} for a tensor of shape {tuple(t.shape)}: a "
                             "swapping Cell keeps or swaps its saved tensors, it recomputes none. Answer MUST_SWAP or "
                             "MUST_SAVE (recompute with checkpoint_wrapper)")
        raise TypeError(f"swap_wrapper policy_fn must answer a CheckpointPolicy (MUST_SWAP / MUST_SAVE) or a bool, "
                        f"got {answer!r}")
    return swap


def swap_wrapper(module: Any, policy_fn: Optional[Callable[[Tensor], Any]] = None, group_swap: bool = False,
                 cpu_pool: Any = None) -> nn.Cell:
    """HyperParallel's ``swap_wrapper``: the activations ``module``'s forward saves for the backward
    are kept on the host and read back for it. A Cell is wrapped in place and returned; another
    callable comes back as a swapping Cell that calls it. PyNative only.

    Args:
        module: an ``nn.Cell``, or a function / bound method / Primitive.
        policy_fn: ``tensor -> CheckpointPolicy`` (or bool): ``MUST_SWAP`` (True) to the host,
            ``MUST_SAVE`` / ``PREFER_SAVE`` (False) kept; default: every saved tensor but Parameters.
        group_swap: fused group copies: ``False`` only.
        cpu_pool: HyperParallel's pinned host-memory pool: ``None`` only (host copies are numpy arrays).

    Example::

        model.layers[0] = swap_wrapper(model.layers[0], policy_fn=lambda t: CheckpointPolicy.MUST_SWAP)
    """
    if cpu_pool is not None:
        raise NotImplementedError("swap_wrapper(cpu_pool=...): a pinned host-memory pool is not built; host copies are "
                                  "plain arrays (leave cpu_pool=None)")
    if policy_fn is not None and not callable(policy_fn):
        raise TypeError(f"swap_wrapper policy_fn must be a callable tensor -> CheckpointPolicy, got {policy_fn!r}")
    answer = None if policy_fn is None else _swap_answer(policy_fn)
    return _swap_cell(_as_cell(module, "swap_wrapper"), policy_fn=answer, group_swap=group_swap)


class SwapManager:
    """HyperParallel's process-wide swap coordinator (one instance: ``SwapManager() is
    SwapManager()``). Copies to and from the host are synchronous here; what it orders is when
    a layer's host copies are read back: :meth:`set_forward_prefetch_layer`.

    Example::

        for i in range(len(model.layers) - 1):
            SwapManager().set_forward_prefetch_layer(model.layers[i], model.layers[i + 1])
    """

    _instance: Optional["SwapManager"] = None
    _lock = threading.Lock()

    def __new__(cls) -> "SwapManager":
        with cls._lock:
            if cls._instance is None:
                instance = super().__new__(cls)
                instance._pairs = []
                cls._instance = instance
        return cls._instance

    def set_forward_prefetch_layer(self, first_layer: nn.Cell, second_layer: nn.Cell) -> None:
        """Order ``first_layer``'s host copies read back when ``second_layer``'s backward begins
        (``second_layer`` runs after ``first_layer`` in the forward, so before it in the backward).

        Args:
            first_layer: a Cell with swapping Cells at or under it (:func:`swap_wrapper`).
            second_layer: a Cell run after ``first_layer``; itself swapped or not.

        Example::

            SwapManager().set_forward_prefetch_layer(model.layers[0], model.layers[1])
        """
        for name, layer in (("first_layer", first_layer), ("second_layer", second_layer)):
            if not isinstance(layer, nn.Cell):
                raise TypeError(f"set_forward_prefetch_layer({name}=...) needs an nn.Cell, got {type(layer).__name__}")
        if first_layer is second_layer:
            raise ValueError("set_forward_prefetch_layer: first_layer and second_layer are the same Cell")
        if not swapped_cells(first_layer):
            raise ValueError(f"set_forward_prefetch_layer: nothing at or under {type(first_layer).__name__} is swapped "
                             "(wrap it or its parts with swap_wrapper first): there is nothing to read back")
        if any(first is first_layer and second is second_layer for first, second in self.prefetch_pairs()):
            return

        def read_back(_cell: nn.Cell, _grad_output: Any) -> None:
            prefetch_swapped(first_layer)
        second_layer.register_backward_pre_hook(read_back)
        self._pairs.append((weakref.ref(first_layer), weakref.ref(second_layer)))   # the manager outlives models

    def prefetch_pairs(self) -> List[Tuple[nn.Cell, nn.Cell]]:
        """The ``(first_layer, second_layer)`` pairs set so far whose Cells are alive, in order.

        Example::

            len(SwapManager().prefetch_pairs())
        """
        pairs = [(first(), second()) for first, second in self._pairs]
        return [(first, second) for first, second in pairs if first is not None and second is not None]
