"""The specialized executor on a GPU: CUDA graphs of CuTe DSL kernels against the standard path.

A TP16 rank of K3's first 12 layers (K3's KDA/MLA pattern, experts cut to 64 so the test builds
in seconds; the benchmark runs all 896) with random weights. Thresholds are the benchmark's
(benchmarks/decode_latency.py, where they are justified)."""

import os
from pathlib import Path

import pytest
import torch

from vllm.models.kimi_k3.nvidia.benchmarks.decode_latency import (PARITY_MEDIAN_REL, PARITY_TOP1, SOURCES,
                                                                    copy_state, fill_state, k3_block, parity)
from vllm.models.kimi_k3.nvidia.latency_specialized.decode_ops import GLUE, KernelOps
from vllm.models.kimi_k3.nvidia.latency_specialized.evidence import write_record
from vllm.models.kimi_k3.nvidia.latency_specialized.executor import SpecializedDecode

BUCKETS = [(1, 1), (4, 1), (8, 8)]
RESULTS: list[dict] = []


@pytest.fixture(scope="module")
def built():
    torch.manual_seed(0)
    model = k3_block(16, experts=64)
    ex = SpecializedDecode(model, max_requests=4, max_len=1200, buckets=BUCKETS, ops=KernelOps())
    yield model, ex
    out = os.environ.get("K3_EVIDENCE_DIR")
    if out and RESULTS:
        write_record(Path(out) / "executor_parity.json", "parity", "executor",
                     "pytest -m gpu vllm/models/kimi_k3/nvidia/tests/test_executor_cuda.py",
                     SOURCES, RESULTS)


@pytest.mark.gpu
def test_graphs_hold_only_kernels_and_declared_glue(built):
    _, ex = built
    for key in BUCKETS:
        outside = sorted({op for op, impl in ex.kernels[key] if impl != "cute" and op not in GLUE})
        assert not outside, f"bucket {key}: ops outside the kernel table: {outside}"
        assert {op for op, impl in ex.kernels[key] if impl == "cute"} >= {
            "embedding", "attn_res", "skinny_gemm", "kda_decode", "mla_cache_write", "mla_decode", "moe_router",
            "moe_expert_gemv", "moe_combine", "rms_norm"}


@pytest.mark.gpu
@pytest.mark.parametrize("rows, q", BUCKETS + [(3, 1)])
def test_replays_match_the_standard_path(built, rows, q):
    model, ex = built
    gen = torch.Generator(device="cuda").manual_seed(rows * 10 + q)
    for r in range(ex.state.max_requests):
        ex.state.free(r)
    slots = fill_state(ex.state, rows // q, 1000, gen)
    std = model.new_state(max_requests=4, max_len=1200, max_q=ex.state.max_q)
    p = parity(model, ex, std, slots, q, 24, gen)
    RESULTS.append({"name": f"tp16 rows{rows} q{q} ctx1000", "status": "pass" if (
        p["rel_err_median"] < PARITY_MEDIAN_REL and p["top1_agreement"] >= PARITY_TOP1) else "fail", **p})
    assert p["rel_err_median"] < PARITY_MEDIAN_REL, p
    assert p["top1_agreement"] >= PARITY_TOP1, p
    assert p["rel_err_last_quarter"] < 3 * max(p["rel_err_first_quarter"], 1e-3), f"error grows with steps: {p}"


@pytest.mark.gpu
def test_steps_may_alternate_between_paths(built):
    """Specialized and standard steps on one state track a standard-only run of the same inputs."""
    model, ex = built
    gen = torch.Generator(device="cuda").manual_seed(7)
    for r in range(ex.state.max_requests):
        ex.state.free(r)
    slots = fill_state(ex.state, 2, 500, gen)
    alone = model.new_state(max_requests=4, max_len=1200, max_q=ex.state.max_q)
    copy_state(alone, ex.state)
    ids = torch.randint(0, model.w.lm_head.shape[0], (2,), generator=gen, device="cuda")
    errs = []
    for step in range(12):
        segs = [ex.state.segment(r, j, 1, prefill=False) for j, r in enumerate(slots)]
        if step % 2:
            got = model.logits(model.forward(ids, segs, ex.state))
        else:
            got = ex(ids, segs, ex.state)
        want = model.logits(model.forward(ids, [alone.segment(r, j, 1, prefill=False)
                                                for j, r in enumerate(slots)], alone))
        errs.append(float((got.double() - want.double()).norm() / want.double().norm()))
        ids = want.argmax(-1)
    RESULTS.append({"name": "tp16 alternating paths, 2 requests", "status": "pass" if max(errs) < 0.1 else "fail",
                    "rel_err": max(errs), "rel_err_median": sorted(errs)[len(errs) // 2]})
    assert sorted(errs)[len(errs) // 2] < PARITY_MEDIAN_REL and max(errs) < 0.1, errs
