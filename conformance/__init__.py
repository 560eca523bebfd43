"""The statedict-conformance suite: requirements (SPEC.md), harness, adapters and tests."""
