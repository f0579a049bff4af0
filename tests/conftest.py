"""Shared pytest setup: Hypothesis profiles.

``HYPOTHESIS_PROFILE=ci`` (default) keeps property tests quick; ``HYPOTHESIS_PROFILE=dev`` runs
many more examples when working on a planner.
"""

import os

from hypothesis import settings

settings.register_profile("ci", max_examples=50, deadline=None)
settings.register_profile("dev", max_examples=1000, deadline=None)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))
