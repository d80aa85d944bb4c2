"""The code examples of README.md and docs/ run: every Python block is marked either
``<!-- runs: tests/...::test_name -->`` (that test executes the block as written, read from the
page) or ``<!-- sketch: path -->`` (a shortened form of the runnable file or test at ``path``).

The README's training example, the collectives example, the whole training loop and the loss
parallel example run in one call on 2 CPU ranks and are compared with one device; the schedule
example runs in this process against the output and the bubble table the page prints."""
from __future__ import annotations

import contextlib
import importlib.util
import io
import re
import sys
import tempfile
from pathlib import Path
from types import ModuleType
from typing import Dict, List, Tuple

import mindspore as ms
import numpy as np

from hyper_parallel_ms.mesh import init_device_mesh
from hyper_parallel_ms.testing import run_on_ranks

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
PAGES = [ROOT / "README.md"] + sorted(DOCS.glob("*.md"))
_BLOCK = re.compile(r"(?:<!-- (runs|sketch): (\S+) -->\n\n)?```python\n(.*?)```", re.S)


def python_blocks(page: Path) -> List[Tuple[str, str, str]]:
    """``(kind, target, code)`` of each Python block of ``page``; kind is "" where no marker precedes it."""
    return [(m.group(1) or "", m.group(2) or "", m.group(3)) for m in _BLOCK.finditer(page.read_text())]


def block(page: Path, heading: str) -> str:
    """The first Python block after ``heading`` (a whole line of the page)."""
    text = "\n" + page.read_text()
    start = text.index(f"\n{heading}\n")
    return python_blocks_of(text[start:])[0]


def python_blocks_of(text: str) -> List[str]:
    return [m.group(3) for m in _BLOCK.finditer(text)]


def load(code: str, name: str, prelude: str = "") -> ModuleType:
    """``prelude`` + ``code`` as an imported module (a file: ms.jit reads a function's source)."""
    path = Path(tempfile.mkdtemp()) / f"{name}.py"
    path.write_text(prelude + code)
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def test_every_python_block_is_run_or_names_its_runnable_source():
    problems = []
    for page in PAGES:
        for kind, target, code in python_blocks(page):
            where = f"{page.relative_to(ROOT)}: block starting {code.splitlines()[0]!r}"
            if not kind:
                problems.append(f"{where}: no <!-- runs: ... --> or <!-- sketch: ... --> marker")
                continue
            file, _, test = target.partition("::")
            if not (ROOT / file).is_file():
                problems.append(f"{where}: {file} does not exist")
            elif kind == "runs":
                source = (ROOT / file).read_text()
                if not test or f"def {test}(" not in source:
                    problems.append(f"{where}: no test {target}")
    assert not problems, "\n".join(problems)
    assert sum(kind == "runs" for page in PAGES for kind, _, _ in python_blocks(page)) >= 5


# The names the whole-loop block of docs/training.md takes from the tensor-parallel script: a (dp, tp)
# mesh, a styled model, its optimizer, the dp reducer and the gradient of the scaled loss.
_LOOP_PRELUDE = """import mindspore as ms
import numpy as np
from mindspore import nn, ops
from hyper_parallel_ms import ColwiseParallel, GradientReducer, RowwiseParallel, init_device_mesh, parallelize_module


class MLP(nn.Cell):
    def __init__(self):
        super().__init__()
        self.up, self.down = nn.Dense(16, 64), nn.Dense(64, 16)

    def construct(self, x):
        return self.down(ops.relu(self.up(x)))


mesh = init_device_mesh("cpu", MESH_SHAPE, mesh_dim_names=("dp", "tp"))
ms.set_seed(0)
model = MLP()
parallelize_module(model, mesh["tp"], {"up": ColwiseParallel(), "down": RowwiseParallel()})
optimizer = nn.AdamWeightDecay(model.trainable_params(), learning_rate=1e-2)
reducer = GradientReducer(model.trainable_params(), dp_mesh=mesh, dp_dim="dp")


def scaled_loss(ids, labels):
    return scaler.scale(((model(ids) - labels) ** 2).mean())


grad_fn = ms.value_and_grad(scaled_loss, None, optimizer.parameters)
rng = np.random.default_rng(1)
ids, labels = (ms.Tensor(rng.standard_normal((8, 16)), ms.float32) for _ in range(2))
"""

# The names the loss-parallel block takes: a tp mesh, class-sharded logits and class targets.
_LOSS_PRELUDE = """import mindspore as ms
import numpy as np
from mindspore import nn
from hyper_parallel_ms import Shard, distribute_tensor, init_device_mesh

mesh = init_device_mesh("cpu", (WORLD,), mesh_dim_names=("tp",))
rng = np.random.default_rng(2)
logits = ms.Tensor(rng.standard_normal((4, 32000)), ms.float32)
target = ms.Tensor(rng.integers(0, 32000, (4,)), ms.int32)
logits_dt = distribute_tensor(logits, mesh, [Shard(-1)])
"""


def _whole_loop(world: Tuple[int, int]) -> Dict[str, object]:
    """The whole-loop block for one step on a (dp, tp) mesh: the loss, the verdict and the whole
    parameters after the step."""
    from hyper_parallel_ms import as_dtensor
    loop = load(block(DOCS / "training.md", "## The whole loop"), f"docs_whole_loop_{world[1]}",
                _LOOP_PRELUDE.replace("MESH_SHAPE", repr(world)))
    whole = [as_dtensor(p).full_tensor().asnumpy() if world[1] > 1 else p.asnumpy()
             for p in loop.optimizer.parameters]
    return {"loss": float(loop.loss), "finite": bool(loop.finite), "scale": float(loop.scaler.scale_value.asnumpy()),
            "params": whole}


def _loss_parallel(world: int) -> Tuple[float, float]:
    """The loss-parallel block: the context's label-smoothed loss and ParallelCrossEntropy's."""
    module = load(block(DOCS / "training.md", "## Loss parallel"), f"docs_loss_parallel_{world}",
                  _LOSS_PRELUDE.replace("WORLD", str(world)))
    return float(module.loss.full_tensor()), float(module.local_loss)


def _examples_on_a_rank() -> Dict[str, object]:
    """Every rank: the README's example on a tp mesh of 2, the collectives example, the whole loop
    on a (1, 2) mesh and the loss-parallel example."""
    from mindspore import communication
    readme = load(block(ROOT / "README.md", "## A training script"), "readme_training_example")
    losses = readme.train(init_device_mesh("cpu", (2,), mesh_dim_names=("tp",)))
    with contextlib.redirect_stdout(io.StringIO()):
        coll = load(block(DOCS / "collectives.md", "# Collectives"), "docs_collectives")
    return {"rank": communication.get_rank(), "readme": losses,
            "collectives": (coll.y.asnumpy(), coll.z.asnumpy(), coll.w.asnumpy(), coll.mode.get_comm_counts()),
            "loop": _whole_loop((1, 2)), "loss_parallel": _loss_parallel(2)}


def test_examples_on_two_ranks():
    ranks = run_on_ranks(_examples_on_a_rank, 2)
    readme = load(block(ROOT / "README.md", "## A training script"), "readme_training_example")
    one_device = readme.train(init_device_mesh("cpu", (1,), mesh_dim_names=("tp",)))
    loop = _whole_loop((1, 1))
    smoothed, plain = _loss_parallel(1)
    x = np.arange(8, dtype=np.float32).reshape(2, 4)
    for got in ranks:
        r = got["rank"]
        np.testing.assert_allclose(got["readme"], one_device, rtol=1e-5)
        assert one_device[-1] < one_device[0] / 2, one_device          # it trains
        y, z, w, counts = got["collectives"]
        np.testing.assert_array_equal(y, np.concatenate([x, x]))
        np.testing.assert_array_equal(z, y[:, 2 * r:2 * r + 2])
        np.testing.assert_array_equal(w, np.concatenate([x[:, 2 * r:2 * r + 2]] * 2))
        assert counts == {"all_reduce": 1}, counts
        assert got["loop"]["finite"] and loop["finite"] and got["loop"]["scale"] == loop["scale"]
        np.testing.assert_allclose(got["loop"]["loss"], loop["loss"], rtol=1e-5)
        for p, q in zip(got["loop"]["params"], loop["params"]):
            np.testing.assert_allclose(p, q, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(got["loss_parallel"], (smoothed, plain), rtol=1e-5)
    assert abs(plain - smoothed) > 1e-3                            # label smoothing was applied


def test_schedules_as_data():
    page = DOCS / "pipelining.md"
    text = page.read_text()
    with contextlib.redirect_stdout(io.StringIO()) as out:
        module = load(block(page, "## Schedules as data"), "docs_schedules_as_data")
    printed = text[text.index("<!-- output of the block above"):]
    printed = printed[printed.index("```text\n") + len("```text\n"):]
    printed = printed[:printed.index("```")]
    assert out.getvalue().startswith(printed), out.getvalue()
    assert str(module.plan.actions[1]) == "(1RECV_F0, 1F0, 1RECV_F1, 1B0, 1SEND_B0, 1F1, 1B1, 1SEND_B1)"
    assert abs(module.plan.bubble_fraction() - 1 / 3) < 1e-12


def test_the_bubble_table_of_the_pipelining_page():
    from hyper_parallel_ms.pipelining import B, F, I, W, build_plan
    text = (DOCS / "pipelining.md").read_text()
    header = "| pp | n | GPipe | 1F1B | Interleaved1F1B | ZBVZeroBubble | InterleavedZeroBubble | DualPipeV |"
    rows = text[text.index(header):].splitlines()[2:5]
    schedules = header.strip("|").split("|")[2:8]
    for row in rows:
        cells = [c.strip() for c in row.strip("|").split("|")]
        pp, n = int(cells[0]), int(cells[1])
        for name, cell in zip(schedules, cells[2:8]):
            got = build_plan(name.strip(), pp, n).bubble_fraction({F: 1, I: 1, W: 1, B: 2})
            assert f"{got:.3f}" == cell, (name, pp, n, got, cell)
        assert f"{(pp - 1) / (2 * n + pp - 1):.3f}" == cells[8]
