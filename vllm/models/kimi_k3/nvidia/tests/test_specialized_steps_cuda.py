"""Admitted decode steps on the H200 are served by the CuTe DSL kernels, as the path counters show.

The real dispatcher (this GPU's deployment at TP16 against SCOPE.yaml; the H200 envelope is declared,
not yet validated, so `allow_unvalidated` admits it) routes the steps of an
`Engine` generating from a TP16 rank-0 shard of K3's first 12 layers (random weights, experts cut
to 64 so it builds in seconds). The test fails if any admitted step ran the standard path, if any
kernel of `kernels/` that the decode step uses did not run in every step, or if any op outside the
kernel table and the declared glue ran inside the replayed graphs. (KDA's gated output norm is
fused into kda_decode, so the standalone gated-norm kernel has no step of its own to run in.)
The Engine's steps carry one token a request; a DSpark verify step (8 tokens a request) goes
through the same dispatcher in a second test, since only it reaches `mla_decode_wgmma`.
"""

import pytest
import torch

from vllm.models.kimi_k3.nvidia.benchmarks.block_parity import fill_state, k3_block
from vllm.models.kimi_k3.nvidia.kernels.device import facts
from vllm.models.kimi_k3.nvidia.kernels.mla_decode import choose_plan
from vllm.models.kimi_k3.nvidia.latency_specialized.decode_ops import GLUE
from vllm.models.kimi_k3.nvidia.latency_specialized.deployment import Deployment, StepFacts
from vllm.models.kimi_k3.nvidia.latency_specialized.dispatch import SPECIALIZED, STANDARD, Dispatcher
from vllm.models.kimi_k3.nvidia.latency_specialized.engine import Engine, Request
from vllm.models.kimi_k3.nvidia.latency_specialized.executor import SpecializedDecode
from vllm.models.kimi_k3.nvidia.latency_specialized.options import BackendOptions
from vllm.models.kimi_k3.nvidia.latency_specialized.sampler import SamplingParams

MAX_TOKENS = 6
UNVALIDATED = {"decode_backend": "latency_specialized", "allow_unvalidated": True}


@pytest.fixture(scope="module")
def model():
    return k3_block(16, experts=64)


@pytest.mark.gpu
def test_admitted_steps_run_every_kernel_and_no_reference_op(model):
    # kernel file (kernels/<name>.py) -> the op name its launches carry in the path counters
    kernel_counters = {
        "attn_res": "attn_res", "embedding": "embedding", "kda_decode": "kda_decode",
        "mla_cache_write": "mla_cache_write", "mla_decode": "mla_decode", "mla_combine": "mla_combine",
        "moe_router": "moe_router", "moe_experts": "moe_expert_gemv", "moe_combine": "moe_combine",
        "rms_norm": "rms_norm", "situ_mul": "situ_and_mul", "skinny_gemm": "skinny_gemm",
    }
    prompts = [torch.randint(0, 256, (n,)).tolist() for n in (23, 41)]
    max_len = max(map(len, prompts)) + MAX_TOKENS
    deployment = Deployment.detect(tp=16, max_model_len=max_len, expert_dtype="bfloat16")
    dispatcher = Dispatcher(BackendOptions.parse(UNVALIDATED), deployment)
    assert dispatcher.enabled, dispatcher.startup_line
    ex = SpecializedDecode(model, max_requests=len(prompts), max_len=max_len, buckets=[(1, 1), (2, 1)])
    dispatcher.executor = ex
    engine = Engine(model, dispatcher=dispatcher, specialized=ex, state=ex.state, max_requests=len(prompts),
                    max_len=max_len)
    done = engine.generate([Request(p, SamplingParams(max_tokens=MAX_TOKENS)) for p in prompts])
    assert [len(c.output_ids) for c in done] == [MAX_TOKENS] * len(prompts)

    counters = dispatcher.counters
    steps = engine.stats.decode_steps
    assert steps == MAX_TOKENS - 1  # the first token of each request comes from its prefill
    assert counters.steps[SPECIALIZED] == steps and counters.steps[STANDARD] == 0, counters.as_dict()
    assert counters.admitted_on_standard == 0 and not counters.fallbacks, counters.as_dict()
    per_step = ex.launches((2, 1))
    for kernel, op in kernel_counters.items():
        assert counters.kernels[op] == steps * per_step.count(op) > 0, (kernel, counters.kernels)
    outside = {name for name in counters.kernels
               if name not in kernel_counters.values() and name.split(" (")[0] not in GLUE}
    assert not outside, f"ops outside the kernel table and the declared glue: {outside}"
    assert all(name.endswith("(torch)") for name in counters.kernels if name.split(" (")[0] in GLUE)
    # the counters name a kernel and its reference op alike; the executor's trace tells them apart
    assert all(impl == "cute" or op in GLUE for op, impl in ex.kernels[(2, 1)]), ex.kernels[(2, 1)]


@pytest.mark.gpu
def test_an_admitted_verify_step_runs_the_verify_kernels(model):
    """Two requests verifying 8 tokens each (DSpark, 7 drafts): a TP16 rank holds 6 MLA heads, so
    48 query rows a request, which on sm_90a is mla_decode_wgmma's case (more than 32)."""
    requests, q, context = 2, 8, 200
    max_len = context + q
    deployment = Deployment.detect(tp=16, max_model_len=max_len, spec="dspark:7", expert_dtype="bfloat16")
    dispatcher = Dispatcher(BackendOptions.parse(UNVALIDATED), deployment)
    assert dispatcher.enabled, dispatcher.startup_line
    key = (requests * q, q)
    ex = SpecializedDecode(model, max_requests=requests, max_len=max_len, buckets=[key])
    dispatcher.executor = ex
    slots = fill_state(ex.state, requests, context, torch.Generator(device="cuda").manual_seed(5))
    route = dispatcher.route(StepFacts(rows=key[0], tokens_per_request=q, max_context=context + q - 1,
                                       pure_decode=True))
    assert route.path == SPECIALIZED and route.plan == key, route
    dispatcher.counters.record_kernels(ex.launches(route.plan))  # as the Engine does for its steps
    ids = torch.randint(0, 256, (key[0],), device="cuda")
    logits = ex(ids, [ex.state.segment(r, j * q, q, prefill=False) for j, r in enumerate(slots)], ex.state)
    assert torch.isfinite(logits).all()

    counters = dispatcher.counters
    assert counters.steps[SPECIALIZED] == 1 and counters.steps[STANDARD] == 0, counters.as_dict()
    for op in ("mla_cache_write", "mla_decode", "mla_combine", "kda_decode", "moe_expert_gemv"):
        assert counters.kernels[op] == ex.launches(key).count(op) > 0, (op, counters.kernels)
    assert all(impl == "cute" or op in GLUE for op, impl in ex.kernels[key]), ex.kernels[key]
    arch = facts(logits.device).arch
    plan = choose_plan(model.shard.mla_heads, q, ex.state.block_size, arch)
    assert plan.mma == ("wgmma" if arch == "sm_90a" else "sync"), (arch, plan)
