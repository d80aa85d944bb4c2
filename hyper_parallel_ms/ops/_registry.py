"""The table of sharding rules, filled by ``register_sharding``.

Example::

    @register_sharding("Exp", "Log")
    def my_rule(schema: OpSchema) -> OutputSharding: ...
"""
from __future__ import annotations

from typing import Callable, Dict, FrozenSet, Iterable

from ._schema import OpSchema, OutputSharding

__all__ = ["register_sharding", "rule_for", "registered_ops", "ignored_args"]

Rule = Callable[[OpSchema], OutputSharding]
_RULES: Dict[str, Rule] = {}
_IGNORED: Dict[str, FrozenSet[int]] = {}
_NONE: FrozenSet[int] = frozenset()


def register_sharding(*op_names: str, ignored_args: Iterable[int] = ()) -> Callable[[Rule], Rule]:
    """Register ``rule`` for MindSpore primitives named ``op_names`` (``func.name``, e.g.
    ``"MatMulExt"``); a later registration replaces an earlier one. ``ignored_args``: positions
    of arguments that never change the sharding (random seeds), left out of the cache key;
    the rule sees them as ``None``."""
    if not op_names or not all(isinstance(n, str) and n for n in op_names):
        raise ValueError(f"register_sharding needs primitive names such as 'AddExt', got {op_names!r}")
    ignored = frozenset(int(i) for i in ignored_args)

    def add(rule: Rule) -> Rule:
        for name in op_names:
            _RULES[name] = rule
            _IGNORED[name] = ignored
        return rule
    return add


def ignored_args(op: str) -> FrozenSet[int]:
    """Argument positions of ``op`` left out of the decision cache key."""
    return _IGNORED.get(op, _NONE)


def rule_for(op: str):
    """The rule registered for ``op``, or ``None``."""
    return _RULES.get(op)


def registered_ops() -> tuple:
    """Names of the ops that have a rule."""
    return tuple(sorted(_RULES))
