"""The executor at K3's full depth: all 93 layers of a TP rank-0 shard, long runs (#8, form b).

- Dense form (K3's dense SiTU MLP in every layer: with random weights, top-16 routing turns
  bf16-sized differences into O(0.3) logit changes; PARITY_* in benchmarks/block_parity.py).
  At this depth random-weight logits are chaotic even so: a first H200 run measured the
  specialized path 0.28 from eager over the first four steps (the first quarter's median), the
  graphed standard table (which differs from eager in almost no rounding) 0.03, growing to
  0.13-0.32 within 16 steps. So the yardstick
  is the standard table with every GEMM output moved by up to one bf16 rounding
  (`torch_ops.RoundingNoiseOps`): the spread any correct bf16 implementation may show. Checks:
  - anchor, 16 steps from one state (64 at one row: block_parity.parity_steps_at), each
    against eager: the specialized path within decode_latency's rule (1.5x the yardstick's
    median error + 0.02, top-1 likewise);
  - long run, 2048 steps at rows 1 and 256 verify steps at rows 8 (q 8), logits every step,
    the specialized path and the yardstick in lockstep against the graphed standard table (the
    eager one takes ~0.3 s a step at this depth), judged by `_util.long_run_vs_graphed`: the same
    rule over the run and over its last quarter, and no growth beyond 3x from the first quarter
    (its own, or the yardstick's where that is higher).
- MoE form (experts cut to 32, top-16 routing kept): every op of one step at every layer,
  kernel against reference on identical inputs (`op_parity.ComparedOps`).

Each TP has a test file (`depth_tests`), each writing its own "parity" record, because a record
must come from one whole run and one run must fit one call on a lent GPU.
"""

from __future__ import annotations

import pytest
import torch

from vllm.models.kimi_k3.nvidia.benchmarks.block_parity import (FULL_LAYERS, PARITY_OP_REL,
                                                                  PARITY_SOURCES, copy_state, fill_state, k3_block,
                                                                  parity_lockstep, parity_status, parity_steps_at)
from vllm.models.kimi_k3.nvidia.latency_specialized.decode_ops import KernelOps, ReferenceOps
from vllm.models.kimi_k3.nvidia.latency_specialized.executor import SpecializedDecode
from vllm.models.kimi_k3.nvidia.latency_specialized.op_parity import ComparedOps
from vllm.models.kimi_k3.nvidia.latency_specialized.torch_ops import RoundingNoiseOps, TorchOps
from vllm.models.kimi_k3.nvidia.tests._evidence import parity_record
from vllm.models.kimi_k3.nvidia.tests._util import VERDICT, long_run_max_len, long_run_vs_graphed

CONTEXT = 1000
RUNS = {(1, 1): 2048, (8, 8): 256}  # bucket -> steps of the long run
ANCHOR_STEPS = 16
MAX_LEN = long_run_max_len(CONTEXT, RUNS, ANCHOR_STEPS)
# what a depth record measured: the executor and its kernels, the per-op comparison, the verdict, this file
DEPTH_SOURCES = [*PARITY_SOURCES, "vllm/models/kimi_k3/nvidia/latency_specialized/op_parity.py", VERDICT,
                 "vllm/models/kimi_k3/nvidia/tests/_depth_runs.py"]


def long_run(dense, tp: int, rows: int, q: int) -> tuple[dict, bool, list[str]]:
    """One bucket of the dense form: its result row, whether the anchor passed, what the long run failed."""
    model, spec, graphed, noisy = dense
    for ex in (spec, graphed, noisy):
        ex.state.free(0)
    slots = fill_state(spec.state, rows // q, CONTEXT, torch.Generator(device="cuda").manual_seed(rows))
    for ex in (graphed, noisy):
        ex.state.allocate()
        copy_state(ex.state, spec.state)
    eager = model.new_state(max_requests=1, max_len=MAX_LEN, max_q=spec.state.max_q)
    gen = torch.Generator(device="cuda").manual_seed(7)
    # anchor: each path against eager from the same state (parity copies it over first); the
    # rounding-noise table is the baseline of decode_latency's rule
    anchor, _ = parity_lockstep(model, {"specialized": spec, "standard_rounding_noise": noisy,
                                        "standard_graphed": graphed}, eager, slots, q,
                                parity_steps_at(rows, ANCHOR_STEPS), gen, required="specialized")
    anchored = parity_status(anchor) == "pass"
    # the long run: specialized and the yardstick against the graphed standard table, from the
    # state the anchor left
    runs, failed = long_run_vs_graphed(spec, noisy, graphed, slots, q, RUNS[(rows, q)], gen)
    result = {"name": f"{FULL_LAYERS}-layer dense TP{tp} rows{rows} q{q} ctx{CONTEXT}: "
              f"{RUNS[(rows, q)]} steps vs graphed standard", "status": "pass" if anchored and not failed else "fail",
              "failed": failed, "anchor_vs_eager": anchor, **runs["specialized"], "long_run": runs}
    return result, anchored, failed


def op_parity(tp: int) -> tuple[dict, list]:
    """The MoE form: every op of one 4-row step at every layer, kernel against reference; the
    result row and the ops out of bounds."""
    model = k3_block(tp, layers=FULL_LAYERS, experts=32)
    ops = ComparedOps(KernelOps(), ReferenceOps())
    ex = SpecializedDecode(model, max_requests=4, max_len=CONTEXT + 8, buckets=[(4, 1)], ops=ops, graphs=False)
    slots = fill_state(ex.state, 4, CONTEXT, torch.Generator(device="cuda").manual_seed(11))
    ops.report.clear()
    ids = torch.randint(0, model.w.lm_head.shape[0], (4,), device="cuda")
    ex(ids, [ex.state.segment(r, j, 1, prefill=False) for j, r in enumerate(slots)], ex.state)
    bad = [(op, i, err) for op, i, err in ops.report
           if (err < 0.99 if op == "route.ids_equal" else not err <= PARITY_OP_REL)]
    errs = [err for op, _, err in ops.report if op != "route.ids_equal"]
    return ({"name": f"{FULL_LAYERS}-layer moe TP{tp} (32 experts, top-16) rows4: per-op kernel vs reference",
             "ops_compared": len(errs), "worst_op_rel_err": max(errs), "status": "fail" if bad else "pass"}, bad)


def depth_tests(tp: int, record_file: str, test_file: str):
    """The fixtures and tests of one depth test file, which binds them to module names so pytest
    collects them: the dense 93-layer shard of `tp`'s rank 0 built once, a long run per bucket
    of RUNS, the per-op parity of the 32-expert form, and the record `record_file`."""
    results: list[dict] = []

    record = parity_record(record_file, "executor", test_file, DEPTH_SOURCES, results)

    @pytest.fixture(scope="module")
    def dense():
        model = k3_block(tp, layers=FULL_LAYERS, dense=True)
        kw = dict(max_requests=1, max_len=MAX_LEN, buckets=list(RUNS))
        return model, *(SpecializedDecode(model, ops=ops, **kw) for ops in (KernelOps(), TorchOps(), RoundingNoiseOps()))

    # collected first (the test files bind it first), so that its 32-expert model is gone before
    # the dense one and its three executors are built: at TP8 the two together would be about
    # twice the TP16 test's 54 GB peak
    @pytest.mark.gpu
    def test_every_kernel_matches_its_reference_op_at_every_layer():
        result, bad = op_parity(tp)
        results.append(result)
        assert not bad, bad

    @pytest.mark.gpu
    @pytest.mark.parametrize("rows, q", list(RUNS))
    def test_long_runs_at_full_depth_do_not_drift(dense, rows, q):
        result, anchored, failed = long_run(dense, tp, rows, q)
        results.append(result)
        assert anchored, result["anchor_vs_eager"]
        assert not failed, (failed, result["long_run"])

    return record, dense, test_every_kernel_matches_its_reference_op_at_every_layer, test_long_runs_at_full_depth_do_not_drift
