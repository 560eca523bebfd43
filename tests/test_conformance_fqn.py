"""The suite's canonical-FQN rule (``conformance.fqn``), the oracle's name for every key."""

from __future__ import annotations

import pytest

from conformance.asserts import WRAPPER_SEGMENTS
from conformance.fqn import canonical_fqn


@pytest.mark.parametrize(
    ("raw", "canonical"),
    [
        ("_fsdp_wrapped_module.net.2._checkpoint_wrapped_module._fsdp_wrapped_module.weight", "net.2.weight"),
        ("_orig_mod.1._fpw_module.0.bias", "1.0.bias"),
        ("a._fsdp_wrapped_module_x.b", "a._fsdp_wrapped_module_x.b"),  # whole segments only
        ("module.weight", "module.weight"),  # DDP's segment is not spelled away (a child may be called so)
        ("weight", "weight"),
    ],
)
def test_canonical_fqn(raw: str, canonical: str) -> None:
    assert canonical_fqn(raw) == canonical


def test_assert_names_key_forbids_every_wrapper_segment() -> None:
    for segment in ("_fsdp_wrapped_module", "_checkpoint_wrapped_module", "_fpw_module", "_orig_mod"):
        assert segment + "." in WRAPPER_SEGMENTS, segment
