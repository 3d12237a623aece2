"""Suite-wide test settings.

Every hypothesis test is derandomized: the suite must give the same answer on every run and in
CI, so a property test that can fail only on some seeds is found here, not after landing. A
test's own ``@settings`` still sets its example count; it inherits this profile's other fields.
"""
from hypothesis import settings

settings.register_profile("kvbench", derandomize=True, deadline=None, print_blob=True)
settings.load_profile("kvbench")
