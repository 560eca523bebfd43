"""The exceptions of :mod:`reference.checkpoint`.

Every error is an :class:`Exception` (DCP's ``CheckpointException`` derives from ``BaseException``, so
``except Exception`` misses it; ours does not). All ranks of a save or load raise the same class with
the same message, which names every failing rank and what it saw, so no rank is left waiting in a
collective and no rank reports a bare "another rank failed".
"""

from __future__ import annotations

from collections.abc import Mapping

__all__ = [
    "CheckpointError",
    "CheckpointFormatError",
    "UnsafeCheckpointError",
    "StateDictError",
]


class CheckpointError(RuntimeError):
    """A save or load failed. ``failures`` maps each failing rank to its message."""

    def __init__(self, message: str, *, failures: Mapping[int, str] | None = None) -> None:
        super().__init__(message)
        self.failures: dict[int, str] = dict(failures or {})


class CheckpointFormatError(CheckpointError):
    """The checkpoint on storage is not a complete, readable checkpoint: a missing or truncated data
    file, missing or corrupt metadata, or a format version this reader does not know."""


class UnsafeCheckpointError(CheckpointFormatError):
    """A metadata file asks the unpickler for something other than the DCP metadata classes: it was
    not written by DCP and is refused without running any of it."""


class StateDictError(CheckpointError, ValueError):
    """The state dict cannot be saved, or does not match the checkpoint: a missing or unexpected key,
    a shape or dtype mismatch, a value that cannot be built from meta, a per-rank value that cannot be
    resharded, an unsupported placement. A load raises it before anything in the state dict changes."""


#: Name -> class, so a failure raised on one rank is re-raised as the same class on every rank.
ERROR_CLASSES: dict[str, type[CheckpointError]] = {
    cls.__name__: cls
    for cls in (CheckpointError, CheckpointFormatError, UnsafeCheckpointError, StateDictError)
}
