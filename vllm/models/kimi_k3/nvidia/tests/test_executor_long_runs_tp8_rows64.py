"""Long runs of the executor on a K3 block with all 896 experts at TP8's per-rank shapes, rows 64
(2048 decode steps), the bucket TP8's decode target is set at; the method is in
`_block_long_runs.py`, the smaller buckets in test_executor_long_runs_tp8.py. Written as the
"parity" record executor_long_runs_tp8_rows64.json."""

from vllm.models.kimi_k3.nvidia.tests._block_long_runs import long_run_tests

RUNS = {(64, 1): 2048}  # (rows, q) -> steps of the long run

record, block, test_long_runs_on_a_k3_block_do_not_drift = long_run_tests(
    RUNS, "executor_long_runs_tp8_rows64.json",
    "vllm/models/kimi_k3/nvidia/tests/test_executor_long_runs_tp8_rows64.py", tp=8)
