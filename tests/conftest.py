"""Suite-wide test settings.

Every hypothesis test is derandomized: the suite must give the same answer on every run and in
CI, so a property test that can fail only on some seeds is found here, not after landing. A
test's own ``@settings`` sets its example count and health checks; it inherits this profile's
other fields, so no test sets `derandomize` itself.

`python -m pytest -q --hypothesis-profile explore` runs the same property tests on fresh
random examples each time (the derandomized suite sees the same ones forever): a failure
prints its example and a `@reproduce_failure` blob to pin it with. Run it now and then, and
before trusting a change to the cache, the policies, the scheduler or the oracle.

Tests marked `fuzz` (long campaigns, `tests/test_fuzz.py`) run only when asked for: `-m fuzz`.

The terminal width is pinned to 80 columns (rich's default off a terminal): the CLI's tables
wrap at the width rich reads from `COLUMNS`, so a narrow shell exporting it would otherwise
change what the tests read.
"""
import os

import pytest
from hypothesis import settings

settings.register_profile("kvbench", derandomize=True, deadline=None, print_blob=True)
settings.register_profile("explore", derandomize=False, database=None, deadline=None,
                          print_blob=True)
settings.load_profile("kvbench")

os.environ["COLUMNS"] = "80"


def pytest_collection_modifyitems(config, items):
    if "fuzz" in (config.getoption("markexpr") or ""):
        return
    skip = pytest.mark.skip(reason="long campaign: run with -m fuzz")
    for item in items:
        if "fuzz" in item.keywords:
            item.add_marker(skip)
