"""The core's tests need torch, pytest and hypothesis alone: no transformers, no adapter, no tool.

``tests/test_core_alone.py`` runs them with those blocked. Their shared helpers are modules of this folder, imported
by name: the naive reference (``reference.py``) and one budgeted layer driven without a framework (``driver.py``).
"""

import profiles  # noqa: F401  (the hypothesis profiles, shared with tests/conftest.py)
from workers import share_cores

share_cores()  # under xdist, each worker its share of the cores (tests/workers.py)
