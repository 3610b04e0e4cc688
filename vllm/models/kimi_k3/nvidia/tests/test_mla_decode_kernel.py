"""MLA decode attention kernels (kernels/mla_decode.py + mla_combine.py) against reference/mla.py.

The oracle is `reference/mla.py::attend_absorbed`, read up to its latent output: with W_UV = I
(512 × 512 per head) its output is ol itself (one exact product per element), and the kernel's
input q_lat = [bf16(q_nope · W_UK) | q_pe] is formed exactly as attend_absorbed forms it.

CPU: envelope errors (raised before any CUDA use); the split schedule (every chunk of every
query tile covered once, the grid bound, one long request filling the GPU, every length
running); the split / combine algorithm modelled on the schedule against the oracle; compile
checks for sm_90a, sm_100a and sm_103a whose PTX must show the design (mma.sync m16n8k16,
ldmatrix and ldmatrix.trans, 16-byte cp.async, ex2, no local memory) and, where ptxas is on
PATH, no register spills; both split kernels launched as PDL dependents, their first chunk
requested before the wait and nothing written before it; every `sweep_plans` variant compiled,
with the registers to hold as many CTAs an SM as its shared memory does. GPU (marker `gpu`): batches mixing lengths (1, 2, 7, block
boundaries, 4097, 65536, one >= 262144), q = 1 and 8 and mixed, heads 6 / 12 / 96, block sizes
16 / 64 / 128, four input distributions, adversarial scores (one huge logit, all equal, very
negative) with many splits and none, every `sweep_plans` variant with its own split policy,
NaN-poisoned outputs, ‖out − ref‖ / ‖ref‖ under a bound;
bit-identical repeats; CUDA-graph replay after the lengths change on the device; the queries
or the step's own cache rows written late by a kernel still running (`_pdl.late_copy`),
eager and graphed, on both kernels. With
K3_EVIDENCE_DIR set the GPU results are written there as a "kernel-test" record.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import random
import re
import shutil
import subprocess

import pytest
import torch

pytest.importorskip("cutlass", reason="nvidia-cutlass-dsl is not installed (pip install nvidia-cutlass-dsl==4.8.1)")

from vllm.models.kimi_k3.nvidia.kernels import mla_combine, mla_decode  # noqa: E402
from vllm.models.kimi_k3.nvidia.kernels.cubin_resources import kernel_resources  # noqa: E402
from vllm.models.kimi_k3.nvidia.kernels.device import facts  # noqa: E402
from vllm.models.kimi_k3.nvidia.kernels.mla_decode import DecodePlan, schedule  # noqa: E402
from vllm.models.kimi_k3.nvidia.tests._evidence import record_kernel_test  # noqa: E402
from vllm.models.kimi_k3.nvidia.tests._pdl import late_copy, warmed  # noqa: E402
from vllm.models.kimi_k3.nvidia.tests._util import rel_err  # noqa: E402
from vllm.models.kimi_k3.nvidia.reference.mla import attend_absorbed  # noqa: E402
from vllm.models.kimi_k3.nvidia.reference.ops import acc_dtype  # noqa: E402

BF16 = torch.bfloat16
R_KV, D_R, D_N = 512, 64, 128
ROW = R_KV + D_R
# bf16 weights p in P·V (2^-9 relative each) and the bf16 output rounding: 3e-4 .. 1.9e-3 in
# the CPU model below (four distributions); the bound leaves room for the GPU's FP32 orders
REL_ERR_BOUND = 5e-3
SOURCES = ("vllm/models/kimi_k3/nvidia/kernels/mla_decode.py", "vllm/models/kimi_k3/nvidia/kernels/mla_decode_wgmma.py",
           "vllm/models/kimi_k3/nvidia/kernels/mla_combine.py",
           "vllm/models/kimi_k3/nvidia/tests/test_mla_decode_kernel.py",
           "vllm/models/kimi_k3/nvidia/tests/_pdl.py")


# ---------------------------------------------------------------- problem construction


def _draw(kind: str, shape: tuple[int, ...], gen: torch.Generator, device: str) -> torch.Tensor:
    """FP32 draws: normal, heavy-tailed (Student t, 3 dof), or plain normal for the scaled kinds."""
    z = torch.randn(shape, generator=gen, device=device)
    if kind == "heavy_tailed":
        chi2 = sum(torch.randn(shape, generator=gen, device=device) ** 2 for _ in range(3))
        z = z / (chi2 / 3).sqrt().clamp_min(1e-3)
    return z


# cache scale and query scale: "large" / "tiny" move the values, not the conditioning of the
# scores (a 3e3-scaled key *and* query would make near-ties of 1e7-sized logits rounding noise)
SCALES = {"normal": (1.0, 1.0), "heavy_tailed": (1.0, 1.0), "large": (3e3, 1 / 3e3), "tiny": (1e-4, 1e4)}
DISTRIBUTIONS = tuple(SCALES)


class Batch:
    """A paged cache with shuffled blocks (block 0 is the null block), block tables padded with
    the null block, the step's queries (q_nope, q_pe, W_UK and the kernel's q_lat) and metadata."""

    def __init__(self, lengths: list[int], q_lens: list[int], heads: int, block_size: int, dist: str,
                 seed: int, device: str, adversarial: str | None = None, capacity: list[int] | None = None,
                 d_nope: int = D_N):
        gen = torch.Generator(device=device).manual_seed(seed)
        self.lengths, self.q_lens, self.heads, self.block_size = lengths, q_lens, heads, block_size
        self.max_q = max(q_lens)
        kv_scale, q_scale = SCALES[dist]
        need = [-(-max(n, c) // block_size) for n, c in zip(lengths, capacity or lengths)]
        max_blocks = max(need) + 1  # one spare entry that must never be read
        perm = torch.randperm(sum(need), generator=torch.Generator().manual_seed(seed)) + 1
        table = torch.zeros(len(lengths), max_blocks, dtype=torch.int32)
        at = 0
        for r, n in enumerate(need):
            table[r, :n] = perm[at:at + n].to(torch.int32)
            at += n
        self.cache = (_draw(dist, (1 + sum(need), block_size, ROW), gen, device) * kv_scale).to(BF16)
        self.block_table = table.to(device)
        rows = sum(q_lens)
        self.q_nope = (_draw(dist, (rows, heads, d_nope), gen, device) * q_scale).to(BF16)
        self.q_pe = (_draw(dist, (rows, heads, D_R), gen, device) * q_scale).to(BF16)
        self.w_uk = (torch.randn(heads, d_nope, R_KV, generator=gen, device=device) / math.sqrt(d_nope)).to(BF16)
        if adversarial is not None:
            self._make_adversarial(adversarial, gen)
        acc = acc_dtype(self.q_nope)
        ql = torch.einsum("nhd,hdr->nhr", self.q_nope.to(acc), self.w_uk.to(acc)).to(BF16)
        self.q_lat = torch.cat([ql, self.q_pe], dim=-1).contiguous()
        self.seq_lens = torch.tensor(lengths, dtype=torch.int32, device=device)
        self.query_start = torch.tensor([0, *itertools.accumulate(q_lens)], dtype=torch.int32, device=device)

    def _make_adversarial(self, kind: str, gen: torch.Generator) -> None:
        """Every head and query shares one direction d (W_UK and q_nope repeated), so the cache
        can be aimed at all of them: one row along +d (one huge logit), every row with the same
        score (equal logits: ql = 0, one shared k_pe), or every row along −d (very negative)."""
        heads, dev = self.heads, self.cache.device
        self.w_uk = self.w_uk[:1].expand(heads, -1, -1).contiguous()
        self.q_nope = self.q_nope[:1, :1].expand_as(self.q_nope).contiguous()
        self.q_pe = self.q_pe[:1, :1].expand_as(self.q_pe).contiguous()
        if kind == "equal":
            self.q_nope.zero_()
            self.cache[..., R_KV:] = self.cache[1, 0, R_KV:]
            return
        acc = acc_dtype(self.q_nope)
        d = torch.cat([torch.einsum("d,dr->r", self.q_nope[0, 0].to(acc), self.w_uk[0].to(acc)),
                       self.q_pe[0, 0].to(acc)]).sign().to(torch.float32)
        noise = torch.randn(self.cache.shape, generator=gen, device=dev)
        if kind == "huge":
            # the huge row sits in the last block of request 0, i.e. in its last split
            last = int(self.block_table[0, -(-self.lengths[0] // self.block_size) - 1])
            self.cache[last, (self.lengths[0] - 1) % self.block_size] = (32 * d).to(BF16)
        elif kind == "negative":
            self.cache.copy_((-32 * d + noise).to(BF16))
        else:
            raise ValueError(kind)

    def rows_of(self, r: int) -> slice:
        start = sum(self.q_lens[:r])
        return slice(start, start + self.q_lens[r])

    def kv_of(self, r: int) -> torch.Tensor:
        n, bs = self.lengths[r], self.block_size
        pos = torch.arange(n, device=self.cache.device)
        return self.cache[self.block_table[r].long()[pos // bs], pos % bs]

    def reference(self, r: int) -> torch.Tensor:
        """attend_absorbed with W_UV = I: the latent output ol of request r's rows."""
        eye = torch.eye(R_KV, dtype=BF16, device=self.cache.device).expand(self.heads, R_KV, R_KV)
        rows = self.rows_of(r)
        q = torch.cat([self.q_nope[rows], self.q_pe[rows]], dim=-1)
        return attend_absorbed(q, self.kv_of(r), self.w_uk, eye)


# ---------------------------------------------------------------- envelope (CPU)


def _ok_inputs():
    b = Batch([5, 9], [1, 1], 6, 16, "normal", 0, "cpu")
    return {"q_lat": b.q_lat, "cache": b.cache, "block_table": b.block_table, "seq_lens": b.seq_lens,
            "query_start": b.query_start, "max_q": 1}


@pytest.mark.parametrize("case, match", [
    ("q_width", "q_lat must be [rows, heads, 576]"),
    ("q_dtype", "must be bfloat16"),
    ("cache_width", "cache must be [num_blocks, block_size, 576]"),
    ("table_dtype", "block_table must be int32"),
    ("lens_shape", "seq_lens must be [2]"),
    ("starts_shape", "query_start must be [3]"),
    ("max_q", "max_q=9"),
    ("too_many_rows", "at most 2"),
    ("requests", "65 requests"),
    ("noncontig", "cache must be contiguous"),
    ("out", "out must be a [2, 6, 512] bfloat16 tensor"),
    ("cpu", "must be a CUDA tensor"),
    ("tau", "tau=nan (the softmax scale) must be a positive finite number"),
])
def test_envelope_errors(case, match):
    kw = _ok_inputs()
    out = None
    if case == "q_width":
        kw["q_lat"] = kw["q_lat"][..., :512].contiguous()
    elif case == "q_dtype":
        kw["q_lat"] = kw["q_lat"].float()
    elif case == "cache_width":
        kw["cache"] = kw["cache"][..., :512].contiguous()
    elif case == "table_dtype":
        kw["block_table"] = kw["block_table"].long()
    elif case == "lens_shape":
        kw["seq_lens"] = kw["seq_lens"][:1]
    elif case == "starts_shape":
        kw["query_start"] = kw["query_start"][:2]
    elif case == "max_q":
        kw["max_q"] = 9
    elif case == "too_many_rows":
        kw["q_lat"] = torch.cat([kw["q_lat"]] * 2)
    elif case == "requests":
        kw["block_table"] = torch.zeros(65, 2, dtype=torch.int32)
        kw["seq_lens"] = torch.ones(65, dtype=torch.int32)
        kw["query_start"] = torch.arange(66, dtype=torch.int32)
    elif case == "noncontig":
        kw["cache"] = kw["cache"].transpose(0, 1)
    elif case == "out":
        out = torch.empty(2, 6, 128, dtype=BF16)
    elif case == "tau":
        kw["tau"] = math.nan
    with pytest.raises(mla_decode.MlaDecodeEnvelopeError, match=re.escape(match)):
        mla_decode.launch(**kw, out=out)


# ---------------------------------------------------------------- the schedule (CPU)


def _plan(heads: int, max_q: int, block_size: int = 64) -> DecodePlan:
    return mla_decode.choose_plan(heads, max_q, block_size)


def _check_cover(lengths, q_lens, plan, target, min_chunks):
    """Run the host schedule and check it: units in slot order within the grid bound, no empty
    split, and the splits of every query tile of every request tiling its chunks exactly."""
    starts = [0, *itertools.accumulate(q_lens)]
    units = schedule(lengths, starts, starts[-1], 1 << 30, plan, target, min_chunks)
    assert len(units) <= mla_decode.grid_size(plan, len(lengths), target)
    assert [u.slot for u in units] == list(range(len(units)))
    ranges: dict[tuple[int, int], list[tuple[int, int]]] = {}
    for u in units:
        assert 0 <= u.chunk_begin < u.chunk_end, u
        assert u.token_end == min(u.chunk_end * plan.chunk, lengths[u.request])
        ranges.setdefault((u.request, u.tile), []).append((u.chunk_begin, u.chunk_end))
    for r, (n, q) in enumerate(zip(lengths, q_lens)):
        for t in range(-(-plan.heads * q // plan.tile_rows) if n > 0 else 0):
            spans = sorted(ranges.pop((r, t)))
            assert spans[0][0] == 0 and spans[-1][1] == -(-n // plan.chunk), (r, t)
            assert all(a[1] == b[0] for a, b in itertools.pairwise(spans)), (r, t)
    assert not ranges
    return units


@pytest.mark.parametrize("heads, max_q", [(6, 1), (12, 1), (12, 8), (96, 8)])
def test_schedule_covers_every_chunk_once(heads, max_q):
    rnd = random.Random(heads * 10 + max_q)
    plan = _plan(heads, max_q)
    for _ in range(25):
        requests = rnd.randint(1, 64)
        lengths = [rnd.choice([0, 1, 2, 7, 31, 32, 33, 64, 4097, 65536, rnd.randint(1, 300000)])
                   for _ in range(requests)]
        q_lens = [rnd.randint(1, max_q) for _ in range(requests)]
        lengths = [max(n, q) if n else 0 for n, q in zip(lengths, q_lens)]
        for target, min_chunks in ((1, 1), (528, 4), (4096, 1)):
            _check_cover(lengths, q_lens, plan, target, min_chunks)


def test_every_length_runs_and_one_long_request_fills_the_gpu():
    plan = _plan(12, 1)
    target = mla_decode.default_target(132)
    for n in list(range(1, 300)) + [4096, 4097, 65536, 262151, mla_decode.MAX_CONTEXT]:
        units = _check_cover([n], [1], plan, target, mla_decode.MIN_CHUNKS)
        assert units and units[-1].token_end == n
    units = _check_cover([mla_decode.MAX_CONTEXT], [1], plan, target, mla_decode.MIN_CHUNKS)
    assert 132 <= len(units) <= target  # every SM busy, and no partial last wave beyond the target
    sizes = {u.chunk_end - u.chunk_begin for u in units}
    assert max(sizes) - min(sizes) <= 1  # balanced splits


def test_schedule_clamps_bad_metadata_into_bounds():
    plan = _plan(6, 2)
    # negative length, rows past the batch, a length beyond the table's capacity
    units = schedule([-5, 40, 10_000], [0, 2, 3, 9], 4, 256, plan, 8, 1)
    assert {u.request for u in units} == {1, 2}
    assert max(u.token_end for u in units if u.request == 2) == 256
    assert all(u.tile < -(-plan.heads * 1 // plan.tile_rows) for u in units if u.request == 2)


# ---------------------------------------------------------------- the algorithm, modelled (CPU)


def _model(b: Batch, plan: DecodePlan, target: int, min_chunks: int) -> torch.Tensor:
    """The kernels' arithmetic on the schedule: per split, chunk-wise online softmax in FP32 with
    the weights rounded to bf16, unnormalized partials, then the log-sum-exp merge."""
    starts = b.query_start.tolist()
    cap = b.block_table.shape[1] * b.block_size
    units = schedule(b.lengths, starts, starts[-1], cap, plan, target, min_chunks)
    flat_q = b.q_lat.view(-1, ROW).float()
    partial: dict[tuple[int, int], list] = {}
    for u in units:
        length, q = b.lengths[u.request], b.q_lens[u.request]
        kv = b.kv_of(u.request).float()
        first = starts[u.request] * b.heads + u.tile * plan.tile_rows
        rows = min(plan.tile_rows, b.heads * q - u.tile * plan.tile_rows)
        qt = flat_q[first:first + rows]
        limit = torch.tensor([min(u.token_end, length - q + (u.tile * plan.tile_rows + i) // b.heads + 1)
                              for i in range(rows)])
        run_max = torch.full((rows,), -math.inf)
        run_sum = torch.zeros(rows)
        acc = torch.zeros(rows, R_KV)
        for ci in range(u.chunk_begin, u.chunk_end):
            tok = torch.arange(ci * plan.chunk, (ci + 1) * plan.chunk)
            rows_kv = kv[tok.clamp(max=u.token_end - 1)]
            s2 = (qt @ rows_kv.T) * (mla_decode.K3_TAU * math.log2(math.e))
            s2 = s2.masked_fill(tok[None, :] >= limit[:, None], -math.inf)
            new_max = torch.maximum(run_max, s2.max(dim=1).values)
            ref = torch.where(new_max == -math.inf, torch.zeros(()), new_max)
            p = torch.exp2(s2 - ref[:, None])
            scale = torch.exp2(run_max - ref)
            run_sum = run_sum * scale + p.sum(dim=1)
            acc = acc * scale[:, None] + p.to(BF16).float() @ rows_kv[:, :R_KV]
            run_max = new_max
        partial.setdefault((u.request, u.tile), []).append((run_max, run_sum, acc, first, rows))
    out = torch.full((starts[-1] * b.heads, R_KV), float("nan"))
    for parts in partial.values():
        first, rows = parts[0][3], parts[0][4]
        # the combine kernel merges all splits at once; an in-kernel combine (`fan_in`) a tree's
        # nodes of up to fan_in children, each relative to its own max
        size = plan.fan_in or len(parts)
        while True:
            parts = [_merge_partials(parts[i:i + size]) for i in range(0, len(parts), size)]
            if len(parts) == 1:
                break
        _, total, o = parts[0]
        out[first:first + rows] = torch.where(total[:, None] > 0, o / total[:, None], torch.zeros(()))
    return out.view(starts[-1], b.heads, R_KV).to(BF16)


def _merge_partials(parts: list) -> tuple:
    """(max, sum, O) of the splits' partials merged with log-sum-exp weights."""
    m = torch.stack([p[0] for p in parts])
    top = m.max(dim=0).values
    w = torch.exp2(m - torch.where(top == -math.inf, torch.zeros(()), top))
    return (top, (w * torch.stack([p[1] for p in parts])).sum(0),
            (w[..., None] * torch.stack([p[2] for p in parts])).sum(0))


@pytest.mark.parametrize("variant", ["default", "4warps_chunk32", "fan_in_4"])
@pytest.mark.parametrize("heads, q_lens, target, min_chunks", [
    (6, [1, 1, 1], 1, 1),  # one split per request: the direct write
    (6, [1, 1, 1], 64, 1),  # many splits, most of them one chunk
    (12, [8, 3], 16, 1),  # verify rows across splits, two query tiles
    (12, [2, 8], 5, 2),
])
def test_split_algorithm_matches_reference(heads, q_lens, target, min_chunks, variant):
    lengths = [max(q, n) for q, n in zip(q_lens, [297, 33, 530][:len(q_lens)])]
    b = Batch(lengths, q_lens, heads, 16, "normal", 3 + heads, "cpu")
    plan = _plan(heads, max(q_lens), 16)
    if variant == "4warps_chunk32":
        plan = dataclasses.replace(plan, warps=4, chunk=32, stages=4, m_tiles=min(plan.m_tiles, 2))
    elif variant == "fan_in_4":
        plan = dataclasses.replace(plan, fan_in=4)
    out = _model(b, plan, target, min_chunks)
    assert not torch.isnan(out).any()
    for r in range(len(lengths)):
        assert rel_err(out[b.rows_of(r)], b.reference(r)) < REL_ERR_BOUND


# ---------------------------------------------------------------- compile checks (CPU)

COMPILE_PLANS = [  # the default plans at TP8 (plain decode: one 16-row tile; verify: 96 rows in two tiles
    # of 48, 16-token blocks) and the 4-warp variant of the sweep; each arch compiles some of them
    # (a compile takes seconds); the GPU tests compile the rest
    mla_decode.choose_plan(12, 1, 64),
    mla_decode.choose_plan(12, 8, 16),
    DecodePlan(heads=12, max_q=8, block_size=64, m_tiles=2, stages=2, warps=4, chunk=64),
]


def _spills(ptx: str, arch: str, tmp_path) -> str | None:
    """ptxas's resource line for the PTX, or None when no ptxas is on PATH."""
    ptxas = shutil.which("ptxas")
    if ptxas is None:
        return None
    src = tmp_path / "k.ptx"
    src.write_text(ptx)
    res = subprocess.run([ptxas, f"-arch={arch}", "-v", str(src), "-o", str(tmp_path / "k.cubin")],
                         check=False, capture_output=True, text=True, timeout=120)
    return res.stderr if res.returncode == 0 else None


@pytest.mark.parametrize("plan, arch", [(COMPILE_PLANS[1], "sm_90a"), (COMPILE_PLANS[0], "sm_90a"),
                                        (COMPILE_PLANS[2], "sm_90a"), (COMPILE_PLANS[0], "sm_100a"),
                                        (COMPILE_PLANS[0], "sm_103a")],
                         ids=["tp8_q8-sm_90a", "tp8_q1-sm_90a", "4warps-sm_90a", "tp8_q1-sm_100a", "tp8_q1-sm_103a"])
def test_decode_compiles_for_arch(plan, arch, tmp_path):
    ptx = mla_decode.compile_mla_decode(plan, arch, ptx_dir=str(tmp_path)).artifacts.PTX
    assert f".target {arch}" in ptx
    mmas = len(re.findall(r"mma\.sync\.aligned\.m16n8k16\.row\.col\.f32\.bf16\.bf16\.f32", ptx))
    # per chunk and 16-row tile: 36 k-atoms of scores per n8 token tile, and chunk / 16 k-atoms
    # of P·V over the warp's 512 / warps value columns (n8 tiles)
    assert plan.m_tiles == (3 if plan.max_q == 8 else 1) or plan.warps == 4
    assert mmas == plan.m_tiles * (36 * plan.n_tiles + plan.chunk // 16 * plan.warp_cols // 8)
    assert "ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16" in ptx  # V straight from the ring
    assert "ldmatrix.sync.aligned.m8n8.x4.shared.b16" in ptx
    assert "cp.async.cg.shared.global" in ptx and ", 16, 16;" in ptx  # 16-byte async copies
    assert "cp.async.wait_group" in ptx and "ex2.approx" in ptx
    assert "vote.sync.ballot" in ptx  # the on-device schedule
    assert not re.search(r"\b(ld|st)\.local", ptx), "registers spilled to local memory"
    _assert_pdl_order(ptx)
    report = _spills(ptx, arch, tmp_path)
    if report is not None:
        assert "0 bytes spill stores" in report, report


def _assert_pdl_order(ptx: str) -> None:
    """Dependents released first; then the first chunk's cp.async, which may run before the PDL
    wait; the wait; and only then any global store (the record for the combine, a stale combine
    of the same shape may still read the workspace)."""
    order = [ptx.index(op) for op in ("griddepcontrol.launch_dependents", "cp.async.cg.shared.global",
                                      "griddepcontrol.wait", "st.global")]
    assert order == sorted(order), order
    assert ptx.count("griddepcontrol.wait") == 1


def test_verify_rows_take_the_wgmma_kernel_on_sm90_only():
    """More than 32 query rows a request (heads × tokens) run the wgmma kernel on sm_90a; fewer rows,
    and every other arch, the mma.sync kernel; the wgmma plan fits one CTA an SM."""
    for heads, max_q, arch, mma in [(6, 8, "sm_90a", "wgmma"), (12, 8, "sm_90a", "wgmma"), (12, 3, "sm_90a", "wgmma"),
                                    (6, 5, "sm_90a", "sync"), (12, 1, "sm_90a", "sync"), (6, 8, "sm_100a", "sync"),
                                    (12, 8, "sm_103a", "sync"), (12, 8, None, "sync")]:
        plan = mla_decode.choose_plan(heads, max_q, 64, arch)
        assert plan.mma == mma, (heads, max_q, arch, plan)
        if mma == "wgmma":
            assert plan.tile_rows == 64 and plan.threads == 256 and plan.smem_bytes <= mla_decode.SMEM_PER_CTA
    plans = mla_decode.sweep_plans(6, 8, 64, "sm_90a")
    assert plans[0].mma == "wgmma" and mla_decode.choose_plan(6, 8, 64) in plans  # judged against mma.sync
    with pytest.raises(ValueError, match="chunk 64"):
        DecodePlan(heads=6, max_q=8, block_size=64, m_tiles=4, warps=8, chunk=32, mma="wgmma")
    with pytest.raises(ValueError, match="'sync' or 'wgmma'"):
        DecodePlan(heads=6, max_q=8, block_size=64, mma="tcgen05")


def test_wgmma_smem_layouts_agree():
    """The wgmma kernel's hand-computed cp.async offsets are the swizzled layouts wgmma reads, and
    P·V's MN-major value view of a stage places every element where the K-major key view does."""
    import cutlass
    import cutlass.cute as cute

    from vllm.models.kimi_k3.nvidia.kernels import mla_decode_wgmma as W
    seen: dict = {"swizzles": [], "q": [], "k": [], "v": [], "p": []}
    rows, vecs = range(0, 64, 3), range(72)

    @cute.jit
    def probe():  # static layouts at static coordinates: plain ints, read at trace time
        q, k, v, p = W.smem_layouts(64)
        seen["swizzles"] += [str(lay.inner) for lay in (q, k, v, p)]
        for row in cutlass.range_constexpr(0, 64, 3):
            for vec in cutlass.range_constexpr(72):
                seen["q"].append(q.outer((row, 8 * vec)))
                seen["k"].append(k.outer((row, 8 * vec + row % 8)))
                if cutlass.const_expr(vec < 32):
                    seen["v"].append(v.outer((8 * vec + row % 8, row)))
                if cutlass.const_expr(vec < 8):
                    seen["p"].append(p.outer((row, 8 * vec)))

    cute.compile(probe)
    assert seen["swizzles"] == ["S<3,4,3>"] * 4  # 128-byte swizzle; x below is in bf16 elements

    def sw128(x: int) -> int:
        return x ^ (((x >> 6) & 7) << 3)

    pairs = [(r, v) for r in rows for v in vecs]
    assert [sw128(x) for x in seen["q"]] == [W.swizzled(r, v, 64) for r, v in pairs]
    assert [sw128(x) - r % 8 for x, (r, v) in zip(seen["k"], pairs)] == [W.swizzled(r, v, 64) for r, v in pairs]
    assert seen["v"] == [x for x, (r, v) in zip(seen["k"], pairs) if v < 32]
    assert seen["p"] == [r * W.BLOCK + 8 * v for r, v in pairs if v < 8]


def test_wgmma_decode_compiles_for_sm90a_only(tmp_path):
    plan = mla_decode.choose_plan(12, 8, 64, "sm_90a")
    compiled = mla_decode.compile_mla_decode(plan, "sm_90a", ptx_dir=str(tmp_path))
    ptx = compiled.artifacts.PTX
    # per chunk and warpgroup: 36 k16 steps of scores over its 32 tokens, 4 of P·V over its 256 columns
    assert len(re.findall(r"wgmma\.mma_async\.sync\.aligned\.m64n32k16\.f32\.bf16\.bf16", ptx)) == 36
    assert len(re.findall(r"wgmma\.mma_async\.sync\.aligned\.m64n256k16\.f32\.bf16\.bf16", ptx)) == 4
    assert "cp.async.cg.shared.global" in ptx and ", 16, 16;" in ptx
    assert "fence.proxy.async.shared::cta" in ptx  # cp.async's writes handed to wgmma's proxy
    _assert_pdl_order(ptx)
    assert not re.search(r"\b(ld|st)\.local", ptx), "registers spilled to local memory"
    used = kernel_resources(compiled.artifacts.CUBIN)
    assert used.frame_bytes == 0 and used.ctas_per_sm(plan.threads) >= 1, used
    with pytest.raises(ValueError, match="sm_90a"):
        mla_decode.compile_mla_decode(plan, "sm_100a")


@pytest.mark.parametrize("max_q", [1, 8])
def test_every_sweep_plan_compiles_and_fits_its_residency(max_q, tmp_path):
    """Every variant `bench_mla_decode --sweep` times compiles for sm_90a with nothing in local
    memory, and the registers ptxas gave it let an SM hold as many of its CTAs as the shared
    memory does: the two-per-SM variant (plain decode) must really get two."""
    plans = {plan.kernel_key: plan for plan in mla_decode.sweep_plans(12, max_q, 64)}
    assert (max_q == 1) == any(plan.smem_ctas == 2 for plan in plans.values())
    for plan in plans.values():
        compiled = mla_decode.compile_mla_decode(plan, "sm_90a", ptx_dir=str(tmp_path))
        used = kernel_resources(compiled.artifacts.CUBIN)
        assert used.frame_bytes == 0, (plan, used)
        assert used.ctas_per_sm(plan.threads) >= plan.smem_ctas, (plan, used)


def test_combine_teams_take_every_piece_and_every_split_once():
    """The combine's partition, run on the host: over the units of a tile (one per split), their
    teams and rounds, every piece of the tile once; within a team, every split once."""
    G, U, C = mla_combine.GROUPS, mla_combine.UNROLL, mla_combine.COL_BLOCKS
    for splits in range(2, 2 * G * U + 3):
        p = mla_combine.team_warps(splits, min)
        assert p == min(G, 1 << max(0, (splits - 1) // U).bit_length()), splits  # least 2^k with 2^k·U >= splits
        teams = G // p
        for rows in (1, 5, 16, 48):
            pieces = rows * C
            taken = [mla_combine.round_piece(base, splits, t) for s in range(splits)
                     for base in range(s, pieces, splits * teams) for t in range(teams)]
            assert sorted(x for x in taken if x < pieces) == list(range(pieces)), (splits, rows)
        merged = [s0 + u for m in range(p) for s0 in range(U * m, splits, U * p) for u in range(U)]
        assert sorted(x for x in merged if x < splits) == list(range(splits)), splits


def _climb_tree(splits: int, fan_in: int, stride: int, rng: random.Random) -> tuple[dict, list]:
    """`mla_combine.merge_splits` run on the host with the splits' CTAs interleaved at random: each
    step one CTA arrives at its next node (its ticket from that node's counter) and, if it is the
    last of the node's children, merges them into the node's slot and climbs on. A slot holds
    (level, index, the level-0 splits merged in it); returns the counters and what the root's
    merger wrote."""
    slot0 = 3
    slots = {slot0 + s * stride: (0, s, [s]) for s in range(splits)}
    counts: dict[tuple[int, int], int] = {}
    written: list = []
    ctas = {s: (s, splits, 1, 0) for s in range(splits)}  # idx, n, span, level
    while ctas:
        s = rng.choice(sorted(ctas))
        idx, n, span, level = ctas.pop(s)
        if n <= 1:
            continue
        assert level < mla_combine.COUNT_LEVELS
        group, child0, members = mla_combine.tree_node(idx, n, fan_in, min)
        node = slot0 + child0 * span * stride
        ticket = counts.get((node, level), 0)
        counts[(node, level)] = ticket + 1
        if ticket != members - 1:
            continue
        counts[(node, level)] = 0
        merged = []
        for ch in range(members):
            lvl, index, parts = slots[slot0 + (child0 + ch) * span * stride]
            assert (lvl, index) == (level, child0 + ch), (splits, fan_in, "read a stale or foreign partial")
            merged += parts
        if n <= fan_in:
            written.append(merged)
        else:
            slots[node] = (level + 1, group, merged)
        ctas[s] = (group, -(-n // fan_in), span * fan_in, level + 1)
    return counts, written


@pytest.mark.parametrize("fan_in", [4, 8, 16])
def test_combine_tree_merges_every_split_once_in_any_arrival_order(fan_in):
    """The in-kernel combine's tree (`mla_combine.merge_splits`), modelled on the host: whatever
    order the CTAs arrive in, every child is read at the level and index it was written for
    (no partial overwritten before its reader), the root is merged once from every split
    once, and every counter is back at zero."""
    rng = random.Random(fan_in)
    for splits in [*range(2, 40), 63, 64, 65, 128, 132, 255, 256, 257, 528, 1024]:
        for _ in range(3):
            counts, written = _climb_tree(splits, fan_in, rng.choice([1, 2, 3]), rng)
            assert len(written) == 1 and sorted(written[0]) == list(range(splits)), (splits, fan_in)
            assert not any(counts.values()), (splits, fan_in)
    with pytest.raises(ValueError, match="fan_in"):
        DecodePlan(6, 1, 64, fan_in=2)


@pytest.mark.parametrize("arch", ["sm_90a", "sm_100a", "sm_103a"])
def test_combine_compiles_for_arch(arch, tmp_path):
    ptx = mla_combine.compile_mla_combine(32, arch, ptx_dir=str(tmp_path)).artifacts.PTX
    assert f".target {arch}" in ptx
    assert len(re.findall(r"ld\.global\.v4\.b32", ptx)) == mla_combine.UNROLL  # a batch of splits in flight
    assert "ex2.approx" in ptx and "cvt.rn.bf16x2.f32" in ptx
    assert not re.search(r"\b(ld|st)\.local", ptx)
    # launched after the split kernel ends, it waits for nothing; as its PDL dependent, before any read
    assert "griddepcontrol.wait" not in ptx
    (tmp_path / "pdl").mkdir()
    pdl = mla_combine.compile_mla_combine(32, arch, ptx_dir=str(tmp_path / "pdl"), pdl=True).artifacts.PTX
    assert pdl.index("griddepcontrol.wait") < pdl.index("ld.global")


# ---------------------------------------------------------------- GPU checks


@pytest.fixture(scope="module")
def evidence():
    results: list[dict] = []
    yield results
    record_kernel_test("mla_decode_test.json", "mla",
                       "vllm/models/kimi_k3/nvidia/tests/test_mla_decode_kernel.py", SOURCES, results,
                       "rel_err below bound, every element written, on every case",
                       extra={"rel_err_bound": REL_ERR_BOUND})


def _run_case(name: str, b: Batch, evidence: list, **launch_kw) -> list[str]:
    """Launch on a NaN-poisoned output, compare each request with the oracle, record the case."""
    out = torch.full((b.q_lat.shape[0], b.heads, R_KV), float("nan"), dtype=BF16, device="cuda")
    mla_decode.launch(b.q_lat, b.cache, b.block_table, b.seq_lens, b.query_start, b.max_q, out, **launch_kw)
    torch.cuda.synchronize()
    unwritten = int(torch.isnan(out).sum())
    errs = [rel_err(out[b.rows_of(r)], b.reference(r)) for r in range(len(b.lengths))]
    worst = max(errs)
    ok = unwritten == 0 and worst < REL_ERR_BOUND
    evidence.append({"name": name, "status": "pass" if ok else "fail", "rel_err": worst,
                     "unwritten": unwritten,
                     "shape": {"heads": b.heads, "block_size": b.block_size, "lengths": b.lengths,
                               "q": b.q_lens, **{k: dataclasses.asdict(v) if dataclasses.is_dataclass(v) else v
                                                 for k, v in launch_kw.items()}}})
    if ok:
        return []
    per_request = ", ".join(f"{e:.1e}" for e in errs)
    return [f"{name}: worst rel_err {worst:.2e} (bound {REL_ERR_BOUND:.0e}; per request {per_request}), "
            f"{unwritten} NaN left"]


MIXED = {1: [1, 2, 7, 63, 64, 65, 4097, 65536], 8: [8, 9, 64, 65, 4097, 65536]}


@pytest.mark.gpu
@pytest.mark.parametrize("heads", [6, 12, 96])
@pytest.mark.parametrize("q", [1, 8])
def test_mixed_lengths_match_reference(heads, q, evidence):
    torch.backends.cuda.matmul.allow_tf32 = False
    lengths = MIXED[q]
    failures = []
    for i, dist in enumerate(DISTRIBUTIONS):
        b = Batch(lengths, [q] * len(lengths), heads, 64, dist, 100 * heads + 10 * q + i, "cuda")
        failures += _run_case(f"mixed h={heads} q={q} {dist}", b, evidence)
    assert not failures, "; ".join(failures)


@pytest.mark.gpu
def test_the_softmax_scale_is_the_models(evidence):
    """τ = 1/sqrt(d_nope + d_rope) comes from the caller: a model with 64-wide q_nope (τ = 1/sqrt(128))
    matches its oracle with its own τ, and K3's τ there would not (the test can tell them apart)."""
    b = Batch([4097, 65, 1], [1, 8, 1], 12, 64, "normal", 128, "cuda", d_nope=64)
    failures = _run_case("d_nope=64, tau=1/sqrt(128)", b, evidence, tau=1 / math.sqrt(128))
    assert not failures, "; ".join(failures)
    wrong = torch.empty(b.q_lat.shape[0], b.heads, R_KV, dtype=BF16, device="cuda")
    mla_decode.launch(b.q_lat, b.cache, b.block_table, b.seq_lens, b.query_start, b.max_q, wrong)
    assert rel_err(wrong[b.rows_of(0)], b.reference(0)) > 3 * REL_ERR_BOUND


@pytest.mark.gpu
@pytest.mark.parametrize("block_size", [16, 128])
def test_mixed_tokens_per_request_and_block_sizes(block_size, evidence):
    q_lens = [1, 3, 8, 2, 8, 5, 1]
    lengths = [1, 3, 4097, 33, 200, 65536, 129]
    b = Batch(lengths, q_lens, 12, block_size, "normal", block_size, "cuda")
    failures = _run_case(f"mixed q, block_size={block_size}", b, evidence)
    assert not failures, "; ".join(failures)


@pytest.mark.gpu
@pytest.mark.parametrize("heads, q", [(12, 1), (12, 8), (6, 8)])
def test_long_context(heads, q, evidence):
    b = Batch([262144 + 37], [q], heads, 64, "normal", 7 + q, "cuda")
    failures = _run_case(f"long 262181 h={heads} q={q}", b, evidence)
    assert not failures, "; ".join(failures)


@pytest.mark.gpu
def test_sixty_four_requests(evidence):
    rnd = random.Random(64)
    lengths = [rnd.choice([1, 5, 64, 65, 1000, 4097, 20000]) for _ in range(64)]
    b = Batch(lengths, [1] * 64, 12, 64, "heavy_tailed", 64, "cuda")
    failures = _run_case("64 requests", b, evidence)
    assert not failures, "; ".join(failures)


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["huge", "equal", "negative"])
@pytest.mark.parametrize("split", [{"target": 1}, {"target": 4096, "min_chunks": 1}], ids=["whole", "many"])
def test_adversarial_scores(kind, split, evidence):
    b = Batch([4097, 65, 1], [1, 1, 1], 12, 64, "normal", 5, "cuda", adversarial=kind)
    failures = _run_case(f"adversarial {kind} {split}", b, evidence, **split)
    b = Batch([4100, 70], [8, 8], 12, 64, "normal", 6, "cuda", adversarial=kind)
    failures += _run_case(f"adversarial {kind} q=8 {split}", b, evidence, **split)
    assert not failures, "; ".join(failures)


@pytest.mark.gpu
@pytest.mark.parametrize("split", [{"target": 1}, {"target": 7, "min_chunks": 1}, {"target": 2048, "min_chunks": 1}])
def test_split_counts_agree(split, evidence):
    b = Batch([8, 40, 4097, 9000], [8, 8, 8, 8], 6, 64, "normal", 9, "cuda")
    failures = _run_case(f"splits {split}", b, evidence, **split)
    assert not failures, "; ".join(failures)


@pytest.mark.gpu
@pytest.mark.parametrize("heads, q, lengths", [(6, 1, [1, 7, 65, 4097, 40000]), (12, 8, [8, 70, 4100, 33000])])
def test_every_sweep_plan_matches_reference(heads, q, lengths, evidence):
    """Each variant the benchmark may time or pick, with its own split policy (waves, minimum
    chunks per split), computes what the default does."""
    failures = []
    for plan in mla_decode.sweep_plans(heads, q, 64, facts(torch.device("cuda")).arch):
        b = Batch(lengths, [q] * len(lengths), heads, 64, "normal", 31 + heads + q, "cuda")
        failures += _run_case(f"sweep h={heads} q={q} {plan}", b, evidence, plan=plan)
    assert not failures, "; ".join(failures)


@pytest.mark.gpu
@pytest.mark.parametrize("fan_in", [4, 16])
def test_in_kernel_combine_matches_reference_and_leaves_its_counters_zero(fan_in, evidence):
    """The split kernel merging its own splits (`plan.fan_in`): one split, a one-level tree, trees
    three to five levels deep (4096 units aimed at, one chunk a split: 65 536 tokens are 1024
    splits), idle CTAs beside them; then repeats, bit-identical, and the counters back at zero, so no launch
    inherits a count from the one before."""
    failures = []
    for heads, q, lengths, split in [(6, 1, [1, 7, 65, 4097, 65536], {}), (12, 2, [2, 70, 40000], {}),
                                     (6, 1, [65536, 300, 9], {"target": 4096, "min_chunks": 1}),
                                     (12, 1, [4097, 65], {"target": 3, "min_chunks": 1})]:
        plan = dataclasses.replace(mla_decode.choose_plan(heads, q, 64), fan_in=fan_in)
        b = Batch(lengths, [q] * len(lengths), heads, 64, "normal", 41 + fan_in + heads, "cuda")
        failures += _run_case(f"in-kernel combine h={heads} q={q} fan_in={fan_in} {split}", b, evidence, plan=plan,
                              **split)
        first = mla_decode.launch(b.q_lat, b.cache, b.block_table, b.seq_lens, b.query_start, q, plan=plan, **split)
        for _ in range(2):
            again = mla_decode.launch(b.q_lat, b.cache, b.block_table, b.seq_lens, b.query_start, q, plan=plan,
                                      **split)
            if not torch.equal(again, first):
                failures.append(f"h={heads} q={q} {split}: a repeat differs")
    torch.cuda.synchronize()
    for key, tensors in facts(torch.device("cuda"))._kept.items():
        if key[0] == "mla_decode":
            counts = tensors[2][key[1] * mla_combine.INFO_FIELDS:]
            if bool(counts.any()):
                failures.append(f"workspace {key}: {int((counts != 0).sum())} tree counters left non-zero")
    assert not failures, "; ".join(failures)


@pytest.mark.gpu
@pytest.mark.parametrize("fan_in", [0, 8], ids=["combine", "in_kernel_combine"])
def test_repeat_launch_and_cuda_graph_follow_device_lengths(fan_in):
    """Repeats are bit-identical (no state left between launches) and a captured launch replays the
    schedule from the device lengths: growing them in place after capture gives the new result, and
    a second replay the same (an in-kernel combine's counters are back at zero after each)."""
    grown = [5900, 63, 70000]
    b = Batch([5000, 3, 70000], [1, 1, 1], 12, 64, "normal", 21, "cuda", capacity=grown)
    plan = dataclasses.replace(mla_decode.choose_plan(12, 1, 64), fan_in=fan_in)

    def run(out=None):
        return mla_decode.launch(b.q_lat, b.cache, b.block_table, b.seq_lens, b.query_start, 1, out, plan=plan)

    first = run()
    for _ in range(3):
        assert torch.equal(run(), first)
    out = torch.full_like(first, float("nan"))
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        run(out)
        torch.cuda.synchronize()
        out.fill_(float("nan"))
        with torch.cuda.graph(graph, stream=stream):
            run(out)
    torch.cuda.synchronize()
    assert torch.isnan(out).all(), "capture ran the kernel instead of recording it"
    b.seq_lens.copy_(torch.tensor(grown, dtype=torch.int32))
    b.lengths = grown
    graph.replay()
    torch.cuda.synchronize()
    for r in range(3):
        assert rel_err(out[b.rows_of(r)], b.reference(r)) < REL_ERR_BOUND
    replayed = out.clone()
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, replayed)


@pytest.mark.gpu
@pytest.mark.parametrize("graphed", [False, True], ids=["eager", "graph"])
@pytest.mark.parametrize("late", ["queries", "step rows"])
@pytest.mark.parametrize("heads, q", [(6, 1), (12, 8)], ids=["h6q1", "h12q8"])
def test_reads_what_the_kernel_before_writes(heads, q, late, graphed, evidence):
    """Launched as a PDL dependent, the split kernel may start while the kernel before it still
    runs. It may request a chunk then only when the chunk holds none of the step's own tokens;
    the queries and the step's cache rows it must read after its wait. A producer that releases
    its dependents at once, spins about 1 ms and then writes the queries or the step's rows
    (`_pdl.late_copy`, whose window `test_pdl_order.test_window_exists` proves) must not be outrun.
    Lengths 200 and 70 in 64-token chunks put a step's tokens in the last chunk of a split whose
    first chunk goes early. h 12 q 8 runs the wgmma kernel on sm_90a."""
    b = Batch([200, 70], [q, q], heads, 64, "normal", 7 * heads + q, "cuda")
    gen = torch.Generator(device="cuda").manual_seed(11 * heads + q)
    if late == "queries":
        target, new = b.q_lat, b.q_lat.clone()
        old = (_draw("normal", tuple(new.shape), gen, "cuda") * 4).to(BF16)
    else:  # the rows of positions L - q .. L - 1 differ; every older row is the same before and after
        target, new = b.cache, b.cache.clone()
        old = new.clone()
        for r, n in enumerate(b.lengths):
            pos = torch.arange(n - q, n, device="cuda")
            blocks = b.block_table[r].long()[pos // b.block_size]
            old[blocks, pos % b.block_size] = (_draw("normal", (q, ROW), gen, "cuda") * 4).to(BF16)
    out = torch.empty((b.q_lat.shape[0], heads, R_KV), dtype=BF16, device="cuda")

    def step():
        late_copy(new, target)
        mla_decode.launch(b.q_lat, b.cache, b.block_table, b.seq_lens, b.query_start, q, out)

    run = warmed(step, graphed)
    target.copy_(old)
    stale = mla_decode.launch(b.q_lat, b.cache, b.block_table, b.seq_lens, b.query_start, q).clone()
    out.fill_(float("nan"))
    torch.cuda.synchronize()
    run()
    torch.cuda.synchronize()
    assert torch.equal(target, new), "the producer did not write what it was given"
    refs = [b.reference(r) for r in range(2)]
    errs = [rel_err(out[b.rows_of(r)], refs[r]) for r in range(2)]
    gaps = [rel_err(stale[b.rows_of(r)], refs[r]) for r in range(2)]
    unwritten = int(torch.isnan(out).sum())
    ok = unwritten == 0 and max(errs) < REL_ERR_BOUND
    evidence.append({"name": f"PDL h={heads} q={q} {late} written late, {'graph' if graphed else 'eager'}",
                     "status": "pass" if ok else "fail", "rel_err": max(errs), "unwritten": unwritten,
                     "stale_rel_err": min(gaps), "shape": {"heads": heads, "lengths": b.lengths, "q": b.q_lens}})
    assert min(gaps) > 10 * REL_ERR_BOUND, f"old and new {late} too alike to tell apart ({min(gaps):.2e})"
    assert ok, f"rel_err {max(errs):.2e} (a stale read gives {min(gaps):.2e}), {unwritten} NaN left"
