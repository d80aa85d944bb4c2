"""Every style and every conversion direction (R->S, S->R, S(i)->S(j), P->R, P->S) on a Cell
held as an attribute, as a CellList element and as a SequentialCell element, in PyNative,
inside ``ms.jit`` and in a GRAPH_MODE train-step Cell: forward values and gradients against
the single-device model.

One model holds the three positions (one block each), so each mode compiles once."""
from __future__ import annotations

import mindspore as ms
import numpy as np
import pytest
from mindspore import nn, ops

from hyper_parallel_ms.mesh import init_device_mesh
from hyper_parallel_ms.nn import (ColwiseParallel, GradientReducer, PrepareModuleInput, PrepareModuleInputOutput,
                                  PrepareModuleOutput, RowwiseParallel, SequenceParallel, parallelize_module)
from hyper_parallel_ms.placement import Replicate, Shard
from hyper_parallel_ms.testing import multi_rank

from tests._parity import gathered

DIM, HIDDEN, VOCAB = 8, 8, 12


class Scale(nn.Cell):
    """A parameter-free Cell: the place where a PrepareModule* style converts."""

    def __init__(self, factor: float) -> None:
        super().__init__()
        self.factor = factor

    def construct(self, x):
        return x * self.factor


class PropertyDense(nn.Dense):
    """A Dense reading its weight through a property: compiled as graph code only if the class a
    style swaps in declares the property again (else a constant: no gradient for the weight)."""

    @property
    def scaled_weight(self):
        return self.weight * 1.5

    def construct(self, x):
        return ops.matmul(x, self.scaled_weight.T) + self.bias


class Block(nn.Cell):
    def __init__(self) -> None:
        super().__init__()
        self.enter = Scale(1.5)               # R -> S(1)
        self.norm = nn.LayerNorm((DIM,))      # SequenceParallel on S(1)
        self.swap = Scale(0.5)                # S(1) -> S(2) in, S(2) -> R out
        self.up = nn.Dense(DIM, HIDDEN)       # Colwise
        self.down = nn.Dense(HIDDEN, DIM)     # Rowwise, P -> S(1)
        self.leave = Scale(2.0)               # S(1) -> R out
        self.up2 = PropertyDense(DIM, HIDDEN)  # Colwise, weight read through a property
        self.down2 = nn.Dense(HIDDEN, DIM)    # Rowwise, P -> R

    def construct(self, x):
        h = self.swap(self.norm(self.enter(x)))
        h = self.leave(self.down(ops.relu(self.up(h))))
        return x + self.down2(ops.tanh(self.up2(h)))


class Model(nn.Cell):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)                     # Rowwise: P -> R
        self.attr = Block()
        self.listed = nn.CellList([Block()])
        self.seq = nn.SequentialCell([Block()])

    def construct(self, ids):
        x = self.embed(ids)
        a = self.attr(x)
        b = a
        for blk in self.listed:
            b = blk(b)
        return a, b, self.seq(b)


def block_plan() -> dict:
    return {
        "enter": PrepareModuleInput(input_layouts=(Replicate(),), desired_input_layouts=(Shard(1),),
                                    use_local_output=True),
        "norm": SequenceParallel(use_local_output=True),
        "swap": PrepareModuleInputOutput(input_layouts=(Shard(1),), desired_input_layouts=(Shard(2),),
                                         use_local_input=True, output_layouts=(Shard(2),),
                                         desired_output_layouts=(Replicate(),)),
        "up": ColwiseParallel(),
        "down": RowwiseParallel(output_layouts=Shard(1)),
        "leave": PrepareModuleOutput(output_layouts=(Shard(1),), desired_output_layouts=(Replicate(),)),
        "up2": ColwiseParallel(),
        "down2": RowwiseParallel(),
    }


def model_plan() -> dict:
    return {"embed": RowwiseParallel(input_layouts=Replicate()), "attr": block_plan(),
            "listed.0": block_plan(), "seq.0": block_plan()}


def _loss(model, ids):
    a, b, c = model(ids)
    return (a ** 2).mean() + (b ** 2).mean() + (c ** 2).mean()


class TrainStep(nn.Cell):
    """A GRAPH_MODE train-step Cell: the model's outputs and the (reduced) gradients."""

    def __init__(self, model, reducer) -> None:
        super().__init__()
        self.model = model
        self.reducer = reducer
        self.weights = ms.ParameterTuple(model.trainable_params())
        self.grad = ops.GradOperation(get_by_list=True)

    def loss(self, ids):
        return _loss(self.model, ids)

    def construct(self, ids):
        return self.model(ids), self.reducer(self.grad(self.loss, self.weights)(ids))


def _outputs_and_grads(model, ids, mode: str, reducer=None):
    if mode == "graph":
        step = TrainStep(model, reducer)
        ms.set_context(mode=ms.GRAPH_MODE)
        try:
            return step(ids)
        finally:
            ms.set_context(mode=ms.PYNATIVE_MODE)
    def loss(i):
        return _loss(model, i)
    grad_fn = ms.grad(loss, None, model.trainable_params())

    def run(i):
        g = grad_fn(i)
        return model(i), (reducer(g) if reducer is not None else g)
    return (ms.jit(run) if mode == "jit" else run)(ids)


@pytest.mark.parametrize("mode", ["pynative", "jit", "graph"])
@multi_rank(2)
def test_styles_and_conversions_in_every_mode_and_container(mode):
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    ids = ms.Tensor(np.random.default_rng(3).integers(0, VOCAB, (2, 4)).astype(np.int32))
    ms.set_seed(0)
    ref = Model()
    ref_outs, ref_grads = _outputs_and_grads(ref, ids, "pynative")
    ms.set_seed(0)
    par = Model()
    parallelize_module(par, mesh, model_plan())
    reducer = GradientReducer(par.trainable_params())
    outs, grads = _outputs_and_grads(par, ids, mode, reducer)
    for where, o, r in zip(("attribute", "CellList element", "SequentialCell element"), outs, ref_outs):
        assert o.shape == r.shape, f"{mode}: output after the {where} has shape {o.shape}, expected {r.shape}"
        np.testing.assert_allclose(o.asnumpy(), r.asnumpy(), rtol=1e-5, atol=1e-5,
                                   err_msg=f"{mode}: output after the {where}")
    for p, g, rg in zip(par.trainable_params(), grads, ref_grads):
        np.testing.assert_allclose(gathered(p, g), rg.asnumpy(), rtol=1e-5, atol=1e-5,
                                   err_msg=f"{mode}: gradient of {p.name}")
