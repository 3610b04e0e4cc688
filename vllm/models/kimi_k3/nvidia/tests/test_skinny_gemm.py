"""Skinny GEMM kernels (kernels/skinny_gemm.py and, beyond 16 rows on sm_90a,
kernels/skinny_gemm_wgmma.py) against reference/ops.py::linear.

CPU: envelope errors (raised before any CUDA use) and compile checks for sm_90a, sm_100a and
sm_103a whose PTX must show the design (mma.sync m16n8k16, 16-byte global loads, no local
memory), also per head and with each epilogue; for the wgmma kernel which steps take it, and
that every pick compiles to TMA loads and m64nTk16 wgmmas, PDL-ordered, two CTAs an SM, no
spills. GPU (marker `gpu`): every K3 projection shape of
TP1/8/16 at M in {1, 2, 3, 8, 16, 33, 64}, four input distributions, NaN-poisoned outputs,
‖out − ref‖/‖ref‖ in fp32 under a bound; the step's uses of the operand layouts and epilogues
(x as a column slice, MLA's per-head absorption and gated un-absorption, the residual add, the
logit scale) against the reference formulas on the same inputs; the wgmma kernel at forced
tilings (64/128-row CTAs, 2 stages, an empty split, N and K tails, a strided x, fp32 out) at
M in {1, 8, 17, 33, 48, 64}; repeat launches bit-identical
(split-K counters reset); CUDA-graph capture and replay. With K3_EVIDENCE_DIR set the GPU
results are also written there as a "kernel-test" record.
"""

from __future__ import annotations

import os
import re

import pytest
import torch

pytest.importorskip("cutlass", reason="nvidia-cutlass-dsl is not installed (pip install nvidia-cutlass-dsl==4.8.1)")

from vllm.models.kimi_k3.nvidia.kernels import skinny_gemm  # noqa: E402
from vllm.models.kimi_k3.nvidia.kernels.skinny_gemm import Tiling, WgmmaTiling  # noqa: E402
from vllm.models.kimi_k3.nvidia.kernels.skinny_gemm_wgmma import TILE_K, choose_wgmma_tiling, stage_bytes, token_rows  # noqa: E402
from vllm.models.kimi_k3.nvidia.kernels.cubin_resources import kernel_resources  # noqa: E402
from vllm.models.kimi_k3.nvidia.kernels.shapes import k3_gemm_shapes  # noqa: E402
from vllm.models.kimi_k3.nvidia.latency_specialized.evidence import write_record  # noqa: E402
from vllm.models.kimi_k3.nvidia.reference.ops import BF16, F32, bf16_add, linear  # noqa: E402
from vllm.models.kimi_k3.nvidia.tests._util import DISTRIBUTIONS, draw, rel_err  # noqa: E402

ROWS = (1, 2, 3, 8, 16, 33, 64)
# bf16 outputs: one rounding of each output (relative 2^-9 at most, ~1.7e-3 in norm measured);
# fp32 outputs: only the fp32 summation order differs from the reference
REL_ERR_BOUND = {torch.bfloat16: 4e-3, torch.float32: 1e-5}
SOURCES = ("vllm/models/kimi_k3/nvidia/kernels/skinny_gemm.py",
           "vllm/models/kimi_k3/nvidia/kernels/skinny_gemm_wgmma.py",
           "vllm/models/kimi_k3/nvidia/kernels/gemm_store.py",
           "vllm/models/kimi_k3/nvidia/kernels/shapes.py",
           "vllm/models/kimi_k3/nvidia/tests/test_skinny_gemm.py")


def _unique_shapes():
    seen, out = set(), []
    for s in k3_gemm_shapes((1, 8, 16)):
        if (s.n, s.k, s.out_dtype) not in seen:
            seen.add((s.n, s.k, s.out_dtype))
            out.append(s)
    return out


SHAPES = _unique_shapes()




# ---------------------------------------------------------------- envelope (CPU)

def _ok_inputs(m=4, n=32, k=64):
    return torch.randn(m, k).to(torch.bfloat16), torch.randn(n, k).to(torch.bfloat16)


def test_reads_in_place_is_the_envelope_rule_for_x():
    wide = torch.randn(4, 3, 80).to(torch.bfloat16)
    assert skinny_gemm.reads_in_place(wide[:, 0, :64])  # a column slice at a 16-byte boundary
    assert skinny_gemm.reads_in_place(wide[:, :, 8:72])  # per head, head stride 80
    assert not skinny_gemm.reads_in_place(wide[:, 0, 4:68])  # starts 8 bytes into a 16-byte unit
    assert not skinny_gemm.reads_in_place(torch.randn(4, 70).to(torch.bfloat16)[:, :64])  # row stride 70
    assert not skinny_gemm.reads_in_place(torch.randn(64, 4).to(torch.bfloat16).t())  # K not unit stride


@pytest.mark.parametrize("case, match", [
    ("dtype", "bfloat16"),
    ("rows", "M=65"),
    ("noncontig", "contiguous"),
    ("k8", "multiple of 8"),
    ("n16", "multiple of 16"),
    ("kmismatch", "K=64 columns but w has K=72"),
    ("out", "out must be"),
    ("xstride", "multiples of 8 elements"),
    ("xalign", "16-byte aligned start"),
    ("heads", "x has 3 heads but w has 2"),
    ("two", "at most one epilogue"),
    ("addend", "the add operand must be a [4, 32] bfloat16"),
    ("scale_bf16", "the 'scale' epilogue writes FP32"),
    ("cpu", "CUDA tensors"),
])
def test_envelope_errors(case, match):
    x, w = _ok_inputs()
    out = None
    if case == "dtype":
        x = x.float()
    elif case == "rows":
        x = torch.randn(65, 64).to(torch.bfloat16)
    elif case == "noncontig":
        w = torch.randn(64, 32).to(torch.bfloat16).t()
    elif case == "k8":
        x, w = _ok_inputs(k=60)
    elif case == "n16":
        x, w = _ok_inputs(n=40)
    elif case == "kmismatch":
        w = torch.randn(32, 72).to(torch.bfloat16)
    elif case == "out":
        out = torch.empty(4, 16, dtype=torch.bfloat16)
    elif case == "xstride":
        x = torch.randn(4, 68).to(torch.bfloat16)[:, 2:66]
    elif case == "xalign":  # row stride 72 is fine, the slice starts 8 bytes into a 16-byte unit
        x = torch.randn(4, 72).to(torch.bfloat16)[:, 4:68]
    elif case == "heads":
        x, w = torch.randn(4, 3, 64).to(torch.bfloat16), torch.randn(2, 32, 64).to(torch.bfloat16)
    kw = {}
    if case == "two":
        kw = {"scale": 2.0, "addend": torch.zeros(4, 32, dtype=torch.bfloat16)}
    elif case == "addend":
        kw = {"addend": torch.zeros(4, 16, dtype=torch.bfloat16)}
    elif case == "scale_bf16":
        kw = {"scale": 2.0}
    with pytest.raises(skinny_gemm.SkinnyGemmEnvelopeError, match=re.escape(match)):
        skinny_gemm.launch(x, w, out, **kw)


def test_tilings_cover_every_shape_and_row_count():
    """Every envelope shape gets a valid tiling whose CTAs tile N and whose splits have work."""
    for s in SHAPES:
        for m_atoms in range(1, 9):
            t = skinny_gemm.choose_tiling(s.n, s.k, m_atoms, 132)
            chunks = -(-s.k // t.chunk_k)
            assert t.tiles_n(s.n) * t.block_n >= s.n
            assert 1 <= t.splits <= chunks, (s.name, m_atoms, t)
            assert t.warps_n * t.warps_k <= 16


# ---------------------------------------------------------------- compile checks (CPU)

COMPILE_CASES = [  # (shape name, m_atoms): split-K with fp32 out, K tail (2112 % 128), tiny K
    ("moe_router@tp8", 1),
    ("dense_down@tp16", 5),
    ("kda_f_b@tp16", 8),
]


@pytest.mark.parametrize("arch", ["sm_90a", "sm_100a", "sm_103a"])
@pytest.mark.parametrize("name, m_atoms", COMPILE_CASES)
def test_compiles_for_arch(arch, name, m_atoms, tmp_path):
    s = next(s for s in k3_gemm_shapes() if s.name == name)
    t = skinny_gemm.choose_tiling(s.n, s.k, m_atoms, 132)
    ptx = skinny_gemm.compile_skinny_gemm(s.n, s.k, m_atoms, s.out_dtype, t, arch, ptx_dir=str(tmp_path)).artifacts.PTX
    assert f".target {arch}" in ptx
    assert "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32" in ptx
    assert "ld.global.v4.b32" in ptx  # 16-byte loads of W and x
    assert not re.search(r"\b(ld|st)\.local", ptx), "registers spilled to local memory"
    if t.splits > 1:
        assert "atom" in ptx  # the split-K arrival counter
    # PDL: dependents released first, the first W chunk in flight before the wait on the previous
    # kernel, and nothing that reads x (the MMAs) before it
    order = [ptx.index(op) for op in ("griddepcontrol.launch_dependents", "ld.global.v4", "griddepcontrol.wait",
                                      "mma.sync")]
    assert order == sorted(order), order


def test_every_pick_fits_the_residency_it_was_chosen_for(tmp_path):
    """choose_tiling sizes its split count for `resident_ctas` CTAs an SM; the registers ptxas gives
    each pick (read from the cubin) must allow that many, with nothing spilled. Until the launch
    capped them, the 16-warp picks got 78 registers at M = 9-16: one CTA an SM, not two."""
    seen = set()
    for s in SHAPES:
        for m_atoms in range(1, 9):
            t = skinny_gemm.choose_tiling(s.n, s.k, m_atoms, 132)
            if (s.n, s.k, s.out_dtype, m_atoms, t) in seen:
                continue
            seen.add((s.n, s.k, s.out_dtype, m_atoms, t))
            compiled = skinny_gemm.compile_skinny_gemm(s.n, s.k, m_atoms, s.out_dtype, t, "sm_90a",
                                                       ptx_dir=str(tmp_path))
            used = kernel_resources(compiled.artifacts.CUBIN)
            assert used.ctas_per_sm(32 * t.warps_n * t.warps_k) >= skinny_gemm.resident_ctas(m_atoms), (s.name, m_atoms,
                                                                                                       t, used)
            assert used.frame_bytes == 0, (s.name, m_atoms, t, used)


# the step's operand layouts and epilogues at TP16's shapes (K3: 6 MLA heads a rank, fused_a
# output 2880 wide with the gate in its last 6·128 columns, kda_in_proj output 3216 wide)
LAYOUT_CASES = {
    "f_b on a column slice of z": (skinny_gemm.Operands(1, (0, 3216), (0, 768)), 768, 128),
    "MLA absorption per head": (skinny_gemm.Operands(6, (192, 1152), (576, 3456)), 576, 192),
    "MLA un-absorption, gated": (skinny_gemm.Operands(6, (512, 3072), (128, 768), "gate", (128, 2880)), 128, 512),
    "latent_up + shared": (skinny_gemm.Operands(1, (0, 3584), (0, 7168), "add", (0, 7168)), 7168, 3584),
    "LM head, scaled": (skinny_gemm.Operands(1, (0, 7168), (0, 10240), "scale"), 10240, 7168),
}


@pytest.mark.parametrize("case", list(LAYOUT_CASES))
def test_operand_layouts_and_epilogues_compile(case, tmp_path):
    ops, n, k = LAYOUT_CASES[case]
    out_dtype = torch.float32 if ops.epilogue == "scale" else torch.bfloat16
    t = skinny_gemm.choose_tiling(n, k, 1, 132, ops.heads)
    ptx = skinny_gemm.compile_skinny_gemm(n, k, 1, out_dtype, t, "sm_90a", ptx_dir=str(tmp_path), ops=ops).artifacts.PTX
    assert "ld.global.v4.b32" in ptx  # strided rows and heads keep the 16-byte loads
    assert not re.search(r"\b(ld|st)\.local", ptx), "registers spilled to local memory"
    assert ("ex2.approx" in ptx) == (ops.epilogue == "gate")  # σ only where the gate is


def test_heads_count_as_ctas_when_splits_fill_the_gpu():
    # 8 tiles of 16 rows: alone they leave room for 7 splits (K's 112 chunks over 16 warps); 16
    # heads make 128 tiles, and 264 resident CTAs hold 2 splits of them
    assert skinny_gemm.choose_tiling(128, 7168, 1, 132).splits == 7
    assert skinny_gemm.choose_tiling(128, 7168, 1, 132, heads=16).splits == 2


def test_small_m_tilings_follow_the_sweep():
    """The picks at M <= 16 are the sweep's best (2026-12-04, TP16): 16 warps along K for long K
    or few N tiles, 2 × 8 where K is moderate and N fills the SMs, 2 × 3 of 128-wide chunks for
    short K."""
    pick = {s.name: skinny_gemm.choose_tiling(s.n, s.k, 1, 132) for s in k3_gemm_shapes()}
    deep = skinny_gemm.Tiling(1, 4, 2, 1, 16, 1)
    for name in ("lm_head@tp16", "dense_gate_up@tp16", "moe_latent_down@tp16", "kda_in_proj@tp16",
                 "mla_fused_a@tp16", "mla_q_b@tp16"):
        assert pick[name] == deep, name
    assert pick["moe_router@tp16"] == skinny_gemm.Tiling(1, 4, 2, 1, 16, 4)
    for name in ("moe_latent_up@tp16", "dense_down@tp16", "kda_o_proj@tp16"):
        assert pick[name] == skinny_gemm.Tiling(1, 4, 2, 2, 8, 1), name
    assert pick["shared_down@tp16"] == skinny_gemm.Tiling(1, 8, 4, 2, 3, 1)


# ---------------------------------------------------------------- the TMA + wgmma kernel (CPU)

def test_rows_beyond_16_of_2d_x_on_hopper_take_the_wgmma_kernel():
    for s in SHAPES:
        assert isinstance(skinny_gemm.pick_tiling("sm_90a", s.n, s.k, 3, 132), WgmmaTiling), s.name
        assert isinstance(skinny_gemm.pick_tiling("sm_90a", s.n, s.k, 2, 132), Tiling), s.name
        assert isinstance(skinny_gemm.pick_tiling("sm_100a", s.n, s.k, 8, 148), Tiling), s.name
    assert isinstance(skinny_gemm.pick_tiling("sm_90a", 576, 192, 8, 132, heads=6), Tiling)


def test_wgmma_tilings_fit_two_ctas_an_sm_and_give_every_split_work():
    for s in SHAPES:
        for m_atoms in range(3, 9):
            t = skinny_gemm.pick_tiling("sm_90a", s.n, s.k, m_atoms, 132)
            k_tiles = -(-s.k // TILE_K)
            per_split = -(-k_tiles // t.splits)
            assert per_split * (t.splits - 1) < k_tiles, (s.name, m_atoms, t)  # the last split has a tile
            assert 2 * (t.stages * stage_bytes(t.block_w, m_atoms) + 1024) <= 228 * 1024, (s.name, m_atoms, t)


def test_wgmma_cost_model_splits_only_where_n_leaves_sms_idle():
    """`choose_wgmma_tiling`'s model keeps one split where N alone gives every SM the same CTAs
    (a split only adds partials and a sum), splits a long K over few N tiles, and never splits
    below two K tiles or past partials of a quarter of W's bytes."""
    even = choose_wgmma_tiling(132 * 64, 7168, 4, 132)
    assert even.splits == 1, even
    few = choose_wgmma_tiling(8 * 64, 32768, 8, 132)
    assert few.splits > 4, few
    for s in SHAPES:
        for m_atoms in (4, 8):
            t = choose_wgmma_tiling(s.n, s.k, m_atoms, 132)
            k_tiles = -(-s.k // TILE_K)
            assert t.splits == 1 or -(-k_tiles // t.splits) >= 2, (s.name, m_atoms, t)
            assert t.splits * 2 * 4 * token_rows(m_atoms) * s.n <= s.n * s.k * 2 / 4 or t.splits == 1, (s.name, t)


def test_wgmma_kernel_is_hopper_only():
    with pytest.raises(ValueError, match="sm_90a"):
        skinny_gemm.compile_skinny_gemm(128, 256, 4, torch.bfloat16, WgmmaTiling(64, 2, 1), "sm_100a")


def test_wgmma_picks_compile_to_tma_and_wgmma_without_spills(tmp_path):
    """Every pick beyond 16 rows (one per x tile height) compiles for sm_90a to TMA loads and
    m64nTk16 wgmmas, W requested before the PDL wait and the MMAs after it, with registers for
    two CTAs an SM and no stack frame."""
    seen = set()
    for s in SHAPES:
        for m_atoms in (4, 6, 8):  # x tiles of 32, 48 and 64 rows (3, 5 and 7 round up to them)
            t = skinny_gemm.pick_tiling("sm_90a", s.n, s.k, m_atoms, 132)
            if (s.n, s.k, s.out_dtype, m_atoms, t) in seen:
                continue
            seen.add((s.n, s.k, s.out_dtype, m_atoms, t))
            compiled = skinny_gemm.compile_skinny_gemm(s.n, s.k, m_atoms, s.out_dtype, t, "sm_90a",
                                                       ptx_dir=str(tmp_path))
            ptx = compiled.artifacts.PTX
            assert f"wgmma.mma_async.sync.aligned.m64n{token_rows(m_atoms)}k16.f32.bf16.bf16" in ptx, (s.name, m_atoms)
            order = [ptx.index(op) for op in ("griddepcontrol.launch_dependents", "cp.async.bulk.tensor",
                                              "griddepcontrol.wait", "wgmma.mma_async")]
            assert order == sorted(order), (s.name, m_atoms, order)
            assert not re.search(r"\b(ld|st)\.local", ptx), (s.name, m_atoms, "spilled")
            used = kernel_resources(compiled.artifacts.CUBIN)
            assert used.ctas_per_sm(128) >= 2 and used.frame_bytes == 0, (s.name, m_atoms, t, used)


# ---------------------------------------------------------------- GPU checks

@pytest.fixture(scope="module")
def evidence():
    results: list[dict] = []
    yield results
    where = os.environ.get("K3_EVIDENCE_DIR")
    if where and results:
        write_record(os.path.join(where, "skinny_gemm_test.json"), "kernel-test", "gemm",
                     "K3_EVIDENCE_DIR=<dir> python -m pytest -q -m gpu "
                     "vllm/models/kimi_k3/nvidia/tests/test_skinny_gemm.py",
                     SOURCES, results,
                     targets=[{"name": "rel_err below bound on every case", "target": "all pass",
                               "value": sum(r["status"] == "pass" for r in results) / len(results),
                               "met": all(r["status"] == "pass" for r in results)}],
                     extra={"rel_err_bound": {str(k).removeprefix("torch."): v for k, v in REL_ERR_BOUND.items()}})


def _judge(evidence: list[dict], failures: list[str], name: str, out: torch.Tensor, ref: torch.Tensor,
           bound: float, **fields) -> None:
    """One case's evidence row (NaN left unwritten, relative error against ref) and its failure."""
    unwritten = int(torch.isnan(out).sum())
    rel = rel_err(out, ref)
    ok = unwritten == 0 and rel < bound
    evidence.append({"name": name, "status": "pass" if ok else "fail", "rel_err": rel, "unwritten": unwritten,
                     **fields})
    if not ok:
        failures.append(f"{name}: rel_err {rel:.2e} (bound {bound:.0e}), {unwritten} NaN left")


@pytest.mark.gpu
@pytest.mark.parametrize("shape", SHAPES, ids=[s.name for s in SHAPES])
def test_matches_reference_on_every_shape(shape, evidence):
    torch.backends.cuda.matmul.allow_tf32 = False
    gen = torch.Generator(device="cuda").manual_seed(shape.n * 7 + shape.k)
    bound = REL_ERR_BOUND[shape.out_dtype]
    failures = []
    for dist in DISTRIBUTIONS:
        w = draw(dist, (shape.n, shape.k), gen, "cuda")
        for m in ROWS:
            x = draw(dist, (m, shape.k), gen, "cuda")
            out = torch.full((m, shape.n), float("nan"), dtype=shape.out_dtype, device="cuda")
            skinny_gemm.launch(x, w, out, out_dtype=shape.out_dtype)
            _judge(evidence, failures, f"{shape.name} M={m} {dist}", out, linear(x, w, torch.float32), bound,
                   shape={"n": shape.n, "k": shape.k, "m": m,
                          "out_dtype": str(shape.out_dtype).removeprefix("torch.")}, distribution=dist)
        del w
    assert not failures, "; ".join(failures)


@pytest.mark.gpu
@pytest.mark.parametrize("name, m", [("moe_router@tp8", 5), ("kda_o_proj@tp16", 5), ("mla_fused_a@tp16", 37)])
def test_repeat_launch_and_cuda_graph(name, m):
    """Split-K counters reset (repeat launches are bit-identical) and a captured launch replays on
    new inputs written in place (M = 37: the padded rows of the split-K sum are never stored)."""
    s = next(s for s in k3_gemm_shapes() if s.name == name)
    gen = torch.Generator(device="cuda").manual_seed(11)
    w = draw("normal", (s.n, s.k), gen, "cuda")
    x = draw("normal", (m, s.k), gen, "cuda")
    first = skinny_gemm.launch(x, w, out_dtype=s.out_dtype)
    for _ in range(3):
        assert torch.equal(skinny_gemm.launch(x, w, out_dtype=s.out_dtype), first)
    out = torch.full_like(first, float("nan"))
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        skinny_gemm.launch(x, w, out, out_dtype=s.out_dtype)  # the launch is compiled: capture only records
        torch.cuda.synchronize()
        out.fill_(float("nan"))
        with torch.cuda.graph(graph, stream=stream):
            skinny_gemm.launch(x, w, out, out_dtype=s.out_dtype)
    torch.cuda.synchronize()
    assert torch.isnan(out).all(), "capture ran the kernel instead of recording it"
    x.copy_(draw("large", (m, s.k), gen, "cuda"))
    graph.replay()
    torch.cuda.synchronize()
    # the CPU oracle (fp64 sums), so that no cuBLAS kernel runs here: this test is the one the
    # racecheck record runs, and cuBLAS's own split-K kernels report shared-memory hazards
    assert rel_err(out.cpu(), linear(x.cpu(), w.cpu(), torch.float32)) < REL_ERR_BOUND[s.out_dtype]


def _layout_inputs(case: str, m: int, gen: torch.Generator, dist: str):
    """x, W, the epilogue operand, the reference output and the launch kwargs of one LAYOUT_CASE,
    the operands cut from wider tensors exactly as the executor cuts them."""
    if case == "f_b on a column slice of z":
        z = draw(dist, (m, 3216), gen, "cuda")
        x, w = z[:, 4 * 768:4 * 768 + 128], draw(dist, (768, 128), gen, "cuda")
        return x, w, {}, linear(x.contiguous(), w, F32)
    if case == "MLA absorption per head":
        q = draw(dist, (m, 6, 192), gen, "cuda")
        w_uk = draw(dist, (6, 128, 512), gen, "cuda")
        w_aug = torch.zeros(6, 576, 192, dtype=BF16, device="cuda")  # [[W_UKᵀ, 0], [0, I]]
        w_aug[:, :512, :128] = w_uk.transpose(1, 2)
        w_aug[:, 512:, 128:] = torch.eye(64, dtype=BF16, device="cuda")
        ql = torch.einsum("nhd,hdr->nhr", q[..., :128].float(), w_uk.float())
        return q, w_aug, {}, torch.cat([ql, q[..., 128:].float()], dim=-1)
    if case == "MLA un-absorption, gated":
        ol = draw(dist, (m, 6, 512), gen, "cuda")
        w_uv = draw(dist, (6, 128, 512), gen, "cuda")
        fused = draw(dist, (m, 2880), gen, "cuda")
        gate = fused[:, 2112:].view(m, 6, 128)
        o = torch.einsum("nhr,hvr->nhv", ol.float(), w_uv.float()).to(BF16)
        return ol, w_uv, {"gate": gate}, o.float() * torch.sigmoid(gate.float())
    if case == "latent_up + shared":
        y, w = draw(dist, (m, 3584), gen, "cuda"), draw(dist, (7168, 3584), gen, "cuda")
        shared = draw(dist, (m, 7168), gen, "cuda")
        return y, w, {"addend": shared}, bf16_add(linear(y, w, BF16), shared).float()
    h, w = draw(dist, (m, 7168), gen, "cuda"), draw(dist, (10240, 7168), gen, "cuda")
    return h, w, {"scale": 0.37}, linear(h, w, BF16).float() * 0.37


@pytest.mark.gpu
@pytest.mark.parametrize("case", list(LAYOUT_CASES))
def test_operand_layouts_and_epilogues_match_the_reference(case, evidence):
    """Each use the step makes of x slices, heads and epilogues against the reference formula it
    replaces, outputs NaN-poisoned, inside a wider NaN-filled tensor where the step writes one
    (the absorbed q_lat): nothing outside the asked columns may be written."""
    torch.backends.cuda.matmul.allow_tf32 = False
    gen = torch.Generator(device="cuda").manual_seed(sum(map(ord, case)))
    failures = []
    for dist in DISTRIBUTIONS:
        for m in ROWS:
            x, w, kw, ref = _layout_inputs(case, m, gen, dist)
            out_dtype = torch.float32 if "scale" in kw else BF16
            out = torch.full(ref.shape, float("nan"), dtype=out_dtype, device="cuda")
            skinny_gemm.launch(x, w, out, out_dtype=out_dtype, **kw)
            _judge(evidence, failures, f"{case} M={m} {dist}", out, ref, REL_ERR_BOUND[BF16], distribution=dist)
    assert not failures, "; ".join(failures)


# (name, N, K, x row stride, out dtype): a partial last W tile at 128 rows, N under one tile with
# a K tail (200 = 3·64 + 8) read from a column slice, and the router's fp32 logits
WGMMA_SHAPES = [("fused_a tail", 2880, 7168, 7168, torch.bfloat16), ("tiny, K tail, slice", 80, 200, 208, torch.bfloat16),
                ("router fp32", 896, 7168, 7168, torch.float32)]
# 64- and 128-row CTAs, the fewest stages, splits that leave the last one empty at K = 200
WGMMA_TILINGS = [WgmmaTiling(64, 2, 1), WgmmaTiling(128, 4, 3), WgmmaTiling(64, 8, 5)]


def wgmma_bound(out_dtype: torch.dtype, k: int, splits: int) -> float:
    """The error bound for one wgmma tiling. Published measurements of Hopper's tensor cores
    report that they add each k16 product into the FP32 accumulator truncating, not rounding to
    nearest, so an FP32 output's error grows with the additions in its chain, ~2^-24 relative
    each; one warpgroup's accumulator takes K / 16 / splits of them in a row. The router at
    K = 7168 unsplit chains 448 (a numpy model of that truncation: 1.0e-5 to 1.1e-5, at the flat
    1e-5 bound), where the warp kernel's 16 warps chain 28. bf16 outputs are bounded by their own
    rounding."""
    chain = -(-k // (16 * splits))
    return max(REL_ERR_BOUND[out_dtype], chain * 2.0**-24) if out_dtype == torch.float32 else REL_ERR_BOUND[out_dtype]


@pytest.mark.gpu
@pytest.mark.parametrize("tiling", WGMMA_TILINGS, ids=str)
def test_wgmma_tilings_match_the_reference(tiling, evidence):
    """The TMA + wgmma kernel at tilings its heuristic may not pick, at row counts on both sides of
    every x tile height (and below 17, which it also runs), outputs NaN-poisoned."""
    torch.backends.cuda.matmul.allow_tf32 = False
    gen = torch.Generator(device="cuda").manual_seed(tiling.block_w + tiling.splits)
    failures = []
    for name, n, k, stride, out_dtype in WGMMA_SHAPES:
        for dist in ("normal", "heavy_tailed"):
            w = draw(dist, (n, k), gen, "cuda")
            for m in (1, 8, 17, 33, 48, 64):
                x = draw(dist, (m, stride), gen, "cuda")[:, :k]
                out = torch.full((m, n), float("nan"), dtype=out_dtype, device="cuda")
                skinny_gemm.launch(x, w, out, out_dtype=out_dtype, tiling=tiling)
                _judge(evidence, failures, f"wgmma {tiling} {name} M={m} {dist}", out,
                       linear(x.contiguous(), w, F32), wgmma_bound(out_dtype, k, tiling.splits), distribution=dist)
    assert not failures, "; ".join(failures)
