"""Every collective of a save or load goes through :class:`Collective`, a thin layer over
:mod:`reference.comm` with the checkpoint's error policy, :class:`CheckpointErrors`.

Each step runs a local function on every rank, catches what it raises, and exchanges the outcome, so
that a failure on one rank becomes the same :class:`~reference.checkpoint.errors.CheckpointError` on
every rank (naming each failing rank and its message) instead of a hang in the next collective. With
no process group (one process, ``torch.distributed`` not initialized), or a group of one rank, the same
steps run locally: nothing is pickled to be sent to the only rank there is.

The steps are named for what they do, not after c10d primitives: :meth:`Collective.gather_decide_scatter`
gathers every rank's local result to the coordinator, which decides one value per rank (DCP's global
plan) and scatters them; :meth:`Collective.gather_decide_broadcast` decides one value for all;
:meth:`Collective.all_succeed` only agrees that every rank succeeded. The exchange itself is
:mod:`reference.comm`'s, the same as for the sharded wrapper and the state-dict API; only the error
raised differs (there, an error keeps its own type).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import ClassVar, TypeVar, cast

import torch
import torch.distributed as dist

from reference import comm
from reference.checkpoint.errors import ERROR_CLASSES, CheckpointError, StateDictError

__all__ = ["Collective", "CheckpointErrors", "process_group_device"]

T = TypeVar("T")
R = TypeVar("R")


@dataclass(frozen=True)
class CheckpointErrors:
    """The checkpoint's :class:`~reference.comm.ErrorPolicy` for one step of a save or load.

    A :class:`~reference.checkpoint.errors.CheckpointError` travels as its own class (by name, one of
    ``ERROR_CLASSES``); a ``ValueError``/``TypeError`` (a bad value in the state dict, surfacing from
    deep inside torch) as a :class:`~reference.checkpoint.errors.StateDictError`, anything else as a
    ``CheckpointError``, both with the original type named in the message. Every rank raises the one
    class all failures share (else ``CheckpointError``), with the message "ACTION failed in STEP on rank
    r[ of w]: message" (ranks with the same message named together, as ranges; one line per message when
    they differ) and ``failures`` mapping each failing rank to its message. This holds in a group of one
    rank too; " of w" is left out only without a process group."""

    action: str  #: what the ranks were doing, as the message starts: "save to '/path'"
    step: str  #: the step that failed: "planning", "writing", "reading", "committing"
    reraise_alone: ClassVar[bool] = False

    def record(self, exc: Exception) -> comm.Failure:
        if isinstance(exc, CheckpointError):
            return comm.Failure(type(exc).__name__, str(exc))
        cls = StateDictError if isinstance(exc, (ValueError, TypeError)) else CheckpointError
        return comm.Failure(cls.__name__, f"{type(exc).__name__}: {exc}")

    def error(self, failures: Mapping[int, comm.Failure], group: dist.ProcessGroup | None) -> CheckpointError:
        classes = {cast(str, f.kind) for f in failures.values()}  # this policy's records name the class
        cls = ERROR_CLASSES[classes.pop()] if len(classes) == 1 else CheckpointError
        by_message: dict[str, list[int]] = {}
        for rank, failure in sorted(failures.items()):
            by_message.setdefault(failure.message, []).append(rank)
        where = f" of {comm.group_size(group)}" if group is not None else ""
        if len(by_message) == 1:
            (message, ranks), = by_message.items()
            label = f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {_ranges(ranks)}"
            text = f"{self.action} failed in {self.step} on {label}{where}: {message}"
        else:
            lines = [f"ranks {_ranges(r)}: {m}" if len(r) > 1 else f"rank {r[0]}: {m}" for m, r in by_message.items()]
            text = f"{self.action} failed in {self.step} on {len(failures)} ranks{where}:\n" + "\n".join(lines)
        return cls(text, failures={r: f.message for r, f in failures.items()})


def process_group_device(process_group: dist.ProcessGroup | None) -> torch.device:
    """The device a process group communicates on (:func:`reference.comm.group_device`; the default
    group for ``None``). This is where meta values are built."""
    return comm.group_device(process_group if process_group is not None else comm.default_group())


class Collective:
    """The ranks of one save or load. Rank 0 of ``process_group`` (or of the default group) is the
    coordinator. Every method is collective: every rank of the group calls it, in the same order; a
    failure on any rank raises, on every rank, the error of :class:`CheckpointErrors` for the step."""

    def __init__(self, process_group: dist.ProcessGroup | None, *, action: str) -> None:
        #: ``None`` (no group, one process) only when ``torch.distributed`` is not initialized
        self.group = process_group if process_group is not None else comm.default_group()
        self.action = action  # "save to '/path'", used in error messages

    @property
    def is_coordinator(self) -> bool:
        return comm.is_coordinator(self.group)

    def gather_decide_scatter(
        self, step: str, local_fn: Callable[[], T], global_fn: Callable[[list[T]], list[R]]
    ) -> R:
        """``local_fn`` on every rank; ``global_fn`` on the coordinator with all results (rank order),
        returning one value per rank; each rank gets its value. Any failure raises on every rank."""
        return comm.gather_decide_scatter(self.group, local_fn, global_fn, errors=CheckpointErrors(self.action, step))

    def gather_decide_broadcast(self, step: str, local_fn: Callable[[], T], decide_fn: Callable[[list[T]], R]) -> R:
        """``local_fn`` on every rank; ``decide_fn`` on the coordinator with all results; every rank
        gets its return value. Any failure raises on every rank."""
        return comm.gather_decide_broadcast(self.group, local_fn, decide_fn, errors=CheckpointErrors(self.action, step))

    def all_succeed(self, step: str, local_fn: Callable[[], T]) -> T:
        """``local_fn`` on every rank; returns its value only if it succeeded on every rank (only the
        outcome travels, the value stays on its rank)."""
        return comm.agree(self.group, local_fn, errors=CheckpointErrors(self.action, step))


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
