"""PyTorch DCP's ``Stateful`` protocol: a top-level value of a saved or loaded state dict with
``state_dict()`` and ``load_state_dict()`` (an application state bundling model, optimizer and
counters) is saved as what ``state_dict()`` returns, and after a load gets the loaded values
through ``load_state_dict()``. Tensors, dicts and Cells are not taken as such (a Cell's state
comes from :func:`get_model_state_dict`).

Example::

    class AppState:
        def state_dict(self):
            return {"model": get_model_state_dict(model), "step": self.step}
        def load_state_dict(self, state):
            set_model_state_dict(model, state["model"]); self.step = state["step"]
    save({"app": AppState()}, checkpoint_id="ckpt")
"""
from __future__ import annotations

from typing import Any, Dict

__all__ = ["is_stateful", "resolve_stateful", "restore_stateful"]


def is_stateful(value: Any) -> bool:
    """Whether ``value`` follows the protocol (callable ``state_dict`` and ``load_state_dict``; not
    a Tensor, a dict or a Cell).

    >>> is_stateful({"a": 1})
    False
    """
    from mindspore import Tensor, nn
    return (callable(getattr(value, "state_dict", None)) and callable(getattr(value, "load_state_dict", None))
            and not isinstance(value, (Tensor, nn.Cell, dict)))


def resolve_stateful(state_dict: Dict[str, Any]) -> Dict[str, Any]:
    """``state_dict`` with each top-level Stateful value replaced by its ``state_dict()`` (a new
    dict where there is one; ``state_dict`` itself otherwise).

    >>> resolve_stateful({"step": 3})
    {'step': 3}
    """
    if not isinstance(state_dict, dict) or not any(is_stateful(v) for v in state_dict.values()):
        return state_dict
    return {k: (v.state_dict() if is_stateful(v) else v) for k, v in state_dict.items()}


def restore_stateful(state_dict: Dict[str, Any], resolved: Dict[str, Any]) -> None:
    """After a load into ``resolved`` (from :func:`resolve_stateful`), hand each Stateful value of
    ``state_dict`` its loaded state (``load_state_dict``) and put the other top-level values
    loaded into ``resolved`` back into ``state_dict``."""
    if resolved is state_dict:
        return
    for key, value in state_dict.items():
        if is_stateful(value):
            value.load_state_dict(resolved[key])
        else:
            state_dict[key] = resolved[key]
