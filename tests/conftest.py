import os

import pytest
import torch
from hypothesis import settings

# Keep CPU timings stable and the suite fast on 2 cores: under pytest-xdist (scripts/test.sh runs two workers)
# one thread per worker, so that the workers' threads do not outnumber the cores (two workers of two threads
# each took 9:09 once, against 5-6 minutes in one process).
torch.set_num_threads(1 if os.environ.get("PYTEST_XDIST_WORKER") else max(1, min(2, os.cpu_count() or 1)))
# The timing cache (Note [Timing cache] in remat.profile.cache): off outside tests (module-scoped fixtures), and
# each test gets its own empty one (the autouse fixture below), so no test reads another's, or a developer's,
# cached times, and the outcome of a test does not depend on which tests ran before it. Within one test, a
# step profiled again reads its first profile's times, as a user's second call does. Subprocesses (the CLI,
# torchrun) inherit the test's. Tests about the timed steps themselves turn it off.
os.environ["REMAT_CACHE"] = "0"
# Note [Plans timed beside the hand rules] in remat.api.hand_rules: a plan that hangs on timing noise is no test's
# business, so the suite plans as the model ranks; tests/integration/test_hand_rules.py turns the timing on
os.environ["REMAT_TIME_HAND_RULES"] = "0"


@pytest.fixture(autouse=True)
def _timing_cache_of_this_test(tmp_path, monkeypatch):
    monkeypatch.setenv("REMAT_CACHE", "1")
    monkeypatch.setenv("REMAT_CACHE_DIR", str(tmp_path / "remat-cache"))


#: the suite's longest files (about 160 s of test_distributed.py's two-rank runs, of about 560 s in all), run
#: first: with two workers taking one file at a time (scripts/test.sh), a long file started last ends alone
LONGEST_FIRST = ("test_distributed.py",)


def pytest_collection_modifyitems(config, items):
    items.sort(key=lambda item: item.path.name not in LONGEST_FIRST)  # (stable: the rest keep their order)
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device; none here")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


# CI must be deterministic: property tests draw the same cases on every run (explicit @example cases
# cover inputs that once failed), and no example database carries state between runs.
settings.register_profile("remat", derandomize=True, database=None, deadline=None)
settings.load_profile("remat")

