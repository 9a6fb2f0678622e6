"""Suite-wide test settings.

CI runs on two shared cores: a Hypothesis example that is slow to *generate* under load is not a
bug, so the `too_slow` health check and per-example deadlines are off for every test. (Each test's
own ``@settings`` still fixes its example budget.)
"""

from hypothesis import HealthCheck, settings

settings.register_profile("pagedkv", deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile("pagedkv")
