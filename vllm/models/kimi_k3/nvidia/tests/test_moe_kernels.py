"""MoE kernels against reference/moe.py: the routed experts (kernels/moe_experts.py +
kernels/moe_combine.py) against `_routed_latent`, the router epilogue (kernels/moe_router.py)
against `route`.

CPU: envelope errors (raised before any CUDA use), the tiling of every K3 per-rank shape at
every row bucket, and compile checks for sm_90a, sm_100a and sm_103a whose PTX must show the
design (mma.sync m16n8k16, 16-byte global loads, no local memory, a 64-bit expert offset).
GPU (marker `gpu`): TP1/8/16 per-rank shapes, M in {1, 2, 3, 8, 16, 33, 64}, four
router distributions (uniform, skewed, every row the same experts, padding rows/slots, an
expert repeated within a row, which the router never emits but the kernels define), four
input distributions, NaN-poisoned output and NaN-poisoned internal buffers (every value used
must have been written), NaN planted in every expert no row selected (an unselected expert
must not contribute) and, at TP16, in the 64 padding columns of every 256-wide expert slice
(the kernels read the 192 real ones only), per-row ‖out − ref‖/‖ref‖ under a bound, repeat launches bit-identical,
CUDA-graph capture and replay. Router (GPU): ids equal to the reference's and weights within
fp32 rounding on normal logits, planted ties (quantized logits and bias), NaN and −inf logits,
rows with fewer finite keys than k. With K3_EVIDENCE_DIR set the GPU results are written there
as a "kernel-test" record.
"""

from __future__ import annotations

import re
from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("cutlass", reason="nvidia-cutlass-dsl is not installed (pip install nvidia-cutlass-dsl==4.8.1)")

from vllm.models.kimi_k3.nvidia.kernels import moe_combine, moe_experts, moe_router  # noqa: E402
from vllm.models.kimi_k3.nvidia.kernels.cubin_resources import kernel_resources  # noqa: E402
from vllm.models.kimi_k3.nvidia.kernels.device import facts  # noqa: E402
from vllm.models.kimi_k3.nvidia.latency_specialized.config import PRESETS  # noqa: E402
from vllm.models.kimi_k3.nvidia.tests._pdl import check_pdl_order  # noqa: E402
from vllm.models.kimi_k3.nvidia.tests._evidence import record_kernel_test  # noqa: E402
from vllm.models.kimi_k3.nvidia.tests._util import DISTRIBUTIONS, draw  # noqa: E402
from vllm.models.kimi_k3.nvidia.reference.dense_mlp import activation_clips  # noqa: E402
from vllm.models.kimi_k3.nvidia.reference.moe import _routed_latent, route  # noqa: E402

K3 = PRESETS["k3"]
H_LAT = K3.routed_expert_hidden_size
TOP_K = K3.num_experts_per_token
BETA, LINEAR_BETA = activation_clips(K3)
# per-rank routed intermediate as stored (TP16: padded to 256) and as held (TP16: 192), and the
# experts a test allocates (TP1's 896 experts would be 59 GB; 128 of them exercise the same code)
TP_SHAPES = {tp: (K3.shard(tp, 0).moe_inter, K3.shard(tp, 0).moe_inter_real, n)
             for tp, n in ((16, K3.num_experts), (8, K3.num_experts), (1, 128))}
ROWS = (1, 2, 3, 8, 16, 33, 64)
ROUTINGS = ("uniform", "skewed", "same_experts", "padding", "repeated_ids")
# bf16 output rounding (2^-9) plus the reference's bf16 roundings of gate/up/h/o, which can
# land one ulp apart when the fp32 sums are ordered differently
REL_ERR_BOUND = 1e-2
SOURCES = ("vllm/models/kimi_k3/nvidia/kernels/moe_experts.py",
           "vllm/models/kimi_k3/nvidia/kernels/moe_combine.py",
           "vllm/models/kimi_k3/nvidia/kernels/moe_router.py",
           "vllm/models/kimi_k3/nvidia/tests/test_moe_kernels.py")


def _routing(kind: str, m: int, n_experts: int, gen: torch.Generator, device: str):
    """(ids int32 [m, k], weights fp32 [m, k]): router-like weights; distinct experts per row
    except for "repeated_ids" (slot 1 repeats slot 0, slot 5 repeats slot 3)."""
    if kind == "skewed":  # a few experts take most rows: p ∝ 1/rank²
        p = 1.0 / torch.arange(1, n_experts + 1, device=device, dtype=torch.float32) ** 2
        ids = torch.multinomial(p.repeat(m, 1), TOP_K, replacement=False, generator=gen)
    elif kind == "same_experts":
        ids = torch.randperm(n_experts, generator=gen, device=device)[:TOP_K].expand(m, -1)
        ids = ids[:, torch.randperm(TOP_K, generator=gen, device=device)]  # one order for all rows
    else:
        ids = torch.rand(m, n_experts, generator=gen, device=device).argsort(dim=1)[:, :TOP_K]
    weights = torch.rand(m, TOP_K, generator=gen, device=device) + 0.05
    weights = weights / weights.sum(-1, keepdim=True) * 2.5
    ids = ids.to(torch.int32).contiguous()
    if kind == "repeated_ids":
        ids[:, 1] = ids[:, 0]
        ids[:, 5] = ids[:, 3]
    if kind == "padding":  # the last slots of every other row and (M > 1) the whole last row
        ids[::2, TOP_K - 3:] = -1
        if m > 1:
            ids[-1] = -1
        weights = weights.masked_fill(ids < 0, 0.0)
    return ids, weights.contiguous()


def _real_slices(w13, w2, inter):
    """The real `inter` columns of zero- (or NaN-) padded expert slices, as the reference takes them."""
    i_pad = w2.shape[2]
    return torch.cat([w13[:, :inter], w13[:, i_pad:i_pad + inter]], dim=1), w2[:, :, :inter]


def _reference(x_lat, ids, weights, w13, w2, inter=None):
    """reference/moe.py's routed sum over the real slices; padding picks become expert 0 at weight
    0 (no contribution)."""
    inter = w2.shape[2] if inter is None else inter
    w13, w2 = _real_slices(w13, w2, inter)
    pad = ids < 0
    ref_ids = ids.masked_fill(pad, 0).long()
    ref_w = weights.masked_fill(pad, 0.0)
    return _routed_latent(SimpleNamespace(w13=w13, w2=w2), K3, SimpleNamespace(moe_inter=inter),
                          x_lat, ref_w, ref_ids)


def _row_rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """Worst row's ‖out − ref‖/‖ref‖; a row whose reference is zero must be exactly zero."""
    diff = (out.float() - ref.float()).norm(dim=1)
    norm = ref.float().norm(dim=1)
    rel = torch.where(norm > 0, diff / norm.clamp_min(1e-30), torch.where(diff > 0, float("inf"), 0.0))
    return float(rel.max())


# ---------------------------------------------------------------- envelope (CPU)

def _ok_inputs(m=2, k=4, e=8, inter=64, h=128):
    return {"x_lat": torch.randn(m, h).to(torch.bfloat16),
            "ids": torch.randint(0, e, (m, k), dtype=torch.int32),
            "weights": torch.rand(m, k),
            "w13": torch.randn(e, 2 * inter, h).to(torch.bfloat16),
            "w2": torch.randn(e, h, inter).to(torch.bfloat16)}


@pytest.mark.parametrize("case, match", [
    ("x_dtype", "must be bfloat16"),
    ("ids_dtype", "ids must be int32"),
    ("w_dtype", "weights must be float32"),
    ("rows", "M=65 rows"),
    ("topk", "k=33"),
    ("experts", "E=8 experts but w2 has 6"),
    ("hidden", "x_lat has H=256 but w13 is (8, 128, 128)"),
    ("inter_pair", "2·I = 128"),
    ("inter64", "I=96 columns per expert cannot be read in 64-column chunks"),
    ("inter_real", "for inter=65 (needs 128)"),
    ("inter_range", "inter=0 must be an int in 1..64"),
    ("h128", "H=192 must be a multiple of 128"),
    ("noncontig", "contiguous"),
    ("out", "out must be"),
    ("cpu", "CUDA tensors"),
])
def test_envelope_errors(case, match):
    a = _ok_inputs()
    out = None
    if case == "x_dtype":
        a["x_lat"] = a["x_lat"].float()
    elif case == "ids_dtype":
        a["ids"] = a["ids"].long()
    elif case == "w_dtype":
        a["weights"] = a["weights"].double()
    elif case == "rows":
        a = _ok_inputs(m=65)
    elif case == "topk":
        a = _ok_inputs(k=33, e=40)
    elif case == "experts":
        a["w2"] = a["w2"][:6]
    elif case == "hidden":
        a["x_lat"] = torch.randn(2, 256).to(torch.bfloat16)
    elif case == "inter_pair":
        a["w13"] = torch.randn(8, 96, 128).to(torch.bfloat16)
    elif case == "inter64":
        a = _ok_inputs(inter=96)
    elif case == "h128":
        a = _ok_inputs(h=192)
    elif case == "inter_real":  # 65 real columns are read as 128, but the slice holds 96
        a = _ok_inputs(inter=96)
        a["inter"] = 65
    elif case == "inter_range":
        a["inter"] = 0
    elif case == "noncontig":
        a["ids"] = torch.randint(0, 8, (4, 2), dtype=torch.int32).t()
    elif case == "out":
        out = torch.empty(2, 64, dtype=torch.bfloat16)
    with pytest.raises(moe_experts.MoEExpertsEnvelopeError, match=re.escape(match)):
        moe_experts.launch(out=out, **a)


def test_combine_envelope_errors():
    o = torch.randn(8, 128).to(torch.bfloat16)
    ids = torch.randint(0, 4, (2, 4), dtype=torch.int32)
    w = torch.rand(2, 4)
    with pytest.raises(moe_combine.MoECombineEnvelopeError, match=re.escape("needs at least M·k = 8")):
        moe_combine.launch(o[:7], ids, w, 4, torch.empty(2, 128, dtype=torch.bfloat16))
    with pytest.raises(moe_combine.MoECombineEnvelopeError, match="CUDA tensors"):
        moe_combine.launch(o, ids, w, 4, torch.empty(2, 128, dtype=torch.bfloat16))


@pytest.mark.parametrize("tp", sorted(TP_SHAPES))
def test_tiling_covers_every_per_rank_shape(tp):
    """CTAs tile each expert's output exactly, chunks tile K, every warp layout is launchable."""
    inter = moe_experts.read_width(TP_SHAPES[tp][1])
    for gate_up, n_out, k in ((True, inter, H_LAT), (False, H_LAT, inter)):
        for m_atoms in range(1, 9):
            t = moe_experts.choose_tiling(gate_up, n_out, k, m_atoms)
            assert n_out % t.block_out(gate_up) == 0, (tp, gate_up, m_atoms, t)
            assert k % t.chunk_k == 0, (tp, gate_up, m_atoms, t)
            assert 64 <= 32 * t.warps_n * t.warps_k <= 256
            assert t.warps_k <= k // t.chunk_k, "a warp along K without a chunk"
            if gate_up:
                assert t.row_tiles == 2, "without the step's experts and SMs, gate/up keeps 16 outputs a warp"


@pytest.mark.parametrize("tp, rows, row_tiles", [(16, 1, 1), (16, 2, 2), (16, 8, 2), (8, 1, 2), (1, 1, 2)])
def test_gate_up_takes_8_output_warps_where_that_loads_the_sms_evenly(tp, rows, row_tiles):
    """At TP16 and one row, 16 experts × 12 CTAs of 16 outputs leave 60 of 132 SMs with two and
    72 with one; 8 outputs a warp make 384 CTAs, two or three an SM. Elsewhere the CTAs already
    fill the SMs evenly and stay whole."""
    inter = moe_experts.read_width(TP_SHAPES[tp][1])
    t = moe_experts.choose_tiling(True, inter, H_LAT, -(-rows // 8), min(rows * TOP_K, K3.num_experts), 132)
    assert t.row_tiles == row_tiles, t
    assert inter % t.block_out(True) == 0


@pytest.mark.parametrize("tp", sorted(TP_SHAPES))
@pytest.mark.parametrize("m_atoms", [1, 8])
@pytest.mark.parametrize("gate_up_tiles", [2, 1])
def test_index_maps_cover_each_weight_row_once_and_pair_gate_with_up(tp, m_atoms, gate_up_tiles):
    """The kernel's own index maps, on Python ints: over all CTAs, warps, lane groups and
    register rows every weight row of an expert is loaded exactly once; the shared-memory
    column each accumulator lands in is the one the epilogue reads for its output column; for
    gate/up that column's gate and up sums come from weight rows n and I + n, I the stored
    (padded) width, and the padding rows are never loaded."""
    i_pad, real = TP_SHAPES[tp][:2]
    inter = moe_experts.read_width(real)
    for gate_up, n_out, k in ((True, inter, H_LAT), (False, H_LAT, inter)):
        t = moe_experts.choose_tiling(gate_up, n_out, k, m_atoms)
        if gate_up:  # both layouts: two tiles (gate, up) or one (gate rows above, up rows below)
            t = replace(t, row_tiles=gate_up_tiles)
        block_out = t.block_out(gate_up)
        seen = torch.zeros(2 * i_pad if gate_up else n_out, dtype=torch.int32)
        # block column -> weight row, for every CTA tile
        for tile in range(n_out // block_out):
            col_row = {}
            for wn in range(t.warps_n):
                for g in range(8):
                    for r in range(t.row_tiles):
                        for v1 in range(2):
                            row = moe_experts.weight_row(gate_up, i_pad, t.row_tiles, t.warps_n, tile, wn, g,
                                                         2 * r + v1)
                            seen[row] += 1
                            col = moe_experts.block_column(t.row_tiles, wn, r, v1, g)
                            assert col not in col_row, "two accumulators share a shared-memory column"
                            col_row[col] = row
            for col in range(block_out):
                n = tile * block_out + col
                if gate_up:
                    gate_col = moe_experts.gate_column(col, t.row_tiles)
                    up_col = gate_col + 8 * t.row_tiles
                    assert col_row[gate_col] == n and col_row[up_col] == i_pad + n, (tp, tile, col)
                else:
                    assert col_row[col] == n, (tp, tile, col)
        want = torch.ones_like(seen)
        if gate_up:  # w13's padding rows: the end of each half
            want[inter:i_pad] = 0
            want[i_pad + inter:] = 0
        assert torch.equal(seen, want), f"tp{tp} gate_up={gate_up}: weight rows loaded {seen.unique().tolist()} times"


@pytest.mark.parametrize("m_atoms", range(1, 9))
def test_atom_steps_hold_every_row_count_with_at_most_half_wasted(m_atoms):
    """Every expert row count 1..8·m_atoms falls in exactly one loop copy's window, that copy
    holds its rows, and (past the first) at most half of its atoms are padding."""
    steps = moe_experts.atom_steps(m_atoms)
    assert steps == sorted(set(steps)) and steps[0] == 1 and steps[-1] == m_atoms
    for rows in range(1, 8 * m_atoms + 1):
        need = -(-rows // 8)
        chosen = [moe_experts.atom_window(m_atoms, i)[1] for i in range(len(steps))
                  if moe_experts.atom_window(m_atoms, i)[0] < need <= moe_experts.atom_window(m_atoms, i)[1]]
        assert len(chosen) == 1, (m_atoms, rows, chosen)
        assert 8 * chosen[0] >= rows
        assert chosen[0] == 1 or chosen[0] < 2 * need, (m_atoms, rows, chosen)


# ---------------------------------------------------------------- compile checks (CPU)

COMPILE_CASES = [  # (pass, per-rank intermediate read, as stored, m_atoms, experts selected)
    ("gate_up", 384, 384, 1, 0),    # TP8, M <= 8
    ("gate_up", 192, 256, 1, 16),   # TP16, M = 1: 8-output warps
    ("down", 192, 256, 8, 0),       # TP16, M = 64: 192 real columns of the 256-wide padded slice
]


@pytest.mark.parametrize("arch", ["sm_90a", "sm_100a", "sm_103a"])
@pytest.mark.parametrize("which, inter, i_pad, m_atoms, experts", COMPILE_CASES)
def test_expert_gemv_compiles_for_arch(arch, which, inter, i_pad, m_atoms, experts, tmp_path):
    gate_up = which == "gate_up"
    n_out, k = (inter, H_LAT) if gate_up else (H_LAT, inter)
    w_rows, ld = (2 * i_pad, H_LAT) if gate_up else (H_LAT, i_pad)
    t = moe_experts.choose_tiling(gate_up, n_out, k, m_atoms, experts, 132)
    assert t.row_tiles == (1 if experts else 2) or not gate_up, t
    beta, lin = (BETA, LINEAR_BETA) if gate_up else (None, None)
    ptx = moe_experts.compile_expert_gemv(gate_up, K3.num_experts, TOP_K, n_out, k, m_atoms, beta, lin, t,
                                          arch, ptx_dir=str(tmp_path), w_rows=w_rows, ld=ld).artifacts.PTX
    assert f".target {arch}" in ptx
    assert "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32" in ptx
    assert "ld.global.v4.b32" in ptx  # 16-byte loads of W and x
    assert not re.search(r"ld\.global\.(b16|v2)", ptx), "W or x loads split below 16 bytes"
    assert "mul.wide.s32" in ptx or "mul.lo.s64" in ptx  # the expert's 64-bit weight offset
    assert not re.search(r"\b(ld|st)\.local", ptx), "registers spilled to local memory"
    if gate_up:
        assert "ex2" in ptx  # σ(g) of the SiTU epilogue
        # a plain launch: it reads the router's ids at once, so it must not start early
        assert "griddepcontrol.wait" not in ptx
    else:
        # PDL: the first W chunk in flight before the wait on the gate/up pass, no h read (MMA) before it
        order = [ptx.index(op) for op in ("griddepcontrol.launch_dependents", "ld.global.v4", "griddepcontrol.wait",
                                          "mma.sync")]
        assert order == sorted(order), order


@pytest.mark.parametrize("tp", [16, 8])
def test_expert_gemv_residency(tp, tmp_path):
    """A pass with a register cap (`register_cap`: the 8-warp down pass beyond 16 rows) reaches the
    residency it is capped for; every other pass keeps what ptxas gives it, which spills nothing."""
    inter = K3.moe_intermediate_size // tp
    capped = []
    for gate_up in (True, False):
        n_out, k = (inter, H_LAT) if gate_up else (H_LAT, inter)
        for m_atoms in range(1, 9):
            t = moe_experts.choose_tiling(gate_up, n_out, k, m_atoms)
            used = kernel_resources(moe_experts.compile_expert_gemv(
                gate_up, K3.num_experts, TOP_K, n_out, k, m_atoms, None, None, t, "sm_90a",
                ptx_dir=str(tmp_path)).artifacts.CUBIN)
            cap = moe_experts.register_cap(gate_up, m_atoms, t.warps_n * t.warps_k)
            if cap:
                capped.append(m_atoms)
                assert used.ctas_per_sm(32 * t.warps_n * t.warps_k) >= cap, (tp, gate_up, m_atoms, used)
            else:
                assert used.frame_bytes == 0, (tp, gate_up, m_atoms, used)
    # TP8's down pass has 8 warps (4 along its K of 384), TP16's 6 (its K of 192 has 3 chunks)
    assert capped == ([] if tp == 16 else [3, 4, 5, 6, 7, 8]), capped


@pytest.mark.parametrize("arch", ["sm_90a", "sm_100a", "sm_103a"])
def test_combine_compiles_for_arch(arch, tmp_path):
    ptx = moe_combine.compile_combine(K3.num_experts, TOP_K, H_LAT, arch, ptx_dir=str(tmp_path)).artifacts.PTX
    assert f".target {arch}" in ptx
    assert "ld.global.v4" in ptx and "st.global.v4" in ptx
    assert not re.search(r"\b(ld|st)\.local", ptx)
    # all but the first pick's o load come before the first sum (the compiler sinks pick 0's,
    # whose row needs no lookup, to its use: still in flight with the others)
    first_add = ptx.index("fma.rn.f32")
    o_loads = [m.start() for m in re.finditer(r"ld\.global\.v4", ptx)]
    assert len(o_loads) == TOP_K and sum(a < first_add for a in o_loads) >= TOP_K - 1, (first_add, o_loads)
    check_pdl_order(ptx, 0)  # it has no weights


# ---------------------------------------------------------------- GPU checks

@pytest.fixture(scope="module")
def evidence():
    results: list[dict] = []
    yield results
    record_kernel_test("moe_test.json", "moe",
                       "vllm/models/kimi_k3/nvidia/tests/test_moe_kernels.py", SOURCES, results,
                       "per-row rel_err below bound on every case",
                       extra={"rel_err_bound": REL_ERR_BOUND})


def _poison_buffers(device: torch.device, inter: int) -> None:
    """NaN in the kernels' h / o buffers: a value read before it was written shows in the output."""
    for buf in moe_experts.buffers(facts(device), TOP_K, moe_experts.read_width(inter), H_LAT):
        buf.fill_(float("nan"))


@pytest.fixture(scope="module", params=sorted(TP_SHAPES, reverse=True), ids=lambda tp: f"tp{tp}")
def expert_weights(request):
    tp = request.param
    i_pad, inter, n_experts = TP_SHAPES[tp]
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = False  # an fp32-summed oracle
    gen = torch.Generator(device="cuda").manual_seed(1000 + tp)
    # scaled so normal inputs give O(1) gate/up and outputs; TP16's padding columns hold NaN
    # instead of vLLM's zeros, so a single padding value read shows in the output
    w13 = draw("normal", (n_experts, 2 * i_pad, H_LAT), gen, "cuda", scale=H_LAT ** -0.5)
    w2 = draw("normal", (n_experts, H_LAT, i_pad), gen, "cuda", scale=inter ** -0.5)
    w13[:, inter:i_pad] = float("nan")
    w13[:, i_pad + inter:] = float("nan")
    w2[:, :, inter:] = float("nan")
    yield tp, w13, w2, inter
    del w13, w2
    torch.cuda.empty_cache()


@pytest.mark.gpu
@pytest.mark.parametrize("routing", ROUTINGS)
def test_matches_reference(expert_weights, routing, evidence):
    tp, w13, w2, inter = expert_weights
    n_experts = w13.shape[0]
    gen = torch.Generator(device="cuda").manual_seed(tp * 31 + ROUTINGS.index(routing))
    failures = []
    for dist in DISTRIBUTIONS:
        for m in ROWS:
            x_lat = draw(dist, (m, H_LAT), gen, "cuda")
            ids, weights = _routing(routing, m, n_experts, gen, "cuda")
            out = torch.full((m, H_LAT), float("nan"), dtype=torch.bfloat16, device="cuda")
            moe_experts.launch(x_lat, ids, weights, w13, w2, inter=inter)  # compiles and allocates the buffers
            _poison_buffers(x_lat.device, inter)
            moe_experts.launch(x_lat, ids, weights, w13, w2, out, inter=inter, beta=BETA, linear_beta=LINEAR_BETA)
            ref = _reference(x_lat, ids, weights, w13, w2, inter)
            unwritten = int(torch.isnan(out).sum())
            rel = _row_rel_err(out, ref)
            ok = unwritten == 0 and rel < REL_ERR_BOUND
            evidence.append({"name": f"tp{tp} {routing} M={m} {dist}", "status": "pass" if ok else "fail",
                             "shape": {"tp": tp, "m": m, "experts": n_experts, "inter": inter,
                                       "inter_stored": w2.shape[2], "h_lat": H_LAT,
                                       "top_k": TOP_K},
                             "routing": routing, "distribution": dist, "rel_err_max_row": rel,
                             "unwritten": unwritten})
            if not ok:
                failures.append(f"M={m} {dist}: row rel_err {rel:.2e} (bound {REL_ERR_BOUND:.0e}), {unwritten} NaN")
    assert not failures, f"tp{tp} {routing}: " + "; ".join(failures)


@pytest.mark.gpu
def test_unselected_experts_do_not_contribute(expert_weights, evidence):
    """NaN in every expert no row picked: the output stays finite and equal to the reference."""
    tp, w13, w2, inter = expert_weights
    n_experts = w13.shape[0]
    gen = torch.Generator(device="cuda").manual_seed(77 + tp)
    m = 33
    x_lat = draw("normal", (m, H_LAT), gen, "cuda")
    ids, weights = _routing("skewed", m, n_experts, gen, "cuda")
    unpicked = torch.ones(n_experts, dtype=torch.bool, device="cuda")
    unpicked[ids.flatten().long()] = False
    w13_p, w2_p = w13.clone(), w2.clone()
    w13_p[unpicked] = float("nan")
    w2_p[unpicked] = float("nan")
    out = moe_experts.launch(x_lat, ids, weights, w13_p, w2_p, inter=inter)
    rel = _row_rel_err(out, _reference(x_lat, ids, weights, w13, w2, inter))
    ok = bool(torch.isfinite(out).all()) and rel < REL_ERR_BOUND
    evidence.append({"name": f"tp{tp} NaN in unselected experts M={m}", "status": "pass" if ok else "fail",
                     "rel_err_max_row": rel, "unselected_experts": int(unpicked.sum())})
    del w13_p, w2_p
    assert ok, f"tp{tp}: rel_err {rel:.2e}, finite {bool(torch.isfinite(out).all())}"


@pytest.mark.gpu
def test_repeat_launch_and_cuda_graph(expert_weights):
    """Repeat launches are bit-identical; a captured launch replays on new ids and inputs."""
    tp, w13, w2, inter = expert_weights
    n_experts = w13.shape[0]
    gen = torch.Generator(device="cuda").manual_seed(5 + tp)
    m = 5
    x_lat = draw("normal", (m, H_LAT), gen, "cuda")
    ids, weights = _routing("uniform", m, n_experts, gen, "cuda")
    first = moe_experts.launch(x_lat, ids, weights, w13, w2, inter=inter)
    for _ in range(3):
        assert torch.equal(moe_experts.launch(x_lat, ids, weights, w13, w2, inter=inter), first)
    out = torch.full_like(first, float("nan"))
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        moe_experts.launch(x_lat, ids, weights, w13, w2, out, inter=inter)
        torch.cuda.synchronize()
        out.fill_(float("nan"))
        with torch.cuda.graph(graph, stream=stream):
            moe_experts.launch(x_lat, ids, weights, w13, w2, out, inter=inter)
    torch.cuda.synchronize()
    assert torch.isnan(out).all(), "capture ran the kernels instead of recording them"
    new_ids, new_weights = _routing("skewed", m, n_experts, gen, "cuda")
    x_lat.copy_(draw("large", (m, H_LAT), gen, "cuda"))
    ids.copy_(new_ids)
    weights.copy_(new_weights)
    graph.replay()
    torch.cuda.synchronize()
    assert _row_rel_err(out, _reference(x_lat, ids, weights, w13, w2, inter)) < REL_ERR_BOUND


# ---------------------------------------------------------------- router

ROUTER_LOGITS = ("normal", "ties", "nan_and_inf", "few_finite")


def _router_inputs(kind: str, m: int, gen: torch.Generator, device: str):
    """fp32 logits [m, E] and bias [E]; "ties" quantizes both so equal keys are common."""
    n_experts = K3.num_experts
    logits = torch.randn(m, n_experts, generator=gen, device=device) * 2
    bias = torch.randn(n_experts, generator=gen, device=device) * 0.1
    if kind == "ties":
        logits = (logits * 2).round() / 2
        bias = torch.randint(0, 3, (n_experts,), generator=gen, device=device).float() * 0.25
    elif kind == "nan_and_inf":
        logits[torch.rand(m, n_experts, generator=gen, device=device) < 0.1] = float("nan")
        logits[torch.rand(m, n_experts, generator=gen, device=device) < 0.1] = float("-inf")
    elif kind == "few_finite":  # 10 live keys per row, the rest NaN: NaN picks by index after them
        keep = torch.rand(m, n_experts, generator=gen, device=device).argsort(dim=1)[:, :10]
        nan = torch.full_like(logits, float("nan"))
        logits = nan.scatter(1, keep, logits.gather(1, keep))
    return logits.contiguous(), bias.contiguous()


@pytest.mark.parametrize("case, match", [
    ("dtype", "must be float32"),
    ("experts", "multiple of 32"),
    ("topk", "top_k=40"),
    ("bias", "bias must be [64]"),
    ("rows", "M=65"),
    ("cpu", "CUDA tensors"),
])
def test_router_envelope_errors(case, match):
    logits, bias, top_k = torch.randn(4, 64), torch.randn(64), 8
    if case == "dtype":
        logits = logits.to(torch.bfloat16)
    elif case == "experts":
        logits, bias = torch.randn(4, 80), torch.randn(80)
    elif case == "topk":
        top_k = 40
    elif case == "bias":
        bias = torch.randn(32)
    elif case == "rows":
        logits = torch.randn(65, 64)
    with pytest.raises(moe_router.MoERouterEnvelopeError, match=re.escape(match)):
        moe_router.launch(logits, bias, top_k)


# K3's shape on sm_90a, the envelope's corners (E = 32 and 1024, k = 1 and 32, no renormalize)
# and a small shape on the other archs
@pytest.mark.parametrize("arch, n_experts, top_k, renormalize", [
    ("sm_90a", K3.num_experts, TOP_K, True), ("sm_90a", 32, 32, True), ("sm_90a", 1024, 32, False),
    ("sm_90a", 1024, 1, True), ("sm_100a", 128, 4, True), ("sm_103a", 128, 4, True)])
def test_router_compiles_for_arch(arch, n_experts, top_k, renormalize, tmp_path):
    ptx = moe_router.compile_router(n_experts, top_k, renormalize, K3.routed_scaling_factor, arch,
                                    ptx_dir=str(tmp_path)).artifacts.PTX
    assert f".target {arch}" in ptx
    # the k rounds are one loop, not unrolled: one warp max and one warp min per round
    assert ptx.count("redux.sync.max.s32") == 1 and ptx.count("redux.sync.min.s32") == 1
    assert '.pragma "nounroll"' in ptx or top_k == 1  # (one round: no loop left)
    # the strike: one compare-and-select per register slot, compile-time slot numbers
    assert ptx.count("selp.b32") >= n_experts // 32
    assert not re.search(r"\b(ld|st)\.local", ptx), "the per-lane keys spilled to local memory"
    # Σ of the k weights in selection order (+1 where the shared-memory base is made warp-uniform)
    assert top_k <= ptx.count("shfl.sync.idx") <= top_k + 1
    check_pdl_order(ptx, n_experts // 32)  # the correction bias's values of the lane, no logit


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ROUTER_LOGITS)
def test_router_matches_reference(kind, evidence):
    gen = torch.Generator(device="cuda").manual_seed(900 + ROUTER_LOGITS.index(kind))
    failures = []
    for m in ROWS:
        logits, bias = _router_inputs(kind, m, gen, "cuda")
        w_out = torch.full((m, TOP_K), float("nan"), device="cuda")
        ids_out = torch.full((m, TOP_K), -7, dtype=torch.int32, device="cuda")
        moe_router.launch(logits, bias, TOP_K, renormalize=K3.moe_renormalize,
                          routed_scaling_factor=K3.routed_scaling_factor, weights_out=w_out, ids_out=ids_out)
        ref_w, ref_ids = route(logits, bias, K3)
        ids_equal = bool(torch.equal(ids_out.long(), ref_ids))
        w_close = bool(torch.allclose(w_out, ref_w, rtol=1e-5, atol=1e-7, equal_nan=True))
        ok = ids_equal and w_close
        evidence.append({"name": f"router {kind} M={m}", "status": "pass" if ok else "fail",
                         "ids_equal": ids_equal, "weights_close": w_close,
                         "max_abs_weight_err": float((w_out - ref_w).abs().nan_to_num(0.0).max())})
        if not ok:
            failures.append(f"M={m}: ids equal {ids_equal}, weights close {w_close}")
    assert not failures, f"router {kind}: " + "; ".join(failures)


@pytest.mark.gpu
@pytest.mark.parametrize("n_experts, top_k, renormalize", [(32, 32, True), (32, 1, True), (64, 32, False),
                                                          (1024, 32, True), (1024, 1, False), (96, 7, True)])
def test_router_envelope_corners(n_experts, top_k, renormalize, evidence):
    """E = 32..1024, k = 1..32, both renormalize settings, keys with ties, NaN, ±∞ and −0 bias."""
    gen = torch.Generator(device="cuda").manual_seed(n_experts * 100 + top_k)
    cfg = SimpleNamespace(num_experts=n_experts, num_experts_per_token=top_k, moe_router_activation_func="sigmoid",
                          use_grouped_topk=False, num_expert_group=1, topk_group=1, moe_renormalize=renormalize,
                          routed_scaling_factor=K3.routed_scaling_factor)
    failures = []
    for m in (1, 5, 64):
        logits = (torch.randn(m, n_experts, generator=gen, device="cuda") * 2).round() / 2  # ties
        bias = torch.randint(-1, 2, (n_experts,), generator=gen, device="cuda").float() * 0.25
        bias[bias == 0] = -0.0
        u = torch.rand(m, n_experts, generator=gen, device="cuda")
        logits[u < 0.1] = float("nan")
        logits[(u >= 0.1) & (u < 0.2)] = float("-inf")
        logits[(u >= 0.2) & (u < 0.25)] = float("inf")
        bias[: n_experts // 16] = float("nan") if m == 5 else float("-inf")
        w_out, ids_out = moe_router.launch(logits, bias, top_k, renormalize=renormalize,
                                           routed_scaling_factor=K3.routed_scaling_factor)
        ref_w, ref_ids = route(logits, bias, cfg)
        ids_equal = bool(torch.equal(ids_out.long(), ref_ids))
        w_close = bool(torch.allclose(w_out, ref_w, rtol=1e-5, atol=1e-7, equal_nan=True))
        evidence.append({"name": f"router corner E={n_experts} k={top_k} renorm={renormalize} M={m}",
                         "status": "pass" if ids_equal and w_close else "fail", "ids_equal": ids_equal,
                         "weights_close": w_close})
        if not (ids_equal and w_close):
            failures.append(f"M={m}: ids equal {ids_equal}, weights close {w_close}")
    assert not failures, f"router E={n_experts} k={top_k}: " + "; ".join(failures)
