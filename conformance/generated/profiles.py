"""Hypothesis profiles of the generated tests, and how many examples each test gets under them."""

from __future__ import annotations

from hypothesis import Phase, settings

__all__ = ["PROFILE_EXAMPLES", "WEIGHTS", "register_profiles", "budget"]

#: Examples per generated test in each profile, before the per-capability weight of :func:`budget`.
PROFILE_EXAMPLES = {"ci": 25, "thorough": 150}

#: How many examples each generated test gets, relative to the profile's ``max_examples``: examples
#: of the local capabilities cost milliseconds, sharded ones a round trip to the rank pools.
WEIGHTS = {"flat_param": 5.0, "state_dict": 5.0, "optim_state": 1.0, "checkpoint": 1.0, "sharded_state_dict": 1.0}


def register_profiles() -> None:
    """Register the ``ci``, ``thorough`` and ``stress`` profiles and make ``ci`` the default.

    ``ci`` (``make test``): derandomized, so every run draws the same examples (no database needed,
    none written), no deadline (a rank pool may start mid-test), and a bounded number of examples.
    ``thorough`` (``pytest --hypothesis-profile thorough``): random examples, many more of them, and
    the example database, so a failure found once is replayed first next time."""
    settings.register_profile(
        "ci",
        max_examples=PROFILE_EXAMPLES["ci"],
        derandomize=True,
        deadline=None,
        database=None,
        print_blob=False,
        phases=[Phase.explicit, Phase.generate, Phase.shrink],  # no explain phase: it reruns with tracing
    )
    settings.register_profile("thorough", max_examples=PROFILE_EXAMPLES["thorough"], deadline=None, print_blob=True)
    # ``stress`` (``make stress``): as many examples as ``ci``, but random ones, a fresh draw per run
    # (pass --hypothesis-seed to repeat one), and no database: each run of a stress loop is independent.
    settings.register_profile(
        "stress", max_examples=PROFILE_EXAMPLES["ci"], deadline=None, database=None, print_blob=True,
        phases=[Phase.explicit, Phase.generate, Phase.shrink],
    )
    if settings.get_current_profile_name() == "default":
        settings.load_profile("ci")


def budget(capability: str) -> int:
    """``max_examples`` for the generated test of ``capability`` under the profile loaded now."""
    current = settings.default
    if current is None:
        raise RuntimeError("no hypothesis profile is loaded (conformance/conftest.py registers and loads them)")
    return max(1, round(current.max_examples * WEIGHTS[capability]))
