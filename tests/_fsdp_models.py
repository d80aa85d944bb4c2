"""Tiny models, data and the single-device comparison shared by the fully_shard / hsdp tests."""
from __future__ import annotations

from typing import Callable, List, Optional

import mindspore as ms
import numpy as np
from mindspore import nn, ops

from hyper_parallel_ms import comm
from hyper_parallel_ms.comm import CommDebugMode

from tests._parity import STEPS, gathered


class Block(nn.Cell):
    """Uneven sizes: 7 rows are (4, 3) pieces on 2 ranks, (2, 2, 2, 1) on 4."""

    def __init__(self, dim: int = 8, hidden: int = 7) -> None:
        super().__init__()
        self.up = nn.Dense(dim, hidden)
        self.down = nn.Dense(hidden, dim)

    def construct(self, x):
        return x + self.down(ops.relu(self.up(x)))


class Net(nn.Cell):
    def __init__(self, dim: int = 8, blocks: int = 2, hidden: int = 7) -> None:
        super().__init__()
        self.inp = nn.Dense(dim, dim)
        self.layers = nn.CellList([Block(dim, hidden) for _ in range(blocks)])
        self.head = nn.Dense(dim, 3)

    def construct(self, x):
        x = self.inp(x)
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def per_block(mesh, reshard_after_forward=True) -> Callable:
    """A ``shard`` for :func:`compare`: fully_shard each block, then the root."""
    from hyper_parallel_ms.fsdp import fully_shard

    def shard(model):
        for layer in model.layers:
            fully_shard(layer, mesh=mesh, reshard_after_forward=reshard_after_forward)
        fully_shard(model, mesh=mesh, reshard_after_forward=reshard_after_forward)
    return shard


def batch(step: int, rows: int = 8, dim: int = 8):
    return ms.Tensor(np.random.default_rng(100 + step).standard_normal((rows, dim)).astype(np.float32))


def loss_of(model, x):
    return (model(x) ** 2).mean()


def make_optimizer(kind: str, params):
    if kind == "sgd":
        return nn.SGD(params, learning_rate=0.1)
    if kind == "adam":
        return nn.Adam(params, learning_rate=0.01)
    return nn.AdamWeightDecay(params, learning_rate=0.01, weight_decay=0.01)


def accumulate_4(set_sync: str) -> Callable:
    """A ``train`` for :func:`compare`: 4 micro-steps with gradient sync (turned on and off by the
    model's method ``set_sync``) on the last only; the mean loss and mean of the micro-gradients."""
    def train(model, step, x):
        rows = x.shape[0] // 4
        total_loss, total = 0.0, None
        for i in range(4):
            getattr(model, set_sync)(i == 3)
            loss, grads = step(x[i * rows:(i + 1) * rows])
            total_loss = total_loss + loss
            total = grads if total is None else tuple(a + b for a, b in zip(total, grads))
        return total_loss / 4, tuple(g / 4 for g in total)
    return train


class GradStep(nn.Cell):
    """The loss and the gradients of ``model``'s parameters, as one Cell (compiled in GRAPH_MODE)."""

    def __init__(self, model, params) -> None:
        super().__init__()
        self.model = model
        self.weights = ms.ParameterTuple(params)

    def loss(self, x):
        return loss_of(self.model, x)

    def construct(self, x):
        return ms.value_and_grad(self.loss, None, self.weights)(x)


class _Graph:
    """Run a callable in GRAPH_MODE."""

    def __init__(self, fn) -> None:
        self.fn = fn

    def __call__(self, *args):
        ms.set_context(mode=ms.GRAPH_MODE)
        try:
            return self.fn(*args)
        finally:
            ms.set_context(mode=ms.PYNATIVE_MODE)


def compiled(mode: str, cell: nn.Cell) -> Callable:
    """``cell`` called in ``mode``: ``"pynative"``, ``"jit"`` (inside ``ms.jit``) or ``"graph"`` (GRAPH_MODE)."""
    if mode == "pynative":
        return cell
    if mode == "jit":
        def run(*args):
            return cell(*args)
        return ms.jit(run)
    if mode == "graph":
        return _Graph(cell)
    raise ValueError(f"mode must be 'pynative', 'jit' or 'graph', got {mode!r}")


def compare(shard: Callable[[nn.Cell], None], dp_index: int, dp_size: int, *, optimizer: str = "sgd",
            steps: int = STEPS, tol: float = 1e-5, loss_mesh=None, make_model: Callable = Net,
            counts: Optional[List] = None, train: Optional[Callable] = None, dim: int = 8,
            rows: int = 8, make_par: Optional[Callable] = None, mode: str = "pynative",
            compile_optimizer: bool = False) -> List[float]:
    """Train the single-device model on the whole batch and the sharded one on this dp rank's rows;
    compare the loss each step and every parameter after ``steps`` optimizer steps.
    ``counts`` collects each step's CommDebugMode counts; ``mode``: how the sharded model's gradient
    step runs (see :func:`compiled`), its optimizer too with ``compile_optimizer``."""
    ms.set_seed(0)
    ref = make_model()
    ms.set_seed(0)
    par = (make_par or make_model)()
    shard(par)
    ref_params, par_params = ref.trainable_params(), par.trainable_params()
    assert [p.name for p in ref_params] == [p.name for p in par_params]
    ref_opt, par_opt = make_optimizer(optimizer, ref_params), make_optimizer(optimizer, par_params)
    ref_step = ms.value_and_grad(lambda x: loss_of(ref, x), None, ref_params)
    if mode == "pynative":
        par_step = ms.value_and_grad(lambda x: loss_of(par, x), None, par_params)
    else:
        par_step = compiled(mode, GradStep(par, par_params))
        par_opt = compiled(mode, par_opt) if compile_optimizer else par_opt
    losses = []
    for step in range(steps):
        x = batch(step, rows, dim)
        local = rows // dp_size
        loss, grads = ref_step(x)
        with CommDebugMode() as mode:
            if train is None:
                p_loss, p_grads = par_step(x[dp_index * local:(dp_index + 1) * local])
            else:
                p_loss, p_grads = train(par, par_step, x[dp_index * local:(dp_index + 1) * local])
        if counts is not None:
            counts.append(mode.get_comm_counts())
        for d in range(loss_mesh.ndim if loss_mesh is not None else 0):
            p_loss = comm.all_reduce(p_loss, loss_mesh, d, op="avg")
        np.testing.assert_allclose(p_loss.asnumpy(), loss.asnumpy(), rtol=tol, atol=tol, err_msg=f"loss, step {step}")
        losses.append(float(loss.asnumpy()))
        ref_opt(grads)
        par_opt(p_grads)
    for p, rp in zip(par_params, ref_params):
        np.testing.assert_allclose(gathered(p, p), rp.asnumpy(), rtol=tol, atol=tol,
                                   err_msg=f"{p.name} after {steps} {optimizer} steps")
    return losses
