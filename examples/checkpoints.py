"""Step checkpoints of the training example: ``DIR/step_K`` holds the model, the optimizer and the
step, saved by every rank (its pieces, or its pipeline stage) and loadable on any layout.

Example::

    save_step(model, optimizer, 2, "ckpts")            # ckpts/step_2
    start = resume(model, optimizer, "ckpts", print)    # 2: the latest step_K, loaded in place
"""
from __future__ import annotations

import os
import re
from typing import Callable, Dict, Optional

from mindspore import nn

from hyper_parallel_ms import checkpoint

__all__ = ["latest_checkpoint", "save_step", "resume"]


def latest_checkpoint(directory: str) -> Optional[str]:
    """The committed ``step_K`` checkpoint with the largest K in ``directory``, or ``None``."""
    steps = [int(m.group(1)) for m in (re.fullmatch(r"step_(\d+)", d) for d in
                                       (os.listdir(directory) if os.path.isdir(directory) else [])) if m]
    return os.path.join(directory, f"step_{max(steps)}") if steps else None


def _state(model: nn.Cell, optimizer: nn.Optimizer, step: int) -> Dict[str, object]:
    model_sd, optim_sd = checkpoint.get_state_dict(model, optimizer)
    return {"model": model_sd, "optim": optim_sd, "step": step}


def save_step(model: nn.Cell, optimizer: nn.Optimizer, step: int, directory: str) -> str:
    """Save ``model`` and ``optimizer`` after ``step`` steps to ``directory/step_<step>`` (every rank calls)."""
    path = os.path.join(directory, f"step_{step}")
    checkpoint.save(_state(model, optimizer, step), checkpoint_id=path)
    return path


def resume(model: nn.Cell, optimizer: nn.Optimizer, directory: str, log: Callable[[str], None]) -> int:
    """Load the latest checkpoint of ``directory`` into the model and optimizer (in place); the step to start at."""
    path = latest_checkpoint(directory)
    if path is None:
        raise FileNotFoundError(f"--resume: no step_K checkpoint in {directory}")
    state = _state(model, optimizer, 0)
    checkpoint.load(state, checkpoint_id=path)
    log(f"[parallel] resumed from {path} at step {state['step']}")
    return int(state["step"])
