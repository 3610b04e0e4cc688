"""Can the parity rule fail? Its power on each random-weight form the parity records judge.

The decode records, the long runs and the depth test pass the specialized path when its median
logit error stays within PARITY_VS_BASELINE × the rounding-noise yardstick's, plus 0.02, and its
top-1 agreement near the yardstick's (`block_parity.parity_status`). Random-weight logits are
chaotic, and where the yardstick is itself far from the reference that rule passes anything: on
the H200 (2026-12-04) the 93-layer block with 32 experts put the yardstick, the graphed torch
table and the kernels all at 1.22-1.25 from eager. So this scores, per form and bucket, a path
that ignores the request's context: the graphed standard table stepped from another random
state on the same tokens (the null), beside the yardstick, both against the graphed standard
table, and asks `parity_status` whether the null would pass. Where it would, the records'
logit parity cannot tell a path that loses the context (a broken attention or KDA state) from a
correct one, and only the per-op parity (op_parity.ComparedOps, every op against the reference
on identical inputs) and the dense-MLP forms' bounds carry the proof. The 93-layer 32-expert form
is asserted to be such a form, which is why test_executor_depth.py runs its long runs dense.
"""

import gc
import statistics

import pytest
import torch

from vllm.models.kimi_k3.nvidia.benchmarks.block_parity import (FULL_LAYERS, copy_state, fill_state, k3_block,
                                                                  parity_status, parity_steps_at)
from vllm.models.kimi_k3.nvidia.latency_specialized.executor import SpecializedDecode
from vllm.models.kimi_k3.nvidia.latency_specialized.torch_ops import RoundingNoiseOps, TorchOps
from vllm.models.kimi_k3.nvidia.tests._evidence import parity_record
from vllm.models.kimi_k3.nvidia.tests._util import free_all

CONTEXT = 1000
MIN_STEPS = 16
# form -> (k3_block arguments, buckets (rows, q)): the forms and buckets the parity records judge
FORMS = {
    "12-layer block, 896 experts, TP16": (dict(tp=16), [(1, 1), (8, 1), (64, 1), (8, 8)]),
    "12-layer block, 896 experts, TP8": (dict(tp=8), [(1, 1), (64, 1), (8, 8)]),
    "93-layer dense, TP16": (dict(tp=16, layers=FULL_LAYERS, dense=True), [(1, 1), (8, 8)]),
}
# a known defect of the evidence, kept visible: the H200 run of 2026-12-04 found the rule passing
# the null at every bucket of the 896-expert block (routing flips put the yardstick at 0.60-0.77,
# a context-blind path at 0.55-1.00, top-1 0.06-0.28 against 0.14-0.27); strict, so that the
# test says so once a rule with power (routing pinned to the reference's) replaces it. Only the
# rule's own assertion is expected: on the H100 (80 GB, 2026-12-05) TP8's block ran out of memory
# and, without `raises`, that passed as the expected failure
NO_POWER_YET = pytest.mark.xfail(strict=True, raises=AssertionError,
                                 reason="the logit rule cannot fail a context-blind path on the "
                                 "896-expert block (REVIEW.md); per-op parity carries the proof there")
UNUSABLE = ("93-layer, 32 experts, TP16", dict(tp=16, layers=FULL_LAYERS, experts=32), [(1, 1)])
SOURCES = ["vllm/models/kimi_k3/nvidia/benchmarks/block_parity.py",
           "vllm/models/kimi_k3/nvidia/latency_specialized/executor.py",
           "vllm/models/kimi_k3/nvidia/latency_specialized/lanes.py",
           "vllm/models/kimi_k3/nvidia/latency_specialized/torch_ops.py",
           *(f"vllm/models/kimi_k3/nvidia/reference/{m}.py" for m in (
               "attn_res", "dense_mlp", "kda", "mla", "model", "moe", "ops", "params", "state"))]
RESULTS: list[dict] = []


record = parity_record("parity_rule_power.json", "executor",
                       "vllm/models/kimi_k3/nvidia/tests/test_parity_rule_power.py", SOURCES, RESULTS)


def rule_power(form: str, block_args: dict, buckets: list[tuple[int, int]]) -> list[dict]:
    """Per bucket: the yardstick's and the null's summaries against the graphed standard table
    over the same steps and tokens, and the rule's verdict on the null."""
    gc.collect()  # the previous form's executors and graphs
    torch.cuda.empty_cache()
    model = k3_block(**block_args)
    steps = {(rows, q): parity_steps_at(rows, MIN_STEPS) for rows, q in buckets}
    kw = dict(max_requests=max(rows // q for rows, q in buckets),
              max_len=CONTEXT + max(s * q for (_, q), s in steps.items()) + 8, buckets=buckets)
    ref, other = (SpecializedDecode(model, ops=TorchOps(), **kw) for _ in range(2))
    noisy = SpecializedDecode(model, ops=RoundingNoiseOps(), **kw)
    out = []
    for rows, q in buckets:
        for ex in (ref, other, noisy):
            free_all(ex.state)
        gen = torch.Generator(device="cuda").manual_seed(rows * 10 + q)
        slots = fill_state(ref.state, rows // q, CONTEXT, gen)
        copy_state(noisy.state, ref.state)
        if fill_state(other.state, rows // q, CONTEXT, gen) != slots:  # not an assert: the xfail expects those
            raise RuntimeError("the context-blind path's state was given other slots")
        segs = lambda st: [st.segment(r, j * q, q, prefill=False) for j, r in enumerate(slots)]  # noqa: E731
        ids = torch.randint(0, model.w.lm_head.shape[0], (rows,), generator=gen, device="cuda")
        errs: dict[str, list[float]] = {"yardstick": [], "null": []}
        top1: dict[str, list[float]] = {"yardstick": [], "null": []}
        for _ in range(steps[(rows, q)]):
            want = ref(ids, segs(ref.state), ref.state).double()
            for name, ex in (("yardstick", noisy), ("null", other)):
                got = ex(ids, segs(ex.state), ex.state).double()
                errs[name].append(float((got - want).norm() / want.norm()))
                top1[name].append(float((got.argmax(-1) == want.argmax(-1)).float().mean()))
            ids = want.argmax(-1)
        summary = {name: {"steps": steps[(rows, q)], "tokens": steps[(rows, q)] * rows,
                          "rel_err_median": statistics.median(errs[name]),
                          "top1_agreement": statistics.mean(top1[name])} for name in errs}
        verdict = parity_status({"specialized": summary["null"], "standard_rounding_noise": summary["yardstick"]})
        out.append({"name": f"{form} rows{rows} q{q} ctx{CONTEXT}: the parity rule on a context-blind path",
                    "yardstick": summary["yardstick"], "null": summary["null"], "rule_on_null": verdict})
    return out


@pytest.mark.gpu
@pytest.mark.parametrize("form", [pytest.param(f, marks=NO_POWER_YET) if "896" in f else f for f in FORMS])
def test_the_rule_fails_a_context_blind_path(form):
    results = rule_power(form, *FORMS[form])
    for r in results:
        r["status"] = "pass" if r["rule_on_null"] == "fail" else "fail"
    RESULTS.extend(results)
    assert all(r["status"] == "pass" for r in results), results


@pytest.mark.gpu
def test_the_93_layer_moe_form_cannot_judge_long_runs():
    form, block_args, buckets = UNUSABLE
    results = rule_power(form, block_args, buckets)
    for r in results:  # recorded as what it is: this form's rule passes a context-blind path
        r["status"] = "pass" if r["rule_on_null"] == "pass" else "fail"
        r["expect"] = "no power (why test_executor_depth.py runs dense)"
    RESULTS.extend(results)
    assert all(r["status"] == "pass" for r in results), results
