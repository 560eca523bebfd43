"""Every collective of a save or load goes through :class:`Collective`.

Each step runs a local function on every rank, catches what it raises, and exchanges the outcome, so
that a failure on one rank becomes the same :class:`~reference.checkpoint.errors.CheckpointError` on
every rank (naming each failing rank and its message) instead of a hang in the next collective. With
no process group (one process, ``torch.distributed`` not initialized), or a group of one rank, the same
steps run locally: nothing is pickled to be sent to the only rank there is.

The steps are named for what they do, not after c10d primitives: :meth:`Collective.gather_decide_scatter`
gathers every rank's local result to the coordinator, which decides one value per rank (DCP's global
plan) and scatters them; :meth:`Collective.gather_decide_broadcast` decides one value for all. This is
the checkpoint's own protocol on top of c10d, kept beside its errors (a
:class:`~reference.checkpoint.errors.CheckpointError` that names every failing rank and its message);
:mod:`reference.comm` is the same agreement for the sharded wrapper and the state-dict API, where an
error keeps its own type.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple, TypeVar, cast

import torch
import torch.distributed as dist

from reference.checkpoint.errors import ERROR_CLASSES, CheckpointError, StateDictError

__all__ = ["Collective", "process_group_device"]

T = TypeVar("T")
R = TypeVar("R")


class _Failure(NamedTuple):
    """What a rank sends instead of its result when its step raised."""

    error_class: str  #: a name in ERROR_CLASSES
    message: str


def _as_failure(exc: BaseException) -> _Failure:
    if isinstance(exc, CheckpointError):
        return _Failure(type(exc).__name__, str(exc))
    # A bad value in the state dict surfaces as ValueError/TypeError from deep inside torch.
    cls = StateDictError if isinstance(exc, (ValueError, TypeError)) else CheckpointError
    return _Failure(cls.__name__, f"{type(exc).__name__}: {exc}")


def process_group_device(process_group: dist.ProcessGroup | None) -> torch.device:
    """The device a process group communicates on: CPU for gloo (and without a group), the current
    accelerator for nccl/xccl. This is where meta values are built."""
    if process_group is None and not (dist.is_available() and dist.is_initialized()):
        return torch.device("cpu")
    # "nccl", "gloo", or per-device pairs such as "cpu:gloo,cuda:nccl".
    backends = {part.split(":")[-1] for part in str(dist.get_backend(process_group)).split(",")}
    for device_type, device_backend in dist.Backend.default_device_backend_map.items():
        if device_type not in ("cpu", "mps") and device_backend in backends:
            return torch.device(device_type, getattr(torch, device_type).current_device())
    return torch.device("cpu")


class Collective:
    """The ranks of one save or load. Rank 0 of ``process_group`` (or of the default group) is the
    coordinator. Every method must be called by every rank of the group, in the same order."""

    def __init__(self, process_group: dist.ProcessGroup | None, *, action: str) -> None:
        self.use_dist = process_group is not None or (dist.is_available() and dist.is_initialized())
        self.group = process_group
        self.rank = dist.get_rank(process_group) if self.use_dist else 0
        self.world_size = dist.get_world_size(process_group) if self.use_dist else 1
        # Object collectives pickle every value, even to a group of one (a save's plan of a few hundred
        # items took tens of ms to unpickle): with one rank, values stay where they are.
        self._exchange = self.use_dist and self.world_size > 1
        self.action = action  # "save to '/path'", used in error messages
        self._local_error: Exception | None = None  # this rank's last failure, chained to the raised error

    @property
    def is_coordinator(self) -> bool:
        return self.rank == 0

    # -- exchange of outcomes ----------------------------------------------------------------

    def _run(self, fn: Callable[[], T]) -> T | _Failure:
        try:
            return fn()
        except Exception as exc:
            self._local_error = exc
            return _as_failure(exc)

    def _raise(self, step: str, failures: dict[int, _Failure]) -> None:
        classes = {f.error_class for f in failures.values()}
        cls = ERROR_CLASSES[classes.pop()] if len(classes) == 1 else CheckpointError
        by_message: dict[str, list[int]] = {}
        for rank, failure in sorted(failures.items()):
            by_message.setdefault(failure.message, []).append(rank)
        where = f" of {self.world_size}" if self.use_dist else ""
        if len(by_message) == 1:
            (message, ranks), = by_message.items()
            label = f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {_ranges(ranks)}"
            text = f"{self.action} failed in {step} on {label}{where}: {message}"
        else:
            lines = [f"ranks {_ranges(r)}: {m}" if len(r) > 1 else f"rank {r[0]}: {m}" for m, r in by_message.items()]
            text = f"{self.action} failed in {step} on {len(failures)} ranks{where}:\n" + "\n".join(lines)
        error = cls(text, failures={r: f.message for r, f in failures.items()})
        local, self._local_error = self._local_error, None
        if local is not None:
            raise error from local
        raise error

    def _gather_and_decide(
        self, local_fn: Callable[[], T], global_fn: Callable[[list[T]], R]
    ) -> tuple[R | None, dict[int, _Failure] | None]:
        """``local_fn`` on every rank, its outcomes gathered to the coordinator (rank order); there, unless
        a rank failed, ``global_fn`` of the results. On the coordinator: ``(result, None)`` or ``(None,
        failures by rank)``; on the other ranks ``(None, None)``. The caller sends the decision out."""
        local = self._run(local_fn)
        gathered: list[Any] = [None] * self.world_size if self.is_coordinator else []
        if self._exchange:
            dist.gather_object(local, gathered if self.is_coordinator else None, group=self.group, group_dst=0)
        else:
            gathered = [local]
        if not self.is_coordinator:
            return None, None
        failures = {r: v for r, v in enumerate(gathered) if isinstance(v, _Failure)}
        if failures:
            return None, failures
        result = self._run(lambda: global_fn(gathered))
        if isinstance(result, _Failure):
            return None, {self.rank: result}
        return result, None

    def gather_decide_scatter(
        self, step: str, local_fn: Callable[[], T], global_fn: Callable[[list[T]], list[R]]
    ) -> R:
        """``local_fn`` on every rank; ``global_fn`` on the coordinator with all results (rank order),
        returning one value per rank; each rank gets its value. Any failure raises on every rank."""
        result, failures = self._gather_and_decide(local_fn, global_fn)
        outgoing: list[Any] = []
        if self.is_coordinator:
            outgoing = [failures] * self.world_size if failures else list(result or ())
        if self._exchange:
            received: list[Any] = [None]
            dist.scatter_object_list(received, outgoing if self.is_coordinator else None, group=self.group, group_src=0)
            mine = received[0]
        else:
            mine = outgoing[0]
        if isinstance(mine, dict):
            self._raise(step, mine)
        return cast(R, mine)

    def gather_decide_broadcast(self, step: str, local_fn: Callable[[], T], decide_fn: Callable[[list[T]], R]) -> R:
        """``local_fn`` on every rank; ``decide_fn`` on the coordinator with all results; every rank
        gets its return value. Any failure raises on every rank."""
        result, failures = self._gather_and_decide(local_fn, decide_fn)
        outcome: list[Any] = [None]
        if self.is_coordinator:
            outcome = [("failed", failures)] if failures else [("ok", result)]
        if self._exchange:
            dist.broadcast_object_list(outcome, group=self.group, group_src=0)
        status, value = outcome[0]
        if status == "failed":
            self._raise(step, value)
        return cast(R, value)

    def all_succeed(self, step: str, local_fn: Callable[[], T]) -> T:
        """``local_fn`` on every rank; returns its value only if it succeeded on every rank."""
        local = self._run(local_fn)
        if self._exchange:
            statuses: list[Any] = [None] * self.world_size
            # Only the failure (or None) travels: results stay on their rank.
            dist.all_gather_object(statuses, local if isinstance(local, _Failure) else None, group=self.group)
        else:
            statuses = [local if isinstance(local, _Failure) else None]
        failures = {r: s for r, s in enumerate(statuses) if s is not None}
        if failures:
            self._raise(step, failures)
        assert not isinstance(local, _Failure)  # it would be in failures
        return local


def _ranges(ranks: list[int]) -> str:
    """``[0, 1, 2, 5]`` -> ``"0-2, 5"``."""
    parts: list[str] = []
    start = prev = ranks[0]
    for r in [*ranks[1:], None]:
        if r is not None and r == prev + 1:
            prev = r
            continue
        parts.append(str(start) if start == prev else f"{start}-{prev}")
        if r is not None:
            start = prev = r
    return ", ".join(parts)
