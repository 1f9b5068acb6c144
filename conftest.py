"""Root pytest configuration: Hypothesis profiles shared by tests/ and conformance/.

Profiles: ``ci`` (default; small example counts so the whole run stays within ~15
minutes on 2 cores), ``thorough`` (``--hypothesis-profile=thorough``) and ``mutation``
(the ci draws without shrinking, for mutation runs).
"""

from __future__ import annotations

from hypothesis import HealthCheck, Phase, settings

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
# mutation runs (a planted bug per run): the ci draws without shrinking, so a killed
# mutant is reported in seconds (``--hypothesis-profile=mutation``)
settings.register_profile(
    "mutation",
    parent=settings.get_profile("ci"),
    phases=[Phase.explicit, Phase.reuse, Phase.generate],
)
settings.load_profile("ci")
