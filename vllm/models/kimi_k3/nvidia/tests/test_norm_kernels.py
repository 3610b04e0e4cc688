"""Norm, AttnRes and embedding kernels (kernels/{rms_norm,attn_res,embedding}.py) against
the reference (reference/ops.py, reference/attn_res.py, reference/model.py).

CPU: envelope errors (raised before any CUDA use), tilings that cover every envelope shape, and
compile checks for sm_90a, sm_100a and sm_103a whose PTX must show the design (16-byte global
loads and stores, the cluster exchange where AttnRes splits a row, no local memory, and AttnRes's
PDL order: only its weights loaded before `griddepcontrol.wait`).
GPU (marker `gpu`): every envelope width, M from 1 to 64, four input
distributions (normal, heavy-tailed, large-magnitude, near-zero), outputs NaN-poisoned before
the launch, ‖out − ref‖/‖ref‖ in fp32 under REL_ERR_BOUND (both sides are rounded to bf16 once,
so they differ only where the fp32 values straddle a rounding boundary: at most one bf16 ulp,
2^-8 relative, on those elements); the AttnRes prefix update and the embedding gather are exact
and compared bit for bit; CUDA-graph capture and replay; AttnRes computing from an activation
that the kernel before it writes late. With K3_EVIDENCE_DIR set the GPU
results are written there as "kernel-test" records (families norm, attn_res, embedding).
"""

from __future__ import annotations

import dataclasses
import os
import re

import pytest
import torch

pytest.importorskip("cutlass", reason="nvidia-cutlass-dsl is not installed (pip install nvidia-cutlass-dsl==4.8.1)")

from vllm.models.kimi_k3.nvidia.kernels import (  # noqa: E402
    attn_res,
    embedding,
    rms_norm,
)
from vllm.models.kimi_k3.nvidia.kernels.rows import MAX_ROWS, MAX_WIDTH, VEC, NormEnvelopeError  # noqa: E402
from vllm.models.kimi_k3.nvidia.evals.tiny import config_named  # noqa: E402
from vllm.models.kimi_k3.nvidia.latency_specialized.config import PRESETS  # noqa: E402
from vllm.models.kimi_k3.nvidia.latency_specialized.evidence import write_record  # noqa: E402
from vllm.models.kimi_k3.nvidia.reference.attn_res import attn_res_mix  # noqa: E402
from vllm.models.kimi_k3.nvidia.reference.collective import SingleRank  # noqa: E402
from vllm.models.kimi_k3.nvidia.reference.model import embed  # noqa: E402
from vllm.models.kimi_k3.nvidia.reference.ops import bf16_add  # noqa: E402
from vllm.models.kimi_k3.nvidia.reference.ops import rms_norm as rms_norm_ref  # noqa: E402
from vllm.models.kimi_k3.nvidia.tests._pdl import check_pdl_order, late_copy, warmed  # noqa: E402
from vllm.models.kimi_k3.nvidia.tests._util import DISTRIBUTIONS, draw, rel_err  # noqa: E402

H = attn_res.HIDDEN
EPS = 1e-5
ROWS = (1, 2, 3, 8, 16, 33, 64)
REL_ERR_BOUND = 4e-3
ARCHS = ("sm_90a", "sm_100a", "sm_103a")
KERNEL_DIR = "vllm/models/kimi_k3/nvidia/kernels/"
TEST_FILE = "vllm/models/kimi_k3/nvidia/tests/test_norm_kernels.py"
SOURCES = {
    "norm": (KERNEL_DIR + "rms_norm.py", KERNEL_DIR + "rows.py", TEST_FILE),
    "attn_res": (KERNEL_DIR + "rows.py", KERNEL_DIR + "attn_res.py", TEST_FILE,
                 "vllm/models/kimi_k3/nvidia/tests/_pdl.py"),  # late_copy, in the PDL cases
    "embedding": (KERNEL_DIR + "rows.py", KERNEL_DIR + "embedding.py", TEST_FILE),
}


def _norm_weight(n: int, gen: torch.Generator, device: str = "cuda") -> torch.Tensor:
    """A trained-looking norm weight: around 1, never zero."""
    return (1.0 + 0.2 * torch.randn(n, generator=gen, device=device)).to(torch.bfloat16)


TINY_NORM_WIDTHS = (32, 64)  # the tiny eval model's q_a and latent MoE norms (evals/tiny)
SMALL_HIDDEN = (128, 200, 2048)  # AttnRes hidden sizes besides K3's: tiny's, spare lanes, the largest


def _nan(shape: tuple[int, ...], device: str = "cuda") -> torch.Tensor:
    return torch.full(shape, float("nan"), dtype=torch.bfloat16, device=device)


# ---------------------------------------------------------------- envelope (CPU)

def _bf(*shape: int) -> torch.Tensor:
    return torch.randn(*shape).to(torch.bfloat16)


@pytest.mark.parametrize("case, match", [
    ("dtype", "bfloat16"),
    ("rows", "M=65"),
    ("width", "D=1004 must be a multiple of 8"),
    ("wide", "D=8200 must be a multiple of 8 in 8..8192"),
    ("weight", "weight must be a [512]"),
    ("stride", "row stride"),
    ("cpu", "CUDA tensor"),
])
def test_rms_norm_envelope_errors(case, match):
    x, w = _bf(4, 512), _bf(512)
    if case == "dtype":
        x = x.float()
    elif case == "rows":
        x = _bf(65, 512)
    elif case == "width":
        x, w = _bf(4, 1004), _bf(1004)
    elif case == "wide":
        x, w = _bf(4, 8200), _bf(8200)
    elif case == "weight":
        w = _bf(256)
    elif case == "stride":
        x = _bf(4, 516)[:, :512]
    with pytest.raises(NormEnvelopeError, match=re.escape(match)):
        rms_norm.launch(x, w, EPS)


@pytest.mark.parametrize("case, match", [
    ("sources", "10 sources"),
    ("none", "0 sources"),
    ("rows", "M=65"),
    ("hidden", "H=4096"),
    ("dtype", "blocks must be bfloat16"),
    ("addend", "addend given without a prefix"),
    ("live", "live_out is only written"),
    ("mix", "mix_out (the rounded mixture before the norm) needs out_w"),
    ("slots", "n_blocks=3 but blocks has only 2 slots"),
    ("out_on_block", "out shares memory with blocks"),
    ("out_on_next_row", "out shares memory with prefix"),
    ("mix_on_out", "mix_out shares memory with out"),
])
def test_attn_res_envelope_errors(case, match):
    m = 2
    blocks, prefix, w = _bf(8, m, H), _bf(m, H), _bf(H)
    kw: dict = {"n_blocks": 3, "prefix": prefix}
    if case == "sources":
        blocks, kw["n_blocks"] = _bf(9, m, H), 9
    elif case == "none":
        kw.update(n_blocks=0, prefix=None)
    elif case == "rows":
        blocks, kw["prefix"] = _bf(8, 65, H), _bf(65, H)
    elif case == "hidden":
        blocks = _bf(8, m, 4096)
    elif case == "dtype":
        blocks = blocks.float()
    elif case == "addend":
        kw.update(prefix=None, addend=_bf(m, H))
    elif case == "live":
        kw["live_out"] = _bf(m, H)
    elif case == "mix":
        kw["mix_out"] = _bf(m, H)
    elif case == "slots":
        blocks = _bf(2, m, H)
    elif case == "out_on_block":  # slot 2 is a source (n_blocks=3)
        kw["out"] = blocks[2]
    elif case == "out_on_next_row":  # out's row 1 is the prefix's row 0: another cluster's source
        rows = _bf(m + 1, H)
        kw.update(prefix=rows[1:], out=rows[:m])
    elif case == "mix_on_out":
        kw.update(out=_bf(m, H), out_w=w)
        kw["mix_out"] = kw["out"]
    n_blocks, prefix = kw.pop("n_blocks"), kw.pop("prefix")
    with pytest.raises(NormEnvelopeError, match=re.escape(match)):
        attn_res.launch(blocks, n_blocks, prefix, w, w, EPS, **kw)


def test_attn_res_overlap_check_passes_interleaved_disjoint_rows():
    """Slots of one [M, 8, H] buffer interleave by row: out in slot 5 and live_out in slot 3 share
    no byte with the sources in slots 0-2, so only the device check (CPU tensors here) objects."""
    m, w = 2, _bf(H)
    buf = _bf(m, 8, H)
    with pytest.raises(NormEnvelopeError, match="must be a CUDA tensor"):
        attn_res.launch(buf.transpose(0, 1), 3, _bf(m, H), w, w, EPS, addend=_bf(m, H), live_out=buf[:, 3],
                        out=buf[:, 5])


@pytest.mark.parametrize("case, match", [
    ("ids", "int32 or int64"),
    ("rows", "M=65"),
    ("hidden", "H=4100 must be a multiple of 8"),
    ("out", "out must be [3, 7168]"),
])
def test_embedding_envelope_errors(case, match):
    ids, table, out = torch.tensor([1, 2, 3]), _bf(16, H), None
    if case == "ids":
        ids = ids.float()
    elif case == "rows":
        ids = torch.arange(65)
    elif case == "hidden":
        table = _bf(16, 4100)
    elif case == "out":
        out = _bf(2, H)
    with pytest.raises(NormEnvelopeError, match=re.escape(match)):
        embedding.launch(ids, table, 0, 163840, out)


def test_tilings_cover_the_envelope():
    for d in range(VEC, MAX_WIDTH + 1, VEC):
        p = rms_norm.RmsNormPlan.for_width(d, d, d)
        assert p.vecs * p.threads * VEC >= d and p.threads % 32 == 0 and p.threads <= 256
        # whole vectors of spare threads only: fewer vectors per thread would not fit 256 threads
        assert p.vecs == 1 or (p.vecs - 1) * 256 * VEC < d
        assert p.exact == (p.vecs * p.threads * VEC == d)
    assert all(rms_norm.RmsNormPlan.for_width(d, d, d).exact for d in rms_norm.NORM_WIDTHS)
    for t in attn_res.TILINGS.values():
        assert t.covers(H)
    for m in range(1, MAX_ROWS + 1):
        t = attn_res.choose_tiling(m, 132)
        assert t.covers(H) and t.exact(H) and t.split >= 2 and (m * t.split <= 132 or t.split == 2)
    for h in range(VEC, attn_res.MAX_SMALL_HIDDEN + 1, VEC):
        t = attn_res.choose_tiling(1, 132, h)
        assert t.split == 1 and t.vecs == 1 and t.covers(h) and t.exact(h) == (h % 256 == 0)


# ---------------------------------------------------------------- compile checks (CPU)

def _attn_res_plan(n_blocks: int, split: int, *, out_norm: bool = True, mix_out: bool = False) -> attn_res.AttnResPlan:
    return attn_res.AttnResPlan(H, n_blocks, H, 8 * H, True, H, True, H, True, H, out_norm, mix_out, H, H,
                                attn_res.TILINGS[split])


ATTN_RES_PLANS = {
    "attn_res 9 sources split 7": _attn_res_plan(8, 7, out_norm=False),
    "attn_res final+norm split 2": _attn_res_plan(8, 2, mix_out=True),
    "attn_res tiny H=128 final+norm, spare lanes": attn_res.AttnResPlan(
        128, 8, 128, 1024, True, 128, True, 128, True, 128, True, True, 128, 128, attn_res.choose_tiling(1, 132, 128)),
    # a block's first post-attention call: the attention output is the prefix, no addend
    "attn_res prefix without addend split 7": attn_res.AttnResPlan(
        H, 3, H, 8 * H, True, H, False, 0, False, 0, True, False, 0, H, attn_res.TILINGS[7]),
    # layer 0: the embedding alone, so no logits and only g loaded
    "attn_res one source split 7": attn_res.AttnResPlan(
        H, 1, H, 8 * H, False, 0, False, 0, False, 0, True, False, 0, H, attn_res.TILINGS[7]),
}

RMS_NORM_PLANS = {
    "rms_norm d=1536 strided": rms_norm.RmsNormPlan.for_width(1536, 2112, 1536),
    "rms_norm d=32 strided, spare lanes": rms_norm.RmsNormPlan.for_width(32, 96, 32),
}

COMPILE_CASES = {
    **{name: (lambda arch, ptx_dir, plan=plan: rms_norm.compile_rms_norm(plan, arch, ptx_dir))
       for name, plan in RMS_NORM_PLANS.items()},
    **{name: (lambda arch, ptx_dir, plan=plan: attn_res.compile_attn_res(plan, arch, ptx_dir))
       for name, plan in ATTN_RES_PLANS.items()},
    "embedding int64": lambda arch, ptx_dir: embedding.compile_embedding(
        embedding.EmbeddingPlan(10240, 8 * H, True, H), arch, ptx_dir),
    "embedding tiny H=128, spare lanes": lambda arch, ptx_dir: embedding.compile_embedding(
        embedding.EmbeddingPlan(160, 8 * 128, False, 128), arch, ptx_dir),
}


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("name", list(COMPILE_CASES))
def test_compiles_for_arch(arch, name, tmp_path):
    ptx = COMPILE_CASES[name](arch, str(tmp_path)).artifacts.PTX
    assert f".target {arch}" in ptx
    assert "ld.global.v4.b32" in ptx and "st.global.v4.b32" in ptx  # 16-byte accesses only
    assert not re.search(r"\b(ld|st)\.local", ptx), "registers spilled to local memory"
    assert not re.search(r"ld\.global\.(b|u|s)(16|8)\b", ptx), "narrow loads of row data"
    if name.startswith("attn_res") and "split" in name:  # cluster tilings (K3's H)
        assert "barrier.cluster.arrive.relaxed" in ptx  # armed before the loads
        assert "st.shared::cluster.f32" in ptx and "mapa.shared::cluster" in ptx  # partial sums pushed to peers
    if name in RMS_NORM_PLANS:
        check_pdl_order(ptx, RMS_NORM_PLANS[name].vecs)  # γ's vectors only
    if name in ATTN_RES_PLANS:
        plan = ATTN_RES_PLANS[name]
        # 16-byte weight vectors a thread loads: γ and w with more than one source, g with the norm
        check_pdl_order(ptx, plan.tiling.vecs * (2 * (plan.n_sources > 1) + plan.has_out_norm))


# ---------------------------------------------------------------- GPU checks

@pytest.fixture(scope="module")
def evidence():
    results: dict[str, list[dict]] = {"norm": [], "attn_res": [], "embedding": []}
    torch.backends.cuda.matmul.allow_tf32 = False  # the reference's v·c product in true fp32
    yield results
    where = os.environ.get("K3_EVIDENCE_DIR")
    for family, rows in results.items():
        if where and rows:
            write_record(os.path.join(where, f"{family}_test.json"), "kernel-test", family,
                         "K3_EVIDENCE_DIR=<dir> python -m pytest -q -m gpu " + TEST_FILE,
                         SOURCES[family], rows,
                         targets=[{"name": "every case within its bound, every output element written",
                                   "target": "all pass", "value": sum(r["status"] == "pass" for r in rows) / len(rows),
                                   "met": all(r["status"] == "pass" for r in rows)}],
                         extra={"rel_err_bound": REL_ERR_BOUND})


def _record(rows: list[dict], failures: list[str], name: str, rel: float, unwritten: int, bound: float = REL_ERR_BOUND,
            exact: bool | None = None, **extra) -> None:
    ok = unwritten == 0 and rel < bound and exact is not False
    rows.append({"name": name, "status": "pass" if ok else "fail", "rel_err": rel, "unwritten": unwritten,
                 **({"exact": exact} if exact is not None else {}), **extra})
    if not ok:
        failures.append(f"{name}: rel_err {rel:.2e} (bound {bound:.0e}), {unwritten} NaN left"
                        + ("" if exact is not False else ", not bit-exact"))


@pytest.mark.gpu
@pytest.mark.parametrize("d", (*rms_norm.NORM_WIDTHS, *TINY_NORM_WIDTHS, 200))
def test_rms_norm_matches_reference(d, evidence):
    gen = torch.Generator(device="cuda").manual_seed(d)
    failures: list[str] = []
    for dist in DISTRIBUTIONS:
        w = _norm_weight(d, gen)
        for m in ROWS:
            # the MLA latent norms read a column slice of the fused_a output: a strided row
            wide = draw(dist, (m, d + 64 if d <= 1536 else d), gen, "cuda")
            x = wide[:, 64:] if d <= 1536 else wide
            out = _nan((m, d))
            rms_norm.launch(x, w, EPS, out)
            ref = rms_norm_ref(x, w, EPS)
            _record(evidence["norm"], failures, f"rms_norm D={d} M={m} {dist}", rel_err(out, ref),
                    int(torch.isnan(out).sum()), shape={"m": m, "d": d, "x_row_stride": x.stride(0)},
                    distribution=dist)
    assert not failures, "; ".join(failures)


class _Layer:
    """One AttnRes call's inputs on an upstream-style [M, 8, H] block buffer, with source scales
    that differ (the embedding is small, block sums grow with depth)."""

    def __init__(self, m: int, dist: str, gen: torch.Generator, h: int = H):
        self.h = h
        self.buf = torch.empty((m, 8, h), dtype=torch.bfloat16, device="cuda")
        for j in range(8):
            self.buf[:, j] = draw(dist, (m, h), gen, "cuda") * (0.25 * (j + 1))
        self.blocks = self.buf.transpose(0, 1)  # [8, M, H] view, strides (H, 8H, 1)
        self.prefix = draw(dist, (m, h), gen, "cuda") * 2
        self.addend = draw(dist, (m, h), gen, "cuda")
        self.norm_w = _norm_weight(h, gen)
        # logits v·(γ⊙w)/RMS(v) of the same spread at every H
        self.proj_w = (0.02 * (H / h) ** 0.5 * torch.randn(h, generator=gen, device="cuda")).to(torch.bfloat16)
        self.out_w = _norm_weight(h, gen)

    def sources(self, n_blocks: int, live: torch.Tensor | None) -> list[torch.Tensor]:
        return [self.blocks[s] for s in range(n_blocks)] + ([live] if live is not None else [])


# (form, n_blocks): the call forms of K3_MATH.md §3.2's table
ATTN_RES_FORMS = (
    [("pre_attention", nb) for nb in range(1, 9)]  # e, S_0..S_{b-1}, bf16(Pr + m): prefix advanced in place
    + [("block_complete", nb) for nb in (1, 4, 7)]  # the advanced prefix becomes block slot n_blocks
    + [("layer0", 1), ("post_attention_fresh", 3), ("final", 8), ("final_with_norm", 8)]
)


def _run_attn_res(layer: _Layer, form: str, nb: int, tiling=None):
    """Launch one form; return (out, live (or None), mix_out (or None), reference out, reference live,
    reference mix)."""
    m = layer.prefix.shape[0]
    out = _nan((m, layer.h))
    kw: dict = {"out": out, "tiling": tiling}
    live_ref = mix_ref = None
    prefix = layer.prefix.clone()
    if form in ("pre_attention", "block_complete", "final", "final_with_norm"):
        kw["addend"] = layer.addend
        live_ref = bf16_add(prefix, layer.addend)
    if form == "pre_attention":
        kw["live_out"] = prefix  # in place
    elif form == "block_complete":
        layer.buf[:, nb] = float("nan")
        kw["live_out"] = layer.blocks[nb]
    if form not in ("final",):
        kw["out_w"] = layer.out_w
    if form == "final_with_norm":
        kw["mix_out"] = _nan((m, layer.h))
    if form == "layer0":
        attn_res.launch(layer.blocks, 1, None, layer.norm_w, layer.proj_w, EPS, **kw)
        ref = attn_res_mix(layer.sources(1, None), layer.norm_w, layer.proj_w, EPS, layer.out_w, EPS)
        return out, None, None, ref, None, None
    if form == "post_attention_fresh":
        live_ref = layer.addend  # the attention output starts the new block
        attn_res.launch(layer.blocks, nb, layer.addend, layer.norm_w, layer.proj_w, EPS, **kw)
    else:
        attn_res.launch(layer.blocks, nb, prefix, layer.norm_w, layer.proj_w, EPS, **kw)
    srcs = layer.sources(nb, live_ref)
    if form == "final":
        ref = attn_res_mix(srcs, layer.norm_w, layer.proj_w, EPS)
    elif form == "final_with_norm":
        mix_ref = attn_res_mix(srcs, layer.norm_w, layer.proj_w, EPS)
        ref = rms_norm_ref(mix_ref, layer.out_w, EPS)
    else:
        ref = attn_res_mix(srcs, layer.norm_w, layer.proj_w, EPS, layer.out_w, EPS)
    live = {"pre_attention": prefix, "block_complete": layer.blocks[nb] if nb < 8 else None}.get(form)
    return out, live, kw.get("mix_out"), ref, live_ref, mix_ref


def _score(out, live, mix, ref, live_ref, mix_ref) -> tuple[float, int, bool | None]:
    """(worst relative error of out and mix_out, NaN elements left in any output, live_out bit-exact
    or None) of one `_run_attn_res`."""
    unwritten = sum(int(torch.isnan(t).sum()) for t in (out, live, mix) if t is not None)
    rel = max(rel_err(out, ref), rel_err(mix, mix_ref) if mix is not None else 0.0)
    return rel, unwritten, None if live is None else torch.equal(live, live_ref)


@pytest.mark.gpu
@pytest.mark.parametrize("form, nb", ATTN_RES_FORMS, ids=[f"{f}-{nb}" for f, nb in ATTN_RES_FORMS])
def test_attn_res_matches_reference(form, nb, evidence):
    gen = torch.Generator(device="cuda").manual_seed(2000 + 17 * nb + len(form))
    failures: list[str] = []
    # every cluster split (7, 4, 2 by choose_tiling) on the single-call forms; pre_attention sweeps n_blocks
    rows = (1, 64) if form == "pre_attention" else (2, 33, 64)
    for dist in DISTRIBUTIONS:
        for m in rows:
            layer = _Layer(m, dist, gen)
            rel, unwritten, exact = _score(*_run_attn_res(layer, form, nb))
            _record(evidence["attn_res"], failures, f"attn_res {form} n_blocks={nb} M={m} {dist}", rel, unwritten,
                    exact=exact, shape={"m": m, "n_blocks": nb, "h": H}, form=form, distribution=dist,
                    tiling=attn_res.choose_tiling(m, torch.cuda.get_device_properties(0).multi_processor_count).split)
    assert not failures, "; ".join(failures)


@pytest.mark.gpu
@pytest.mark.parametrize("h", SMALL_HIDDEN)
def test_attn_res_small_hidden_matches_reference(h, evidence):
    """Every call form at hidden sizes other than K3's: one CTA per row, spare lanes off (H = 200:
    25 of 32 lanes; 2048: whole warps)."""
    gen = torch.Generator(device="cuda").manual_seed(5000 + h)
    failures: list[str] = []
    for form, nb in ATTN_RES_FORMS:
        for dist in DISTRIBUTIONS:
            for m in (1, 64):
                layer = _Layer(m, dist, gen, h)
                rel, unwritten, exact = _score(*_run_attn_res(layer, form, nb))
                _record(evidence["attn_res"], failures, f"attn_res H={h} {form} n_blocks={nb} M={m} {dist}", rel,
                        unwritten, exact=exact, shape={"m": m, "n_blocks": nb, "h": h}, form=form,
                        distribution=dist, tiling=1)
    assert not failures, "; ".join(failures)


@pytest.mark.gpu
@pytest.mark.parametrize("split", sorted(attn_res.TILINGS))
def test_attn_res_every_tiling_and_repeatable(split, evidence):
    """Each cluster split gives the reference result, and repeat launches are bit-identical (the
    cross-CTA sums have a fixed order)."""
    gen = torch.Generator(device="cuda").manual_seed(3000 + split)
    failures: list[str] = []
    tiling = attn_res.TILINGS[split]
    for m in (1, 7, 18):
        layer = _Layer(m, "normal", gen)
        out, live, _, ref, live_ref, _ = _run_attn_res(layer, "pre_attention", 8, tiling)
        again, _, _, _, _, _ = _run_attn_res(layer, "pre_attention", 8, tiling)
        _record(evidence["attn_res"], failures, f"attn_res split={split} M={m} repeat", rel_err(out, ref),
                int(torch.isnan(out).sum()), exact=torch.equal(out, again) and torch.equal(live, live_ref),
                shape={"m": m, "n_blocks": 8, "h": H}, tiling=split)
    assert not failures, "; ".join(failures)


@pytest.mark.gpu
@pytest.mark.parametrize("graphed", [False, True], ids=["eager", "graph"])
@pytest.mark.parametrize("late", ["block slot", "prefix", "addend"])
@pytest.mark.parametrize("m", [1, 64])
def test_attn_res_reads_what_the_kernel_before_writes(m, late, graphed, evidence):
    """Launched as a PDL dependent, AttnRes may start while the kernel before it still runs, and
    may read only its weights then. A producer that releases its dependents at once, spins about
    1 ms and then writes one activation (`_pdl.late_copy`, whose window
    `test_window_exists` proves) must not be outrun: a block slot (layer 0 reads the embedding its
    kernel has just written), the prefix (the attention output that starts a block) or the addend
    (the sub-layer output the other calls add). M = 1 and 64 run the 7- and 2-CTA clusters."""
    gen = torch.Generator(device="cuda").manual_seed(6000 + m + ("block slot", "prefix", "addend").index(late))
    blocks = torch.stack([draw("normal", (m, H), gen, "cuda") * (j + 1) for j in range(2)])  # slots contiguous
    prefix, addend = draw("normal", (m, H), gen, "cuda"), draw("normal", (m, H), gen, "cuda")
    norm_w, out_w = _norm_weight(H, gen), _norm_weight(H, gen)
    proj_w = (0.02 * torch.randn(H, generator=gen, device="cuda")).to(torch.bfloat16)
    target = {"block slot": blocks[0], "prefix": prefix, "addend": addend}[late]
    new, old = target.clone(), draw("large", (m, H), gen, "cuda")  # the old value would dominate the mixture
    out, live = _nan((m, H)), _nan((m, H))

    def call(out: torch.Tensor, live: torch.Tensor) -> None:
        attn_res.launch(blocks, 2, prefix, norm_w, proj_w, EPS, addend=addend, live_out=live, out_w=out_w, out=out)

    def step():
        late_copy(new, target)
        call(out, live)

    run = warmed(step, graphed)
    target.copy_(old)
    stale = _nan((m, H))
    call(stale, _nan((m, H)))
    out.fill_(float("nan"))
    live.fill_(float("nan"))
    torch.cuda.synchronize()
    run()
    torch.cuda.synchronize()
    assert torch.equal(target, new), "the producer did not write what it was given"
    live_ref = bf16_add(prefix, addend)
    ref = attn_res_mix([blocks[0], blocks[1], live_ref], norm_w, proj_w, EPS, out_w, EPS)
    gap = rel_err(stale, ref)
    failures: list[str] = []
    _record(evidence["attn_res"], failures, f"attn_res PDL M={m} {late} written late, {'graph' if graphed else 'eager'}",
            rel_err(out, ref), int(torch.isnan(out).sum() + torch.isnan(live).sum()),
            exact=torch.equal(live, live_ref), stale_rel_err=gap, shape={"m": m, "n_blocks": 2, "h": H}, late=late)
    assert gap > 10 * REL_ERR_BOUND, f"old and new {late} too alike to tell apart ({gap:.2e})"
    assert not failures, "; ".join(failures) + f" (a stale read gives {gap:.2e})"


@pytest.mark.gpu
@pytest.mark.parametrize("ids_dtype", [torch.int64, torch.int32])
@pytest.mark.parametrize("model, tp, rank", [("k3", 16, 3), ("tiny", 1, 0)])
def test_embedding_matches_reference(ids_dtype, model, tp, rank, evidence):
    cfg = config_named(model)
    shard, h = cfg.shard(tp, rank), cfg.hidden_size
    gen = torch.Generator(device="cuda").manual_seed(4000)
    table = draw("normal", (shard.vocab, h), gen, "cuda")
    failures: list[str] = []
    for m in ROWS:
        # ids of this rank, of other ranks, negative (padding) and past the vocabulary
        mine = torch.randint(shard.vocab_start, shard.vocab_start + shard.vocab, (m,), generator=gen, device="cuda")
        other = torch.randint(0, cfg.vocab_size, (m,), generator=gen, device="cuda")
        bad = torch.tensor([-1, cfg.vocab_size, cfg.vocab_size + 5, shard.vocab_start - 1], device="cuda")
        pick = torch.randint(0, 3, (m,), generator=gen, device="cuda")
        ids = torch.where(pick == 0, mine, torch.where(pick == 1, other, bad[torch.arange(m, device="cuda") % 4]))
        ids = ids.to(ids_dtype)
        buf = _nan((m, 8, h))  # write straight into slot 0 of an AttnRes block buffer
        embedding.launch(ids, table, shard.vocab_start, cfg.vocab_size, buf[:, 0])
        ref = embed(ids.long(), table, shard, cfg.vocab_size, SingleRank(tp, rank))
        got = buf[:, 0]
        name = f"embedding M={m} ids={str(ids_dtype).removeprefix('torch.')}" + ("" if model == "k3" else f" {model}")
        _record(evidence["embedding"], failures, name,
                0.0 if torch.equal(got, ref) else rel_err(got, ref), int(torch.isnan(got).sum()),
                exact=torch.equal(got, ref), shape={"m": m, "shard_rows": shard.vocab, "h": h},
                untouched_slots_still_nan=bool(torch.isnan(buf[:, 1:]).all()))
        if not torch.isnan(buf[:, 1:]).all():
            failures.append(f"M={m}: wrote outside slot 0")
    assert not failures, "; ".join(failures)


@pytest.mark.gpu
def test_cuda_graph_capture_and_replay():
    """All three kernels record into one CUDA graph (capture runs nothing) and replay on new inputs
    written in place."""
    gen = torch.Generator(device="cuda").manual_seed(5000)
    m = 6
    layer = _Layer(m, "normal", gen)
    x, w = draw("normal", (m, 3584), gen, "cuda"), _norm_weight(3584, gen)
    table = draw("normal", (1000, H), gen, "cuda")
    ids = torch.tensor([3, 999, 1000, -1, 0, 17], device="cuda")
    outs = [_nan((m, 3584)), _nan((m, H)), _nan((m, H))]
    prefix = layer.prefix.clone()

    def step():
        rms_norm.launch(x, w, EPS, outs[0])
        attn_res.launch(layer.blocks, 5, prefix, layer.norm_w, layer.proj_w, EPS, addend=layer.addend,
                        out_w=layer.out_w, out=outs[1])
        embedding.launch(ids, table, 0, 1000, outs[2])

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step()  # compile outside the capture
        torch.cuda.synchronize()
        for t in outs:
            t.fill_(float("nan"))
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            step()
    torch.cuda.synchronize()
    assert all(torch.isnan(t).all() for t in outs), "capture ran a kernel instead of recording it"
    x.copy_(draw("large", (m, 3584), gen, "cuda"))
    prefix.copy_(draw("normal", (m, H), gen, "cuda"))
    ids.copy_(torch.tensor([5, 0, 999, 2000, -7, 1], device="cuda"))
    graph.replay()
    torch.cuda.synchronize()
    assert rel_err(outs[0], rms_norm_ref(x, w, EPS)) < REL_ERR_BOUND
    ref = attn_res_mix(layer.sources(5, bf16_add(prefix, layer.addend)), layer.norm_w, layer.proj_w, EPS,
                       layer.out_w, EPS)
    assert rel_err(outs[1], ref) < REL_ERR_BOUND
    shard = dataclasses.replace(PRESETS["k3"].shard(1, 0), vocab=1000)  # a 1000-row table
    assert torch.equal(outs[2], embed(ids, table, shard, 1000, SingleRank(1, 0)))
