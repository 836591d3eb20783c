"""Fixtures of the launch-recipe tests; their helpers are in tests/_recipes.py."""

import pytest


@pytest.fixture(scope="module")
def schemas():
    """Register each entry point's structured config schema, as running it does (both scripts
    forward to these modules)."""
    import aligner.actor.run  # noqa: F401
    import aligner.critic.server  # noqa: F401
