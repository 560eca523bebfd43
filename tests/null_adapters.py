"""Two adapters that provide nothing, for the suite's no-false-pass self-tests (issue 46).

Each claims every capability and returns ops objects for all of them, but every op of every ops object
raises: :class:`UnsupportedEverywhere` raises :class:`Unsupported` (an implementation that declares
nothing it has), :class:`FailingEverywhere` raises ``RuntimeError`` (an implementation whose every call
fails). A suite that passes either one a single test has a test that does not test anything; the
self-tests in ``tests/test_no_false_pass.py`` run the whole suite against both and require 0 passed.
"""

from __future__ import annotations

from typing import Any, ClassVar, NoReturn

from conformance.adapters.async_checkpoint import AsyncCheckpointOps
from conformance.adapters.base import Adapter, Unsupported
from conformance.adapters.checkpoint import CheckpointOps
from conformance.adapters.flat_param import FlatParamOps
from conformance.adapters.optim_state import OptimStateOps
from conformance.adapters.sharding import ShardingOps
from conformance.adapters.state_dict import StateDictOps

__all__ = ["UnsupportedEverywhere", "FailingEverywhere"]

_PROTOCOLS: dict[str, type] = {
    "flat_param": FlatParamOps,
    "state_dict": StateDictOps,
    "optim_state": OptimStateOps,
    "checkpoint": CheckpointOps,
    "async_checkpoint": AsyncCheckpointOps,
    "sharding": ShardingOps,
}


def _ops_methods(protocol: type) -> list[str]:
    """The operations (public methods) a capability's protocol declares."""
    return [name for name, value in vars(protocol).items() if callable(value) and not name.startswith("_")]


def _raising_ops(protocol: type, error: type[Exception]) -> Any:
    """An object with every op of ``protocol``, each raising ``error`` naming the op, and the protocol's
    declarations set to what a real implementation could declare (so that no test skips on them)."""

    def raiser(op: str) -> Any:
        def call(self: Any, *args: Any, **kwargs: Any) -> NoReturn:
            raise error(f"{op} does nothing here (a no-false-pass self-test adapter)")

        call.__name__ = op
        return call

    namespace: dict[str, Any] = {op: raiser(op) for op in _ops_methods(protocol)}
    namespace.update(name="null", executors=("thread", "process"), concurrent_saves="wait", submodules_deprecated=False)
    return type(f"Raising{protocol.__name__}", (), namespace)()


class _NullAdapter(Adapter):
    """Provides every capability; every op raises :attr:`error`."""

    error: ClassVar[type[Exception]]

    def flat_param(self) -> Any:
        return _raising_ops(_PROTOCOLS["flat_param"], self.error)

    def state_dict(self) -> Any:
        return _raising_ops(_PROTOCOLS["state_dict"], self.error)

    def optim_state(self) -> Any:
        return _raising_ops(_PROTOCOLS["optim_state"], self.error)

    def checkpoint(self) -> Any:
        return _raising_ops(_PROTOCOLS["checkpoint"], self.error)

    def async_checkpoint(self) -> Any:
        return _raising_ops(_PROTOCOLS["async_checkpoint"], self.error)

    def sharding(self) -> Any:
        return _raising_ops(_PROTOCOLS["sharding"], self.error)


class UnsupportedEverywhere(_NullAdapter):
    """Every op raises :class:`Unsupported`: every test must be a skip (naming the op), none a pass."""

    name = "unsupported-everywhere"
    error = Unsupported


class FailingEverywhere(_NullAdapter):
    """Every op raises ``RuntimeError``: no test may pass."""

    name = "failing-everywhere"
    error = RuntimeError
