"""Long runs of the executor on one AttnRes block of K3 with all 896 experts (#8, form a).

One 12-layer block (K3's KDA/MLA pattern, latent MoE with 896 experts, the rank-0 shard of TP16
or TP8) at the buckets the decode records time. Each bucket first takes ANCHOR_STEPS steps (more where that
is under PARITY_MIN_TOKENS tokens: `parity_steps_at`) in lockstep against the eager standard path,
judged as the decode records judge it (`parity_status`: within 1.5× the rounding-noise
yardstick's error + 0.02, top-1 likewise); then the long run, the specialized path and the
yardstick in lockstep against the graphed standard table (the eager one takes ~2.8 s a step at
64 rows), judged by `_util.long_run_vs_graphed`: the same rule over the run and over its last
quarter, and no growth beyond 3× from the first quarter (its own, or the yardstick's where that
is higher) to the last. Routing flips make the per-step error O(0.5) at any point
(benchmarks/block_parity.py, PARITY_*), so the yardstick, not an absolute bound, says what is
too far.

Several test files run it (`long_run_tests`), each writing its own "parity" record, because a
record must come from one whole run and one run must fit one call on a lent GPU: at TP16 rows 64
alone replays three graphs of ~10-35 ms 2048 times (test_executor_long_runs_rows64.py), rows 1, 8
and the q = 8 verify together take about as long (test_executor_long_runs.py), rows 2 and 4
(test_executor_long_runs_mid.py) and rows 16 and 32 (test_executor_long_runs_rows16_32.py) are
two more; TP8 has the first two (test_executor_long_runs_tp8*.py).
"""

from __future__ import annotations

import pytest
import torch

from vllm.models.kimi_k3.nvidia.benchmarks.block_parity import (PARITY_SOURCES, fill_state, k3_block, parity_lockstep,
                                                                  parity_status, parity_steps_at)
from vllm.models.kimi_k3.nvidia.latency_specialized.decode_ops import KernelOps
from vllm.models.kimi_k3.nvidia.latency_specialized.executor import SpecializedDecode
from vllm.models.kimi_k3.nvidia.latency_specialized.torch_ops import RoundingNoiseOps, TorchOps
from vllm.models.kimi_k3.nvidia.tests._evidence import parity_record
from vllm.models.kimi_k3.nvidia.tests._util import VERDICT, free_all, long_run_max_len, long_run_vs_graphed

CONTEXT = 1000
ANCHOR_STEPS = 8
# what a long-run record measured: the executor and its kernels, the verdict, and this file
LONG_RUN_SOURCES = [*PARITY_SOURCES, VERDICT, "vllm/models/kimi_k3/nvidia/tests/_block_long_runs.py"]


class BlockLongRuns:
    """The block and its three paths (specialized on the kernels, graphed standard, rounding-noise
    yardstick), built once for the buckets of `runs` ((rows, q) -> steps of the long run)."""

    def __init__(self, runs: dict[tuple[int, int], int], tp: int):
        self.runs, self.tp = runs, tp
        self.max_len = long_run_max_len(CONTEXT, runs, ANCHOR_STEPS)
        self.model = k3_block(tp)
        kw = dict(max_requests=max(rows // q for rows, q in runs), max_len=self.max_len, buckets=list(runs))
        self.spec, self.graphed, self.noisy = (SpecializedDecode(self.model, ops=ops, **kw)
                                               for ops in (KernelOps(), TorchOps(), RoundingNoiseOps()))

    def run(self, rows: int, q: int) -> tuple[dict, bool, list[str]]:
        """One bucket: its result row, whether the anchor passed, and what the long run failed."""
        spec = self.spec
        free_all(spec.state)
        # parity_lockstep copies this state (slots included) into every other executor and the eager state
        slots = fill_state(spec.state, rows // q, CONTEXT, torch.Generator(device="cuda").manual_seed(rows * 10 + q))
        # parity_lockstep copies whole pools, so the eager state has the executors' shape
        eager = self.model.new_state(max_requests=spec.state.max_requests, max_len=self.max_len,
                                     max_q=spec.state.max_q)
        gen = torch.Generator(device="cuda").manual_seed(7)
        anchor, _ = parity_lockstep(self.model, {"specialized": spec, "standard_rounding_noise": self.noisy,
                                                 "standard_graphed": self.graphed}, eager, slots, q,
                                    parity_steps_at(rows, ANCHOR_STEPS), gen, required="specialized")
        anchored = parity_status(anchor) == "pass"
        del eager
        steps = self.runs[(rows, q)]
        runs, failed = long_run_vs_graphed(spec, self.noisy, self.graphed, slots, q, steps, gen)
        result = {"name": f"12-layer K3 block (896 experts) TP{self.tp} rows{rows} q{q} ctx{CONTEXT}: {steps} steps vs "
                  "graphed standard", "status": "pass" if anchored and not failed else "fail", "failed": failed,
                  "anchor_vs_eager": anchor, **runs["specialized"], "long_run": runs}
        return result, anchored, failed


def long_run_tests(runs: dict[tuple[int, int], int], record_file: str, test_file: str, tp: int = 16):
    """The fixtures and the test of one long-run test file, which binds them to module names so
    pytest collects them: the block of `tp`'s rank-0 shard built once for `runs`, one test per
    bucket, and the record `record_file` written from the whole run."""
    results: list[dict] = []

    record = parity_record(record_file, "executor", test_file, LONG_RUN_SOURCES, results)

    @pytest.fixture(scope="module")
    def block():
        return BlockLongRuns(runs, tp)

    @pytest.mark.gpu
    @pytest.mark.parametrize("rows, q", list(runs))
    def test_long_runs_on_a_k3_block_do_not_drift(block, rows, q):
        result, anchored, failed = block.run(rows, q)
        results.append(result)
        assert anchored, result["anchor_vs_eager"]
        assert not failed, (failed, result["long_run"])

    return record, block, test_long_runs_on_a_k3_block_do_not_drift
