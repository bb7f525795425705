import os

import pytest
import torch

# Keep CPU timings stable and the suite fast on 2 cores.
torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device; none here")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)
