"""MLA latent cache write fused with the kv_a RMSNorm (kernels/mla_cache_write.py) against the
reference: `reference/ops.py::rms_norm` of kv_c, then the cache write of
`reference/mla.py::mla_core` (cache[blocks, offsets] = [latent ‖ k_pe]).

CPU: envelope errors (raised before any CUDA use, each naming the problem); compile checks for
sm_90a, sm_100a and sm_103a whose PTX must show the design (16-byte global loads and stores
only, the slot read once as 64 bits, the cache row addressed in 64 bits, no local memory).
GPU (marker `gpu`): M from 1 to 64, block sizes 1 / 16 / 64, kv_c and k_pe as column slices of
a fused_a output, four input distributions, the cache pre-filled with random values and
latent_out NaN-poisoned; the written rows' latent by ‖out − ref‖/‖ref‖ under REL_ERR_BOUND and
their k_pe bit for bit, every other cache row bit-identical to before (negative and
out-of-range slots are skipped), latent_out identical to the cached latent; a cache of more
than 2^31 elements (64-bit row offsets); CUDA-graph capture and replay with new slots. With
K3_EVIDENCE_DIR set the GPU results are written there as a "kernel-test" record.
"""

from __future__ import annotations

import re

import pytest
import torch

pytest.importorskip("cutlass", reason="nvidia-cutlass-dsl is not installed (pip install nvidia-cutlass-dsl==4.8.1)")

from vllm.models.kimi_k3.nvidia.kernels import mla_cache_write  # noqa: E402
from vllm.models.kimi_k3.nvidia.kernels.mla_cache_write import CacheWritePlan  # noqa: E402
from vllm.models.kimi_k3.nvidia.kernels.rows import NormEnvelopeError  # noqa: E402
from vllm.models.kimi_k3.nvidia.reference.ops import rms_norm as rms_norm_ref  # noqa: E402
from vllm.models.kimi_k3.nvidia.tests._pdl import check_pdl_order  # noqa: E402
from vllm.models.kimi_k3.nvidia.tests._evidence import record_kernel_test  # noqa: E402
from vllm.models.kimi_k3.nvidia.tests._util import DISTRIBUTIONS, draw, rel_err  # noqa: E402

BF16 = torch.bfloat16
R_KV, D_R = 512, 64
ROW = R_KV + D_R
Q_A = 1536  # the fused_a output row: [q_c (1536) | kv_c (512) | k_pe (64) | gate (heads · 128)]
FUSED_W = Q_A + ROW + 12 * 128  # TP8: 3648
EPS = 1e-5
ROWS = (1, 2, 3, 8, 16, 33, 64)
BLOCK_SIZES = (1, 16, 64)
# both sides round to bf16 once from FP32 (the kernel's rsqrt is the approximate one): they differ
# by at most one bf16 ulp (2^-8 relative) on the elements where the FP32 values straddle a
# rounding boundary
REL_ERR_BOUND = 1e-2
ARCHS = ("sm_90a", "sm_100a", "sm_103a")
TEST_FILE = "vllm/models/kimi_k3/nvidia/tests/test_mla_cache_write.py"
SOURCES = ("vllm/models/kimi_k3/nvidia/kernels/rows.py", "vllm/models/kimi_k3/nvidia/kernels/mla_cache_write.py",
           TEST_FILE)


# ---------------------------------------------------------------- envelope (CPU)


def _bf(*shape: int) -> torch.Tensor:
    return torch.randn(*shape).to(BF16)


def _ok_inputs(m: int = 4) -> dict:
    fused = _bf(m, FUSED_W)
    return {"kv_c": fused[:, Q_A:Q_A + R_KV], "k_pe": fused[:, Q_A + R_KV:Q_A + ROW], "gamma": _bf(R_KV),
            "eps": EPS, "cache": _bf(3, 16, ROW), "slot": torch.arange(m), "latent_out": None}


@pytest.mark.parametrize("case, match", [
    ("dtype", "kv_c must be bfloat16, got torch.float32"),
    ("kv_width", "kv_c must be [4, 512], got (4, 256)"),
    ("pe_width", "k_pe must be [4, 64], got (4, 128)"),
    ("pe_rows", "k_pe must be [4, 64], got (3, 64)"),
    ("rows", "M=65 rows is outside 1..64"),
    ("stride", "kv_c rows must be contiguous, 16-byte aligned, with a row stride that is a multiple of 8"),
    ("gamma", "gamma must be a [512] tensor, got (256,)"),
    ("slot_dtype", "slot must be int64"),
    ("slot_rows", "slot must be a [4] tensor"),
    ("cache_width", "cache must be the paged [num_blocks, block_size, 576] latent cache, got (3, 16, 512)"),
    ("cache_dtype", "cache must be bfloat16"),
    ("cache_layout", "cache must be contiguous"),
    ("out", "latent_out must be [4, 512], got (4, 576)"),
    ("cpu", "kv_c must be a CUDA tensor"),
])
def test_envelope_errors(case, match):
    kw = _ok_inputs()
    if case == "dtype":
        kw["kv_c"] = kw["kv_c"].float()
    elif case == "kv_width":
        kw["kv_c"] = _bf(4, 256)
    elif case == "pe_width":
        kw["k_pe"] = _bf(4, 128)
    elif case == "pe_rows":
        kw["k_pe"] = _bf(3, D_R)
    elif case == "rows":
        kw = _ok_inputs(65)
    elif case == "stride":
        kw["kv_c"] = _bf(4, 516)[:, :R_KV]
    elif case == "gamma":
        kw["gamma"] = _bf(256)
    elif case == "slot_dtype":
        kw["slot"] = kw["slot"].int()
    elif case == "slot_rows":
        kw["slot"] = torch.arange(3)
    elif case == "cache_width":
        kw["cache"] = _bf(3, 16, R_KV)
    elif case == "cache_dtype":
        kw["cache"] = kw["cache"].half()
    elif case == "cache_layout":
        kw["cache"] = _bf(16, 3, ROW).transpose(0, 1)
    elif case == "out":
        kw["latent_out"] = _bf(4, ROW)
    with pytest.raises(NormEnvelopeError, match=re.escape(match)):
        mla_cache_write.launch(**kw)


def test_error_names_the_kernel():
    kw = _ok_inputs()
    kw["slot"] = kw["slot"].int()
    with pytest.raises(ValueError, match=r"^mla_cache_write: slot must be int64 .*use \.long\(\)"):
        mla_cache_write.launch(**kw)


# ---------------------------------------------------------------- compile checks (CPU)


COMPILE_PLANS = {
    "strided, latent_out": CacheWritePlan(FUSED_W, FUSED_W, R_KV, True),
    "strided, no latent_out": CacheWritePlan(FUSED_W, FUSED_W, 0, False),
}


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("name", list(COMPILE_PLANS))
def test_compiles_for_arch(arch, name, tmp_path):
    plan = COMPILE_PLANS[name]
    ptx = mla_cache_write.compile_mla_cache_write(plan, arch, str(tmp_path)).artifacts.PTX
    assert f".target {arch}" in ptx
    assert ".reqntid 64, 1, 1" in ptx  # one CTA of two warps per row
    # kv_c, k_pe and gamma: one 16-byte load each; the latent and k_pe (+ latent_out) stores
    assert len(re.findall(r"ld\.global\.v4\.b32", ptx)) == 3
    assert len(re.findall(r"st\.global\.v4\.b32", ptx)) == (3 if plan.has_out else 2)
    assert len(re.findall(r"ld\.global\.b64", ptx)) == 1  # the slot
    assert not re.search(r"(ld|st)\.global\.(b|u|s)(16|8)\b", ptx), "narrow accesses of row data"
    assert re.search(r"\.s64\s+%rd\d+, %rd\d+, 1152,", ptx), "cache row offset not formed in 64 bits"
    check_pdl_order(ptx, 1)  # γ's vector only
    assert "setp.lt.s64" in ptx  # negative slots are skipped
    assert not re.search(r"\b(ld|st)\.local", ptx), "registers spilled to local memory"


# ---------------------------------------------------------------- GPU checks


@pytest.fixture(scope="module")
def evidence():
    results: list[dict] = []
    yield results
    record_kernel_test("mla_cache_write_test.json", "mla", TEST_FILE, SOURCES, results,
                       "written rows within the bound, k_pe exact, every other cache row unchanged, "
                       "latent_out fully written",
                       extra={"rel_err_bound": REL_ERR_BOUND})


def _norm_weight(gen: torch.Generator) -> torch.Tensor:
    return (1.0 + 0.2 * torch.randn(R_KV, generator=gen, device="cuda")).to(BF16)


def _random_cache(num_blocks: int, block_size: int, gen: torch.Generator) -> torch.Tensor:
    """A cache full of random, nonzero values (a write of zeros or of the wrong row shows)."""
    c = draw("normal", (num_blocks, block_size, ROW), gen, "cuda")
    return torch.where(c == 0, torch.ones_like(c), c)


def _fused_rows(m: int, dist: str, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """kv_c and k_pe as the column slices of a fused_a output that the kernel reads."""
    fused = draw(dist, (m, FUSED_W), gen, "cuda")
    return fused[:, Q_A:Q_A + R_KV], fused[:, Q_A + R_KV:Q_A + ROW]


def _slots(m: int, cache_rows: int, gen: torch.Generator) -> torch.Tensor:
    """Distinct in-range slots, with every fourth row padding (-1) or past the cache's end."""
    s = torch.randperm(cache_rows, generator=gen, device="cuda")[:m].clone()
    bad = torch.tensor([-1, cache_rows, -(2**40), cache_rows + 2**33], device="cuda")
    pad = torch.arange(m, device="cuda") % 4 == 3
    s[pad] = bad[torch.arange(m, device="cuda")[pad] // 4 % 4]
    return s


def _reference(before: torch.Tensor, kv_c: torch.Tensor, k_pe: torch.Tensor, gamma: torch.Tensor,
               slot: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(reference cache, normed latent, mask of rows written): mla_core's write of the rows whose slot is in range."""
    latent = rms_norm_ref(kv_c, gamma, EPS)
    cache_rows = torch.cat([latent, k_pe], dim=-1)
    keep = (slot >= 0) & (slot < before.shape[0] * before.shape[1])
    s = slot[keep]
    ref = before.clone()
    ref[s // before.shape[1], s % before.shape[1]] = cache_rows[keep]
    return ref, latent, keep


def _check(name: str, cache: torch.Tensor, before: torch.Tensor, kv_c: torch.Tensor, k_pe: torch.Tensor,
           gamma: torch.Tensor, slot: torch.Tensor, latent_out: torch.Tensor | None, evidence: list,
           **extra) -> list[str]:
    """Compare a launched cache (and latent_out) with the reference; record the case; return failures."""
    ref, latent, keep = _reference(before, kv_c, k_pe, gamma, slot)
    flat, flat_ref = cache.view(-1, ROW), ref.view(-1, ROW)
    written = torch.zeros(flat.shape[0], dtype=torch.bool, device="cuda")
    written[slot[keep]] = True
    rows = flat[written]
    rel = rel_err(rows[:, :R_KV], flat_ref[written][:, :R_KV]) if bool(keep.any()) else 0.0
    pe_exact = torch.equal(rows[:, R_KV:], flat_ref[written][:, R_KV:])
    untouched = torch.equal(flat[~written], flat_ref[~written])
    unwritten = 0
    out_ok = True
    if latent_out is not None:
        unwritten = int(torch.isnan(latent_out).sum())
        rel = max(rel, rel_err(latent_out, latent))
        # the cached latent is the same rounded value as latent_out
        out_ok = torch.equal(flat[slot[keep]][:, :R_KV], latent_out[keep])
    ok = rel < REL_ERR_BOUND and pe_exact and untouched and unwritten == 0 and out_ok
    evidence.append({"name": name, "status": "pass" if ok else "fail", "rel_err": rel, "unwritten": unwritten,
                     "k_pe_exact": pe_exact, "other_rows_unchanged": untouched, "latent_out_matches_cache": out_ok,
                     "rows_written": int(keep.sum()), **extra})
    if ok:
        return []
    return [f"{name}: rel_err {rel:.2e} (bound {REL_ERR_BOUND:.0e}), k_pe exact {pe_exact}, other rows "
            f"unchanged {untouched}, {unwritten} NaN left in latent_out, latent_out == cache {out_ok}"]


@pytest.mark.gpu
@pytest.mark.parametrize("block_size", BLOCK_SIZES)
def test_matches_reference(block_size, evidence):
    gen = torch.Generator(device="cuda").manual_seed(6000 + block_size)
    failures: list[str] = []
    num_blocks = 256 // block_size + 3
    for dist in DISTRIBUTIONS:
        gamma = _norm_weight(gen)
        for m in ROWS:
            for with_out in (True, False):
                kv_c, k_pe = _fused_rows(m, dist, gen)
                cache = _random_cache(num_blocks, block_size, gen)
                before = cache.clone()
                slot = _slots(m, num_blocks * block_size, gen)
                # latent_out as a strided view too (a slice of a wider buffer), NaN-poisoned
                out = torch.full((m, R_KV + 64), float("nan"), dtype=BF16, device="cuda")[:, 64:] if with_out else None
                mla_cache_write.launch(kv_c, k_pe, gamma, EPS, cache, slot, out)
                torch.cuda.synchronize()
                failures += _check(f"block_size={block_size} M={m} {dist} latent_out={with_out}", cache, before,
                                   kv_c, k_pe, gamma, slot, out, evidence,
                                   shape={"m": m, "block_size": block_size, "num_blocks": num_blocks,
                                          "row_stride": kv_c.stride(0)}, distribution=dist)
    assert not failures, "; ".join(failures)


@pytest.mark.gpu
def test_every_slot_skipped_writes_nothing(evidence):
    gen = torch.Generator(device="cuda").manual_seed(6100)
    m, cache = 5, _random_cache(4, 16, gen)
    before = cache.clone()
    kv_c, k_pe = _fused_rows(m, "normal", gen)
    slot = torch.tensor([-1, -2, 64, 65, 2**62], device="cuda")
    out = torch.full((m, R_KV), float("nan"), dtype=BF16, device="cuda")
    mla_cache_write.launch(kv_c, k_pe, _norm_weight(gen), EPS, cache, slot, out)
    torch.cuda.synchronize()
    assert torch.equal(cache, before), "a skipped slot was written"
    assert not torch.isnan(out).any(), "latent_out rows of skipped slots must still be written"
    evidence.append({"name": "every slot skipped", "status": "pass", "rel_err": 0.0, "unwritten": 0})


@pytest.mark.gpu
def test_cache_beyond_2_31_elements(evidence):
    """Slots whose element offset exceeds 2^31 (a 4.5 GB cache): the row address is 64-bit."""
    gen = torch.Generator(device="cuda").manual_seed(6200)
    block_size, num_blocks = 64, 2**31 // (64 * ROW) + 64
    cache = _random_cache(num_blocks, block_size, gen)
    before = cache.clone()
    rows = num_blocks * block_size
    m = 8
    kv_c, k_pe = _fused_rows(m, "normal", gen)
    gamma = _norm_weight(gen)
    slot = torch.tensor([rows - 1, rows - block_size, 2**31 // ROW + 1, 0, 17, -1, rows, rows - 2], device="cuda")
    mla_cache_write.launch(kv_c, k_pe, gamma, EPS, cache, slot)
    torch.cuda.synchronize()
    failures = _check("cache > 2^31 elements", cache, before, kv_c, k_pe, gamma, slot, None, evidence,
                      shape={"m": m, "block_size": block_size, "num_blocks": num_blocks})
    assert not failures, "; ".join(failures)


@pytest.mark.gpu
def test_cuda_graph_capture_and_replay(evidence):
    """The launch records into a CUDA graph (capture writes nothing) and replays on new inputs and
    new slots written in place."""
    gen = torch.Generator(device="cuda").manual_seed(6300)
    m, block_size, num_blocks = 6, 16, 8
    kv_c, k_pe = _fused_rows(m, "normal", gen)
    gamma = _norm_weight(gen)
    cache = _random_cache(num_blocks, block_size, gen)
    slot = torch.tensor([3, 40, -1, 127, 128, 0], device="cuda")
    out = torch.full((m, R_KV), float("nan"), dtype=BF16, device="cuda")
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        mla_cache_write.launch(kv_c, k_pe, gamma, EPS, cache, slot, out)  # compile outside the capture
        torch.cuda.synchronize()
        out.fill_(float("nan"))
        cache.copy_(_random_cache(num_blocks, block_size, gen))
        before = cache.clone()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            mla_cache_write.launch(kv_c, k_pe, gamma, EPS, cache, slot, out)
    torch.cuda.synchronize()
    assert torch.isnan(out).all() and torch.equal(cache, before), "capture ran the kernel instead of recording it"
    kv_new, pe_new = _fused_rows(m, "large", gen)
    kv_c.copy_(kv_new)
    k_pe.copy_(pe_new)
    slot.copy_(torch.tensor([100, -5, 7, 2**40, 64, 1], device="cuda"))
    graph.replay()
    torch.cuda.synchronize()
    failures = _check("cuda graph replay", cache, before, kv_c, k_pe, gamma, slot, out, evidence,
                      shape={"m": m, "block_size": block_size, "num_blocks": num_blocks})
    assert not failures, "; ".join(failures)
