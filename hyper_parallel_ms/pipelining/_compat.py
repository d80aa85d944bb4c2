"""HyperParallel's spellings of the pipelining arguments, translated to this library's (PyTorch's)
in one place: the schedules and :class:`PipelineStage` take both, and call this module once.

=====================  ======================  =============================================
HyperParallel          PyTorch / this library  translation
=====================  ======================  =============================================
``micro_batch_num``    ``n_microbatches``      the same number
``args_batch_dim``     ``args_chunk_spec``     a list of ``BatchDimSpec`` taken as a tuple
``kwargs_batch_dim``   ``kwargs_chunk_spec``   the same dict
``output_concat_dim``  ``output_merge_spec``   an int ``d``: ``TensorChunkSpec(d)``
``overlap_p2p``        (none)                  checked and accepted: transfers are synchronous
``stage_num``          ``num_stages``          the same number
``overlap_b_f``        ``build_plan(...,       interleaved 1F1B: backward/forward pairs
                       overlap_b_f=True)``     (:mod:`._pairing`); other schedules refuse it
``enable_dxdw_split``  ``build_plan(...,       with ``overlap_b_f``: a pair's backward split
                       dxdw_split=True)``      into I in the pair and W after it
``swap``,                                      ``False`` only (the activation swap is not
``p2p_transport``                              built); ``p2p_transport``: ``"plain"`` only
=====================  ======================  =============================================

Each pair is one argument under two names: give either; both are accepted when they are equal,
and refused (``ValueError`` naming both) when they differ.

Example:
    >>> schedule_arguments("ScheduleGPipe", None, None, None, None, micro_batch_num=4,
    ...                    args_batch_dim=None, kwargs_batch_dim=None, output_concat_dim=1, overlap_p2p=False)
    (4, None, None, TensorChunkSpec(1))
"""
from __future__ import annotations

from typing import Any, Dict, Optional, Sequence, Tuple

from ._microbatch import TensorChunkSpec

__all__ = ["either", "schedule_arguments", "SCHEDULE_ARGS_DOC", "refuse_unbuilt"]

# the docstring lines of the schedules' HyperParallel arguments (in every schedule's ``{shared_args}``)
SCHEDULE_ARGS_DOC = """\
        micro_batch_num: HyperParallel's name for ``n_microbatches`` (give one of the two).
        args_batch_dim: HyperParallel's name for ``args_chunk_spec`` (a list of :class:`BatchDimSpec`).
        kwargs_batch_dim: HyperParallel's name for ``kwargs_chunk_spec``.
        output_concat_dim: HyperParallel's name for ``output_merge_spec`` (an int: that dim).
        overlap_p2p: HyperParallel's: accepted; the transfers here are synchronous either way (the values
            are the same).
        overlap_b_f: HyperParallel's overlap of one micro-batch's backward with another's forward (for
            expert-parallel all-to-alls): interleaved 1F1B pairs each steady-state backward with the
            forward after it (``plan.paired``; run one after the other, or by HyperParallel's
            ``OVERLAP_B_F`` callback on two threads); the other schedules refuse ``True``.
        enable_dxdw_split: HyperParallel's split of that overlapped backward into input and weight
            gradients (with ``overlap_b_f=True``: the input gradient in the pair, the weight gradient
            right after its transfers; a first stage's backwards stay whole).
        p2p_transport: HyperParallel's transfer backend: ``"plain"`` only (point-to-point sends).
        swap: HyperParallel's activation swap between micro-batches: ``False`` only (swap Cells with
            ``hyper_parallel_ms.training.swap_wrapper``).
"""


def either(where: str, name: str, value: Any, hp_name: str, hp_value: Any, *, required: bool = False) -> Any:
    """The value of one argument given under PyTorch's ``name`` or HyperParallel's ``hp_name``
    (``None``: not given).

    Args:
        where: the callee, for the error messages.
        name: PyTorch's (this library's) name of the argument.
        value: the value given under ``name``.
        hp_name: HyperParallel's name of the same argument.
        hp_value: the value given under ``hp_name``.
        required: raise ``TypeError`` when neither is given.

    Example:
        >>> either("PipelineStage", "num_stages", None, "stage_num", 4)
        4
    """
    if hp_value is None:
        if value is None and required:
            raise TypeError(f"{where} needs {name} (PyTorch) or {hp_name} (HyperParallel); got neither")
        return value
    if value is not None and value != hp_value:
        raise ValueError(f"{where} got {name}={value!r} and {hp_name}={hp_value!r}; they name the same argument "
                         f"({hp_name} is HyperParallel's name for {name}): give one")
    return hp_value


def schedule_arguments(where: str, n_microbatches: Optional[int], args_chunk_spec: Optional[Sequence[Any]],
                       kwargs_chunk_spec: Optional[Dict[str, Any]], output_merge_spec: Any, *,
                       micro_batch_num: Optional[int], args_batch_dim: Optional[Sequence[Any]],
                       kwargs_batch_dim: Optional[Dict[str, Any]], output_concat_dim: Any,
                       overlap_p2p: bool) -> Tuple[int, Any, Any, Any]:
    """A schedule's ``(n_microbatches, args_chunk_spec, kwargs_chunk_spec, output_merge_spec)`` from
    the arguments given under either spelling (see the module docstring).

    Args:
        where: the schedule's class name, for the error messages.
        n_microbatches: PyTorch's micro-batch count.
        args_chunk_spec: PyTorch's positional chunk specs.
        kwargs_chunk_spec: PyTorch's keyword chunk specs.
        output_merge_spec: PyTorch's output merge spec.
        micro_batch_num: HyperParallel's ``n_microbatches``.
        args_batch_dim: HyperParallel's ``args_chunk_spec`` (a list is taken as a tuple).
        kwargs_batch_dim: HyperParallel's ``kwargs_chunk_spec``.
        output_concat_dim: HyperParallel's ``output_merge_spec`` (an int ``d``: ``TensorChunkSpec(d)``).
        overlap_p2p: HyperParallel's flag, checked to be a bool.

    Example::

        n, args_spec, kwargs_spec, merge_spec = schedule_arguments("ScheduleGPipe", 4, None, None, None,
            micro_batch_num=None, args_batch_dim=None, kwargs_batch_dim=None, output_concat_dim=None,
            overlap_p2p=False)
    """
    if not isinstance(overlap_p2p, bool):
        raise TypeError(f"{where} overlap_p2p must be True or False, got {overlap_p2p!r}")
    if isinstance(args_batch_dim, list):
        args_batch_dim = tuple(args_batch_dim)
    if isinstance(output_concat_dim, int) and not isinstance(output_concat_dim, bool):
        output_concat_dim = TensorChunkSpec(output_concat_dim)
    return (either(where, "n_microbatches", n_microbatches, "micro_batch_num", micro_batch_num, required=True),
            either(where, "args_chunk_spec", args_chunk_spec, "args_batch_dim", args_batch_dim),
            either(where, "kwargs_chunk_spec", kwargs_chunk_spec, "kwargs_batch_dim", kwargs_batch_dim),
            either(where, "output_merge_spec", output_merge_spec, "output_concat_dim", output_concat_dim))


def refuse_unbuilt(where: str, *, overlap_b_f: bool, enable_dxdw_split: bool, p2p_transport: str,
                   swap: bool, pairs: bool = False) -> None:
    """Refuse, by name, HyperParallel's schedule options that are not built here when they ask for
    something (``True``, a transport other than ``"plain"``); their defaults are accepted.

    Args:
        where: the schedule's class name, for the error messages.
        overlap_b_f: HyperParallel's backward/forward overlap flag.
        pairs: whether the schedule builds backward/forward pairs (interleaved 1F1B).
        enable_dxdw_split: HyperParallel's input/weight gradient split of that overlap.
        p2p_transport: HyperParallel's transfer backend name.
        swap: HyperParallel's activation swap flag.

    Example:
        >>> refuse_unbuilt("Schedule1F1B", overlap_b_f=False, enable_dxdw_split=False, p2p_transport="plain",
        ...                swap=False)
    """
    for name, value in (("overlap_b_f", overlap_b_f), ("enable_dxdw_split", enable_dxdw_split), ("swap", swap)):
        if not isinstance(value, bool):
            raise TypeError(f"{where} {name} must be True or False, got {value!r}")
    if overlap_b_f and not pairs:
        raise NotImplementedError(f"{where}(overlap_b_f=True): only interleaved 1F1B pairs a backward with the "
                                  "forward after it (HyperParallel's OVERLAP_B_F); use ScheduleInterleaved1F1B, or "
                                  "leave overlap_b_f=False (the values are the same)")
    if enable_dxdw_split and not overlap_b_f:
        raise ValueError(f"{where}(enable_dxdw_split=True) splits the backward of each backward/forward pair: it "
                         f"needs overlap_b_f=True")
    if swap:
        raise NotImplementedError(f"{where}(swap=True): swapping activations between micro-batches is not built; "
                                  "swap Cells with hyper_parallel_ms.training.swap_wrapper instead")
    if p2p_transport != "plain":
        raise NotImplementedError(f"{where}(p2p_transport={p2p_transport!r}): only 'plain' point-to-point transfers "
                                  "are built")
