"""The rank side of tests/test_compat_activation.py: MindFormers 2.1.0's own activation-checkpoint
applier (``mindformers.pynative.distributed.activation_checkpoint.apply_ac``) on a small decoder,
through HyperParallel's activation-checkpoint face served by ``alias_hyper_parallel``."""
from __future__ import annotations

from typing import Any, Dict, List

import numpy as np

HIDDEN, LAYERS, ROWS = 16, 2, 6


def _model_classes():
    import mindspore as ms
    from mindspore import nn, ops
    from mindformers.pynative.distributed.activation_checkpoint import is_in_recompute

    class Config:
        num_layers = LAYERS

    class Mlp(nn.Cell):
        def __init__(self) -> None:
            super().__init__()
            self.up = nn.Dense(HIDDEN, 2 * HIDDEN)
            self.down = nn.Dense(2 * HIDDEN, HIDDEN)
            self.act = lambda x: ops.exp(x * 0.25)        # a function attribute (an "op" to MindFormers)

        def construct(self, x):
            return self.down(self.act(self.up(x)))

    class Layer(nn.Cell):
        def __init__(self) -> None:
            super().__init__()
            self.attn = nn.Dense(HIDDEN, HIDDEN)
            self.mlp = Mlp()
            self.phases: List[bool] = []       # is_in_recompute() at each run of the layer

        def construct(self, x, mask):
            self.phases.append(is_in_recompute())
            h = x + ops.tanh(self.attn(x)) * mask
            return h + self.mlp(h)

    class Block(nn.Cell):
        """What apply_ac needs of MindFormers' TransformerBlock: config.num_layers, layers,
        layer_start / layer_end, and a construct taking hidden_states."""

        def __init__(self) -> None:
            super().__init__()
            self.config = Config()
            self.layers = nn.CellList([Layer() for _ in range(LAYERS)])
            self.layer_start, self.layer_end = 0, LAYERS - 1

        def construct(self, hidden_states, attention_mask):
            for layer in self.layers:
                hidden_states = layer(hidden_states, attention_mask)
            return hidden_states

    return ms, Block


def _grads(ms, model, x, mask) -> List[np.ndarray]:
    for layer in model.layers:
        layer.phases.clear()
    grads = ms.grad(lambda x: (model(x, mask) ** 2).sum(), None, model.trainable_params())(x)
    return [g.asnumpy() for g in grads]


def _max_diff(a: List[np.ndarray], b: List[np.ndarray]) -> float:
    return max(float(np.abs(x - y).max() / max(np.abs(y).max(), 1e-30)) for x, y in zip(a, b))


def run_mindformers_activation_checkpointing() -> Dict[str, Any]:
    """Full recompute with exclusions, select recompute of a Cell and of a function attribute,
    and layer swap with its prefetch, each applied by MindFormers' apply_ac to a fresh model with
    the same weights; each one step's gradients against the unwrapped model's."""
    from tests._mindformers_qwen3 import _setup
    _setup()
    from mindformers.pynative.config.config import RecomputeCommConfig, RecomputeConfig, SwapConfig
    from mindformers.pynative.distributed.activation_checkpoint import apply_ac

    from hyper_parallel_ms.training import CheckpointWrapper, SwapWrapper, checkpoint_stats, exclude_stats, swap_stats
    from hyper_parallel_ms.compat._activation import SwapManager
    ms, Block = _model_classes()

    def fresh():
        ms.set_seed(7)
        return Block()

    rng = np.random.RandomState(0)
    x = ms.Tensor(rng.randn(ROWS, HIDDEN).astype(np.float32))
    mask = ms.Tensor((rng.rand(ROWS, HIDDEN) > 0.3).astype(np.float32))
    reference = _grads(ms, fresh(), x, mask)
    out: Dict[str, Any] = {}

    # 1. full recompute of both layers; layer 0's mlp Cell and layer 1's act function excluded
    model = fresh()
    apply_ac(model, RecomputeConfig(mode="full", full_recompute_layer=["0-1"],
                                    exclude_op={"mlp": ["0"], "mlp.act": ["1"]}),
             RecomputeCommConfig(), SwapConfig(), pp=1)
    grads = _grads(ms, model, x, mask)
    out["full"] = {
        "diff": _max_diff(grads, reference),
        "wrapped": [isinstance(layer, CheckpointWrapper) for layer in model.layers],
        "recomputes": [checkpoint_stats(layer).recomputes for layer in model.layers],
        "forwards": [checkpoint_stats(layer).forwards for layer in model.layers],
        "phases": [list(layer.phases) for layer in model.layers],
        "excluded_mlp": vars(exclude_stats(model.layers[0].mlp)).copy(),
        "excluded_act": vars(exclude_stats(model.layers[1].mlp.act)).copy(),
        "names": [p.name for p in model.trainable_params()],
        "reference_names": [p.name for p in fresh().trainable_params()],
    }

    # 2. select recompute: layer 0's attn Cell, layer 1's act function (checkpoint_wrapper(op, output_recompute=True))
    model = fresh()
    apply_ac(model, RecomputeConfig(mode="select", select_module={"attn": ["0"], "mlp.act": ["1"]}),
             RecomputeCommConfig(), SwapConfig(), pp=1)
    grads = _grads(ms, model, x, mask)
    act = model.layers[1].mlp.act
    out["select"] = {
        "diff": _max_diff(grads, reference),
        "attn": checkpoint_stats(model.layers[0].attn).recomputes,
        "act": checkpoint_stats(act).recomputes if isinstance(act, CheckpointWrapper) else None,
        "layers_wrapped": [isinstance(layer, CheckpointWrapper) for layer in model.layers],
    }

    # 3. layer swap of layer 0, prefetched by layer 1's backward; MindFormers' storage-aware policy
    #    keeps the block's other inputs (the mask) on the device
    model = fresh()
    apply_ac(model, RecomputeConfig(), RecomputeCommConfig(),
             SwapConfig(enable=True, default_prefetch=1, layer_swap=[{"layers": ["0"]}]), pp=1)
    grads = _grads(ms, model, x, mask)
    stats = swap_stats(model.layers[0])
    everything = fresh()                       # the same layer swapping every saved tensor, for the count
    from hyper_parallel_ms.training import swap_wrapper
    swap_wrapper(everything.layers[0])
    _grads(ms, everything, x, mask)
    out["swap"] = {
        "diff": _max_diff(grads, reference),
        "swapped": isinstance(model.layers[0], SwapWrapper),
        "stats": vars(stats).copy(),
        "all_tensors": swap_stats(everything.layers[0]).tensors,
        "pairs": [(first is model.layers[0], second is model.layers[1])
                  for first, second in SwapManager().prefetch_pairs()],
    }
    return out
