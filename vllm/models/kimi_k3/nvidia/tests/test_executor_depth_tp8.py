"""The executor at K3's full depth, TP8: test_executor_depth.py at TP8's per-rank shapes (the
method in `_depth_runs.py`). Written as the "parity" record executor_depth_parity_tp8.json."""

from vllm.models.kimi_k3.nvidia.tests._depth_runs import depth_tests

(record, dense, test_every_kernel_matches_its_reference_op_at_every_layer,
 test_long_runs_at_full_depth_do_not_drift) = depth_tests(
    8, "executor_depth_parity_tp8.json", "vllm/models/kimi_k3/nvidia/tests/test_executor_depth_tp8.py")
