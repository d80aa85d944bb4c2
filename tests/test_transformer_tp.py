"""MindSpore's own ``nn.TransformerEncoder`` under tensor parallelism: ``MultiheadAttentionParallel``
on the attention and Colwise / Rowwise feed-forward on 2 CPU ranks against one device (loss,
every rank's gradient pieces, parameters after 2 SGD steps), in PyNative and ``ms.jit``; the
attention's own options (masks, ``batch_first``, unbatched inputs, weights, ``add_bias_kv``,
sequence-parallel layouts) in PyNative.

Tolerances: 1e-5 (float32, a few hundred terms per sum; the pieces compute the same products
in another order, about 1e-7 relative)."""
from __future__ import annotations

from typing import Callable, List, Tuple

import mindspore as ms
import numpy as np
from mindspore import nn

from hyper_parallel_ms.checkpoint import StateDictOptions, get_model_state_dict
from hyper_parallel_ms.mesh import init_device_mesh
from hyper_parallel_ms.nn import (ColwiseParallel, MultiheadAttentionParallel, RowwiseParallel, parameter_sharding,
                                  parallelize_module)
from hyper_parallel_ms.placement import Shard
from hyper_parallel_ms.testing import multi_rank
from hyper_parallel_ms.training import apply_activation_checkpointing, checkpoint_stats

TOL = 1e-5
D_MODEL, HEADS, FFN, SEQ, BATCH = 32, 4, 64, 6, 2
PLAN = {"layers.*.self_attn": MultiheadAttentionParallel(), "layers.*.dense1": ColwiseParallel(),
        "layers.*.dense2": RowwiseParallel()}


def _encoder() -> nn.Cell:
    layer = nn.TransformerEncoderLayer(D_MODEL, HEADS, FFN, dropout=0.0, batch_first=True)
    return nn.TransformerEncoder(layer, 2)


def _data(seed: int, *shape) -> ms.Tensor:
    return ms.Tensor(np.random.default_rng(seed).standard_normal(shape).astype(np.float32))


def _masks():
    causal = np.triu(np.full((SEQ, SEQ), -1e4, np.float32), 1)
    padding = np.zeros((BATCH, SEQ), np.float32)
    padding[1, -1] = -1e4                     # the last key of the second sequence is padding
    return ms.Tensor(causal), ms.Tensor(padding)


def piece_of(param, whole: np.ndarray) -> np.ndarray:
    """This rank's piece of ``whole`` (a one-device value of ``param``) as the parameter's sharding
    cuts it (in its global view: ``in_proj_weight`` is cut as ``(3, E, E)``)."""
    record = parameter_sharding(param)
    if record is None:
        return whole
    spec = record.spec
    return whole.reshape(spec.shape)[spec.layout.local_slices(spec.shape, spec.mesh.coordinate)]


def _close(got, want: np.ndarray, what: str) -> None:
    np.testing.assert_allclose(got.asnumpy() if hasattr(got, "asnumpy") else got, want, rtol=TOL, atol=TOL,
                               err_msg=what)


def compare_training(mesh, mode: str, wrap: Callable[[nn.Cell], None] = lambda m: None,
                     steps: int = 2) -> Tuple[List[float], nn.Cell]:
    """Train the encoder on one device and (with ``PLAN``, then ``wrap``) over ``mesh`` with SGD;
    check the loss each step, every gradient piece each step and the parameters after; return the
    losses and the parallel model."""
    ms.set_seed(0)
    ref = _encoder()
    ms.set_seed(0)
    par = _encoder()
    parallelize_module(par, mesh, PLAN)
    wrap(par)
    ref_params, par_params = ref.trainable_params(), par.trainable_params()
    assert [p.name for p in ref_params] == [p.name for p in par_params]
    assert par.layers[0].self_attn.num_heads == HEADS // mesh.size()
    src_mask, padding = _masks()

    def loss_of(model):
        def loss(x, target):
            out = model(x, src_mask=src_mask, src_key_padding_mask=padding)
            return ((out - target) ** 2).mean()
        return loss
    ref_step = ms.value_and_grad(loss_of(ref), None, ref_params)
    par_grad = ms.value_and_grad(loss_of(par), None, par_params)

    def par_step(x, target):
        return par_grad(x, target)
    if mode == "jit":
        par_step = ms.jit(par_step)
    ref_opt, par_opt = nn.SGD(ref_params, learning_rate=0.1), nn.SGD(par_params, learning_rate=0.1)
    losses = []
    for step in range(steps):
        x, target = _data(step, BATCH, SEQ, D_MODEL), _data(100 + step, BATCH, SEQ, D_MODEL)
        loss, grads = ref_step(x, target)
        p_loss, p_grads = par_step(x, target)
        _close(p_loss, loss.asnumpy(), f"{mode}: loss, step {step}")
        for p, g, rg in zip(par_params, p_grads, grads):
            assert g.shape == p.shape, (p.name, g.shape, p.shape)
            _close(g, piece_of(p, rg.asnumpy()), f"{mode}: gradient of {p.name}, step {step}")
        ref_opt(grads)
        par_opt(p_grads)
        losses.append(float(loss.asnumpy()))
    for p, rp in zip(par_params, ref_params):
        _close(p, piece_of(p, rp.asnumpy()), f"{mode}: {p.name} after {steps} SGD steps")
    if mode == "pynative":      # the whole parameters, gathered: in_proj_weight whole in its (3, E, E) view
        whole = get_model_state_dict(par, options=StateDictOptions(full_state_dict=True))
        assert tuple(whole["layers.0.self_attn.in_proj_weight"].shape) == (3, D_MODEL, D_MODEL)
        for rp in ref_params:
            _close(whole[rp.name].reshape(rp.shape), rp.asnumpy(), f"full state dict: {rp.name}")
    return losses, par


def _attention_cases(mesh) -> None:
    """The attention's options: output, weights and every gradient piece against one device (PyNative;
    loss and gradients of the first two also under ms.jit)."""
    tp, rank = mesh.size(), mesh.coordinate[0]
    x3 = _data(7, SEQ, BATCH, D_MODEL)
    mask3 = ms.Tensor(np.random.default_rng(8).standard_normal((BATCH * HEADS, SEQ, SEQ)).astype(np.float32))
    padding = ms.Tensor(np.array([[False] * SEQ, [False] * (SEQ - 1) + [True]]))
    cases = [
        # (name, constructor keywords, style keywords, inputs -> (args, kwargs), this rank's piece of the output)
        # the first two also compiled
        ("seq-first, 3-D mask, per-head weights", {}, {},
         lambda: ((x3, x3, x3), {"attn_mask": mask3, "average_attn_weights": False}), None),
        ("bias_k / bias_v, zero attention, bool padding, averaged weights", {"add_bias_kv": True,
                                                                           "add_zero_attn": True}, {},
         lambda: ((x3, x3, x3), {"key_padding_mask": padding}), None),
        ("cross-attention, separate kdim / vdim, no bias", {"kdim": 16, "vdim": 8, "has_bias": False}, {},
         lambda: ((x3, _data(9, SEQ + 1, BATCH, 16), _data(10, SEQ + 1, BATCH, 8)), {}), None),
        ("unbatched", {}, {}, lambda: ((x3[:, 0], x3[:, 0], x3[:, 0]), {}), None),
        ("sequence parallel: Shard(1) in and out, batch_first", {"batch_first": True},
         {"input_layouts": Shard(1), "output_layouts": Shard(1)},
         lambda: ((x3.swapaxes(0, 1),) * 3, {"need_weights": False}), (1, SEQ // tp)),
    ]
    for index, (name, make, style, inputs, seq_piece) in enumerate(cases):
        ms.set_seed(1)
        ref = nn.MultiheadAttention(D_MODEL, HEADS, **make)
        ms.set_seed(1)
        par = nn.MultiheadAttention(D_MODEL, HEADS, **make)
        parallelize_module(par, mesh, MultiheadAttentionParallel(**style))
        args, kwargs = inputs()
        local_args = args
        if seq_piece is not None:
            dim, size = seq_piece
            local_args = tuple(a[:, rank * size:(rank + 1) * size] for a in args)

        def run(model, given, compiled=False):
            def loss(*a):
                outs = model(*a, **kwargs)
                total = (outs[0] * outs[0]).sum()
                if len(outs) > 1:
                    total = total + (outs[1] * outs[1]).sum()
                return total
            step = ms.value_and_grad(loss, None, model.trainable_params())
            if compiled:
                step = ms.jit(step)
            value, grads = step(*given)
            return value, model(*given, **kwargs), grads
        loss, outs, grads = run(ref, args)
        p_loss, p_outs, p_grads = run(par, local_args)
        if index < 2:
            c_loss, _, c_grads = run(par, local_args, compiled=True)
            _close(c_loss, loss.asnumpy(), f"{name}, ms.jit: loss")
            for p, g, rg in zip(par.trainable_params(), c_grads, grads):
                _close(g, piece_of(p, rg.asnumpy()), f"{name}, ms.jit: gradient of {p.name}")
        want = outs[0].asnumpy()
        if seq_piece is not None:
            want = want[:, rank * seq_piece[1]:(rank + 1) * seq_piece[1]]
        _close(p_outs[0], want, f"{name}: output")
        for o, po in zip(outs[1:], p_outs[1:]):
            _close(po, o.asnumpy(), f"{name}: attention weights")
        if seq_piece is None:
            _close(p_loss, loss.asnumpy(), f"{name}: loss")
        for p, g, rg in zip(par.trainable_params(), p_grads, grads):
            _close(g, piece_of(p, rg.asnumpy()), f"{name}: gradient of {p.name}")


def _checkpoint_layers(model: nn.Cell) -> None:
    """Every encoder layer recomputed in the backward (MindSpore's encoder calls them with keywords)."""
    apply_activation_checkpointing(model, check_fn=lambda cell: isinstance(cell, nn.TransformerEncoderLayer))


@multi_rank(2, timeout=900)
def test_transformer_encoder_with_multihead_attention_parallel_matches_one_device():
    """PyNative and ms.jit in one rank call (compiling is slow on CPU), each also with every layer
    under apply_activation_checkpointing, then the attention's options."""
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    eager, _ = compare_training(mesh, "pynative")
    compiled, _ = compare_training(mesh, "jit")
    np.testing.assert_allclose(compiled, eager, rtol=TOL, atol=TOL)
    for mode in ("pynative", "jit"):
        losses, model = compare_training(mesh, mode, wrap=_checkpoint_layers)
        np.testing.assert_allclose(losses, eager, rtol=TOL, atol=TOL)
        if mode == "pynative":      # each layer's forward ran again in each step's backward
            assert [checkpoint_stats(layer).recomputes for layer in model.layers] == [2, 2]
    _attention_cases(mesh)
