"""The hand-written global-norm recipe of docs/training.md (the Python block of "The norm by hand",
run as written) gives the single-device global norm on TP and fully_shard gradients, in PyNative and
ms.jit; the per-rank norm MindSpore's clip_by_global_norm would use does not."""
from __future__ import annotations

import importlib.util
import re
import sys
import tempfile
from pathlib import Path

import mindspore as ms
import numpy as np
from mindspore import nn, ops

from hyper_parallel_ms.mesh import init_device_mesh
from hyper_parallel_ms.testing import multi_rank

from tests._fsdp_models import Net, batch, loss_of

ROOT = Path(__file__).resolve().parent.parent


def _recipe(folder: str) -> dict:
    """The docs block as a module (a file: ms.jit reads a function's source)."""
    text = (ROOT / "docs" / "training.md").read_text()
    item = text[text.index("## The norm by hand"):]
    code = re.search(r"```python\n(.*?)```", item, re.S).group(1)
    path = Path(folder) / "docs_clip_recipe.py"
    path.write_text(code)
    spec = importlib.util.spec_from_file_location("docs_clip_recipe", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module              # MindSpore's parser imports it by name
    spec.loader.exec_module(module)
    return vars(module)


class MLP(nn.Cell):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Dense(8, 12)
        self.down = nn.Dense(12, 8)

    def construct(self, x):
        return self.down(ops.relu(self.up(x)))


def _grads(model, x):
    return ms.value_and_grad(lambda v: loss_of(model, v), None, model.trainable_params())(x)[1]


def _norm(grads) -> float:
    return float(np.sqrt(sum(float((g.asnumpy().astype(np.float64) ** 2).sum()) for g in grads)))


@multi_rank(2)
def test_recipe_gives_the_single_device_norm_for_tp_and_fully_shard():
    from hyper_parallel_ms import fully_shard
    from hyper_parallel_ms.nn import ColwiseParallel, GradientReducer, RowwiseParallel, parallelize_module
    recipe = _recipe(tempfile.mkdtemp())
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("dp",))
    x = batch(0)
    for build, shard in (
            (MLP, lambda m: parallelize_module(m, mesh, {"up": ColwiseParallel(), "down": RowwiseParallel()})),
            (Net, lambda m: [fully_shard(b, mesh=mesh) for b in m.layers] and fully_shard(m, mesh=mesh))):
        ms.set_seed(0)
        want = _norm(_grads(build(), x))
        ms.set_seed(0)
        model = build()
        shard(model)
        params = model.trainable_params()
        grads = GradientReducer(params)(_grads(model, x))
        dims = [recipe["split_dims"](p) for p in params]
        assert any(dims), dims
        got = float(recipe["global_grad_norm"](grads, dims, mesh).asnumpy())

        def norm_of(*g):
            return recipe["global_grad_norm"](g, dims, mesh)
        jitted = float(ms.jit(norm_of)(*grads).asnumpy())
        assert abs(got - want) <= 1e-5 * want and abs(jitted - want) <= 1e-5 * want, (build.__name__, got, jitted, want)
        assert abs(_norm(grads) - want) > 1e-3 * want, "the per-rank norm should differ (the bug this recipe fixes)"
        clipped = recipe["clip_grads"](grads, dims, mesh, want / 2)
        ratio = float(recipe["global_grad_norm"](clipped, dims, mesh).asnumpy()) / (want / 2)
        assert abs(ratio - 1) <= 1e-5, ratio
