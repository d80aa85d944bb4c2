"""Wrapped Cells called with keyword arguments, as MindSpore's own transformer calls its layers
(``layer(x, src_mask=..., src_key_padding_mask=...)``): an ``nn.TransformerEncoder`` of 2 layers
(batch_first, dropout 0) with every layer checkpointed by apply_activation_checkpointing (full and
selective policies in PyNative; full under ms.jit), an ``nn.TransformerDecoderLayer``
checkpointed whole, and swapped / offloaded layers: the loss and every gradient equal the unwrapped
model's (fp32, 1e-6: the same ops run in the same order, the recompute only repeats them)."""
from __future__ import annotations

import mindspore as ms
import numpy as np
import pytest
from mindspore import nn

from hyper_parallel_ms.training import (apply_activation_checkpointing, checkpoint_stats, checkpoint_wrapper,
                                        offload_wrapper, swap_stats, swap_wrapper)

D, HEADS, FF, SEQ, MEM = 16, 2, 32, 5, 4


def _encoder() -> nn.TransformerEncoder:
    ms.set_seed(0)
    layer = nn.TransformerEncoderLayer(D, HEADS, FF, dropout=0.0, batch_first=True)
    return nn.TransformerEncoder(layer, 2)


def _decoder_layer() -> nn.TransformerDecoderLayer:
    ms.set_seed(0)
    return nn.TransformerDecoderLayer(D, HEADS, FF, dropout=0.0, batch_first=True)


def _inputs():
    rng = np.random.default_rng(0)
    x = ms.Tensor(rng.standard_normal((2, SEQ, D)).astype(np.float32))
    memory = ms.Tensor(rng.standard_normal((2, MEM, D)).astype(np.float32))
    causal = ms.Tensor(np.triu(np.full((SEQ, SEQ), -1e9, np.float32), 1))
    padding = ms.Tensor(np.array([[False] * SEQ, [False] * 3 + [True] * (SEQ - 3)]))
    return x, memory, causal, padding


class EncoderStep(nn.Cell):
    """The loss of the encoder called with keyword masks, and its gradients."""

    def __init__(self, model: nn.Cell) -> None:
        super().__init__()
        self.model = model
        self.weights = ms.ParameterTuple(model.trainable_params())

    def loss(self, x, mask, padding):
        return (self.model(x, src_mask=mask, src_key_padding_mask=padding) ** 2).mean()

    def construct(self, x, mask, padding):
        return ms.value_and_grad(self.loss, None, self.weights)(x, mask, padding)


class DecoderStep(nn.Cell):
    def __init__(self, model: nn.Cell) -> None:
        super().__init__()
        self.model = model
        self.weights = ms.ParameterTuple(model.trainable_params())

    def loss(self, x, memory, mask, padding):
        return (self.model(x, memory, tgt_mask=mask, tgt_key_padding_mask=padding,
                           memory_key_padding_mask=None) ** 2).mean()

    def construct(self, x, memory, mask, padding):
        return ms.value_and_grad(self.loss, None, self.weights)(x, memory, mask, padding)


def _run(step: nn.Cell, mode: str, *args):
    if mode == "jit":
        def run(*inputs):
            return step(*inputs)
        return ms.jit(run)(*args)
    return step(*args)


def _assert_same(result, reference, params) -> None:
    loss, grads = result
    ref_loss, ref_grads = reference
    assert abs(float(loss.asnumpy()) - float(ref_loss.asnumpy())) <= 1e-6
    assert len(grads) == len(ref_grads) == len(params)
    for p, g, r in zip(params, grads, ref_grads):
        assert np.abs(r.asnumpy()).max() > 0, p.name          # every parameter takes part (no vacuous check)
        np.testing.assert_allclose(g.asnumpy(), r.asnumpy(), rtol=1e-6, atol=1e-6, err_msg=p.name)


def _layers(model: nn.Cell):
    return apply_activation_checkpointing(model, check_fn=lambda c: isinstance(c, nn.TransformerEncoderLayer))


@pytest.mark.parametrize("mode", ["pynative", "jit"])
def test_encoder_layers_checkpointed_take_keyword_masks(mode):
    x, _, causal, padding = _inputs()
    reference = EncoderStep(_encoder())(x, causal, padding)
    model = _layers(_encoder())
    step = EncoderStep(model)
    _assert_same(_run(step, mode, x, causal, padding), reference, step.weights)
    if mode == "pynative":
        stats = checkpoint_stats(model.layers[0])
        assert (stats.forwards, stats.recomputes) == (2, 1), "the layer's forward ran again in the backward"


@pytest.mark.parametrize("policy", ["selective", {"MatMul"}])
def test_encoder_layers_with_selective_policies_take_keyword_masks(policy):
    x, _, causal, padding = _inputs()
    reference = EncoderStep(_encoder())(x, causal, padding)
    model = apply_activation_checkpointing(_encoder(), check_fn=lambda c: isinstance(c, nn.TransformerEncoderLayer),
                                           policy=policy)
    step = EncoderStep(model)
    _assert_same(step(x, causal, padding), reference, step.weights)
    stats = checkpoint_stats(model.layers[1])
    assert stats.recomputes == 1 and stats.saved and stats.saved == stats.replayed, (stats.saved, stats.replayed)


@pytest.mark.parametrize("mode", ["pynative", "jit"])
def test_decoder_layer_checkpointed_whole_takes_memory_and_keyword_masks(mode):
    x, memory, causal, padding = _inputs()
    reference = DecoderStep(_decoder_layer())(x, memory, causal, padding)
    layer = checkpoint_wrapper(_decoder_layer())
    step = DecoderStep(layer)
    _assert_same(_run(step, mode, x, memory, causal, padding), reference, step.weights)
    if mode == "pynative":
        assert checkpoint_stats(layer).recomputes == 1


@pytest.mark.parametrize("wrap", [swap_wrapper, offload_wrapper])
def test_swapped_encoder_layers_take_keyword_masks(wrap):
    x, _, causal, padding = _inputs()
    reference = EncoderStep(_encoder())(x, causal, padding)
    model = _encoder()
    for layer in model.layers:
        wrap(layer)
    step = EncoderStep(model)
    _assert_same(step(x, causal, padding), reference, step.weights)
    stats = swap_stats(model.layers[0])
    assert stats.tensors > 0 and stats.restored == stats.tensors, stats
