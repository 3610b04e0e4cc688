"""The specialized executor on a GPU: CUDA graphs of CuTe DSL kernels against the standard path.

TP16 rank-0 shards of K3's first 12 layers (K3's KDA/MLA pattern), random weights, in two forms
(why two: PARITY_* in benchmarks/block_parity.py; random top-16-of-896 routing turns bf16-sized
differences into O(0.3) logit changes, so whole-step logits are compared where routing is absent):
- the MoE block (experts cut to 64 so it builds in seconds; the benchmark runs all 896): every op
  of a step, kernel against reference on identical inputs (`op_parity.ComparedOps`);
- the dense block (K3's dense SiTU MLP in every layer): whole-step logits, multi-step drift,
  graph replay against an eager run, and steps alternating between the paths;
- graphs with side lanes (`lanes.py`, the default) against one-stream graphs: bit-identical steps;
- the shipped tiny eval model (all 8 layers, its 8 experts padded for the MoE kernels by
  `moe_padding`): the MoE block's two tests as well.
"""

import pytest
import torch

from vllm.models.kimi_k3.nvidia.benchmarks.block_parity import (PARITY_MEDIAN_REL, PARITY_OP_REL, PARITY_TOP1,
                                                                  PARITY_SOURCES, copy_state, fill_state, k3_block, parity)
from vllm.models.kimi_k3.nvidia.latency_specialized.decode_ops import GLUE, KernelOps, ReferenceOps
from vllm.models.kimi_k3.nvidia.latency_specialized.executor import SpecializedDecode
from vllm.models.kimi_k3.nvidia.evals.tiny import config_named, shipped_weights
from vllm.models.kimi_k3.nvidia.latency_specialized.op_parity import ComparedOps
from vllm.models.kimi_k3.nvidia.latency_specialized.weights import SafetensorsSource, load_rank
from vllm.models.kimi_k3.nvidia.reference.model import ReferenceModel
from vllm.models.kimi_k3.nvidia.tests._evidence import parity_record

BUCKETS = [(1, 1), (4, 1), (8, 8)]
MAX_LEN = 1000 + 48 * 8 + 8  # the longest parity run: 48 verify steps of 8 tokens after a 1000-token context
RESULTS: list[dict] = []


record = parity_record("executor_parity.json", "executor", "vllm/models/kimi_k3/nvidia/tests/test_executor_cuda.py",
                       [*PARITY_SOURCES, "vllm/models/kimi_k3/nvidia/latency_specialized/op_parity.py"], RESULTS)


@pytest.fixture(scope="module")
def moe_block():
    return k3_block(16, experts=64)


@pytest.fixture(scope="module")
def dense():
    model = k3_block(16, dense=True)
    return model, SpecializedDecode(model, max_requests=4, max_len=MAX_LEN, buckets=BUCKETS, ops=KernelOps())


@pytest.fixture(scope="module")
def tiny():
    cfg = config_named("tiny")
    return ReferenceModel(cfg, load_rank(SafetensorsSource(shipped_weights("tiny")), cfg, device="cuda"))


def _fresh(ex, requests, context, seed):
    for r in range(ex.state.max_requests):
        ex.state.free(r)
    return fill_state(ex.state, requests, context, torch.Generator(device="cuda").manual_seed(seed))


BLOCKS = {"moe_block": "moe block", "tiny": "tiny"}  # fixture, record name


@pytest.mark.gpu
@pytest.mark.parametrize("block", BLOCKS)
def test_graphs_hold_only_kernels_and_declared_glue(block, request):
    ex = SpecializedDecode(request.getfixturevalue(block), max_requests=4, max_len=256, buckets=BUCKETS,
                           ops=KernelOps())
    for key in BUCKETS:
        outside = sorted({op for op, impl in ex.kernels[key] if impl != "cute" and op not in GLUE})
        assert not outside, f"bucket {key}: ops outside the kernel table: {outside}"
        assert {op for op, impl in ex.kernels[key] if impl == "cute"} >= {
            "embedding", "attn_res", "skinny_gemm", "kda_decode", "mla_cache_write", "mla_decode", "moe_router",
            "moe_expert_gemv", "moe_combine", "rms_norm"}


@pytest.mark.gpu
@pytest.mark.parametrize("block", BLOCKS)
@pytest.mark.parametrize("rows, q", [(3, 1), (8, 8)])
def test_every_kernel_matches_its_reference_op_in_a_step(block, rows, q, request):
    model = request.getfixturevalue(block)
    ops = ComparedOps(KernelOps(), ReferenceOps())
    ex = SpecializedDecode(model, max_requests=rows // q, max_len=600, buckets=[(4 if rows == 3 else rows, q)],
                           ops=ops, graphs=False)
    slots = _fresh(ex, rows // q, 500, rows)
    gen = torch.Generator(device="cuda").manual_seed(1)
    for _ in range(3):
        ops.report.clear()
        ids = torch.randint(0, model.w.lm_head.shape[0], (rows,), generator=gen, device="cuda")
        ex(ids, [ex.state.segment(r, j * q, q, prefill=False) for j, r in enumerate(slots)], ex.state)
        bad = [(op, i, err) for op, i, err in ops.report
               if (err < 0.99 if op == "route.ids_equal" else not err <= PARITY_OP_REL)]
        worst = max(err for op, _, err in ops.report if op != "route.ids_equal")
        RESULTS.append({"name": f"{BLOCKS[block]} rows{rows} q{q}: per-op kernel vs reference", "worst_op_rel_err": worst,
                        "status": "fail" if bad else "pass"})
        assert not bad, bad


@pytest.mark.gpu
@pytest.mark.parametrize("rows, q", BUCKETS + [(3, 1)])
def test_replays_match_the_standard_path(dense, rows, q):
    model, ex = dense
    slots = _fresh(ex, rows // q, 1000, rows * 10 + q)
    std = model.new_state(max_requests=4, max_len=MAX_LEN, max_q=ex.state.max_q)
    p = parity(model, ex, std, slots, q, 48, torch.Generator(device="cuda").manual_seed(3))
    ok = p["rel_err_median"] < PARITY_MEDIAN_REL and p["top1_agreement"] >= PARITY_TOP1
    ok = ok and p["rel_err_last_quarter"] < 3 * max(p["rel_err_first_quarter"], 1e-3)
    RESULTS.append({"name": f"dense block rows{rows} q{q} ctx1000, 48 steps", "status": "pass" if ok else "fail", **p})
    assert ok, p


@pytest.mark.gpu
def test_graph_replay_equals_an_eager_run_bit_for_bit(dense):
    model, ex = dense
    slots = _fresh(ex, 4, 300, 5)
    saved = model.new_state(max_requests=4, max_len=MAX_LEN, max_q=ex.state.max_q)
    copy_state(saved, ex.state)
    ids = torch.randint(0, model.w.lm_head.shape[0], (4,), device="cuda")
    graphed = ex(ids, [ex.state.segment(r, j, 1, prefill=False) for j, r in enumerate(slots)], ex.state).clone()
    copy_state(ex.state, saved)
    eager = ex._forward(ex.meta[(4, 1)])[:4]  # the same metadata, kernels launched one by one
    RESULTS.append({"name": "dense block rows4: graph replay vs eager launches", "status":
                    "pass" if torch.equal(graphed, eager) else "fail"})
    assert torch.equal(graphed, eager)


@pytest.mark.gpu
def test_lanes_change_the_schedule_not_the_step(moe_block):
    """Graphs whose MoE and MLA layers run side ops on lanes (the default) replay what one-stream
    graphs replay, bit for bit, step after step on one state, with the same kernels in the step."""
    ex = {ov: SpecializedDecode(moe_block, max_requests=4, max_len=600, buckets=BUCKETS, ops=KernelOps(), overlap=ov)
          for ov in (True, False)}
    assert ex[True].lanes.on and not ex[False].lanes.on
    for key in BUCKETS:
        assert sorted(ex[True].kernels[key]) == sorted(ex[False].kernels[key]), key
    rows, q = 8, 8
    slots = _fresh(ex[True], rows // q, 500, 11)
    copy_state(ex[False].state, ex[True].state)
    gen = torch.Generator(device="cuda").manual_seed(12)
    same = True
    for _ in range(6):
        ids = torch.randint(0, moe_block.w.lm_head.shape[0], (rows,), generator=gen, device="cuda")
        out = [e(ids, [e.state.segment(r, j * q, q, prefill=False) for j, r in enumerate(slots)], e.state).clone()
               for e in (ex[True], ex[False])]
        same &= torch.equal(*out)
    RESULTS.append({"name": "moe block rows8 q8: lanes vs one stream, 6 graph replays", "status":
                    "pass" if same else "fail"})
    assert same


@pytest.mark.gpu
def test_steps_may_alternate_between_paths(dense):
    """Specialized and standard steps on one state track a standard-only run of the same inputs."""
    model, ex = dense
    slots = _fresh(ex, 2, 500, 7)
    alone = model.new_state(max_requests=4, max_len=MAX_LEN, max_q=ex.state.max_q)
    copy_state(alone, ex.state)
    ids = torch.randint(0, model.w.lm_head.shape[0], (2,), device="cuda")
    errs = []
    for step in range(16):
        segs = [ex.state.segment(r, j, 1, prefill=False) for j, r in enumerate(slots)]
        got = model.logits(model.forward(ids, segs, ex.state)) if step % 2 else ex(ids, segs, ex.state)
        want = model.logits(model.forward(ids, [alone.segment(r, j, 1, prefill=False)
                                                for j, r in enumerate(slots)], alone))
        errs.append(float((got.double() - want.double()).norm() / want.double().norm()))
        ids = want.argmax(-1)
    median = sorted(errs)[len(errs) // 2]
    RESULTS.append({"name": "dense block, paths alternating every step, 2 requests", "rel_err": max(errs),
                    "rel_err_median": median, "status": "pass" if median < PARITY_MEDIAN_REL else "fail"})
    assert median < PARITY_MEDIAN_REL, errs

