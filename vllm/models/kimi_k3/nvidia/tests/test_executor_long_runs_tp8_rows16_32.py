"""Long runs of the executor on a K3 block with all 896 experts at TP8's per-rank shapes, rows 16
and 32 (2048 decode steps each), as test_executor_long_runs_rows16_32.py runs them at TP16; the
method is in `_block_long_runs.py`. Written as the "parity" record
executor_long_runs_tp8_rows16_32.json."""

from vllm.models.kimi_k3.nvidia.tests._block_long_runs import long_run_tests

RUNS = {(16, 1): 2048, (32, 1): 2048}  # (rows, q) -> steps of the long run

record, block, test_long_runs_on_a_k3_block_do_not_drift = long_run_tests(
    RUNS, "executor_long_runs_tp8_rows16_32.json",
    "vllm/models/kimi_k3/nvidia/tests/test_executor_long_runs_tp8_rows16_32.py", tp=8)
