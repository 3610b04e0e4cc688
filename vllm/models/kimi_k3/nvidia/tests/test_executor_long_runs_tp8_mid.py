"""Long runs of the executor on a K3 block with all 896 experts at TP8's per-rank shapes, rows 2
and 4 (2048 decode steps each), as test_executor_long_runs_mid.py runs them at TP16; the method
is in `_block_long_runs.py`. Written as the "parity" record executor_long_runs_tp8_mid.json."""

from vllm.models.kimi_k3.nvidia.tests._block_long_runs import long_run_tests

RUNS = {(2, 1): 2048, (4, 1): 2048}  # (rows, q) -> steps of the long run

record, block, test_long_runs_on_a_k3_block_do_not_drift = long_run_tests(
    RUNS, "executor_long_runs_tp8_mid.json", "vllm/models/kimi_k3/nvidia/tests/test_executor_long_runs_tp8_mid.py",
    tp=8)
