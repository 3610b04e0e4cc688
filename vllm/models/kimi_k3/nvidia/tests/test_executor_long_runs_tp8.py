"""Long runs of the executor on a K3 block with all 896 experts at TP8's per-rank shapes: rows 1
and 8 (2048 decode steps) and a q = 8 verify of one request (256 steps, 2048 tokens), as
test_executor_long_runs.py runs them at TP16; the method is in `_block_long_runs.py`, rows 64 in
test_executor_long_runs_tp8_rows64.py. Written as the "parity" record
executor_long_runs_tp8.json."""

from vllm.models.kimi_k3.nvidia.tests._block_long_runs import long_run_tests

RUNS = {(1, 1): 2048, (8, 1): 2048, (8, 8): 256}  # (rows, q) -> steps of the long run

record, block, test_long_runs_on_a_k3_block_do_not_drift = long_run_tests(
    RUNS, "executor_long_runs_tp8.json", "vllm/models/kimi_k3/nvidia/tests/test_executor_long_runs_tp8.py", tp=8)
