"""MindFormers' PyNative trainer step on one device (the reference of MindFormers' Trainer runs on ranks):
``loss.backward(sense)`` (HyperParallel's
``enable_mindspore_backward_compat``, served by this library), MindFormers' own global gradient norm
and clipping (``_calculate_global_grad_norm`` on ``param.grad``, DTensors where the parameters are),
its own AdamW (which steps the local pieces of DTensor gradients) under ``_no_grad`` and ``param.grad = None``:
what its ``Trainer.training_step`` runs.
Module-level functions for the rank pool of tests/test_mindformers.py."""
from __future__ import annotations

from typing import Dict, List, Tuple

import numpy as np

MAX_NORM = 0.5      # MindFormers' clipping threshold for these runs: the gradients' norm is above it


def _local(grad) -> np.ndarray:
    return (grad.to_local() if hasattr(grad, "to_local") else grad).asnumpy().copy()


def _relative(a: List[np.ndarray], b: List[np.ndarray]) -> float:
    """The largest elementwise difference of two gradient lists, relative to ``a``'s largest value."""
    return max(float(np.abs(x - y).max()) for x, y in zip(a, b)) / max(float(np.abs(x).max()) for x in a)


def _train_by_backward(model, steps: int, checks: dict, after_step=None,
                       max_norm: float = MAX_NORM) -> Tuple[List[float], List[float]]:
    """``steps`` AdamW steps on the whole batch as MindFormers' trainer takes them on one device (see the
    module's text); returns the losses and the global gradient norms MindFormers computed. ``checks`` is
    given, for the first step: ``"clipping"``, the largest difference between the gradients the optimizer
    was given and the backward's gradients times MindFormers' clipping coefficient; ``"value_and_grad"``,
    between the backward's gradients and those ``ms.value_and_grad`` computes (while the compatibility is
    on); both relative to the largest gradient. ``after_step(model)``: after each optimizer step."""
    import mindspore as ms
    from mindspore.graph.api import _no_grad
    from hyper_parallel.platform.mindspore.autograd_compat import enable_mindspore_backward_compat
    from mindformers.pynative.optimizer.adamw import AdamW
    from mindformers.pynative.trainer.utils import _calculate_global_grad_norm
    from hyper_parallel_ms.training import disable_mindspore_backward_compat
    from tests._mindformers_qwen3 import _batch
    ids, labels = (ms.Tensor(a) for a in _batch())
    opt = AdamW(model.trainable_params(), learning_rate=1e-2, weight_decay=0.0)
    model.set_train(True)

    def forward():
        loss = model(input_ids=ids, labels=labels)
        return loss[0] if isinstance(loss, tuple) else loss

    enable_mindspore_backward_compat()          # what MindFormers' Trainer.__init__ calls
    losses, norms = [], []
    try:
        for step in range(steps):
            if step == 0:
                _, by_grad = ms.value_and_grad(forward, None, opt.parameters)()
                by_grad = [_local(g) for g in by_grad]
            loss = forward()
            loss.backward(ms.Tensor(1.0, ms.float32))      # one device: MindFormers' loss sense is 1
            backward = [_local(p.grad) for p in opt.parameters] if step == 0 else None
            norm, grads = _calculate_global_grad_norm(opt.parameters, enable_parallel=False, max_norm=max_norm)
            if len(grads) != len(opt.parameters):
                raise RuntimeError(f"{len(opt.parameters) - len(grads)} parameters got no gradient")
            if step == 0:
                coefficient = min(1.0, max_norm / (float(norm.asnumpy()) + 1e-6))
                checks["clipping"] = _relative(backward, [_local(g) / coefficient for g in grads])
                checks["value_and_grad"] = _relative(by_grad, backward)
            with _no_grad():
                opt(grads)
            for param in model.trainable_params():
                param.grad = None
            if after_step is not None:
                after_step(model)
            losses.append(float(loss.asnumpy().reshape(-1)[0]))
            norms.append(float(norm.asnumpy()))
    finally:
        disable_mindspore_backward_compat()
    return losses, norms


def one_device(steps: int, moe: bool = False) -> Tuple[List[float], List[float], Dict[str, np.ndarray], dict]:
    """The trainer step on one device, the whole batch: losses, MindFormers' gradient norms, parameters,
    and the first step's checks (see :func:`_train_by_backward`). ``moe``: MindFormers' DeepSeek-V3 at tiny
    sizes (tests/_mindformers_moe.py), its expert bias updated after each step, in place of the Qwen3."""
    from tests._mindformers_qwen3 import _setup, _weights, config
    _setup()
    import mindspore as ms
    from mindformers.models.qwen3.modeling_qwen3_train_pynative import PyNativeQwen3ForCausalLM
    from hyper_parallel_ms.testing import cpu_twins
    checks: dict = {}
    with cpu_twins():
        if moe:
            from mindformers.models.deepseek3.modeling_deepseek_v3_pynative import PyNativeDeepseekV3ForCausalLM
            from tests._mindformers_moe import _update_expert_bias, moe_config
            model, after_step = PyNativeDeepseekV3ForCausalLM(moe_config()), _update_expert_bias
        else:
            model, after_step = PyNativeQwen3ForCausalLM(config()), None
        for name, value in _weights(model).items():
            dict(model.parameters_and_names())[name].set_data(ms.Tensor(value))
        losses, norms = _train_by_backward(model, steps, checks, after_step=after_step)
    return losses, norms, {name: p.asnumpy() for name, p in model.parameters_and_names()}, checks


def run_all(steps: int) -> dict:
    """On each rank: MindFormers' Trainer (tests/_mindformers_trainer.py) with TP=2 + SP and with FSDP over
    dp=2, its checkpoint saved after ``steps - 1`` steps and resumed (TP=2 + SP, FSDP), its Trainer on its
    DeepSeek-V3 over pp=2; rank 0 also the trainer step of each model on one device."""
    from mindspore.communication import get_rank
    from tests import _mindformers_trainer as trainer
    out = {"trainer_tp2_sp": trainer.train(steps, 2), "trainer_fsdp_dp2": trainer.train(steps, 1),
           "trainer_resumed": trainer.resume(steps),
           "trainer_pp2_moe": trainer.train(steps, 1, pipeline_parallel=2, moe=True)}
    if get_rank() == 0:
        out.update(backward_one_device=one_device(steps), backward_one_device_moe=one_device(steps, moe=True))
    return out
