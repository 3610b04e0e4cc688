"""Long runs of the executor on a K3 block with all 896 experts at rows 2 and 4 (2048 decode steps
each), the buckets between rows 1 and 8. The method is in `_block_long_runs.py`; rows 1, 8 and
the q = 8 verify in test_executor_long_runs.py, rows 16 and 32 in
test_executor_long_runs_rows16_32.py, rows 64 in test_executor_long_runs_rows64.py. Written as
the "parity" record executor_long_runs_mid.json."""

from vllm.models.kimi_k3.nvidia.tests._block_long_runs import long_run_tests

RUNS = {(2, 1): 2048, (4, 1): 2048}  # (rows, q) -> steps of the long run

record, block, test_long_runs_on_a_k3_block_do_not_drift = long_run_tests(
    RUNS, "executor_long_runs_mid.json", "vllm/models/kimi_k3/nvidia/tests/test_executor_long_runs_mid.py")
