"""The hypothesis profiles every test folder runs under (imported by tests/conftest.py and tests/core/conftest.py).

The property tests draw the same examples on every machine and run, so a red suite is reproducible where it is
read; ``HYPOTHESIS_PROFILE=explore`` draws new ones each run (and more of them) to look for counterexamples.
"""

import os

from hypothesis import settings

settings.register_profile("fixed", derandomize=True)
settings.register_profile("explore", max_examples=200)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "fixed"))
