"""Parity of a parallelized model with the same model on one device: forward loss, every
parameter's gradient (gathered), and parameters after optimizer steps.

The comparison rule (it must pass on any x86 CPU and still fail on a real bug):

- loss and gradients: ``tol`` (1e-5) everywhere; float32 rounding differs between kernels
  and CPUs by about 1e-7 relative, far inside it.
- parameters after SGD steps: ``tol``. SGD is linear in the gradient: rounding noise of
  ~1e-8 in a gradient moves a parameter by ``lr * 1e-8`` per step.
- parameters after AdamW steps: ``tol`` for every element except those whose gradient is
  mathematically zero (e.g. an attention key bias: softmax is shift-invariant). AdamW divides
  the gradient by its own running magnitude, so on those elements it turns rounding noise
  (up to ~1e-6, different on an Intel and an AMD CPU) into steps of up to ``lr`` scale. Such
  elements are found explicitly: the single-device gradient is at most :data:`ZERO_GRAD` at
  every step, and the parallel gradient is checked to be at most :data:`ZERO_GRAD` there too
  (at step 0, where gradients are gathered). Their parameters are compared with
  :func:`adamw_noise_bound`, the largest drift AdamW can give an element on each side.
  A real bug still fails: a wrong gradient fails the gradient check, a nonzero gradient
  where the reference has none fails the explicit zero check, and every other element is
  compared at ``tol``.
"""
from __future__ import annotations

import math
from typing import Callable, Dict, Optional, Tuple

import mindspore as ms
import numpy as np
from mindspore import nn

from hyper_parallel_ms import comm
from hyper_parallel_ms.dtensor import DTensor
from hyper_parallel_ms.nn import GradientReducer, parameter_sharding

# optimizer steps a parity check runs by default: the third step's update already reads moments built
# from two steps' gradients (AdamW) and parameters moved twice, which is what a wrong gradient, a wrong
# reduction or a wrong update shows in
STEPS = 3


def gathered(param, value) -> np.ndarray:
    """The whole of ``value`` (a gradient or the parameter itself) from every rank's piece."""
    sharding = parameter_sharding(param)
    if sharding is None:
        return value.asnumpy()
    spec = sharding.spec
    piece = DTensor.from_local(ms.Tensor(value.asnumpy()), spec.mesh, spec.layout, shape=spec.shape)
    return piece.full_tensor().asnumpy()


# a gradient this small is taken for rounding noise of a mathematically zero one: such noise
# grows with the terms summed (measured up to 7e-7 for a logit shift over 6 samples of 3
# classes); it stays below the gradient tolerance 1e-5 so that the explicit zero check bites
ZERO_GRAD = 4e-6
ADAMW_LR, ADAMW_BETAS = 0.01, (0.9, 0.999)


def adamw_noise_bound(lr: float, steps: int, betas=ADAMW_BETAS) -> float:
    """Largest difference AdamW steps can make between two runs on an element whose
    gradients are noise: MindSpore's ``AdamWeightDecay`` (no bias correction) moves an
    element by ``lr * |m| / (sqrt(v) + eps)`` per step, and by Cauchy-Schwarz after ``t``
    steps ``|m| / sqrt(v) <= (1 - b1) / sqrt(1 - b2) * sqrt(sum_k<t (b1**2 / b2)**k)``
    whatever the gradients; both runs may move the opposite way.

    >>> round(adamw_noise_bound(0.01, 1), 4)      # one step: 2 * lr * 0.1 / sqrt(0.001)
    0.0632
    """
    b1, b2 = betas
    total = 0.0
    for t in range(1, steps + 1):
        total += (1 - b1) / math.sqrt(1 - b2) * math.sqrt(sum((b1 * b1 / b2) ** k for k in range(t)))
    return 2 * lr * total


def _compare_after_steps(name: str, got: np.ndarray, want: np.ndarray, quiet: Optional[np.ndarray], tol: float,
                         bound: float, what: str) -> None:
    if quiet is None or not quiet.any():
        np.testing.assert_allclose(got, want, rtol=tol, atol=tol, err_msg=f"{name} after {what}")
        return
    np.testing.assert_allclose(got[~quiet], want[~quiet], rtol=tol, atol=tol, err_msg=f"{name} after {what}")
    drift = float(np.max(np.abs(got[quiet] - want[quiet])))
    assert drift <= bound + tol, (f"{name} after {what}: elements with zero gradient drifted {drift:.3g}, more "
                                  f"than AdamW can move noise ({bound:.3g})")


class _GraphStep(nn.Cell):
    """The parallel step as a Cell that GRAPH_MODE compiles: loss, reduced (and transformed) gradients."""

    def __init__(self, model: nn.Cell, loss_of: Callable, params, reducer: nn.Cell, transform) -> None:
        super().__init__(auto_prefix=False)         # the parameters keep their names
        self.model, self.loss_of, self.reducer, self.transform = model, loss_of, reducer, transform
        self.grad_fn = ms.value_and_grad(self.forward, None, params)

    def forward(self, *batch):
        return self.loss_of(self.model, *batch)

    def construct(self, *batch):
        loss, grads = self.grad_fn(*batch)
        grads = self.reducer(grads)
        if self.transform is not None:
            grads = self.transform(grads)
        return loss, grads


def _in_graph_mode(step: nn.Cell) -> Callable:
    def run(*batch):
        ms.set_context(mode=ms.GRAPH_MODE)
        try:
            return step(*batch)
        finally:
            ms.set_context(mode=ms.PYNATIVE_MODE)
    return run


def check_parity(make_model: Callable[[], nn.Cell], parallelize: Callable[[nn.Cell], None], batch_of: Callable,
                 loss_of: Callable, *, optimizer: str = "sgd", steps: int = STEPS, dp_mesh=None, dp_dim=None,
                 dp_index: int = 0, dp_size: int = 1, tol: float = 1e-5, jit: bool = False, graph: bool = False,
                 transform_grads: Optional[Tuple[Callable, Callable]] = None) -> Optional[float]:
    """``batch_of(dp_index, dp_size)`` gives this data-parallel rank's batch (``(0, 1)``: the whole).
    ``transform_grads``: ``(on_reference, make_parallel)``: ``on_reference(grads)`` transforms the
    one-device gradients, ``make_parallel(par_params)`` gives the function applied to the reduced
    parallel ones (inside the jitted step with ``jit``), e.g. gradient clipping. ``graph``: the
    parallel step is a Cell run in GRAPH_MODE (the reference stays PyNative).

    Comparison rule: see the module docstring (zero-gradient elements under AdamW).
    """
    ms.set_seed(0)
    ref = make_model()
    ms.set_seed(0)
    par = make_model()
    parallelize(par)
    ref_params, par_params = ref.trainable_params(), par.trainable_params()
    assert [p.name for p in ref_params] == [p.name for p in par_params]
    reducer = GradientReducer(par_params, dp_mesh=dp_mesh, dp_dim=dp_dim)

    def make_opt(params):
        if optimizer == "sgd":
            return nn.SGD(params, learning_rate=0.1)
        return nn.AdamWeightDecay(params, learning_rate=ADAMW_LR, beta1=ADAMW_BETAS[0], beta2=ADAMW_BETAS[1],
                                  weight_decay=0.01)
    ref_opt, par_opt = make_opt(ref_params), make_opt(par_params)

    def ref_loss(*batch):
        return loss_of(ref, *batch)

    def par_loss(*batch):
        return loss_of(par, *batch)
    ref_step = ms.value_and_grad(ref_loss, None, ref_params)
    par_step = ms.value_and_grad(par_loss, None, par_params)

    ref_transform, par_transform = (None, None) if transform_grads is None else \
        (transform_grads[0], transform_grads[1](par_params))

    def par_train(*batch):
        loss, grads = par_step(*batch)
        if par_transform is None:
            return loss, reducer(grads)
        return loss, par_transform(reducer(grads))
    if jit:
        par_train = ms.jit(par_train)
    if graph:
        par_train = _in_graph_mode(_GraphStep(par, loss_of, par_params, reducer, par_transform))
    first = None
    # per parameter: elements whose single-device gradient stayed at rounding-noise level
    quiet: Dict[str, np.ndarray] = {p.name: np.ones(p.shape, bool) for p in ref_params}
    for step in range(steps):
        full_batch = batch_of(0, 1, step)
        local_batch = batch_of(dp_index, dp_size, step)
        loss, grads = ref_step(*full_batch)
        if ref_transform is not None:
            grads = ref_transform(grads)
        p_loss, p_grads = par_train(*local_batch)
        if dp_mesh is not None:
            p_loss = comm.all_reduce(p_loss, dp_mesh, dp_dim, op="avg")
        np.testing.assert_allclose(p_loss.asnumpy(), loss.asnumpy(), rtol=tol, atol=tol, err_msg=f"loss, step {step}")
        for p, rg in zip(par_params, grads):
            quiet[p.name] &= np.abs(rg.asnumpy()) <= ZERO_GRAD
        if step == 0:
            first = float(loss.asnumpy())
            for p, g, rg in zip(par_params, p_grads, grads):
                full = gathered(p, g)
                np.testing.assert_allclose(full, rg.asnumpy(), rtol=tol, atol=tol, err_msg=f"gradient of {p.name}")
                noisy = quiet[p.name] & (np.abs(full) > ZERO_GRAD)
                assert not noisy.any(), (f"gradient of {p.name}: zero on one device but up to "
                                         f"{float(np.abs(full[noisy]).max()):.3g} in parallel")
        ref_opt(grads)
        par_opt(p_grads)
    adaptive = optimizer != "sgd"
    bound = adamw_noise_bound(ADAMW_LR, steps) if adaptive else 0.0
    for p, rp in zip(par_params, ref_params):
        _compare_after_steps(p.name, gathered(p, p), rp.asnumpy(), quiet[p.name] if adaptive else None, tol, bound,
                             f"{steps} {optimizer} steps")
    return first
