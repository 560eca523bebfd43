"""The one switch of the checkpoint's fast paths: on by default, off for the plain path.

The plain path is the reference: a record is written with ``torch.save`` and read with
``torch.load(weights_only=True)``, every save is planned anew, one thread reads and writes, and the
collectives carry DCP's own dataclasses. It is what a reviewer checks against SPEC.md. The fast
paths (record templates and parses, the save plan cache, reader and writer threads, compact wire
forms, ...) exist for speed only: each keeps every requirement the plain path meets and writes the
same bytes, and each asks :func:`enabled` before it runs. Why each exists, with the figures that
showed it: docs/benchmark-results.md, "Why the fast paths".

``SDC_REFERENCE_FAST_PATHS=0`` in the environment turns them off for a process and every process it
starts (the suite's rank processes, an async save's writer process); it is read once, at import.
:func:`disabled` turns them off inside a ``with`` block (tests), for every thread of the process.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Iterator

__all__ = ["ENVIRONMENT_VARIABLE", "enabled", "disabled", "set_enabled"]

#: The environment variable read at import: ``0`` (or ``false``, ``no``, ``off``) turns the fast paths off.
ENVIRONMENT_VARIABLE = "SDC_REFERENCE_FAST_PATHS"

_ON = ("1", "true", "yes", "on", "")
_OFF = ("0", "false", "no", "off")


def _from_environment() -> bool:
    value = os.environ.get(ENVIRONMENT_VARIABLE, "1").strip().lower()
    if value in _ON:
        return True
    if value in _OFF:
        return False
    raise ValueError(f"{ENVIRONMENT_VARIABLE}={value!r}: expected 1 (the fast paths, the default) or 0 (the plain path)")


_enabled = _from_environment()
_lock = threading.Lock()


def enabled() -> bool:
    """Whether the checkpoint's fast paths run (else the plain path does)."""
    return _enabled


@contextlib.contextmanager
def set_enabled(on: bool) -> Iterator[None]:
    """Inside the ``with`` block the fast paths are ``on`` (or off) for the whole process; after it,
    as they were before. Blocks do not nest across threads: set it around a whole save or load."""
    global _enabled
    with _lock:
        before, _enabled = _enabled, bool(on)
    try:
        yield
    finally:
        with _lock:
            _enabled = before


def disabled() -> contextlib.AbstractContextManager[None]:
    """The plain path inside the ``with`` block: ``with fast_paths.disabled(): save(...)``."""
    return set_enabled(False)
