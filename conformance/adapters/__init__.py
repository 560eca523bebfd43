"""Implementations under test. See :mod:`conformance.adapters.base` for the protocol."""

from conformance.adapters.base import CAPABILITIES, SHIPPED, Adapter, Unsupported, capability_of, load_adapter

__all__ = ["Adapter", "Unsupported", "CAPABILITIES", "SHIPPED", "capability_of", "load_adapter"]
