"""The executor at K3's full depth, TP16: all 93 layers of the rank-0 shard, long runs of the dense
form at rows 1 and the q = 8 verify and the per-op parity of the 32-expert form (#8, form b).
The method and why the dense form is the one run long: `_depth_runs.py`; TP8 in
test_executor_depth_tp8.py. Written as the "parity" record executor_depth_parity.json."""

from vllm.models.kimi_k3.nvidia.tests._depth_runs import depth_tests

(record, dense, test_every_kernel_matches_its_reference_op_at_every_layer,
 test_long_runs_at_full_depth_do_not_drift) = depth_tests(
    16, "executor_depth_parity.json", "vllm/models/kimi_k3/nvidia/tests/test_executor_depth.py")
