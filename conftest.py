"""Root pytest configuration: Hypothesis profiles shared by tests/ and conformance/.

Profiles: ``ci`` (default; small example counts so the whole run stays within ~15
minutes on 2 cores) and ``thorough`` (``--hypothesis-profile=thorough``).
"""

from __future__ import annotations

from hypothesis import HealthCheck, settings

settings.register_profile(
    "ci",
    max_examples=15,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    print_blob=True,
)
settings.register_profile(
    "thorough",
    max_examples=300,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    print_blob=True,
)
settings.load_profile("ci")
