"""Long runs of the executor on a K3 block with all 896 experts at rows 1 and 8 (2048 decode
steps) and a q = 8 verify of one request (256 steps, 2048 tokens); the method is in
`_block_long_runs.py`, rows 64 in test_executor_long_runs_rows64.py. Written as the "parity"
record executor_long_runs.json."""

import pytest

from vllm.models.kimi_k3.nvidia.tests._block_long_runs import LONG_RUN_SOURCES, BlockLongRuns
from vllm.models.kimi_k3.nvidia.tests._evidence import record_parity

RUNS = {(1, 1): 2048, (8, 1): 2048, (8, 8): 256}  # (rows, q) -> steps of the long run
RESULTS: list[dict] = []


@pytest.fixture(scope="module", autouse=True)
def record():
    yield
    record_parity("executor_long_runs.json", "executor", "vllm/models/kimi_k3/nvidia/tests/test_executor_long_runs.py",
                  LONG_RUN_SOURCES, RESULTS)


@pytest.fixture(scope="module")
def block():
    return BlockLongRuns(RUNS)


@pytest.mark.gpu
@pytest.mark.parametrize("rows, q", list(RUNS))
def test_long_runs_on_a_k3_block_do_not_drift(block, rows, q):
    result, anchored, failed = block.run(rows, q)
    RESULTS.append(result)
    assert anchored, result["anchor_vs_eager"]
    assert not failed, (failed, result["long_run"])
