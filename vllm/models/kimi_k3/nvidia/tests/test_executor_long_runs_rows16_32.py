"""Long runs of the executor on a K3 block with all 896 experts at rows 16 and 32 (2048 decode
steps each): they replay the skinny GEMM and the routed experts compiled for 2 and 4 row atoms,
which no other long run does. The method is in `_block_long_runs.py`; with rows 2 and 4 in one
file the run outlasted a 450-s call (2026-12-04: three of the four buckets done), so these two
have their own record, executor_long_runs_rows16_32.json."""

from vllm.models.kimi_k3.nvidia.tests._block_long_runs import long_run_tests

RUNS = {(16, 1): 2048, (32, 1): 2048}  # (rows, q) -> steps of the long run

record, block, test_long_runs_on_a_k3_block_do_not_drift = long_run_tests(
    RUNS, "executor_long_runs_rows16_32.json",
    "vllm/models/kimi_k3/nvidia/tests/test_executor_long_runs_rows16_32.py")
