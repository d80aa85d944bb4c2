"""A GPT-3-style transformer layer (Korthikanti et al. 2022's): LayerNorm, causal self-attention
with separate q / k / v projections (biases), attention dropout, residual dropout, LayerNorm, an
MLP of 4h with tanh GeLU; its tensor-parallel plans (TP, TP + SP); and the measurement of the
activations MindSpore's autodiff keeps for its backward on real ranks.

Used by ``tests/test_activation_memory.py``.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Optional

import numpy as np
from mindspore import Tensor, nn, ops
from mindspore.common import dtype as mstype

__all__ = ["GPTShape", "GPTLayer", "gpt_plan", "formula_bytes", "measure_rank", "measure_cases", "planned_bytes"]


@dataclass(frozen=True)
class GPTShape:
    """h hidden, a heads, s sequence, b micro-batch, t tensor-parallel ranks, p dropout, dtype of the
    parameters and activations (``"float16"`` or ``"float32"``)."""
    h: int = 512
    a: int = 8
    s: int = 512
    b: int = 1
    t: int = 2
    p: float = 0.0
    dtype: str = "float16"

    @property
    def itemsize(self) -> int:
        return np.dtype(self.dtype).itemsize


class Attention(nn.Cell):
    def __init__(self, h: int, a: int, p: float, dtype) -> None:
        super().__init__()
        self.wq, self.wk, self.wv, self.wo = (nn.Dense(h, h, dtype=dtype) for _ in range(4))
        self.head_dim = h // a
        self.scale = 1.0 / float(np.sqrt(self.head_dim))
        self.attn_drop = nn.Dropout(p=p) if p > 0 else nn.Identity()

    def construct(self, x, mask):
        b, s = x.shape[0], x.shape[1]
        q = self.wq(x).reshape(b, s, -1, self.head_dim).transpose(0, 2, 1, 3)
        k = self.wk(x).reshape(b, s, -1, self.head_dim).transpose(0, 2, 1, 3)
        v = self.wv(x).reshape(b, s, -1, self.head_dim).transpose(0, 2, 1, 3)
        scores = ops.matmul(q * self.scale, k.transpose(0, 1, 3, 2)) + mask
        probs = self.attn_drop(ops.softmax(scores, -1))
        out = ops.matmul(probs, v).transpose(0, 2, 1, 3).reshape(b, s, -1)
        return self.wo(out)


class MLP(nn.Cell):
    def __init__(self, h: int, dtype) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Dense(h, 4 * h, dtype=dtype), nn.Dense(4 * h, h, dtype=dtype)

    def construct(self, x):
        return self.fc2(ops.gelu(self.fc1(x), approximate="tanh"))


class GPTLayer(nn.Cell):
    """``x + drop(attn(ln1(x)))``, then ``+ drop(mlp(ln2(.)))``; ``x``: (b, s, h), causal."""

    def __init__(self, shape: GPTShape) -> None:
        super().__init__()
        h, p = shape.h, shape.p
        dtype = getattr(mstype, shape.dtype)
        self.ln1, self.ln2 = nn.LayerNorm((h,), dtype=dtype), nn.LayerNorm((h,), dtype=dtype)
        self.attn = Attention(h, shape.a, p, dtype)
        self.mlp = MLP(h, dtype)
        self.drop1 = nn.Dropout(p=p) if p > 0 else nn.Identity()
        self.drop2 = nn.Dropout(p=p) if p > 0 else nn.Identity()
        self.mask = Tensor(np.triu(np.full((shape.s, shape.s), -6e4, shape.dtype), 1))

    def construct(self, x):
        x = x + self.drop1(self.attn(self.ln1(x), self.mask))
        return x + self.drop2(self.mlp(self.ln2(x)))


def gpt_plan(sequence_parallel: bool, dropout: bool) -> dict:
    """Megatron's plan of the layer: q / k / v and fc1 Colwise, wo and fc2 Rowwise (the block
    inputs reach only Colwise layers: one gradient reduction each); ``sequence_parallel``: norms and
    residual dropouts on sequence pieces, Rowwise outputs reduce-scattered; attention dropout on
    this rank's heads (its piece of the one-device mask)."""
    from hyper_parallel_ms.nn import ColwiseParallel, PrepareModuleInput, RowwiseParallel, SequenceParallel
    from hyper_parallel_ms.placement import Replicate, Shard
    rep, seq = Replicate(), Shard(1)
    src = seq if sequence_parallel else rep
    plan = {
        "attn": PrepareModuleInput(input_layouts=(src, None), desired_input_layouts=(rep, None),
                                   defer_colwise_grads=True, use_local_output=True),
        "attn.w[qkv]": ColwiseParallel(),
        "attn.wo": RowwiseParallel(output_layouts=src),
        "mlp": PrepareModuleInput(input_layouts=(src,), desired_input_layouts=(rep,), defer_colwise_grads=True,
                                  use_local_output=True),
        "mlp.fc1": ColwiseParallel(),
        "mlp.fc2": RowwiseParallel(output_layouts=src),
    }
    if dropout:
        plan["attn.attn_drop"] = SequenceParallel(sequence_dim=1, use_local_output=True)
    if sequence_parallel:
        plan.update({name: SequenceParallel(use_local_output=True) for name in ("ln1", "ln2")})
        if dropout:
            plan.update({name: SequenceParallel(use_local_output=True) for name in ("drop1", "drop2")})
    return plan


def formula_bytes(shape: GPTShape, sequence_parallel: bool, itemsize: int = 2, recompute: str = "none") -> float:
    """Korthikanti et al.'s activation bytes per layer, for ``itemsize``-byte activations and 1-byte
    dropout masks (the paper: itemsize 2): TP ``sbh(10 + 24/t) + 5as^2b/t`` (with dropout), TP + SP
    ``(34 sbh + 5 as^2 b) / t``; without dropout the masks and the dropout outputs go: TP ``sbh(8 +
    24/t) + 2as^2b/t``, TP + SP ``(32 sbh + 2 as^2 b) / t``. ``recompute``: ``"selective"`` (the
    attention core recomputed: no s^2 term), ``"full"`` (``2sbh``, the layer input, only)."""
    s, b, h, a, t = shape.s, shape.b, shape.h, shape.a, shape.t
    sbh, as2b = s * b * h, a * s * s * b
    k = itemsize / 2                              # the paper counts 2-byte activations
    drop = shape.p > 0
    if recompute == "full":
        return k * 2 * sbh / (t if sequence_parallel else 1)
    masks = (1 if drop else 0) * 2 * sbh          # the two residual masks, 1 byte each
    replicated = k * 8 * sbh + masks               # norms' inputs, q/k/v and fc1 inputs (+ masks)
    split = k * 24 * sbh
    core = (k * 2 + (1 + k * 2 if drop else 0)) * as2b     # softmax output (+ mask + dropout output)
    if recompute == "selective":
        core = 0.0
    if sequence_parallel:
        return (replicated + split + core) / t
    return replicated + (split + core) / t


def measure_rank(shape: dict, sequence_parallel: Optional[bool], recompute: str = "none",
                 seed: int = 0) -> Dict[str, object]:
    """On each rank (``sequence_parallel`` None: one device, no plan): the layer under its plan,
    one forward and backward; the activations MindSpore's autodiff kept for the backward (every
    tensor handed to its saved-tensor hooks that is not a Parameter's storage, each storage once,
    addresses read after the forward ran), their bytes and a listing. ``shape``: a
    :class:`GPTShape`'s fields (plain values: the ranks unpickle arguments before importing this
    module)."""
    import mindspore as ms
    from hyper_parallel_ms.mesh import init_device_mesh
    from hyper_parallel_ms.nn import parallelize_module
    if ms.get_context("device_target") != "CPU":
        ms.set_device("CPU")
    shape = GPTShape(**shape)
    ms.set_seed(seed)
    layer = GPTLayer(shape)
    layer.set_train(True)
    s_local = shape.s
    if sequence_parallel is not None:
        mesh = init_device_mesh("cpu", (shape.t,), mesh_dim_names=("tp",))
        parallelize_module(layer, mesh, gpt_plan(sequence_parallel, shape.p > 0))
        if sequence_parallel:
            s_local = shape.s // shape.t
    if recompute != "none":
        from hyper_parallel_ms.training import checkpoint_wrapper
        if recompute == "full":
            checkpoint_wrapper(layer)
        else:
            checkpoint_wrapper(layer.attn, policy=recompute)
    rng = np.random.default_rng(seed)
    x = Tensor(rng.standard_normal((shape.b, s_local, shape.h)).astype(shape.dtype))
    params = layer.trainable_params()
    kept = []

    def pack(t):
        kept.append(t)
        return t
    grad_fn = ms.grad(lambda inp: layer(inp).sum(), grad_position=0, weights=params)
    # a checkpoint's forward keeps op outputs itself (not through the saved-tensor hooks): those its
    # policy names, and every policy those of random ops; read them when its forward ends
    from hyper_parallel_ms.training import _policies
    exits = {cls: cls.__exit__ for cls in (_policies._RecordOutputs, _policies._SaveOutputs)}
    own = {cls for cls in exits if "__exit__" in cls.__dict__}

    def counting(cls):
        def exit_and_count(self, *exc):
            result = exits[cls](self, *exc)
            for _, out in getattr(self, "record", None) or self.saved:
                for t in (out if isinstance(out, tuple) else (out,)):
                    if isinstance(t, Tensor):
                        kept.append(t)
            return result
        return exit_and_count
    for cls in exits:
        cls.__exit__ = counting(cls)
    try:
        with ms.saved_tensors_hooks(pack, lambda t: t):
            grads = grad_fn(x)
    finally:
        for cls, original in exits.items():
            if cls in own:
                cls.__exit__ = original
            else:
                del cls.__exit__
    values = [grads[0].asnumpy()] + [g.asnumpy() for g in grads[1]]
    param_ptrs = {p.data_ptr() for p in layer.get_parameters()}
    seen, listing = {}, []
    for t in kept:
        ptr = t.data_ptr()
        if ptr in param_ptrs or ptr in seen:
            continue
        seen[ptr] = t.nbytes
        listing.append((tuple(t.shape), str(t.dtype), t.nbytes))
    return {"bytes": sum(seen.values()), "listing": listing, "grads": values}


def measure_cases(cases: list) -> list:
    """On each rank: :func:`measure_rank` of each ``(shape fields, sequence_parallel, recompute)``
    case, as ``(bytes, largest gradient difference)``; the difference is to the case with the same
    shape and ``sequence_parallel`` without recomputation, which must come earlier (0.0 for it)."""
    plain, out = {}, []
    for shape, sequence_parallel, recompute in cases:
        res = measure_rank(shape, sequence_parallel, recompute)
        key = (tuple(sorted(shape.items())), sequence_parallel)
        if recompute == "none":
            plain[key] = res["grads"]
        diff = max(float(np.abs(a.astype(np.float64) - b.astype(np.float64)).max())
                   for a, b in zip(res["grads"], plain[key]))
        out.append((res["bytes"], diff))
    return out


def planned_bytes(shape: GPTShape, sequence_parallel: Optional[bool], recompute: str = "none") -> int:
    """The planner's activation bytes per layer: ``simulate(...)[0].activation_bytes`` of two layers
    less that of one (the peak of a step also holds one layer's recompute, or its backward's
    transients, once), each layer under its plan on a simulated mesh of ``shape.t`` ranks, built and
    stepped as :func:`measure_rank` does."""
    return _planned(shape, sequence_parallel, recompute, 2) - _planned(shape, sequence_parallel, recompute, 1)


def _planned(shape: GPTShape, sequence_parallel: Optional[bool], recompute: str, layers: int) -> int:
    import mindspore as ms
    from hyper_parallel_ms import no_init_parameters, simulate
    from hyper_parallel_ms.nn import parallelize_module
    from hyper_parallel_ms.training import checkpoint_wrapper

    def build(mesh):
        ms.set_seed(0)
        with no_init_parameters():
            model = nn.SequentialCell([GPTLayer(shape) for _ in range(layers)])
        model.set_train(True)
        s_local = shape.s
        for layer in model:
            if sequence_parallel is not None:
                parallelize_module(layer, mesh, gpt_plan(sequence_parallel, shape.p > 0))
            if recompute == "full":
                checkpoint_wrapper(layer)
            elif recompute != "none":
                checkpoint_wrapper(layer.attn, policy=recompute)
        if sequence_parallel:
            s_local = shape.s // shape.t
        x = ms.Tensor(np.zeros((shape.b, s_local, shape.h), shape.dtype))
        optimizer = nn.SGD(model.trainable_params())
        grad_fn = ms.grad(lambda inp: model(inp).sum(), grad_position=0, weights=optimizer.parameters)

        def step():
            grad_fn(x)
        return model, optimizer, step
    ranks = 1 if sequence_parallel is None else shape.t
    report = simulate(build, mesh_shape=(ranks,), mesh_dim_names=("tp",), device_type="cpu", ranks=[0])
    assert report.ok, report.table()
    return report[0].activation_bytes
