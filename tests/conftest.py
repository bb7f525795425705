import os

import pytest
import torch
from hypothesis import settings

# Keep CPU timings stable and the suite fast on 2 cores.
torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))
# Every test measures its own times (Note [Timing cache] in remat.profile.cache): no test reads another's, or a
# developer's, cached times, and none writes to the home directory; subprocesses (the CLI, torchrun) inherit it.
# The cache's own tests turn it on in a temporary directory.
os.environ["REMAT_CACHE"] = "0"


def pytest_collection_modifyitems(config, items):
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
