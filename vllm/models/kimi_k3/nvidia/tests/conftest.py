"""Test markers: `gpu` tests need a CUDA device and skip with a visible reason without one."""

import pytest
import torch


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs a CUDA device (skipped with a reason when absent)")
    config.addinivalue_line("markers", "slow: builds a wheel or runs a subprocess")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="GPU test: no CUDA device on this machine (GPU evidence lives in evidence/)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
