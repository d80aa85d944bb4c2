"""The seam: every use of MindSpore that is not public API, in one package.

Modules by concern: :mod:`._release` (the release check and what differs between releases),
:mod:`.swaps` (entry point swaps), :mod:`.hooks` (tensor hooks, subclass views, list arguments,
op interception), :mod:`.compiling` (compile-time Python, compile detection, Cell classes for
graphs), :mod:`.autodiff` (saved tensors, the PyNative tape, recompute), :mod:`.deferred`
(deferred initialisers), :mod:`.abstract` (shape-only runs), :mod:`.p2p` (point-to-point
kernels). Everything is imported from here (``from .._mindspore import tensor_hook``).

Each contract below is something MindSpore does today without promising it; a smoke test
in ``tests/test_seam_*.py`` names each one, so that a MindSpore upgrade that
breaks a contract fails one test here instead of many elsewhere.

Contracts (measured on MindSpore 2.8, 2.9 and 2.10):

- **tensor hook**: a Tensor subclass with ``__fallback__(self, func, args, kwargs)`` is
  called for the ops it takes part in; what it returns is the op's result. 2.8 / 2.9
  replace an exception raised in it by ``RuntimeError: Python fallback failed.``
  (:func:`tensor_hook` keeps the original, :func:`original_hook_errors` restores it), and
  do not call it for tensors inside list arguments (:data:`LIST_ARGS_REACH_HOOK`).
- **hook op objects**: the ``func`` handed to the hook can be called from Python and
  returns a result the caller owns. On 2.8 / 2.9 the ``func`` of an overloaded functional
  op (``mindspore.ops.functional_overload``: ``mint.add``, ``mint.max``, ``mint.where``,
  ...) returns its result already released (use after free: garbage shapes, crashes);
  :func:`tensor_hook` passes an op that calls the overloaded function itself instead
  (:data:`OVERLOAD_OPS_CALLABLE`).
- **no-hook guard**: ``mindspore._c_expression.NoFallbackGuard`` runs ops on subclass
  objects as on plain tensors (:func:`no_hook`).
- **subclass views**: ``Tensor._make_subclass(cls, t)`` makes an object of ``cls``
  sharing storage and autodiff node with ``t`` (:func:`as_subclass`); assigning
  ``__class__`` turns a fresh plain op result into a subclass (:func:`adopt`). On 2.8 such
  a swapped object does not reach the hook in legacy primitives (``ops.reduce_sum``,
  ``P.Softplus``) nor inside tuples (:data:`ADOPTED_REACH_HOOK`), so there :func:`adopt`
  makes a new object with ``_make_subclass`` instead.
- **seeded dropout** (here): ``mindspore.ops.auto_generate.func_dropout_ext_op(x, p, training,
  inplace, seed, offset)``, the primitive behind ``ops.dropout``, draws its mask from
  explicit seed and offset tensors (:data:`seeded_dropout`).
- **compile-time Python**: ``ms.jit`` runs a ``functools.lru_cache`` object as opaque
  Python on its constant arguments (:func:`cached_in_python`, :func:`run_in_python`).
- **one custom-bprop Cell per call site**: differentiating a compiled forward from PyNative
  reads the last call's output for every call of one custom-bprop Cell instance
  (:func:`cell_per_call_site` builds one per call while compiling).
- **compile detection**: graph compilation runs in ``_JitExecutor.compile`` (``ms.jit``)
  or ``_CellGraphExecutor.compile`` (GRAPH_MODE Cells), in ``mindspore.graph.api`` from
  2.9 and ``mindspore.common.api`` on 2.8; both receive the call's arguments
  (:func:`is_compiling`; :func:`reject_in_compiled_args` and :func:`check_compiled_calls` wrap them).
- **op entry points** (2.8 / 2.9 only): ops reach C++ through ``Primitive.__call__``, the
  generated primitives' ``__call__`` and ``mindspore.ops.functional_overload``; wrapping
  them restores hook errors. ``ops`` / ``mint`` sequence functions are wrapped to pass
  lists as tuples (:func:`route_list_arguments`).
- **point-to-point kernels**: ``mindspore.ops.auto_generate.gen_ops_prim.dist_comm_isend_op(x,
  dst, group, tag)`` and ``dist_comm_irecv_op(buffer, tag, src, group)`` (ranks in the group),
  the kernels behind ``mint.distributed.send`` / ``recv``, return ``(tensor, handle)`` and run
  on CPU (MCCL, any group) where ``mint.distributed.send`` itself fails: its own-rank check
  reads the group ``hccl_world_group`` (:func:`p2p_send`, :func:`p2p_recv`).
- **autograd tape**: in PyNative, with the executor's grad flag on
  (``_pynative_executor.set_grad_flag(True)``), every op result carries an autodiff node
  (``Tensor._grad_node``), and ``mindspore._c_expression.run_backward(outputs, sens,
  keep_graph, create_graph, inputs, allow_unreachable, accumulate_grad=False)`` returns the
  gradients of ``inputs`` (``None`` for one the outputs do not reach) from the saved nodes,
  for tapes of several forwards kept at once and in any order, without running the forward
  again; ``keep_graph=True`` keeps the tape for a second call (:func:`taped`,
  :func:`tape_backward`). ``ms.vjp`` / ``GradOperation`` instead find a forward by its
  "top cell", only the most recent one (a backward of an older pending forward fails:
  "Can not find top cell for backward").
  A Cell with a custom ``bprop`` run under the bare grad flag fails ("The pointer[top_cell_]
  is null"): wrapping the forward in ``_pynative_executor.new_graph`` / ``end_graph`` gives it
  its top graph, and ``run_backward`` then differentiates it, several such tapes in any order,
  and an input-only call does not run the custom bprops of the weights (:func:`taped_call`).
  An exception raised inside the forward of a gradient call (``ms.grad``, ``value_and_grad``)
  leaves the executor recording: the grad flag stays on and the failed call's top cell stays
  pending, so a later in-place op on a leaf Parameter fails ("A leaf tensor that requires grad
  is being used in an inplace operator"), even after the next gradient call;
  ``_pynative_executor.clear_res()`` drops that state (:func:`discard_grad_recording`).
- **swappable entry points**: MindSpore's functions, Cell methods and compile entry points
  are looked up as module / class attributes at call time, so replacing the attribute
  reroutes every call made after it. :func:`swap_entry_points` (for the process) and
  :func:`entry_points_swapped` (for a scope) are the only places that replace them, and
  put back exactly what was there.

- **saved tensors** (2.10): inside ``mindspore.saved_tensors_hooks(pack, unpack)``, PyNative
  autodiff passes every tensor it keeps for the backward through ``pack`` (a custom-bprop
  Cell's input and output included), as a tensor with the storage address (``data_ptr``) of
  the one the op received, and the backward reads what ``unpack`` returns; ops run under
  ``mindspore._no_grad()`` are not recorded (:func:`saved_tensors_hooks`, :func:`no_grad`,
  :func:`tensor_address`; :data:`SAVED_TENSOR_HOOKS` says whether the release has them).
- **deferred initialisers**: eagerly, ``Parameter(initializer(...))`` (and ``set_data`` of an
  initialiser Tensor) runs the ``Initializer`` at once on a numpy array; the random ones draw
  only from numpy's global generator, a fixed number of times for MindSpore's own classes
  (:func:`initializer_draws`, :func:`draw_numpy_seed`), and fill from that draw alone. Under
  ``no_init_parameters()`` the Parameter keeps the initialiser Tensor as ``init_mode``
  (:func:`pending_init`); Parameters are made through ``Parameter._get_parameter_new_args``
  (:func:`deferred_creation_hooked`); :func:`initial_array` computes what ``init_data`` would, and
  :func:`fill_deferred` stores it as ``init_data`` does.

- **recompute**: ``mindspore.recompute(fn, *args, use_reentrant=False, early_stop=False,
  context_fn=...)`` in PyNative keeps none of the tensors ``fn`` saves for the backward and
  runs ``fn`` again (whole, Cell hooks included) when the backward needs them; it captures no
  parameter, so a Parameter replaced after wrapping gets exact gradients (``Cell.recompute()``
  and ``use_reentrant=True`` capture ``trainable_params()`` once: silently zero gradients for a
  later replacement). ``context_fn()`` returns (forward context, recompute context). Inside
  ``ms.jit`` the same call on a bound method compiles to ``ops.recompute_block``, and the
  compiler's ``add_recomputation`` pass duplicates the method's forward ops into the backward
  (:func:`recompute_eagerly`, :func:`recompute_in_graph`; :data:`RECOMPUTE_CONTEXT_FN`); the random
  state a recompute draws from again (:func:`random_state`, :func:`set_random_state`).
- **op interception**: a ``mindspore.MsDispatchMode`` subclass sees every PyNative primitive
  run inside its ``with`` block as ``__ms_dispatch__(func, args, kwargs)`` with ``func.name``;
  what it returns is the op's result, and the op is recorded for autodiff as usual
  (:class:`OpInterception`).

:func:`guard_mindspore_for` installs the wrappers the first time a DTensor is made (never at
import).

Example:
    >>> @run_in_python
    ... def double(n):
    ...     return 2 * n
    >>> double(4), is_compiling()
    (8, False)
"""
from __future__ import annotations

from ._release import (ADOPTED_REACH_HOOK, HOOK_ERRORS_REACH_CALLER, LIST_ARGS_REACH_HOOK, MINDSPORE_VERSION,
                       OVERLOAD_OPS_CALLABLE)
from .abstract import GRAD_ENTRY_POINTS, abstract_run, has_custom_bprop, numpy_dtype, stride_free_view, reads_shape_only
from .autodiff import (RECOMPUTE_CONTEXT_FN, SAVED_TENSOR_HOOKS, discard_grad_recording, discard_tapes, no_grad,
                       call_keeping_nothing, identity_with_gradient, keeping_nothing,
                       random_state, recompute_eagerly, set_random_state,
                       recompute_in_graph, recompute_record, recomputing, replaying, recording_gradients, saved_tensors_hooks, tape_backward,
                       taped, taped_call, tensor_address)
from .compiling import (graph_of_its_own, cached_in_python, cell_per_call_site, cell_subclass, check_compiled_calls,
                        reading_class,
                        constant_id, constant_of, refuse_while_compiling,
                        compile_argument_checks, compiling_graph_code, is_compiling, reject_in_compiled_args, run_first_call_checks,
                        run_in_python, running_eagerly)
from .deferred import (deferred_creation_hooked, deferred_parameter, is_meta, meta_empty, off_meta_device,
                       process_device_target, draw_numpy_seed, fill_deferred, initial_array,
                       initializer_draws, pending_init)
from .hooks import (ONE_NODE, OP_INTERCEPTION, OpInterception, adopt, as_subclass, guard_mindspore_for, hooks_off,
                    in_one_autodiff_node, one_autodiff_node,
                    keep_hook_errors, keeps_hook_errors, no_hook, original_hook_errors, plain_view,
                    route_list_arguments, tensor_hook)
from .p2p import p2p_recv, p2p_send
from .swaps import Swap, entry_points_swapped, swap_entry_points

from mindspore.ops.auto_generate import func_dropout_ext_op as seeded_dropout  # noqa: E402  (after the release check)

__all__ = ["identity_with_gradient", "keeping_nothing", "call_keeping_nothing", "MINDSPORE_VERSION", "LIST_ARGS_REACH_HOOK", "HOOK_ERRORS_REACH_CALLER", "ADOPTED_REACH_HOOK",
           "OVERLOAD_OPS_CALLABLE",
           "tensor_hook", "original_hook_errors", "keep_hook_errors", "keeps_hook_errors", "no_hook", "hooks_off",
           "as_subclass",
           "plain_view", "adopt", "graph_of_its_own", "cell_subclass", "reading_class", "run_first_call_checks", "cached_in_python", "run_in_python", "cell_per_call_site", "constant_id", "constant_of", "refuse_while_compiling", "is_compiling", "running_eagerly",
           "compiling_graph_code",
           "guard_mindspore_for", "reject_in_compiled_args", "check_compiled_calls", "compile_argument_checks", "route_list_arguments",
           "seeded_dropout", "Swap", "swap_entry_points", "entry_points_swapped", "p2p_send", "p2p_recv",
           "deferred_parameter", "off_meta_device", "process_device_target", "is_meta", "meta_empty", "GRAD_ENTRY_POINTS", "has_custom_bprop", "abstract_run", "stride_free_view", "numpy_dtype", "reads_shape_only",
           "taped", "taped_call", "tape_backward", "discard_grad_recording", "discard_tapes",
           "initializer_draws", "draw_numpy_seed", "pending_init", "initial_array", "fill_deferred",
           "deferred_creation_hooked", "SAVED_TENSOR_HOOKS", "saved_tensors_hooks", "no_grad",
           "recording_gradients", "tensor_address",
           "RECOMPUTE_CONTEXT_FN", "random_state", "set_random_state", "recompute_eagerly", "recomputing", "recompute_record", "replaying", "recompute_in_graph", "OP_INTERCEPTION", "OpInterception",
           "one_autodiff_node", "in_one_autodiff_node", "ONE_NODE"]
