"""PDL ordering stress: the skinny GEMMs read activations only after the wait that protects them.

Every kernel of the step releases its dependents first thing, and the GEMMs are launched as PDL
dependents that request their W rows before `griddepcontrol.wait` (skinny_gemm.py). The failure
ARCHITECTURE.md §5 guards against is a read of x (or of the residual addend) moved ahead of that
wait: it would see the previous step's values and nothing but a numerical drift would show it.

Here a test-only producer releases its dependents at once, spins for `DELAY_CYCLES` (about
1 ms), and only then writes the GEMM's operand. Within that window a dependent that read early
sees the old values. `test_window_exists` proves the window is real: a reader launched like the
GEMMs copies x before and after its wait and must find the old values before and the new ones
after. Then each GEMM case (the warp kernel with and without split-K, fp32 out, the residual
addend written late, the wgmma kernel with and without split-K) must compute from the new values,
eagerly and replayed from a CUDA graph, outputs NaN-poisoned. The old and new operands are drawn
so that a result from the old one would miss the bound by orders of magnitude.

CPU: the producer and the reader compile for sm_90a, the producer releasing its dependents
before it spins and the reader loading before its wait. With K3_EVIDENCE_DIR set the GPU results
are written there as a "kernel-test" record.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

pytest.importorskip("cutlass", reason="nvidia-cutlass-dsl is not installed (pip install nvidia-cutlass-dsl==4.8.1)")

import cuda.bindings.driver as cuda  # noqa: E402
import cutlass  # noqa: E402
import cutlass.cute as cute  # noqa: E402
from cutlass import BFloat16, Int32  # noqa: E402

from vllm.models.kimi_k3.nvidia.kernels import skinny_gemm  # noqa: E402
from vllm.models.kimi_k3.nvidia.kernels.device import facts  # noqa: E402
from vllm.models.kimi_k3.nvidia.kernels.rows import current_stream, gmem_ptr  # noqa: E402
from vllm.models.kimi_k3.nvidia.kernels.skinny_gemm import Tiling, WgmmaTiling, pick_tiling  # noqa: E402
from vllm.models.kimi_k3.nvidia.reference.ops import BF16, F32, bf16_add, linear  # noqa: E402
from vllm.models.kimi_k3.nvidia.tests._evidence import record_kernel_test  # noqa: E402
from vllm.models.kimi_k3.nvidia.tests._pdl import (  # noqa: E402
    CTAS,
    DELAY_CYCLES,
    THREADS,
    compile_late_copy,
    compiled,
    late_copy,
    warmed,
)
from vllm.models.kimi_k3.nvidia.tests._util import draw, rel_err  # noqa: E402

REL_ERR_BOUND = {BF16: 4e-3, F32: 1e-5}  # test_skinny_gemm.py's bounds
STALE_AT_LEAST = 0.5  # the relative error a result computed from the old operand would show, at least
SOURCES = ("vllm/models/kimi_k3/nvidia/kernels/skinny_gemm.py",
           "vllm/models/kimi_k3/nvidia/kernels/skinny_gemm_wgmma.py",
           "vllm/models/kimi_k3/nvidia/kernels/gemm_store.py",
           "vllm/models/kimi_k3/nvidia/tests/test_pdl_order.py",
           "vllm/models/kimi_k3/nvidia/tests/_pdl.py")


@cute.kernel
def _early_read_kernel(x_ptr: cute.Pointer, before_ptr: cute.Pointer, after_ptr: cute.Pointer, n: Int32):
    tid, _, _ = cute.arch.thread_idx()
    bid, _, _ = cute.arch.block_idx()
    x = cute.make_tensor(x_ptr, cute.make_layout(n))
    before = cute.make_tensor(before_ptr, cute.make_layout(n))
    after = cute.make_tensor(after_ptr, cute.make_layout(n))
    for i in cutlass.range(bid * THREADS + tid, n, CTAS * THREADS):
        before[i] = x[i]
    cute.arch.griddepcontrol_wait()
    for i in cutlass.range(bid * THREADS + tid, n, CTAS * THREADS):
        after[i] = x[i]


@cute.jit
def _early_read_host(x_ptr: cute.Pointer, before_ptr: cute.Pointer, after_ptr: cute.Pointer, n: Int32,
                     stream: cuda.CUstream):
    _early_read_kernel(x_ptr, before_ptr, after_ptr, n).launch(grid=(CTAS, 1, 1), block=(THREADS, 1, 1),
                                                               stream=stream, use_pdl=True)


def _compile_early_read(arch: str, ptx_dir: str | None = None) -> Any:
    p = gmem_ptr(BFloat16, 16)
    return cute.compile(_early_read_host, p, p, p, Int32(1), cute.runtime.make_fake_stream(),
                        options=f"--gpu-arch {arch}" + (f" --keep-ptx --dump-dir {ptx_dir}" if ptx_dir else ""))


def test_helpers_compile_with_the_window_in_place(tmp_path):
    """The producer releases its dependents before it spins on the clock; the reader loads x
    before its wait (that load is the control's early read)."""
    for which, compile_it, first, second in (
            ("late_copy", compile_late_copy, "griddepcontrol.launch_dependents", "%clock64"),
            ("early_read", _compile_early_read, "ld.global", "griddepcontrol.wait")):
        d = tmp_path / which
        d.mkdir()
        compile_it("sm_90a", str(d))
        ptx = next(d.glob("*.ptx")).read_text()
        assert first in ptx and second in ptx, (which, first, second)
        assert ptx.index(first) < ptx.index(second), f"{which}: {first} is not before {second}"


# ---------------------------------------------------------------- GPU checks

@pytest.fixture(scope="module")
def evidence():
    results: list[dict] = []
    yield results
    record_kernel_test("pdl_order_test.json", "gemm", "vllm/models/kimi_k3/nvidia/tests/test_pdl_order.py", SOURCES,
                       results, "every GEMM computes from the operand written late", {"delay_cycles": DELAY_CYCLES})


@pytest.mark.gpu
def test_window_exists(evidence):
    """A PDL dependent that reads before its wait sees the old values: the producer really is
    still running when the GEMMs below start, so a GEMM that read early would be caught."""
    gen = torch.Generator(device="cuda").manual_seed(3)
    # small, so that each thread's loads before the wait (28 of them, one latency each) end well
    # inside the producer's spin: a larger x could outlast it and read new values without a fault
    n = 8 * 7168
    x, new = draw("normal", (n,), gen, "cuda"), draw("large", (n,), gen, "cuda")
    old = x.clone()
    before, after = torch.full_like(x, float("nan")), torch.full_like(x, float("nan"))

    def pair(src, dst):
        late_copy(src, dst)
        compiled(_compile_early_read, facts(x.device).arch)(
            gmem_ptr(BFloat16, dst.data_ptr()), gmem_ptr(BFloat16, before.data_ptr()),
            gmem_ptr(BFloat16, after.data_ptr()), n, current_stream(x.device, None))

    # a first launch loads each kernel's module, which may take the host longer than the producer
    # spins: the H100's first run, without this, found no window. The GEMM cases warm up too
    pair(new.clone(), torch.empty_like(x))
    torch.cuda.synchronize()
    before.fill_(float("nan"))
    after.fill_(float("nan"))
    pair(new, x)
    torch.cuda.synchronize()
    early_old, late_new = bool(torch.equal(before, old)), bool(torch.equal(after, new))
    evidence.append({"name": "window: a read before the wait sees the old x", "status":
                     "pass" if early_old and late_new else "fail", "before_is_old": early_old, "after_is_new": late_new,
                     "before_old_fraction": float((before == old).float().mean())})
    assert early_old, "the read before the wait saw values the producer wrote: no window, the GEMM cases prove nothing"
    assert late_new, "the read after the wait missed the producer's values"


# (name, N, K, M, late operand, out dtype, the kernel and split the case is for)
CASES = [
    ("o_proj + residual, x late", 7168, 768, 1, "x", BF16, "warp, unsplit"),
    ("o_proj + residual, addend late", 7168, 768, 8, "addend", BF16, "warp, unsplit"),
    ("shared gate/up", 768, 7168, 1, "x", BF16, "warp, split-K"),
    ("router, fp32 out", 896, 7168, 8, "x", F32, "warp, split-K"),
    ("o_proj + residual, x late", 7168, 768, 64, "x", BF16, "wgmma, unsplit"),
    ("shared gate/up", 768, 7168, 33, "x", BF16, "wgmma, split-K"),
]


def _kind(t: Tiling | WgmmaTiling) -> str:
    return f"{'wgmma' if isinstance(t, WgmmaTiling) else 'warp'}, {'split-K' if t.splits > 1 else 'unsplit'}"


@pytest.mark.gpu
@pytest.mark.parametrize("graphed", [False, True], ids=["eager", "graph"])
@pytest.mark.parametrize("name, n, k, m, late, out_dtype, kind", CASES, ids=[f"{c[0]} M={c[3]}" for c in CASES])
def test_gemm_reads_after_the_wait(name, n, k, m, late, out_dtype, kind, graphed, evidence):
    torch.backends.cuda.matmul.allow_tf32 = False
    dev = facts(torch.device("cuda"))
    tiling = pick_tiling(dev.arch, n, k, -(-m // 8), dev.sm_count)
    if kind.startswith("wgmma") and not isinstance(tiling, WgmmaTiling):
        pytest.skip(f"the wgmma kernel runs on sm_90a only; this GPU is {dev.arch}")
    assert _kind(tiling) == kind, f"{name} M={m} now picks {tiling}: the case no longer covers {kind}"
    gen = torch.Generator(device="cuda").manual_seed(sum(map(ord, name)) + m)
    # an addend written late must move the output: x·W kept well below it there
    w = draw("normal", (n, k), gen, "cuda", scale=1.0 if late == "x" else 0.01)
    x = draw("normal", (m, k), gen, "cuda")
    addend = draw("normal", (m, n), gen, "cuda") if "residual" in name else None
    out = torch.empty((m, n), dtype=out_dtype, device="cuda")
    target = x if late == "x" else addend
    src = torch.empty_like(target)

    def step():
        late_copy(src, target)
        skinny_gemm.launch(x, w, out, out_dtype=out_dtype, addend=addend)

    run = warmed(step, graphed)
    failures = []
    for rep, dist in enumerate(("normal", "large", "heavy_tailed")):
        old = draw("tiny" if rep % 2 else "normal", tuple(target.shape), gen, "cuda")
        target.copy_(old)
        src.copy_(draw(dist, tuple(target.shape), gen, "cuda"))
        out.fill_(float("nan"))
        torch.cuda.synchronize()
        run()
        torch.cuda.synchronize()
        ref = _ref(x, w, addend, out_dtype)
        stale = _ref(old if late == "x" else x, w, old if late == "addend" else addend, out_dtype)
        rel, gap = rel_err(out, ref), rel_err(stale, ref)
        unwritten = int(torch.isnan(out).sum())
        ok = unwritten == 0 and rel < REL_ERR_BOUND[out_dtype]
        evidence.append({"name": f"{name} M={m} {late} late, {'graph' if graphed else 'eager'}, {dist}",
                         "status": "pass" if ok else "fail", "rel_err": rel, "unwritten": unwritten,
                         "stale_rel_err": gap, "tiling": str(tiling)})
        assert gap > STALE_AT_LEAST, f"old and new operands too alike to tell apart ({gap:.2e})"
        if not ok:
            failures.append(f"{dist}: rel_err {rel:.2e} (a stale read gives {gap:.2e}), {unwritten} NaN left")
    assert not failures, f"{name} M={m}, {late} written late ({kind}): " + "; ".join(failures)


def _ref(x: torch.Tensor, w: torch.Tensor, addend: torch.Tensor | None, out_dtype: torch.dtype) -> torch.Tensor:
    if addend is None:
        return linear(x, w, F32) if out_dtype == F32 else linear(x, w, F32).to(BF16).float()
    return bf16_add(linear(x, w, BF16), addend).float()
