"""The routed experts never load an expert that no row selected: proven by the MMU, not by timing.

kernels/moe_experts.py reads each selected expert's weights once and no other expert's. The
benchmark's bandwidth figure cannot show the second half once a launch is slower than reading
every expert (M = 64), so here the weights lie in one reserved virtual range where only the
selected experts' slabs are backed by memory (cuMemAddressReserve, cuMemCreate, cuMemMap): a load
from any other expert is an illegal address. H = 4096 and I = 256 or 512 make every expert's w13
and w2 slab a whole number of 2 MiB pages, so the backed pages hold no byte of an unselected
expert. Each case runs in a child process (a fault ends its CUDA context) that prints one JSON
line; the output must also match the reference on dense copies. A control case leaves one
selected expert unbacked and must fault: the mapping does catch a stray load.

GPU only (marker `gpu`). With K3_EVIDENCE_DIR set the cases are written there as the
"kernel-test" record moe_unread_test.json.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("cutlass", reason="nvidia-cutlass-dsl is not installed (pip install nvidia-cutlass-dsl==4.8.1)")

from vllm.models.kimi_k3.nvidia.tests._evidence import record_kernel_test  # noqa: E402

H = 4096
REL_ERR_BOUND = 1e-2  # as tests/test_moe_kernels.py: bf16 output and intermediate roundings
SOURCES = ("vllm/models/kimi_k3/nvidia/kernels/moe_experts.py",
           "vllm/models/kimi_k3/nvidia/tests/test_moe_unread_experts.py")
# (rows, experts, top-k, I, routing): few selected (M = 1, skewed) to most (M = 64 uniform picks
# ~63% of 256 experts), and K3's top-16
CASES = [
    (1, 256, 4, 256, "uniform"),
    (8, 256, 4, 256, "skewed"),
    (33, 256, 4, 512, "uniform"),
    (64, 256, 4, 256, "uniform"),
    (64, 256, 4, 256, "skewed"),
    (16, 512, 16, 256, "uniform"),
]


class _CudaArray:
    """A device pointer as torch sees one: the CUDA array interface (bf16 travels as float16)."""

    def __init__(self, ptr: int, shape: tuple[int, ...]):
        self.__cuda_array_interface__ = {"shape": shape, "typestr": "<f2", "data": (ptr, False),
                                         "version": 3, "strides": None}


def _ok(result):
    """cuda.bindings returns (CUresult, value...): raise on an error, give back the value."""
    err, *rest = result
    if int(err) != 0:
        raise RuntimeError(f"CUDA driver call failed: {err}")
    return rest[0] if rest else None


def _sparse_experts(dense: torch.Tensor, backed: list[int]) -> torch.Tensor:
    """[E, rows, cols] bf16 over one reserved virtual range where only experts `backed` have memory
    (a copy of `dense`'s); the mapping lives as long as the process, which is a child's."""
    import cuda.bindings.driver as cu

    n_experts, rows, cols = dense.shape
    slab = rows * cols * dense.element_size()
    prop = cu.CUmemAllocationProp()
    prop.type = cu.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
    prop.location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
    prop.location.id = dense.device.index or 0
    page = _ok(cu.cuMemGetAllocationGranularity(
        prop, cu.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_MINIMUM))
    if slab % page:
        raise ValueError(f"an expert slab of {slab} bytes is not a whole number of {page}-byte pages")
    base = int(_ok(cu.cuMemAddressReserve(n_experts * slab, page, 0, 0)))
    access = cu.CUmemAccessDesc()
    access.location = prop.location
    access.flags = cu.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
    for e in backed:
        handle = _ok(cu.cuMemCreate(slab, prop, 0))
        _ok(cu.cuMemMap(base + e * slab, slab, 0, handle, 0))
        _ok(cu.cuMemSetAccess(base + e * slab, slab, [access], 1))
    sparse = torch.as_tensor(_CudaArray(base, (n_experts, rows, cols)), device=dense.device).view(torch.bfloat16)
    for e in backed:
        sparse[e].copy_(dense[e])
    return sparse


def _child(case: dict) -> dict:
    """One case in this process: route, back only the selected experts (all but the lowest for the
    control), run the kernels, compare with the reference on the dense weights."""
    from vllm.models.kimi_k3.nvidia.benchmarks.bench_moe import uniform_routing
    from vllm.models.kimi_k3.nvidia.kernels import moe_experts
    from vllm.models.kimi_k3.nvidia.latency_specialized.config import PRESETS
    from vllm.models.kimi_k3.nvidia.reference.dense_mlp import activation_clips
    from vllm.models.kimi_k3.nvidia.reference.moe import _routed_latent
    from vllm.models.kimi_k3.nvidia.tests._util import draw

    m, n_experts, top_k, inter = case["rows"], case["experts"], case["top_k"], case["inter"]
    gen = torch.Generator(device="cuda").manual_seed(case["seed"])
    if case["routing"] == "skewed":  # p ∝ 1/rank²: a few experts take most rows
        p = 1.0 / torch.arange(1, n_experts + 1, device="cuda", dtype=torch.float32) ** 2
        ids = torch.multinomial(p.repeat(m, 1), top_k, replacement=False, generator=gen)
        ids = ids.to(torch.int32).contiguous()
    else:
        ids = uniform_routing(m, n_experts, top_k, gen)
    weights = torch.rand(m, top_k, generator=gen, device="cuda") + 0.05
    weights = (weights / weights.sum(-1, keepdim=True)).contiguous()
    x = draw("normal", (m, H), gen, "cuda")
    w13 = draw("normal", (n_experts, 2 * inter, H), gen, "cuda", scale=H ** -0.5)
    w2 = draw("normal", (n_experts, H, inter), gen, "cuda", scale=inter ** -0.5)
    selected = sorted(set(ids.flatten().tolist()))
    backed = selected[1:] if case.get("unback_one_selected") else selected
    beta, linear_beta = activation_clips(PRESETS["k3"])
    result = {"selected": len(selected), "backed": len(backed), "unselected": n_experts - len(selected)}
    # compiled on the dense weights first: a failure up to the sync below is the setup's, and raises
    moe_experts.launch(x, ids, weights, w13, w2, beta=beta, linear_beta=linear_beta)
    w13_sparse, w2_sparse = _sparse_experts(w13, backed), _sparse_experts(w2, backed)
    torch.cuda.synchronize()
    try:
        out = moe_experts.launch(x, ids, weights, w13_sparse, w2_sparse, beta=beta, linear_beta=linear_beta)
        torch.cuda.synchronize()
    except Exception as exc:  # the fault surfaces at the sync, as a torch or driver error
        return {**result, "fault": f"{type(exc).__name__}: {exc}"[:300]}
    ref = _routed_latent(SimpleNamespace(w13=w13, w2=w2), PRESETS["k3"], SimpleNamespace(moe_inter=inter),
                         x, weights, ids.long())
    rel = (out.float() - ref.float()).norm(dim=1) / ref.float().norm(dim=1).clamp_min(1e-30)
    return {**result, "fault": None, "rel_err_max_row": float(rel.max()), "finite": bool(torch.isfinite(out).all())}


def _run(case: dict) -> dict:
    proc = subprocess.run([sys.executable, __file__, json.dumps(case)], capture_output=True, text=True,
                          timeout=600, env=os.environ.copy())
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    assert lines, f"the child printed no result (exit {proc.returncode}):\n{proc.stderr[-2000:]}"
    return json.loads(lines[-1])


@pytest.fixture(scope="module")
def evidence():
    results: list[dict] = []
    yield results
    record_kernel_test("moe_unread_test.json", "moe", "vllm/models/kimi_k3/nvidia/tests/test_moe_unread_experts.py",
                       SOURCES, results, "no load from an unselected (unmapped) expert; output matches the "
                       "reference; the control with one selected expert unmapped faults",
                       extra={"rel_err_bound": REL_ERR_BOUND, "hidden": H})


@pytest.mark.gpu
@pytest.mark.parametrize("rows, experts, top_k, inter, routing", CASES)
def test_only_the_selected_experts_are_loaded(rows, experts, top_k, inter, routing, evidence):
    case = {"rows": rows, "experts": experts, "top_k": top_k, "inter": inter, "routing": routing,
            "seed": 100 + rows + inter + top_k}
    r = _run(case)
    ok = r["fault"] is None and r["finite"] and r["rel_err_max_row"] < REL_ERR_BOUND and r["unselected"] > 0
    evidence.append({"name": f"M={rows} E={experts} k={top_k} I={inter} {routing}", "status": "pass" if ok else "fail",
                     **case, **r})
    assert r["fault"] is None, f"a load touched an unselected expert: {r['fault']}"
    assert r["unselected"] > 0, "every expert was selected: the case proves nothing"
    assert r["finite"] and r["rel_err_max_row"] < REL_ERR_BOUND, r


@pytest.mark.gpu
def test_control_an_unmapped_selected_expert_faults(evidence):
    """The mechanism can fail: with one selected expert left unbacked, the launch must fault."""
    case = {"rows": 8, "experts": 256, "top_k": 4, "inter": 256, "routing": "uniform", "seed": 7,
            "unback_one_selected": True}
    r = _run(case)
    ok = r["fault"] is not None
    evidence.append({"name": "control: one selected expert unmapped", "status": "pass" if ok else "fail", **case, **r})
    assert ok, f"the kernels ran with a selected expert unmapped: the mapping catches nothing ({r})"


if __name__ == "__main__":
    print(json.dumps(_child(json.loads(sys.argv[1]))))
