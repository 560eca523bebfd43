"""pytest hooks of the conformance suite; everything lives in :mod:`conformance.harness.plugin`.

Registered as a plugin (not re-exported here) so that ``tests/conftest.py`` can register the same
module for the tests of the reference alone, and ``pytest tests conformance`` loads it once.
"""

pytest_plugins = ("conformance.harness.plugin",)

# Hypothesis profiles of the generated cases, registered before hypothesis's own pytest_configure reads
# --hypothesis-profile: "ci" (the default here, derandomized and bounded) and "thorough".
from conformance.generated import register_profiles  # noqa: E402

register_profiles()
