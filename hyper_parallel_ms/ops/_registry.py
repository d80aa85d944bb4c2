"""The sharding propagator: the table of rules and the cache of decisions made with them.

One :class:`ShardingPropagator` owns both, so replacing a rule (``register_sharding``)
forgets every decision the old rule made. ``propagator`` is the instance the dispatcher
uses; ``register_sharding`` / ``registered_ops`` act on it.

Example::

    @register_sharding("Exp", "Log")
    def my_rule(schema: OpSchema) -> OutputSharding: ...

    propagator.rule_for("Exp") is my_rule
"""
from __future__ import annotations

from typing import Any, Callable, Dict, FrozenSet, Iterable, Optional, Union

from ._schema import OpSchema, OutputSharding

__all__ = ["ShardingPropagator", "propagator", "register_sharding", "registered_ops"]

Rule = Callable[[OpSchema], OutputSharding]
_NONE: FrozenSet[Union[int, str]] = frozenset()


def _ignored(entries: Iterable[Union[int, str]]) -> FrozenSet[Union[int, str]]:
    out = set()
    for e in entries:
        if isinstance(e, bool) or not isinstance(e, (int, str)):
            raise TypeError(f"ignored_args entries are argument positions (int) or primitive attribute names "
                            f"(str), got {e!r}")
        out.add(e)
    return frozenset(out)


def _check_names(op_names: tuple) -> None:
    if not op_names or not all(isinstance(n, str) and n for n in op_names):
        raise ValueError(f"register_sharding needs primitive names such as 'AddExt', got {op_names!r}")


class ShardingPropagator:
    """Rules by primitive name, the argument positions each rule ignores, and the decisions
    made with them (keyed by op, argument layouts and shapes, other arguments).

    Example::

        p = ShardingPropagator()
        p.register(my_rule, "Exp")
        p.rule_for("Exp") is my_rule
    """

    def __init__(self) -> None:
        self._rules: Dict[str, Rule] = {}
        self._ignored: Dict[str, FrozenSet[int]] = {}
        self._decisions: Dict[Any, Any] = {}

    def register(self, rule: Rule, *op_names: str, ignored_args: Iterable[Union[int, str]] = ()) -> Rule:
        """Use ``rule`` for ``op_names`` (replacing earlier rules) and forget cached decisions."""
        _check_names(op_names)
        ignored = _ignored(ignored_args)
        for name in op_names:
            self._rules[name] = rule
            self._ignored[name] = ignored
        self._decisions.clear()
        return rule

    def unregister(self, *op_names: str) -> None:
        """Remove the rules of ``op_names`` (calls of them raise again) and forget cached decisions."""
        for name in op_names:
            self._rules.pop(name, None)
            self._ignored.pop(name, None)
        self._decisions.clear()

    def rule_for(self, op: str) -> Optional[Rule]:
        """The rule registered for ``op``, or ``None``."""
        return self._rules.get(op)

    def ignored_args(self, op: str) -> FrozenSet[Union[int, str]]:
        """Argument positions and primitive attribute names of ``op`` left out of the decision
        cache key (random seeds)."""
        return self._ignored.get(op, _NONE)

    def ops(self) -> tuple:
        """Names of the ops that have a rule, sorted."""
        return tuple(sorted(self._rules))

    def cached(self, key: Any) -> Any:
        """The decision stored under ``key``, or ``None`` (raises TypeError if unhashable)."""
        return self._decisions.get(key)

    def remember(self, key: Any, decision: Any) -> None:
        self._decisions[key] = decision

    def clear_cache(self) -> None:
        """Forget every cached decision."""
        self._decisions.clear()


propagator = ShardingPropagator()


def register_sharding(*op_names: str, ignored_args: Iterable[Union[int, str]] = ()) -> Callable[[Rule], Rule]:
    """Register a rule for MindSpore primitives; a later registration replaces an earlier one
    and the decisions made with it are forgotten.

    Args:
        op_names: primitive names (``func.name``, e.g. ``"MatMulExt"``).
        ignored_args: positions of arguments (ints) and names of a primitive's attributes (strs)
            that never change the sharding (random seeds): left out of the cache key, the rule sees
            such arguments as ``None`` and not such attributes.

    Example::

        @register_sharding("MyElementwiseOp")
        def my_rule(schema: OpSchema) -> OutputSharding:
            x = schema.args[0]
            return OutputSharding(inputs=(x.layout,), outputs=((x.layout, x.shape),))
    """
    _check_names(op_names)

    def add(rule: Rule) -> Rule:
        return propagator.register(rule, *op_names, ignored_args=ignored_args)
    return add


def registered_ops() -> tuple:
    """Names of the ops that have a rule.

    >>> "MatMulExt" in registered_ops()
    True
    """
    return propagator.ops()
