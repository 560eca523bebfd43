"""The one exception every adapter module raises, in a module of its own so that the capability
modules and :mod:`conformance.adapters.base` (which names their Protocols) do not import each other."""

from __future__ import annotations

__all__ = ["Unsupported"]


class Unsupported(Exception):
    """Raised by an adapter for a capability or feature it does not provide; the message is the reason."""
