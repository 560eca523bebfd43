"""The one exception every adapter module raises, in a module of its own so that the capability
modules and :mod:`conformance.adapters.base` (which names their Protocols) do not import each other."""

from __future__ import annotations

__all__ = ["Unsupported", "skip_reason"]


class Unsupported(Exception):
    """Raised by an adapter for a capability or feature it does not provide; the message is the reason."""


#: Modules whose objects' methods are the suite's or pytest's, never an adapter's op.
_SUITE_MODULES = ("conformance", "_pytest", "pluggy", "pytest")


def skip_reason(exc: Unsupported) -> str:
    """The skip a test reports when ``exc`` escaped it: the op that raised it and the reason.

    The op is the outermost method call in the traceback on an object of the adapter's (a class outside
    the suite's and pytest's own modules, or in ``conformance.adapters``), named by its class
    (``TorchCheckpointOps.load``): a reader of the report sees which operation of which ops class is
    missing, not only why."""
    tb = exc.__traceback__
    op = None
    while tb is not None and op is None:
        frame = tb.tb_frame
        owner = frame.f_locals.get("self")
        module = type(owner).__module__ if owner is not None else ""
        if owner is not None and (module.startswith("conformance.adapters") or not module.startswith(_SUITE_MODULES)):
            op = f"{type(owner).__qualname__}.{frame.f_code.co_name}"
        tb = tb.tb_next
    return f"{op} is not provided: {exc}" if op else f"not provided: {exc}"
