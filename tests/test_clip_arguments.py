"""clip_grad_norm's arguments on one device (no ranks): the clipped gradients against numpy's
PyTorch formula; a negative max_norm (a Tensor too) refused in PyNative and, inside ms.jit (where
compiled code cannot raise on a value), turned into NaN gradients instead of flipped ones; gradients
whose shapes differ from their parameters' refused in PyNative and while compiling; errors that name
the argument and the fix (norm_type='fro', max_norm='1', parameters=None or a Cell)."""
from __future__ import annotations

import mindspore as ms
import numpy as np
import pytest
from mindspore import Parameter, Tensor, nn

from hyper_parallel_ms.training import TotalGradNorm, clip_grad_norm

SHAPES = ((3, 4), (3,), ())


def _params():
    rng = np.random.default_rng(0)
    return tuple(Parameter(Tensor(rng.standard_normal(s).astype(np.float32)), name=f"p{i}")
                 for i, s in enumerate(SHAPES))


def _grads(scale: float = 1.0):
    rng = np.random.default_rng(1)
    return tuple(Tensor((scale * rng.standard_normal(s)).astype(np.float32)) for s in SHAPES)


def _expected(grads, max_norm: float):
    """PyTorch's clip_grad_norm_ on one device, in float64."""
    arrays = [g.asnumpy().astype(np.float64) for g in grads]
    total = np.sqrt(sum((a * a).sum() for a in arrays))
    coef = min(max_norm / (total + 1e-6), 1.0)
    return [a * coef for a in arrays], total


def _check(out, grads, max_norm):
    want, total = _expected(grads, max_norm)
    clipped, got_total = out
    assert abs(float(got_total.asnumpy()) - total) <= 1e-5 * total
    for g, w, shape in zip(clipped, want, SHAPES):
        assert tuple(g.shape) == shape          # a one-element Tensor max_norm leaves 0-d gradients 0-d
        np.testing.assert_allclose(g.asnumpy(), w, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("max_norm", [0.5, np.float32(0.5), Tensor(0.5), Tensor([0.5]), Tensor(1, ms.int32)])
def test_float_and_one_element_tensor_max_norm_clip_like_pytorch(max_norm):
    params, grads = _params(), _grads()
    value = float(max_norm.asnumpy().reshape(())) if isinstance(max_norm, Tensor) else max_norm
    assert _expected(grads, value)[1] > value, "clipping must be active"
    _check(clip_grad_norm(grads, max_norm, parameters=params), grads, value)


def test_negative_max_norm_refused_in_pynative_a_tensor_too():
    params, grads = _params(), _grads()
    for bad in (-1.0, Tensor(-1.0), Tensor([-0.5]), float("nan"), Tensor(float("nan"))):
        with pytest.raises(ValueError, match="max_norm must be a number >= 0.*flip the gradients"):
            clip_grad_norm(grads, bad, parameters=params)


def test_inside_jit_shapes_are_refused_while_compiling_and_a_negative_tensor_gives_nan():
    params, grads = _params(), _grads()
    norm = TotalGradNorm(params)

    @ms.jit
    def step(g, max_norm):
        return clip_grad_norm(g, max_norm, parameters=norm)

    _check(step(grads, Tensor(0.5)), grads, 0.5)
    clipped, total = step(grads, Tensor(-1.0))          # a value: no raise from a graph; NaN, not flipped
    assert np.isfinite(float(total.asnumpy()))
    assert all(np.isnan(g.asnumpy()).all() for g in clipped)

    with pytest.raises(ValueError, match=r"max_norm must be .*one-element Tensor, got a Tensor of shape \(2,\)"):
        step(grads, Tensor([0.5, 0.5]))

    @ms.jit
    def swapped(g0, g1, g2):
        return clip_grad_norm((g1, g0, g2), 1.0, parameters=norm)
    with pytest.raises(ValueError, match=r"gradient 0 has shape \(3,\) but its parameter 'p0' has \(3, 4\)"):
        swapped(*grads)


def test_gradients_not_matching_the_parameters_are_refused_in_pynative():
    params, grads = _params(), _grads()
    with pytest.raises(ValueError, match=r"gradient 0 has shape \(3,\) but its parameter 'p0' has \(3, 4\).*aligned"):
        clip_grad_norm((grads[1], grads[0], grads[2]), 1.0, parameters=params)
    with pytest.raises(ValueError, match=r"gradient 0 has shape \(4, 3\) but its parameter 'p0' has \(3, 4\)"):
        clip_grad_norm((grads[0].T, grads[1], grads[2]), 1.0, parameters=params)
    with pytest.raises(ValueError, match="number of gradients"):
        clip_grad_norm(grads[:2], 1.0, parameters=params)


def test_errors_name_the_argument_and_the_fix():
    params, grads = _params(), _grads()
    with pytest.raises(ValueError, match=r"norm_type must be a positive number or inf.*'fro'.*norm_type=2.0"):
        clip_grad_norm(grads, 1.0, parameters=params, norm_type="fro")
    with pytest.raises(TypeError, match="norm_type must be"):
        clip_grad_norm(grads, 1.0, parameters=params, norm_type=None)
    with pytest.raises(ValueError, match="norm_type must be a positive number"):
        clip_grad_norm(grads, 1.0, parameters=params, norm_type=0)
    with pytest.raises(TypeError, match=r"max_norm must be a number >= 0 .*got '1' \(str\) \(pass 1.0\)"):
        clip_grad_norm(grads, "1", parameters=params)
    with pytest.raises(TypeError, match="max_norm must be a number"):
        clip_grad_norm(grads, True, parameters=params)
    with pytest.raises(TypeError, match=r"parameters is required: pass .*optimizer.parameters.*trainable_params\(\)"):
        clip_grad_norm(grads, 1.0, parameters=None)
    with pytest.raises(TypeError, match=r"parameters is the Cell Dense.*Dense.trainable_params\(\)"):
        clip_grad_norm(grads, 1.0, parameters=nn.Dense(4, 3))
    with pytest.raises(TypeError, match="parameters must be the Parameters"):
        clip_grad_norm(grads, 1.0, parameters=3)
    with pytest.raises(TypeError, match=r"TotalGradNorm: parameters is required"):
        TotalGradNorm(None)
    # accepted: "inf" as float() reads it (PyTorch's spelling), one Parameter alone
    inf = clip_grad_norm(grads, 1.0, parameters=params, norm_type="inf")[1]
    assert float(inf.asnumpy()) == max(float(np.abs(g.asnumpy()).max()) for g in grads)
    one = clip_grad_norm(grads[:1], 1e9, parameters=params[0])[0]
    np.testing.assert_array_equal(one[0].asnumpy(), grads[0].asnumpy())
