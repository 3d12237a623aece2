"""Suite-wide test settings.

Every hypothesis test is derandomized: the suite must give the same answer on every run and in
CI, so a property test that can fail only on some seeds is found here, not after landing. A
test's own ``@settings`` still sets its example count; it inherits this profile's other fields.

Tests marked `fuzz` (long campaigns, `tests/test_fuzz.py`) run only when asked for: `-m fuzz`.

The terminal width is pinned to 80 columns (rich's default off a terminal): the CLI's tables
wrap at the width rich reads from `COLUMNS`, so a narrow shell exporting it would otherwise
change what the tests read.
"""
import os

import pytest
from hypothesis import settings

settings.register_profile("kvbench", derandomize=True, deadline=None, print_blob=True)
settings.load_profile("kvbench")

os.environ["COLUMNS"] = "80"


def pytest_collection_modifyitems(config, items):
    if "fuzz" in (config.getoption("markexpr") or ""):
        return
    skip = pytest.mark.skip(reason="long campaign: run with -m fuzz")
    for item in items:
        if "fuzz" in item.keywords:
            item.add_marker(skip)
