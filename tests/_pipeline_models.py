"""The pipeline tests' model and helpers: a residual MLP of ``Block`` s between an embedding and a
head (each block counts its forwards, PyNative and compiled), its batches and optimizer, and a
schedule of any kind built over this rank's stages of it.

Example::

    schedule, models = make_schedule("1F1B", mesh, 4)       # this rank's stage(s) of Model(num_stages)
"""
from __future__ import annotations

import mindspore as ms
import numpy as np
from mindspore import Parameter, nn, ops

SCHEDULES = ("GPipe", "1F1B", "Interleaved1F1B", "LoopedBFS", "ZBVZeroBubble", "InterleavedZeroBubble", "DualPipeV")
# the schedules whose runtime paths differ; LoopedBFS is another order of Interleaved1F1B's actions,
# InterleavedZeroBubble and DualPipeV other orders of ZBVZeroBubble's and 1F1B's (their own parity
# runs once, on 2 ranks)
RUNTIME_SCHEDULES = ("GPipe", "1F1B", "Interleaved1F1B", "ZBVZeroBubble")
STAGES_PER_RANK = {"GPipe": 1, "1F1B": 1, "Interleaved1F1B": 2, "LoopedBFS": 2, "ZBVZeroBubble": 2,
                   "InterleavedZeroBubble": 2, "DualPipeV": 2}
BATCHES = (24, 48, 24)        # the second step changes every inter-stage shape, the third changes it back
WIDTH, IN, OUT = 8, 6, 4
RTOL, ATOL = 1e-5, 1e-6
# this MLP (tanh, mean-square loss) has no element with a mathematically zero gradient, so AdamW
# is compared at the plain tolerance everywhere (tests/_parity.py's zero-gradient rule does not arise)



class Block(nn.Cell):
    def __init__(self):
        super().__init__()
        self.dense = nn.Dense(WIDTH, WIDTH)
        # how many times this forward ran, as Python or as a compiled graph
        self.runs = Parameter(ms.Tensor(np.zeros(1, np.float32)), requires_grad=False)
        self.eager: list = []        # ... as Python (never under ms.jit, where the list is left alone)

    def construct(self, x):
        self.eager.append(1)
        ops.assign_add(self.runs, ops.ones((1,), ms.float32))
        return ops.tanh(self.dense(x)) + x


class Model(nn.Cell):
    def __init__(self, n_blocks: int):
        super().__init__()
        self.embed = nn.Dense(IN, WIDTH)
        self.layers = nn.CellList([Block() for _ in range(n_blocks)])
        self.head = nn.Dense(WIDTH, OUT)

    def construct(self, x):
        x = x if self.embed is None else self.embed(x)
        for block in self.layers:
            x = block(x)
        return x if self.head is None else self.head(x)

    def forwards(self) -> int:
        """Block forwards run so far (all blocks together)."""
        return int(sum(float(block.runs.asnumpy()[0]) for block in self.layers))

    def eager_forwards(self) -> int:
        """Block forwards run as Python (PyNative)."""
        return sum(len(block.eager) for block in self.layers)


def loss_fn(out, target):
    return ((out - target) ** 2).mean()


def batch(step: int, size: int):
    rs = np.random.RandomState(100 + step)
    return ms.Tensor(rs.randn(size, IN).astype(np.float32)), ms.Tensor(rs.randn(size, OUT).astype(np.float32))


def optimizer(params):
    return nn.AdamWeightDecay(params, learning_rate=0.01, beta1=0.9, beta2=0.999, weight_decay=0.01)


def make_schedule(name: str, mesh, n: int, *, loss=loss_fn, num_stages=None, stage_of=None, jit=False, prepare=None,
                  stages_per_rank=None):
    """``name``'s schedule over this rank's stages of ``Model`` (``stages_per_rank``: the schedule's
    usual count by default; 1 makes a looped schedule run its one-stage form)."""
    from hyper_parallel_ms import pipelining as pl

    pp, me = mesh.size(), mesh.get_local_rank()
    v = STAGES_PER_RANK[name] if stages_per_rank is None else stages_per_rank
    num_stages = pp * v if num_stages is None else num_stages
    held = pl.build_plan(name, pp, pp * v, stages_per_rank=v).stages_of(me) if stage_of is None else stage_of
    stages, models = [], []
    for s in held:
        ms.set_seed(0)
        model = pl.split_blocks(Model(num_stages), s, num_stages, first=("embed",), last=("head",))
        if prepare is not None:
            prepare(model)
        models.append(model)
        stages.append(pl.PipelineStage(model, s, num_stages, mesh=mesh, jit=jit))
    cls = pl.get_schedule_class(name)
    return cls(stages[0] if v == 1 and issubclass(cls, pl.PipelineScheduleSingle) else stages, n, loss), models


def one_device_run(num_stages: int, n: int):
    """Per step: the micro-batch losses and full-batch gradients (by name); then the parameters."""
    ms.set_seed(0)
    model = Model(num_stages)
    params = model.trainable_params()
    opt = optimizer(params)
    step_fn = ms.value_and_grad(lambda x, y: loss_fn(model(x), y), None, params)
    history = []
    for step, size in enumerate(BATCHES):
        x, y = batch(step, size)
        k = size // n
        mb_losses = [float(loss_fn(model(x[m * k:(m + 1) * k]), y[m * k:(m + 1) * k]).asnumpy()) for m in range(n)]
        _, grads = step_fn(x, y)
        history.append((mb_losses, {p.name: g.asnumpy() for p, g in zip(params, grads)}))
        opt(grads)
    return history, {p.name: p.asnumpy() for p in params}


# ----------------------------------------------------------------------------- a model nobody here wrote
VOCAB, D_MODEL, HEADS, FFN, SEQ = 32, 16, 2, 32, 4


class EncoderModel(nn.Cell):
    """MindSpore's own ``nn.TransformerEncoder`` (2 layers, batch_first, dropout 0, a final norm)
    between an embedding and a head; its ``construct`` knows nothing about pipeline stages."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, D_MODEL)
        layer = nn.TransformerEncoderLayer(D_MODEL, HEADS, FFN, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, 2, norm=nn.LayerNorm((D_MODEL,)))
        self.head = nn.Dense(D_MODEL, VOCAB)

    def construct(self, ids):
        return self.head(self.encoder(self.embed(ids)))


def token_loss(logits, target):
    return ops.cross_entropy(logits.reshape(-1, VOCAB), target.reshape(-1))


def token_batch(step: int, size: int):
    rs = np.random.RandomState(300 + step)
    return (ms.Tensor(rs.randint(0, VOCAB, (size, SEQ)).astype(np.int32)),
            ms.Tensor(rs.randint(0, VOCAB, (size, SEQ)).astype(np.int32)))
