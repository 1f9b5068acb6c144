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
    # the same draws on every run: a default (CI) run cannot fail by chance on a draw no
    # earlier run made (issue 10); the random search is the "thorough" profile's job
    derandomize=True,
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
