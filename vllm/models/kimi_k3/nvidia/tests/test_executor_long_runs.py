"""Long runs of the executor on one AttnRes block of K3 with all 896 experts (#8, form a).

One 12-layer block (K3's KDA/MLA pattern, latent MoE with 896 experts, TP16 rank-0 shard) at
the buckets the decode records time: rows 1, 8 and 64 for 2048 decode steps, and a q = 8 verify
of one request for 256 steps (2048 tokens). Each bucket first takes ANCHOR_STEPS steps (more where
that is under PARITY_MIN_TOKENS tokens: `parity_steps_at`) in lockstep against the eager standard
path, judged as the decode records judge it (`parity_status`: within 1.5× the rounding-noise
yardstick's error + 0.02, top-1 likewise); then the long run, the specialized path and the
yardstick in lockstep against the graphed standard table (the eager one takes ~2.5 s a step at 64
rows), judged by `_util.long_run_vs_graphed`: the same rule over the run and over its last
quarter, and no growth beyond 3× from the first quarter (its own, or the yardstick's where that
is higher) to the last. Routing flips make the
per-step error O(0.5) at any point (benchmarks/decode_latency.py, PARITY_*), so the yardstick,
not an absolute bound, says what is too far. Written as the "parity" record executor_long_runs.json.
"""

import pytest
import torch

from vllm.models.kimi_k3.nvidia.benchmarks.decode_latency import (SOURCES, fill_state, k3_block,
                                                                    parity_lockstep, parity_status, parity_steps_at)
from vllm.models.kimi_k3.nvidia.latency_specialized.decode_ops import KernelOps
from vllm.models.kimi_k3.nvidia.latency_specialized.executor import SpecializedDecode
from vllm.models.kimi_k3.nvidia.latency_specialized.torch_ops import RoundingNoiseOps, TorchOps
from vllm.models.kimi_k3.nvidia.tests._evidence import record_parity
from vllm.models.kimi_k3.nvidia.tests._util import VERDICT, long_run_max_len, long_run_vs_graphed

TP = 16
CONTEXT = 1000
RUNS = {(1, 1): 2048, (8, 1): 2048, (64, 1): 2048, (8, 8): 256}  # (rows, q) -> steps of the long run
ANCHOR_STEPS = 8
MAX_LEN = long_run_max_len(CONTEXT, RUNS, ANCHOR_STEPS)
RESULTS: list[dict] = []


@pytest.fixture(scope="module", autouse=True)
def record():
    yield
    record_parity("executor_long_runs.json", "executor", "vllm/models/kimi_k3/nvidia/tests/test_executor_long_runs.py",
                  [*SOURCES, VERDICT], RESULTS)


@pytest.fixture(scope="module")
def block():
    model = k3_block(TP)
    kw = dict(max_requests=max(rows // q for rows, q in RUNS), max_len=MAX_LEN, buckets=list(RUNS))
    return model, *(SpecializedDecode(model, ops=ops, **kw) for ops in (KernelOps(), TorchOps(), RoundingNoiseOps()))


@pytest.mark.gpu
@pytest.mark.parametrize("rows, q", list(RUNS))
def test_long_runs_on_a_k3_block_do_not_drift(block, rows, q):
    model, spec, graphed, noisy = block
    for r, used in enumerate(spec.state.in_use):  # the previous bucket's requests
        if used:
            spec.state.free(r)
    # parity_lockstep copies this state (slots included) into every other executor and the eager state
    slots = fill_state(spec.state, rows // q, CONTEXT, torch.Generator(device="cuda").manual_seed(rows * 10 + q))
    # parity_lockstep copies whole pools, so the eager state has the executors' shape
    eager = model.new_state(max_requests=spec.state.max_requests, max_len=MAX_LEN, max_q=spec.state.max_q)
    gen = torch.Generator(device="cuda").manual_seed(7)
    anchor, _ = parity_lockstep(model, {"specialized": spec, "standard_rounding_noise": noisy,
                                        "standard_graphed": graphed}, eager, slots, q,
                                parity_steps_at(rows, ANCHOR_STEPS), gen, required="specialized")
    anchored = parity_status(anchor) == "pass"
    del eager
    runs, failed = long_run_vs_graphed(spec, noisy, graphed, slots, q, RUNS[(rows, q)], gen)
    RESULTS.append({"name": f"12-layer K3 block (896 experts) TP{TP} rows{rows} q{q} ctx{CONTEXT}: {RUNS[(rows, q)]} "
                    "steps vs graphed standard", "status": "pass" if anchored and not failed else "fail",
                    "failed": failed, "anchor_vs_eager": anchor, **runs["specialized"], "long_run": runs})
    assert anchored, anchor
    assert not failed, (failed, runs)
