"""Test markers: `gpu` tests need a CUDA device and skip with a visible reason without one; a
test whose K3 block cannot fit the GPU skips with the sizes (`_block_fit.py`).

Evidence records are written only by whole-file runs: a run that selects part of its files'
tests ignores K3_EVIDENCE_DIR and says so at its end (`_evidence.partial_selection`)."""

import os

import pytest
import torch

from vllm.models.kimi_k3.nvidia.tests._block_fit import pytest_runtest_call, pytest_runtest_setup  # noqa: F401
from vllm.models.kimi_k3.nvidia.tests._evidence import partial_selection

_NO_RECORDS = pytest.StashKey[str]()


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs a CUDA device (skipped with a reason when absent)")
    config.addinivalue_line("markers", "slow: builds a wheel or runs a subprocess")
    why = partial_selection(config.option, config.args)
    if why and os.environ.get("K3_EVIDENCE_DIR"):
        del os.environ["K3_EVIDENCE_DIR"]
        config.stash[_NO_RECORDS] = why


def pytest_terminal_summary(terminalreporter, config):
    why = config.stash.get(_NO_RECORDS, None)
    if why:
        terminalreporter.write_line(f"K3_EVIDENCE_DIR ignored: this run selects part of its tests ({why}); "
                                    "evidence records come from whole-file runs (`pytest -m gpu <file>`)",
                                    yellow=True)


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="GPU test: no CUDA device on this machine (GPU evidence lives in evidence/)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
