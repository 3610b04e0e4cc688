"""KDA decode kernel (kernels/kda_decode.py) against reference/kda.py.

The oracle is `reference_step` below: kda_attention's decode segments run from the two projection
outputs (z, g_raw) that the kernel takes, built from reference/kda.py's own functions; a CPU test
checks that it is bit for bit kda_attention (mini preset, through the GEMMs).

CPU: envelope errors (raised before any CUDA use); the kernel's index maps cover the state tile,
the conv channels and the outputs exactly once for every split; the split heuristic; compile
checks for sm_90a, sm_100a and sm_103a whose PTX must show the design (16-byte state loads and
stores, 8-lane butterflies, the cluster exchange, no local memory) and, where ptxas is installed,
no spills. GPU (marker `gpu`): heads 1 / 6 / 12 / 96, q = 1..8 with random accepted counts, shuffled
slots, null and out-of-range slots, skipped token slots, four input distributions, outputs
NaN-poisoned and the null slots NaN-filled; the output, every written state slot (fp32, under
a bound), every untouched slot (bit-exact) and the conv pool (bit-exact) are compared; every
split; every accepted prefix of a verify step against single steps; 4096 decode steps against an
fp64 oracle (bounded error, and within 10x of the reference's own fp32 error); kernel and
reference steps alternating on one request; the
end-to-end layer through kda_attention on K3 shapes; repeat launches bit-identical; CUDA-graph
capture and replay. With K3_EVIDENCE_DIR set the GPU results are written there as a
"kernel-test" record (family kda).
"""

from __future__ import annotations

import random
import re
import shutil
import subprocess

import pytest
import torch

pytest.importorskip("cutlass", reason="nvidia-cutlass-dsl is not installed (pip install nvidia-cutlass-dsl==4.8.1)")

from vllm.models.kimi_k3.nvidia.kernels import kda_decode  # noqa: E402
from vllm.models.kimi_k3.nvidia.kernels.kda_decode import (  # noqa: E402
    HEAD_DIM,
    SPLITS,
    KdaDecodePlan,
    KdaEnvelopeError,
)
from vllm.models.kimi_k3.nvidia.latency_specialized.config import preset  # noqa: E402
from vllm.models.kimi_k3.nvidia.tests._pdl import check_pdl_order  # noqa: E402
from vllm.models.kimi_k3.nvidia.tests._evidence import record_kernel_test  # noqa: E402
from vllm.models.kimi_k3.nvidia.tests._util import DISTRIBUTIONS, draw, page_views, rel_err  # noqa: E402
from vllm.models.kimi_k3.nvidia.reference.collective import SingleRank  # noqa: E402
from vllm.models.kimi_k3.nvidia.reference.kda import (  # noqa: E402
    _gated_rms_norm,
    _is_padding,
    _l2_normalize,
    decay_log_alpha,
    gated_delta_rule_recurrent,
    kda_attention,
    short_conv,
)
from vllm.models.kimi_k3.nvidia.reference.ops import linear  # noqa: E402
from vllm.models.kimi_k3.nvidia.reference.params import KDAWeights  # noqa: E402
from vllm.models.kimi_k3.nvidia.reference.state import KDALayerState, Segment  # noqa: E402

BF16, F32, F64 = torch.bfloat16, torch.float32, torch.float64
LB = -5.0  # K3's gate lower bound
ARCHS = ("sm_90a", "sm_100a", "sm_103a")
# out: both sides round o and the output to bf16, so they differ only where fp32 values straddle
# a rounding boundary (one bf16 ulp, 2^-8 relative, on those elements); state: fp32 arithmetic in
# another order, plus the rare conv output that rounds to the other bf16 neighbour
OUT_REL_ERR_BOUND = 4e-3
STATE_REL_ERR_BOUND = 2e-4
LONG_RUN_STEPS = 4096
# against fp64 over thousands of steps the error is set by conv outputs and o that round to the
# other bf16 neighbour than in fp64 and, in channels that never decay, persist: the reference
# itself reaches ~1e-4 (state) and ~2e-3 (output, worst step) on the CPU with this test's inputs
LONG_RUN_STATE_BOUND = 1e-3
LONG_RUN_OUT_BOUND = 1e-2
SOURCES = ("vllm/models/kimi_k3/nvidia/kernels/kda_decode.py",
           "vllm/models/kimi_k3/nvidia/kernels/rows.py",
           "vllm/models/kimi_k3/nvidia/tests/test_kda_decode_kernel.py")
TEST_FILE = SOURCES[-1]


# ---------------------------------------------------------------- the oracle


def reference_step(z: torch.Tensor, g_raw: torch.Tensor, conv_weight: torch.Tensor, A_log: torch.Tensor,
                   dt_bias: torch.Tensor, o_norm: torch.Tensor, lower_bound: float, rec: torch.Tensor,
                   conv: torch.Tensor, conv_slot: torch.Tensor, rec_read_slot: torch.Tensor,
                   rec_slots: torch.Tensor, accepted: torch.Tensor) -> torch.Tensor:
    """kda_attention's decode segments (reference/kda.py) from the in_proj output z and the f_b
    output g_raw, with the kernel's arguments: request r owns rows r·q …; updates rec and conv in
    place and returns the gated-normed y [R·q, P] bf16 that feeds o_proj.

    Slot indices at or past a pool's size count as null, as the kernel documents (the reference
    layer raises on them instead)."""
    h, d = A_log.shape[0], o_norm.shape[0]
    p = h * d
    requests, q = rec_slots.shape
    rows = requests * q
    x = z[:, :3 * p]
    g_out = z[:, 3 * p:4 * p].reshape(rows, h, d)
    pointwise = F32 if z.is_cuda else F64
    beta = torch.sigmoid(z[:, 4 * p + d:4 * p + d + h].to(pointwise)).to(F32)
    log_alpha = decay_log_alpha(g_raw.reshape(rows, h, d), A_log, dt_bias, lower_bound)
    core = torch.zeros(rows, h, d, dtype=BF16, device=z.device)
    slots, reads, convs, accs = rec_slots.tolist(), rec_read_slot.tolist(), conv_slot.tolist(), accepted.tolist()
    for r in range(requests):
        seg = Segment(request=r, row0=r * q, n=q, prefill=False, pos0=0, rec_slots=slots[r], rec_read_slot=reads[r],
                      conv_slot=convs[r], accepted=accs[r], block_table=None)
        if _is_padding(seg) or seg.conv_slot >= conv.shape[0] or max(seg.rec_read_slot, slots[r][0]) >= rec.shape[0]:
            continue
        rr = slice(seg.row0, seg.row0 + q)
        a = seg.accepted
        window = conv[seg.conv_slot, a - 1:a + 2].clone()
        y = short_conv(window, x[rr], conv_weight).to(F32).view(q, 3, h, d)
        qh = _l2_normalize(y[:, 0]) * d ** -0.5
        kh = _l2_normalize(y[:, 1])
        v = y[:, 2]
        s = rec[seg.rec_read_slot].clone()
        la, bt = log_alpha[rr], beta[rr]
        o = torch.empty(q, h, d, dtype=F32, device=z.device)
        for t in range(q):
            tok = slice(t, t + 1)
            o[tok], s = gated_delta_rule_recurrent(qh[tok], kh[tok], v[tok], la[tok], bt[tok], s)
            if 0 < slots[r][t] < rec.shape[0]:
                rec[slots[r][t]].copy_(s)
        conv[seg.conv_slot, 0:2 + q] = torch.cat([window[1:], x[rr]])
        core[rr] = o.to(BF16)
    return _gated_rms_norm(core, g_out, o_norm).reshape(rows, p)


def _step_tensors(conv_slot, rec_read_slot, rec_slots, accepted, device="cpu"):
    i32 = {"dtype": torch.int32, "device": device}
    return (torch.tensor(conv_slot, **i32), torch.tensor(rec_read_slot, **i32), torch.tensor(rec_slots, **i32),
            torch.tensor(accepted, **i32))


def test_oracle_is_the_reference_layer():
    """reference_step after the layer's two GEMMs, then o_proj, is kda_attention bit for bit (CPU, mini
    preset: 4 heads of 32), for a verify step with a padding request, a skipped token slot and
    accepted counts 1..max_q."""
    cfg = preset("mini")
    shard = cfg.shard(1, 0)
    h, d, p, hidden = shard.kda_heads, cfg.kda_head_dim, shard.kda_proj, cfg.hidden_size
    gen = torch.Generator().manual_seed(60)
    in_proj = torch.zeros(shard.kda_in_rows, hidden)
    in_proj[:4 * p + d + h] = torch.randn(4 * p + d + h, hidden, generator=gen) * hidden ** -0.5
    w = KDAWeights(in_proj=in_proj.to(BF16), f_b=(torch.randn(p, d, generator=gen) * d ** -0.5).to(BF16),
                   conv=torch.randn(3 * p, 4, generator=gen) * 0.5, A_log=torch.log(1 + 15 * torch.rand(h, generator=gen)),
                   dt_bias=torch.randn(p, generator=gen) * 0.5, o_norm=(1 + 0.1 * torch.randn(d, generator=gen)).to(BF16),
                   o_proj=(torch.randn(hidden, p, generator=gen) * p ** -0.5).to(BF16))
    requests, q, max_q = 4, 3, 4
    rec = torch.randn(1 + requests * max_q, h, d, d, generator=gen)
    conv = torch.randn(1 + requests, 2 + max_q, 3 * p, generator=gen).to(BF16)
    own = [[1 + r * max_q + j for j in range(max_q)] for r in range(requests)]
    accepted = [2, 4, 1, 3]
    rec_slots = [own[r][:q] for r in range(requests)]
    rec_slots[1][2] = 0  # token 2 of request 1 writes no state
    conv_slot = [1, 2, 0, 4]  # request 2 is padding
    reads = [own[r][accepted[r] - 1] for r in range(requests)]
    u = torch.randn(requests * q, hidden, generator=gen).to(BF16)
    segs = [Segment(r, r * q, q, False, 5, rec_slots[r], reads[r], conv_slot[r], accepted[r], torch.zeros(1))
            for r in range(requests)]
    layer_state = KDALayerState(rec.clone(), conv.clone())
    want = kda_attention(w, cfg, shard, u, segs, layer_state, SingleRank())

    z = linear(u, w.in_proj)
    g_raw = linear(z[:, 4 * p:4 * p + d], w.f_b)
    rec_o, conv_o = rec.clone(), conv.clone()
    y = reference_step(z, g_raw, w.conv, w.A_log, w.dt_bias, w.o_norm, cfg.gate_lower_bound, rec_o, conv_o,
                       *_step_tensors(conv_slot, reads, rec_slots, accepted))
    assert torch.equal(linear(y, w.o_proj), want)
    assert torch.equal(rec_o, layer_state.rec) and torch.equal(conv_o, layer_state.conv)
    assert not torch.equal(rec_o, rec) and torch.equal(y[2 * q:3 * q], torch.zeros_like(y[:q]))


# ---------------------------------------------------------------- envelope (CPU)


def _cpu_inputs(heads=6, requests=2, q=2, max_q=4):
    p = heads * HEAD_DIM
    n = requests * q
    def bf(*shape):
        return torch.randn(*shape).to(BF16)

    ones = {"dtype": torch.int32}
    return {"z": bf(n, 4 * p + HEAD_DIM + heads + 10), "g_raw": bf(n, p), "conv_weight": torch.randn(3 * p, 4),
            "A_log": torch.randn(heads), "dt_bias": torch.randn(p), "o_norm": bf(HEAD_DIM),
            "rec": torch.randn(1 + requests * max_q, heads, HEAD_DIM, HEAD_DIM), "conv": bf(1 + requests, 2 + max_q, 3 * p),
            "conv_slot": torch.arange(1, requests + 1, **ones), "rec_read_slot": torch.ones(requests, **ones),
            "rec_slots": torch.ones(requests, q, **ones), "accepted": torch.ones(requests, **ones), "lower_bound": LB}


@pytest.mark.parametrize("case, match", [
    ("q", "q=9 tokens per request"),
    ("rows", "65 rows is outside 1..64"),
    ("heads", "129 KDA heads per rank (A_log.shape[0]) is outside 1..128"),
    ("z_width", "needs >= 3206"),
    ("z_dtype", "z must be bfloat16"),
    ("z_stride", "row stride that is a multiple of 8"),
    ("g_shape", "g_raw must be [4, 768]"),
    ("conv_weight", "conv_weight must be float32"),
    ("rec_shape", "rec must be [·, 6, 128, 128]"),
    ("rec_noncontig", "rec must hold each slot contiguously"),
    ("conv_overlap", "slots may be further apart than a slot's size, never overlap"),
    ("rec_page_misaligned", "rec slots must start on 16-byte boundaries"),
    ("conv_positions", "conv holds 3 positions"),
    ("slots_dtype", "rec_slots must be int32"),
    ("accepted_shape", "accepted must be [2]"),
    ("lower_bound", "lower_bound=None"),
    ("out_overlap", "out overlaps z"),
    ("cpu", "must be a CUDA tensor"),
])
def test_envelope_errors(case, match):
    kw = _cpu_inputs()
    if case == "q":
        kw = _cpu_inputs(requests=1, q=9, max_q=9)
    elif case == "rows":
        kw = _cpu_inputs(requests=13, q=5, max_q=5)
    elif case == "heads":
        kw["A_log"] = torch.randn(129)
    elif case == "z_width":
        kw["z"] = kw["z"][:, :3205]
    elif case == "z_dtype":
        kw["z"] = kw["z"].float()
    elif case == "z_stride":
        kw["z"] = torch.randn(4, 3221).to(BF16)[:, :3220]
    elif case == "g_shape":
        kw["g_raw"] = kw["g_raw"][:, :640]
    elif case == "conv_weight":
        kw["conv_weight"] = kw["conv_weight"].double()
    elif case == "rec_shape":
        kw["rec"] = kw["rec"][:, :5]
    elif case == "rec_noncontig":
        kw["rec"] = kw["rec"].transpose(2, 3)
    elif case == "conv_overlap":
        kw["conv"] = torch.as_strided(kw["conv"], kw["conv"].shape, (kw["conv"].stride(1), kw["conv"].stride(1), 1))
    elif case == "rec_page_misaligned":
        slot = kw["rec"][0].numel()
        kw["rec"] = torch.as_strided(torch.randn(3 * (slot + 1)), (3, *kw["rec"].shape[1:]), (slot + 1, *kw["rec"].stride()[1:]))
    elif case == "conv_positions":
        kw["conv"] = kw["conv"][:, :3].contiguous()
    elif case == "slots_dtype":
        kw["rec_slots"] = kw["rec_slots"].long()
    elif case == "accepted_shape":
        kw["accepted"] = torch.ones(3, dtype=torch.int32)
    elif case == "lower_bound":
        kw["lower_bound"] = None
    elif case == "out_overlap":
        kw["out"] = kw["z"][:, 8:8 + 768]
    with pytest.raises(KdaEnvelopeError, match=re.escape(match)):
        kda_decode.launch(**kw)


def test_page_strided_pools_pass_the_envelope():
    """vLLM-style pools (slots a page apart, conv and recurrent state sharing the page) are inside the
    envelope: on CPU tensors only the device check refuses them."""
    kw = _cpu_inputs()
    _, kw["rec"], kw["conv"] = page_views(kw["rec"], kw["conv"], 4096)
    assert kw["rec"].stride(0) > kw["rec"][0].numel() and kw["conv"].stride(0) > kw["conv"][0].numel()
    with pytest.raises(KdaEnvelopeError, match="must be a CUDA tensor"):
        kda_decode.launch(**kw)


# ---------------------------------------------------------------- index maps and split (CPU)


@pytest.mark.parametrize("split", SPLITS)
def test_index_maps_cover_each_element_once(split):
    """The maps the kernel traces: the state tile, the conv channels a CTA rewrites and the output
    vectors it stores are each a partition of the head's elements over the cluster."""
    plan = _plan(12, 1, 3, 6400, 1536, 1536, split)
    vr = plan.value_rows
    tiles = [(kda_decode.state_row(rank, tid, split), kda_decode.state_vector(tid, i))
             for rank in range(split) for tid in range(plan.threads) for i in range(kda_decode.VECS_PER_LANE)]
    assert sorted(tiles) == [(r, v) for r in range(HEAD_DIM) for v in range(kda_decode.ROW_VECS)]
    # a warp's lanes of one vector slot i read whole 128-byte lines: 4 rows × 8 consecutive float4
    for i in range(kda_decode.VECS_PER_LANE):
        vecs = {kda_decode.state_vector(tid, i) for tid in range(32)}
        assert vecs == set(range(8 * i, 8 * i + 8))
    for head in (0, 5, 11):
        owned = [kda_decode.owned_channel_vector(part, head, rank, c4, 12, split)
                 for rank in range(split) for part in range(3) for c4 in range(vr // 4)]
        head_vecs = [(part * 12 * HEAD_DIM + head * HEAD_DIM) // 4 + c for part in range(3) for c in range(32)]
        assert sorted(owned) == head_vecs
    for q in range(1, 9):
        outs = [kda_decode.output_vector(rank, tid, split) for rank in range(split) for tid in range(q * vr // 8)]
        assert sorted(outs) == [(t, v) for t in range(q) for v in range(HEAD_DIM // 8)]
        # and the local o_s column a thread reads is inside its CTA's slice
        for rank in range(split):
            for tid in range(q * vr // 8):
                assert 0 <= kda_decode.output_vector(rank, tid, split)[1] - rank * (vr // 8) < vr // 8


def test_split_heuristic():
    for heads in kda_decode.TESTED_HEADS:
        for q in (1, 8):
            for requests in range(1, 64 // q + 1):
                s = kda_decode.choose_split(requests, heads, 132)
                assert s in SPLITS
                assert s == SPLITS[-1] or requests * heads * s >= 264  # two CTAs per SM
                if s > SPLITS[0]:  # the next smaller split would not fill the SMs
                    assert requests * heads * (s // 2) < 264
    assert kda_decode.choose_split(1, 6, 132) == 8 and kda_decode.choose_split(64, 12, 132) == 2


# ---------------------------------------------------------------- compile checks (CPU)

def _plan(heads: int, q: int, positions: int, z: int, g: int, out: int, split: int,
          page: tuple[int, int] | None = None) -> KdaDecodePlan:
    """A plan on contiguous pools, or with `page` = (rec, conv) slot strides (vLLM's page-strided pools)."""
    rec, conv = page or (heads * HEAD_DIM * HEAD_DIM, positions * 3 * heads * HEAD_DIM)
    return KdaDecodePlan(heads, q, positions, z, g, out, split, rec, conv)


COMPILE_CASES = {  # plain decode at TP16, a q = 8 verify at TP1 (512 threads), the tiny model's one head,
    # and TP16 on vLLM-style pools (conv then recurrent state in one 128 KiB page per slot)
    "h6 q1 split8": _plan(6, 1, 3, 3216, 768, 768, 8),
    "h96 q8 split2": _plan(96, 8, 10, 49376, 12288, 12288, 2),
    "h1 q1 split8 (tiny)": _plan(1, 1, 3, 656, 128, 128, 8),
    "h6 q1 split8 paged": _plan(6, 1, 3, 3216, 768, 768, 8, page=(2**17 // 4, 2**17 // 2)),
}


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("name", list(COMPILE_CASES))
def test_compiles_for_arch(arch, name, tmp_path):
    plan = COMPILE_CASES[name]
    ptx = kda_decode.compile_kda_decode(plan, arch, str(tmp_path)).artifacts.PTX
    assert f".target {arch}" in ptx
    # the state tile: 4 float4 loads per thread, 4 float4 stores per token (+ the output and the
    # padding rows' zeros, one 16-byte store each); sm_100+ spells a 16-byte access v2.b64
    assert len(re.findall(r"ld\.global\.(?:v4\.b32|v2\.b64)", ptx)) >= 4
    assert len(re.findall(r"st\.global\.(?:v4\.b32|v2\.b64)", ptx)) == 4 * plan.q + 2
    assert not re.search(r"\b(ld|st)\.local", ptx), "a register array went to local memory"
    bfly = re.findall(r"shfl\.sync\.bfly\.b32\s+%r\d+, %r\d+, (\d+),", ptx)
    assert bfly.count("4") >= 3 * plan.q  # the three 8-lane row dots of every token
    assert "barrier.cluster.arrive.relaxed" in ptx and "barrier.cluster.wait" in ptx
    assert "st.shared::cluster.f32" in ptx and "mapa.shared::cluster" in ptx  # Σ o² pushed to the peers
    check_pdl_order(ptx, 0)  # the slots, z, g_raw and the states are all this step's
    assert f".reqntid {plan.threads}, 1, 1" in ptx
    ptxas = shutil.which("ptxas")
    if arch == "sm_90a" and ptxas:
        src = next(tmp_path.glob("*.ptx"))
        report = subprocess.run([ptxas, f"-arch={arch}", "-v", str(src), "-o", str(tmp_path / "k.cubin")],
                                capture_output=True, text=True, timeout=120, check=False).stderr
        regs = int(re.search(r"Used (\d+) registers", report).group(1))
        assert "0 bytes spill stores" in report and "0 bytes stack frame" in report, report
        assert regs * plan.threads <= 65536, f"{regs} registers × {plan.threads} threads do not fit one SM"


# ---------------------------------------------------------------- GPU: inputs


class Layer:
    """One rank's KDA parameters at a trained-looking scale."""

    def __init__(self, heads: int, gen: torch.Generator):
        p = heads * HEAD_DIM
        self.heads, self.p = heads, p
        self.z_width = -(-(4 * p + HEAD_DIM + heads) // 16) * 16  # the padded in_proj rows
        self.conv_weight = torch.randn(3 * p, 4, generator=gen, device="cuda") * 0.5
        self.A_log = torch.log(1 + 15 * torch.rand(heads, generator=gen, device="cuda"))
        self.dt_bias = torch.randn(p, generator=gen, device="cuda") * 0.5
        self.o_norm = (1 + 0.2 * torch.randn(HEAD_DIM, generator=gen, device="cuda")).to(BF16)

    def params(self) -> tuple:
        return self.conv_weight, self.A_log, self.dt_bias, self.o_norm

    def inputs(self, rows: int, dist: str, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        return draw(dist, (rows, self.z_width), gen, "cuda"), draw(dist, (rows, self.p), gen, "cuda")

    def pools(self, rec_slots: int, conv_slots: int, max_q: int, gen: torch.Generator):
        """State pools with random contents; the null slot 0 holds NaN (it must never be read or written)."""
        rec = torch.randn(rec_slots, self.heads, HEAD_DIM, HEAD_DIM, generator=gen, device="cuda") * 0.5
        conv = torch.randn(conv_slots, 2 + max_q, 3 * self.p, generator=gen, device="cuda").to(BF16)
        rec[0] = float("nan")
        conv[0] = float("nan")
        return rec, conv


class Step:
    """The per-request slot tensors of one step: request r owns max_q shuffled rec slots and a shuffled
    conv slot; with `padding`, some requests are padding (a null or out-of-range slot) and some
    tokens write no state."""

    def __init__(self, requests: int, q: int, max_q: int, rng: random.Random, padding: bool = True):
        self.rec_pool = 1 + requests * max_q + 2  # two spare slots nobody owns
        self.conv_pool = 1 + requests + 1
        perm = rng.sample(range(1, self.rec_pool), requests * max_q)
        cperm = rng.sample(range(1, self.conv_pool), requests)
        self.own = [perm[r * max_q:(r + 1) * max_q] for r in range(requests)]
        self.accepted = [rng.randint(1, max_q) for _ in range(requests)]
        self.conv_slot = list(cperm)
        self.rec_read_slot = [self.own[r][a - 1] for r, a in enumerate(self.accepted)]
        self.rec_slots = [self.own[r][:q] for r in range(requests)]
        self.padding = []
        for r in range(1, requests) if padding else ():
            kind = rng.randrange(10)
            if kind < 4:  # null conv / read / first slot, or a conv slot past the pool
                if kind == 0:
                    self.conv_slot[r] = 0
                elif kind == 1:
                    self.rec_read_slot[r] = 0
                elif kind == 2:
                    self.rec_slots[r][0] = 0
                else:
                    self.conv_slot[r] = self.conv_pool
                self.padding.append(r)
            elif kind < 7 and q > 1:  # a token that writes no state (null or past the pool)
                self.rec_slots[r][rng.randrange(1, q)] = 0 if kind == 5 else self.rec_pool
        self.q = q

    def tensors(self) -> tuple:
        return _step_tensors(self.conv_slot, self.rec_read_slot, self.rec_slots, self.accepted, "cuda")

    def written(self) -> list[int]:
        return sorted({s for r, slots in enumerate(self.rec_slots) if r not in self.padding
                       for s in slots if 0 < s < self.rec_pool})

    def padding_rows(self) -> list[int]:
        return [r * self.q + t for r in self.padding for t in range(self.q)]


def _equal_with_nan(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit-equal, with NaN (the poisoned null slots) equal to NaN."""
    return torch.equal(torch.nan_to_num(a), torch.nan_to_num(b))


def _nan_out(rows: int, p: int) -> torch.Tensor:
    return torch.full((rows, p), float("nan"), dtype=BF16, device="cuda")


def run_both(layer: Layer, step: Step, z, g_raw, rec, conv, split=None):
    """The kernel and the oracle on separate copies of the pools: (out, rec, conv, ref_out, ref_rec, ref_conv)."""
    t = step.tensors()
    k_rec, k_conv = rec.clone(), conv.clone()
    out = _nan_out(z.shape[0], layer.p)
    kda_decode.launch(z, g_raw, *layer.params(), k_rec, k_conv, *t, LB, out, split=split)
    r_rec, r_conv = rec.clone(), conv.clone()
    ref = reference_step(z, g_raw, *layer.params(), LB, r_rec, r_conv, *t)
    torch.cuda.synchronize()
    return out, k_rec, k_conv, ref, r_rec, r_conv


def check_step(name: str, step: Step, rec0, conv0, got, rows: list[dict], failures: list[str], **extra) -> None:
    """Compare one step (run_both's result) and record it."""
    out, k_rec, k_conv, ref, r_rec, r_conv = got
    written = step.written()
    others = [s for s in range(1, rec0.shape[0]) if s not in written]
    pad = step.padding_rows()
    res = {
        "unwritten": int(torch.isnan(out).sum()),
        "rel_err": rel_err(out, ref),
        "state_rel_err": rel_err(k_rec[written], r_rec[written]),
        "padding_rows_zero": bool((out[pad] == 0).all()) if pad else True,
        "untouched_slots_exact": torch.equal(k_rec[others], rec0[others]),
        "null_slots_untouched": bool(torch.isnan(k_rec[0]).all() and torch.isnan(k_conv[0]).all()),
        "conv_exact": torch.equal(k_conv[1:], r_conv[1:]),
        "conv_changed": not torch.equal(k_conv[1:], conv0[1:]),
    }
    ok = (res["unwritten"] == 0 and res["rel_err"] < OUT_REL_ERR_BOUND and res["state_rel_err"] < STATE_REL_ERR_BOUND
          and all(res[k] for k in ("padding_rows_zero", "untouched_slots_exact", "null_slots_untouched",
                                   "conv_exact", "conv_changed")))
    rows.append({"name": name, "status": "pass" if ok else "fail", **res, **extra})
    if not ok:
        failures.append(f"{name}: {res}")


@pytest.fixture(scope="module")
def evidence():
    results: list[dict] = []
    yield results
    record_kernel_test("kda_decode_test.json", "kda", TEST_FILE, SOURCES, results,
                       "every case within its bounds, every output written, state exact where untouched",
                       extra={"rel_err_bound": {"out": OUT_REL_ERR_BOUND, "state": STATE_REL_ERR_BOUND}})


# ---------------------------------------------------------------- GPU: against the reference

# (q, requests, max_q): plain decode with 3- and 10-position conv states, verify steps 2..8
SHAPES = [(1, 1, 1), (1, 7, 1), (1, 64, 1), (1, 5, 8), (2, 3, 2), (3, 4, 8), (5, 2, 5), (8, 1, 8), (8, 8, 8)]


@pytest.mark.gpu
@pytest.mark.parametrize("heads", kda_decode.TESTED_HEADS)
def test_matches_reference(heads, evidence):
    gen = torch.Generator(device="cuda").manual_seed(6000 + heads)
    rng = random.Random(heads)
    layer = Layer(heads, gen)
    failures: list[str] = []
    for q, requests, max_q in SHAPES:
        for dist in DISTRIBUTIONS:
            step = Step(requests, q, max_q, rng)
            rec, conv = layer.pools(step.rec_pool, step.conv_pool, max_q, gen)
            z, g_raw = layer.inputs(requests * q, dist, gen)
            got = run_both(layer, step, z, g_raw, rec, conv)
            check_step(f"h={heads} q={q} R={requests} max_q={max_q} {dist}", step, rec, conv, got, evidence, failures,
                       shape={"heads": heads, "q": q, "requests": requests, "max_q": max_q}, distribution=dist,
                       accepted=step.accepted, padding=step.padding)
    assert not failures, "; ".join(failures)


@pytest.mark.gpu
@pytest.mark.parametrize("split", SPLITS)
def test_every_split(split, evidence):
    gen = torch.Generator(device="cuda").manual_seed(6100 + split)
    layer = Layer(12, gen)
    failures: list[str] = []
    for q, requests in ((1, 3), (3, 4), (8, 2)):
        step = Step(requests, q, 8, random.Random(split * 10 + q))
        rec, conv = layer.pools(step.rec_pool, step.conv_pool, 8, gen)
        z, g_raw = layer.inputs(requests * q, "normal", gen)
        check_step(f"split={split} h=12 q={q} R={requests}", step, rec, conv,
                   run_both(layer, step, z, g_raw, rec, conv, split=split), evidence, failures, split=split)
    assert not failures, "; ".join(failures)


@pytest.mark.gpu
@pytest.mark.parametrize("heads", (1, 6))
def test_page_strided_pools_equal_contiguous_ones(heads, evidence):
    """On vLLM-style pools (`page_views`: conv and recurrent state of a slot in one page, pages 4 KiB longer
    than both) the kernel computes bit for bit what it computes on contiguous pools, writes the same
    states, and leaves every byte outside the two views alone."""
    gen = torch.Generator(device="cuda").manual_seed(6300 + heads)
    layer = Layer(heads, gen)
    failures: list[str] = []
    for q, requests, max_q in ((1, 5, 1), (4, 3, 8)):
        step = Step(requests, q, max_q, random.Random(heads * 10 + q))
        rec, conv = layer.pools(step.rec_pool, step.conv_pool, max_q, gen)
        z, g_raw = layer.inputs(requests * q, "normal", gen)
        want = run_both(layer, step, z, g_raw, rec, conv)[:3]
        buf, p_rec, p_conv = page_views(torch.zeros_like(rec), torch.zeros_like(conv), 4096)
        gaps = int(torch.isnan(buf).sum())
        p_rec.copy_(rec)
        p_conv.copy_(conv)
        out = _nan_out(requests * q, layer.p)
        kda_decode.launch(z, g_raw, *layer.params(), p_rec, p_conv, *step.tensors(), LB, out)
        got = (out.clone(), p_rec.clone(), p_conv.clone())
        p_rec.zero_()
        p_conv.zero_()
        res = {"out_equal": _equal_with_nan(got[0], want[0]), "rec_equal": _equal_with_nan(got[1], want[1]),
               "conv_equal": _equal_with_nan(got[2], want[2]), "gaps_untouched": int(torch.isnan(buf).sum()) == gaps}
        name = f"page-strided pools h={heads} q={q} R={requests} max_q={max_q}"
        ok = all(res.values())
        evidence.append({"name": name, "status": "pass" if ok else "fail", **res,
                         "shape": {"heads": heads, "q": q, "requests": requests, "max_q": max_q}})
        if not ok:
            failures.append(f"{name}: {res}")
    assert not failures, "; ".join(failures)


@pytest.mark.gpu
def test_all_padding_rows_are_zero(evidence):
    """Every request padding: rows zero, pools bit-identical."""
    gen = torch.Generator(device="cuda").manual_seed(6200)
    layer = Layer(6, gen)
    step = Step(3, 2, 2, random.Random(1), padding=False)
    step.conv_slot[0] = 0
    step.conv_slot[1] = step.conv_pool  # past the pool: null as well
    step.rec_slots[2][0] = 0
    rec, conv = layer.pools(step.rec_pool, step.conv_pool, 2, gen)
    z, g_raw = layer.inputs(6, "normal", gen)
    out = _nan_out(6, layer.p)
    k_rec, k_conv = rec.clone(), conv.clone()
    kda_decode.launch(z, g_raw, *layer.params(), k_rec, k_conv, *step.tensors(), LB, out)
    torch.cuda.synchronize()
    ok = bool((out == 0).all()) and _equal_with_nan(k_rec, rec) and _equal_with_nan(k_conv, conv)
    evidence.append({"name": "all requests padding", "status": "pass" if ok else "fail", "rel_err": 0.0,
                     "unwritten": int(torch.isnan(out).sum())})
    assert ok


@pytest.mark.gpu
def test_every_accepted_prefix(evidence):
    """After a q = 8 verify step, accepting k tokens leaves the state (and outputs) of k single steps,
    to fp32 rounding, and the next step continues from it (conv taps C[k-1..k+1], read slot k-1)."""
    gen = torch.Generator(device="cuda").manual_seed(6300)
    layer = Layer(6, gen)
    q = max_q = 8
    step = Step(1, q, max_q, random.Random(2), padding=False)
    own = step.own[0]
    rec0, conv0 = layer.pools(step.rec_pool, step.conv_pool, max_q, gen)
    z, g_raw = layer.inputs(q + 1, "normal", gen)  # row q: the token after the accepted prefix
    v_rec, v_conv = rec0.clone(), conv0.clone()
    verify = _nan_out(q, layer.p)
    kda_decode.launch(z[:q], g_raw[:q], *layer.params(), v_rec, v_conv, *step.tensors(), LB, verify)
    failures: list[str] = []
    s_rec, s_conv = rec0.clone(), conv0.clone()
    singles = []
    for k in range(1, q + 1):
        # single step k: token k-1; the first reads the verify step's start, later ones own[0]
        a, read = (step.accepted[0], step.rec_read_slot[0]) if k == 1 else (1, own[0])
        o = _nan_out(1, layer.p)
        kda_decode.launch(z[k - 1:k], g_raw[k - 1:k], *layer.params(), s_rec, s_conv,
                          *_step_tensors([step.conv_slot[0]], [read], [[own[0]]], [a], "cuda"), LB, o)
        singles.append(o)
        state_err = rel_err(v_rec[own[k - 1]], s_rec[own[0]])
        out_err = rel_err(verify[:k], torch.cat(singles))
        # then the next token, after accepting k, from both paths
        nxt = []
        for pool_rec, pool_conv, acc, rd in ((v_rec, v_conv, k, own[k - 1]), (s_rec, s_conv, 1, own[0])):
            r2, c2 = pool_rec.clone(), pool_conv.clone()
            o2 = _nan_out(1, layer.p)
            kda_decode.launch(z[q:], g_raw[q:], *layer.params(), r2, c2,
                              *_step_tensors([step.conv_slot[0]], [rd], [[own[-1]]], [acc], "cuda"), LB, o2)
            nxt.append((o2, r2[own[-1]]))
        next_err = max(rel_err(nxt[0][0], nxt[1][0]), rel_err(nxt[0][1], nxt[1][1]))
        torch.cuda.synchronize()
        ok = (max(state_err, next_err) < STATE_REL_ERR_BOUND and out_err < OUT_REL_ERR_BOUND
              and not torch.isnan(verify).any())
        evidence.append({"name": f"accept {k} of 8", "status": "pass" if ok else "fail", "rel_err": out_err,
                         "state_rel_err": state_err, "next_step_rel_err": next_err})
        if not ok:
            failures.append(f"k={k}: state {state_err:.1e} out {out_err:.1e} next {next_err:.1e}")
    assert not failures, "; ".join(failures)


# ---------------------------------------------------------------- GPU: long run, alternation, layer


class Fp64Oracle:
    """Plain decode (q = 1) of K3_MATH.md §3.4 in float64, rounding only where the reference does
    (conv output, o and the output to bf16): an independent check of the kernel's state over long runs."""

    def __init__(self, layer: Layer, rec: torch.Tensor, conv: torch.Tensor):
        self.h, self.p = layer.heads, layer.p
        self.w = layer.conv_weight.double().cpu()
        self.a = torch.exp(layer.A_log.double().cpu()).view(-1, 1)
        self.dt = layer.dt_bias.double().cpu().view(self.h, HEAD_DIM)
        self.gamma = layer.o_norm.double().cpu()
        self.rec = rec.double().cpu()  # [R, h, d, d]
        self.conv = conv.cpu()  # [R, 3, 3P] bf16

    def step(self, z: torch.Tensor, g_raw: torch.Tensor) -> torch.Tensor:
        h, p, d = self.h, self.p, HEAD_DIM
        z, g_raw = z.cpu(), g_raw.cpu()
        x = z[:, :3 * p]
        seq = torch.cat([self.conv, x[:, None]], 1).double()  # [R, 4, 3P]
        acc = (seq * self.w.t()[None]).sum(1)
        y = (acc * torch.sigmoid(acc)).to(BF16).double().view(-1, 3, h, d)
        qh = y[:, 0] / torch.sqrt((y[:, 0] ** 2).sum(-1, keepdim=True) + 1e-6) * d ** -0.5
        kh = y[:, 1] / torch.sqrt((y[:, 1] ** 2).sum(-1, keepdim=True) + 1e-6)
        v = y[:, 2]
        beta = torch.sigmoid(z[:, 4 * p + d:4 * p + d + h].double())
        alpha = torch.exp(LB * torch.sigmoid(self.a * (g_raw.double().view(-1, h, d) + self.dt)))
        s = self.rec * alpha[:, :, None, :]
        delta = beta[..., None] * (v - torch.einsum("rhvc,rhc->rhv", s, kh))
        s = s + delta[..., None] * kh[:, :, None, :]
        o = torch.einsum("rhvc,rhc->rhv", s, qh).to(BF16).double()
        self.rec = s
        self.conv = torch.cat([self.conv[:, 1:], x[:, None]], 1)
        rrms = torch.rsqrt((o ** 2).mean(-1, keepdim=True) + 1e-5)
        gate = torch.sigmoid(z[:, 3 * p:4 * p].double().view(-1, h, d))
        return (o * rrms * self.gamma * gate).to(BF16).reshape(-1, p)


@pytest.mark.gpu
def test_long_run_stays_bounded(evidence):
    """4096 decode steps of two requests at TP16: request 0 with gates spread over (lb, 0), request 1
    with half its channels at zero decay (α = 1: nothing there is ever forgotten, rounding included)
    and a quarter at the lower bound. The kernel, and the reference (fp32 on the GPU) on a copy of
    the pools, against the fp64 oracle: outputs every step, states every 256th."""
    gen = torch.Generator(device="cuda").manual_seed(6400)
    layer = Layer(6, gen)
    step = Step(2, 1, 1, random.Random(3), padding=False)
    rec, conv = layer.pools(step.rec_pool, step.conv_pool, 1, gen)
    ref_rec, ref_conv = rec.clone(), conv.clone()
    slots = step.tensors()
    mine = [step.own[0][0], step.own[1][0]]
    oracle = Fp64Oracle(layer, rec[mine], conv[step.conv_slot])
    chan = torch.arange(layer.p, device="cuda") % HEAD_DIM
    g_bias = torch.zeros(2, layer.p, device="cuda")
    g_bias[1] = torch.where(chan < 64, -200.0, torch.where(chan < 96, 200.0, 0.0))
    out = torch.empty(2, layer.p, dtype=BF16, device="cuda")
    trace = {"kernel": [], "reference": []}
    out_worst = {"kernel": 0.0, "reference": 0.0}
    for i in range(LONG_RUN_STEPS):
        z, g_raw = layer.inputs(2, "normal", gen)
        g_raw = (g_raw.float() * 2 + g_bias).to(BF16)
        kda_decode.launch(z, g_raw, *layer.params(), rec, conv, *slots, LB, out)
        ref = reference_step(z, g_raw, *layer.params(), LB, ref_rec, ref_conv, *slots)
        want = oracle.step(z, g_raw)
        for who, got in (("kernel", out), ("reference", ref)):
            out_worst[who] = max(out_worst[who], rel_err(got.cpu(), want))
        if (i + 1) % 256 == 0:
            for who, pool in (("kernel", rec), ("reference", ref_rec)):
                trace[who].append(rel_err(pool[mine].cpu(), oracle.rec))
    worst = max(trace["kernel"])
    ok = (worst < LONG_RUN_STATE_BOUND and out_worst["kernel"] < LONG_RUN_OUT_BOUND
          and worst <= 10 * max(trace["reference"]) + 1e-5)
    evidence.append({"name": f"long run {LONG_RUN_STEPS} steps h=6 R=2 (fp64 oracle)", "status": "pass" if ok else "fail",
                     "rel_err": out_worst["kernel"], "state_rel_err": worst, "state_rel_err_trace": trace["kernel"],
                     "reference_state_rel_err_trace": trace["reference"], "reference_rel_err": out_worst["reference"]})
    assert ok, f"state rel err traces {trace}, worst outputs {out_worst}"


@pytest.mark.gpu
def test_alternating_with_reference_steps(evidence):
    """Kernel and reference steps alternate on one request's pools (decode and verify steps with random
    accepted counts) and track an all-reference run on a copy."""
    gen = torch.Generator(device="cuda").manual_seed(6500)
    rng = random.Random(4)
    layer = Layer(12, gen)
    max_q = 4
    step = Step(1, 1, max_q, rng, padding=False)
    own, cs = step.own[0], step.conv_slot
    rec, conv = layer.pools(step.rec_pool, step.conv_pool, max_q, gen)
    ref_rec, ref_conv = rec.clone(), conv.clone()
    accepted, worst_out = 1, 0.0
    for i in range(48):
        q = rng.choice((1, 1, 2, 4))
        z, g_raw = layer.inputs(q, "normal", gen)
        t = _step_tensors(cs, [own[accepted - 1]], [own[:q]], [accepted], "cuda")
        if i % 2:
            mixed = kda_decode.launch(z, g_raw, *layer.params(), rec, conv, *t, LB)
        else:
            mixed = reference_step(z, g_raw, *layer.params(), LB, rec, conv, *t)
        want = reference_step(z, g_raw, *layer.params(), LB, ref_rec, ref_conv, *t)
        worst_out = max(worst_out, rel_err(mixed, want))
        accepted = rng.randint(1, q)
    state_err = rel_err(rec[1:], ref_rec[1:])
    ok = worst_out < OUT_REL_ERR_BOUND and state_err < STATE_REL_ERR_BOUND and torch.equal(conv[1:], ref_conv[1:])
    evidence.append({"name": "48 steps alternating kernel / reference, h=12", "status": "pass" if ok else "fail",
                     "rel_err": worst_out, "state_rel_err": state_err})
    assert ok, f"worst output {worst_out:.2e}, state {state_err:.2e}"


@pytest.mark.gpu
@pytest.mark.parametrize("tp, rank", [(16, 5), (8, 1)])
def test_layer_through_kda_attention(tp, rank, evidence):
    """The whole layer on K3 shapes: kda_attention(u) against in_proj and f_b GEMMs, the kernel, o_proj."""
    cfg = preset("k3")
    shard = cfg.shard(tp, rank)
    h, d, p, hidden = shard.kda_heads, cfg.kda_head_dim, shard.kda_proj, cfg.hidden_size
    gen = torch.Generator(device="cuda").manual_seed(6600 + tp)
    dev = {"generator": gen, "device": "cuda"}
    in_proj = torch.zeros(shard.kda_in_rows, hidden, device="cuda")
    in_proj[:4 * p + d + h] = torch.randn(4 * p + d + h, hidden, **dev) * hidden ** -0.5
    layer = Layer(h, gen)
    w = KDAWeights(in_proj=in_proj.to(BF16), f_b=(torch.randn(p, d, **dev) * d ** -0.5).to(BF16),
                   conv=layer.conv_weight, A_log=layer.A_log, dt_bias=layer.dt_bias, o_norm=layer.o_norm,
                   o_proj=(torch.randn(hidden, p, **dev) * p ** -0.5).to(BF16))
    del in_proj
    failures: list[str] = []
    for q, requests in ((1, 16), (4, 3)):
        step = Step(requests, q, 4, random.Random(tp + q))
        # the layer raises on slots past its pools (the kernel nulls them): null those instead
        step.conv_slot = [0 if s >= step.conv_pool else s for s in step.conv_slot]
        step.rec_slots = [[0 if s >= step.rec_pool else s for s in slots] for slots in step.rec_slots]
        rec, conv = layer.pools(step.rec_pool, step.conv_pool, 4, gen)
        u = torch.randn(requests * q, hidden, **dev).to(BF16)
        segs = [Segment(r, r * q, q, False, 9, step.rec_slots[r], step.rec_read_slot[r], step.conv_slot[r],
                        step.accepted[r], torch.zeros(1)) for r in range(requests)]
        pad_rows = step.padding_rows()
        ref_state = KDALayerState(rec.clone(), conv.clone())
        want = kda_attention(w, cfg, shard, u, segs, ref_state, SingleRank(tp, rank))
        z = linear(u, w.in_proj)
        g_raw = linear(z[:, 4 * p:4 * p + d], w.f_b)
        k_rec, k_conv = rec.clone(), conv.clone()
        y = kda_decode.launch(z, g_raw, *layer.params(), k_rec, k_conv, *step.tensors(), cfg.gate_lower_bound)
        got = linear(y, w.o_proj)
        torch.cuda.synchronize()
        written = step.written()
        rel = rel_err(got, want)
        state = rel_err(k_rec[written], ref_state.rec[written])
        ok = (rel < OUT_REL_ERR_BOUND and state < STATE_REL_ERR_BOUND and torch.equal(k_conv[1:], ref_state.conv[1:])
              and bool((got[pad_rows] == 0).all()))
        evidence.append({"name": f"layer via kda_attention TP{tp} rank {rank} q={q} R={requests}",
                         "status": "pass" if ok else "fail", "rel_err": rel, "state_rel_err": state})
        if not ok:
            failures.append(f"q={q}: out {rel:.2e} state {state:.2e}")
    assert not failures, "; ".join(failures)


# ---------------------------------------------------------------- GPU: determinism and CUDA graphs


@pytest.mark.gpu
def test_repeat_launch_is_bit_identical(evidence):
    gen = torch.Generator(device="cuda").manual_seed(6700)
    layer = Layer(12, gen)
    step = Step(5, 3, 4, random.Random(5))
    rec, conv = layer.pools(step.rec_pool, step.conv_pool, 4, gen)
    z, g_raw = layer.inputs(15, "heavy_tailed", gen)
    runs = []
    for _ in range(3):
        r, c = rec.clone(), conv.clone()
        runs.append((kda_decode.launch(z, g_raw, *layer.params(), r, c, *step.tensors(), LB), r, c))
    ok = all(_equal_with_nan(x, y) for run in runs[1:] for x, y in zip(run, runs[0]))
    evidence.append({"name": "repeat launches bit-identical", "status": "pass" if ok else "fail", "rel_err": 0.0})
    assert ok


@pytest.mark.gpu
def test_cuda_graph_capture_and_replay(evidence):
    """A captured launch records only; replay reads the z, g_raw and slot tensors written in place."""
    gen = torch.Generator(device="cuda").manual_seed(6800)
    layer = Layer(12, gen)
    rng = random.Random(6)
    step = Step(3, 2, 2, rng)
    rec, conv = layer.pools(step.rec_pool, step.conv_pool, 2, gen)
    z, g_raw = layer.inputs(6, "normal", gen)
    t = step.tensors()
    out = _nan_out(6, layer.p)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        kda_decode.launch(z, g_raw, *layer.params(), rec.clone(), conv.clone(), *t, LB, out)  # compile outside
        torch.cuda.synchronize()
        out.fill_(float("nan"))
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            kda_decode.launch(z, g_raw, *layer.params(), rec, conv, *t, LB, out)
    torch.cuda.synchronize()
    recorded_only = bool(torch.isnan(out).all())
    step2 = Step(3, 2, 2, rng)
    step2.rec_pool, step2.conv_pool = step.rec_pool, step.conv_pool
    for dst, src in zip(t, step2.tensors()):
        dst.copy_(src)
    z2, g2 = layer.inputs(6, "large", gen)
    z.copy_(z2)
    g_raw.copy_(g2)
    rec0, conv0 = rec.clone(), conv.clone()
    ref_rec, ref_conv = rec.clone(), conv.clone()
    ref = reference_step(z, g_raw, *layer.params(), LB, ref_rec, ref_conv, *t)
    graph.replay()
    torch.cuda.synchronize()
    rows: list[dict] = []
    failures: list[str] = []
    check_step("cuda graph replay on new inputs and slots", step2, rec0, conv0,
               (out, rec, conv, ref, ref_rec, ref_conv), rows, failures, recorded_only=recorded_only)
    evidence.extend(rows)
    assert recorded_only, "capture ran the kernel instead of recording it"
    assert not failures, "; ".join(failures)
