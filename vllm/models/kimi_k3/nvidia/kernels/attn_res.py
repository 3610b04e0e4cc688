"""AttnRes for decode: each K3 layer's input formed in one pass over its sources (K3_MATH.md §3.2).

Sources are the first `n_blocks` slots of the block buffer (e, S_0, S_1, ...) followed, when
given, by the live prefix; with an `addend` the prefix is first advanced by one sub-layer output
and rounded, exactly as the running sums of §3.2 (`Pr' = bf16(Pr + Δ)`):

    live   = bf16(prefix + addend)                       (or prefix; stored to live_out)
    c      = γ ⊙ w                                        (fp32, exact product of two bf16)
    ℓ_s    = (v_s · c) / RMS_ε(v_s)                       (fp32)
    p      = softmax(ℓ)                                   (fp32, max-subtracted)
    mix    = Σ_s p_s v_s                                  (fp32, raw sources)
    out    = bf16(mix / RMS_ε'(mix) ⊙ g)      with out_w = g (pre-attention / MLP input)
    out    = bf16(mix)                        without out_w (final AttnRes)
    mix_out = bf16(mix), out = bf16(mix_out / RMS_ε'(mix_out) ⊙ g)
                                              with out_w and mix_out (final AttnRes fused with the
                                              final norm: two roundings, §8 item 3)

Reference: `reference/attn_res.py::attn_res_mix` on the source list, after
`reference/ops.py::bf16_add` for the prefix and `reference/ops.py::rms_norm` for the final norm.

Envelope: H = 7168 (K3), or H % 8 = 0 with H <= 2048 (the tiny eval model's 128: one CTA of whole
warps per row, spare lanes predicated off); 1 <= M <= 64 rows; 1..9 sources. `blocks` is any `[slots, M, H]` BF16 view
with H contiguous (upstream's `[M, 8, H]` buffer passes as `buf.transpose(0, 1)`); prefix,
addend, live_out, mix_out and out are `[M, H]` BF16 with contiguous rows (any row stride that is
a multiple of 8, so live_out may be a block slot `buf[:, j]` when a block completes); γ, w, g are
contiguous `[H]` BF16. live_out may be the prefix itself (in-place update: each element is read
and written by one thread); out and mix_out may share no byte with a source, the addend,
live_out or each other (checked: rows of other clusters are read while these are written). Compiles for sm_90a,
sm_100a, sm_103a (thread-block clusters: sm_90 and later).

Design: every source byte is read once. A row is cut into `split` column ranges, one CTA each,
launched as one cluster; a thread keeps its 16-byte vectors of all sources in registers from the
load to the mixture. The 2S partial sums (v·c and v·v per source) meet in one `block_sums` call
(butterfly, shared memory, then distributed shared memory across the cluster, fixed order, so
every CTA of the row computes bit-identical softmax weights); the output norm needs one more
(a single value). split > 1 keeps more SMs pulling at small M. The cluster's start-up barrier is
armed before the loads and waited on after them, so it costs no latency.

PDL: launched as a dependent of the kernel before it (like the skinny GEMM), so its clusters are
placed and its weights γ, w, g (constants of the graph) loaded while that kernel finishes; then
`griddepcontrol.wait`, and only after it any read of an activation (block slots, prefix, addend)
or write. The wait covers every kernel the launch depends on, not only the one before: each PDL
dependent of the step waits in at least one CTA before it can finish (in every CTA but the MoE
down pass's non-leaders, which read only the ids, and the combine after them waits in every CTA),
so no grid finishes before those it depends on; the graph lanes join before the next AttnRes.

The host `launch` checks the envelope before touching the GPU, compiles once per static variant
(which inputs are present, strides, n_blocks, tiling, arch), then only launches, on an explicit
stream (CUDA-graph capturable).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
import torch
from cutlass import BFloat16, Constexpr, Float32, Int32, const_expr

from .device import facts
from .rows import (
    VEC,
    block_sums,
    check_devices,
    check_row_count,
    check_rows,
    check_vector,
    copy_if,
    current_stream,
    gmem_ptr,
    need,
    pow2_at_least,
    row_split,
    row_vectors,
)

HIDDEN = 7168  # K3's hidden size, with its cluster tilings below
MAX_SMALL_HIDDEN = 2048  # other hidden sizes: one CTA per row, one vector per thread and source
MAX_SOURCES = 9  # e, S_0..S_6 and the live prefix of the final AttnRes


@dataclass(frozen=True)
class AttnResTiling:
    split: int  # CTAs (one cluster) per row
    vecs: int  # 16-byte vectors per thread and source
    threads: int

    def __post_init__(self) -> None:
        if self.threads % 32 or not 32 <= self.threads <= 1024 or not 1 <= self.split <= 8:
            raise ValueError(f"{self}: threads must be whole warps (32..1024), split 1..8")

    def covers(self, h: int) -> bool:
        """Each CTA's h / 8 / split vectors fill its last vector round (spare lanes only there)."""
        part = h // VEC // self.split
        return h % (VEC * self.split) == 0 and (self.vecs - 1) * self.threads < part <= self.vecs * self.threads

    def exact(self, h: int) -> bool:
        return self.split * self.vecs * self.threads * VEC == h


# the tilings of H = 7168 (896 vectors) in whole warps, by split. No split 1: at M <= 64 two CTAs
# per row always fit the SMs, and one CTA holding all 9 sources of 896 vectors needs more
# registers than 64K / threads (ptxas spills at every vecs/threads choice)
TILINGS = {2: AttnResTiling(2, 1, 448), 4: AttnResTiling(4, 1, 224), 7: AttnResTiling(7, 1, 128)}


def choose_tiling(m: int, sm_count: int, h: int = HIDDEN) -> AttnResTiling:
    """K3's H: the widest split whose CTAs (M · split) still fit one per SM (at least two per row).
    A small H: one CTA per row (`row_split`)."""
    if h != HIDDEN:
        return AttnResTiling(1, *row_split(h))
    for split in (7, 4):
        if m * split <= sm_count:
            return TILINGS[split]
    return TILINGS[2]


@dataclass(frozen=True)
class AttnResPlan:
    """Everything static about one compiled variant (strides in elements)."""

    h: int
    n_blocks: int
    slot_stride: int
    block_row_stride: int
    has_prefix: bool
    prefix_stride: int
    has_addend: bool
    addend_stride: int
    has_live_out: bool
    live_stride: int
    has_out_norm: bool
    has_mix_out: bool
    mix_stride: int
    out_stride: int
    tiling: AttnResTiling

    @property
    def n_sources(self) -> int:
        return self.n_blocks + int(self.has_prefix)


@cute.jit
def _load_row_vectors(view: cute.Tensor, row: Int32, col0: Int32, threads: Constexpr, vecs: Constexpr, ok: list,
             exact: Constexpr) -> cute.Tensor:
    """This thread's `vecs` vectors of `row` of a `row_vectors` view, in registers (zeros where a
    spare lane has none). `ok[v]`: whether vector v exists (True, or a DSL predicate)."""
    regs = cute.make_rmem_tensor(cute.make_layout((VEC, vecs)), BFloat16)
    if const_expr(not exact):
        regs.fill(0.0)
    for v in cutlass.range_constexpr(vecs):
        copy_if(view[(0, None), (row, col0 + v * threads)], regs[None, v], ok[v], exact)
    return regs


@cute.kernel
def _attn_res_kernel(blk_ptr: cute.Pointer, pre_ptr: cute.Pointer, add_ptr: cute.Pointer, live_ptr: cute.Pointer,
                     nw_ptr: cute.Pointer, pw_ptr: cute.Pointer, ow_ptr: cute.Pointer, out_ptr: cute.Pointer,
                     mix_ptr: cute.Pointer, m: Int32, eps: Float32, out_eps: Float32, plan: Constexpr):
    cute.arch.griddepcontrol_launch_dependents()  # a PDL-launched GEMM may start its W loads (skinny_gemm.py)
    tid, _, _ = cute.arch.thread_idx()
    part, row, _ = cute.arch.block_idx()
    t = plan.tiling
    split, vecs, threads = t.split, t.vecs, t.threads
    if const_expr(split > 1):
        cute.arch.cluster_arrive_relaxed()
    h = plan.h
    n_src = plan.n_sources
    col0 = part * (h // VEC // split) + tid  # this thread's first vector; the others every `threads`
    exact = t.exact(h)
    ok = [True] * vecs  # which of this thread's vectors exist (all of them when the tiling is exact)
    if const_expr(not exact):
        ok = [tid + v * threads < h // VEC // split for v in range(vecs)]

    smem = cutlass.memory.SmemAllocator()
    warps = threads // 32
    # the weights are the graph's constants, so they load while the previous kernel finishes; every
    # activation (sources, prefix, addend) is read, and every output written, after the wait
    if const_expr(n_src > 1):
        nwr = _load_row_vectors(row_vectors(nw_ptr, 1, h, h), 0, col0, threads, vecs, ok, exact)
        pwr = _load_row_vectors(row_vectors(pw_ptr, 1, h, h), 0, col0, threads, vecs, ok, exact)
    if const_expr(plan.has_out_norm):
        owr = _load_row_vectors(row_vectors(ow_ptr, 1, h, h), 0, col0, threads, vecs, ok, exact)

    cute.arch.griddepcontrol_wait()

    src = cute.make_rmem_tensor(cute.make_layout((VEC, vecs, n_src)), BFloat16)
    if const_expr(not exact):
        src.fill(0.0)  # spare vectors add nothing to the sums
    if const_expr(plan.n_blocks > 0):
        blk = cute.zipped_divide(
            cute.make_tensor(blk_ptr, cute.make_layout((plan.n_blocks, m, h),
                                                       stride=(plan.slot_stride, plan.block_row_stride, 1))),
            (1, 1, VEC))
        for s in cutlass.range_constexpr(plan.n_blocks):
            for v in cutlass.range_constexpr(vecs):
                copy_if(blk[(0, 0, None), (s, row, col0 + v * threads)], src[None, v, s], ok[v], exact)
    if const_expr(plan.has_prefix):
        pre = row_vectors(pre_ptr, m, h, plan.prefix_stride)
        if const_expr(plan.has_addend):
            pr = _load_row_vectors(pre, row, col0, threads, vecs, ok, exact)
            ad = _load_row_vectors(row_vectors(add_ptr, m, h, plan.addend_stride), row, col0, threads, vecs, ok, exact)
            src[None, None, n_src - 1].store((pr.load().to(Float32) + ad.load().to(Float32)).to(BFloat16))
            if const_expr(plan.has_live_out):
                live = row_vectors(live_ptr, m, h, plan.live_stride)
                for v in cutlass.range_constexpr(vecs):
                    copy_if(src[None, v, n_src - 1], live[(0, None), (row, col0 + v * threads)], ok[v], exact)
        else:
            for v in cutlass.range_constexpr(vecs):
                copy_if(pre[(0, None), (row, col0 + v * threads)], src[None, v, n_src - 1], ok[v], exact)

    if const_expr(n_src > 1):
        n_sums = 2 * n_src
        red = smem.allocate_tensor(Float32, cute.make_layout((n_sums, warps)), byte_alignment=16)
        fin = smem.allocate_tensor(Float32, cute.make_layout((n_sums, split)), byte_alignment=16)
        c = nwr.load().to(Float32) * pwr.load().to(Float32)
        sums = cute.make_rmem_tensor(cute.make_layout(pow2_at_least(n_sums)), Float32)
        sums.fill(0.0)
        for s in cutlass.range_constexpr(n_src):
            vf = src[None, None, s].load().to(Float32)
            sums[2 * s] = (vf * c).reduce(cute.ReductionOp.ADD, init_val=0.0, reduction_profile=0)
            sums[2 * s + 1] = (vf * vf).reduce(cute.ReductionOp.ADD, init_val=0.0, reduction_profile=0)
        if const_expr(split > 1):
            cute.arch.cluster_wait()
        block_sums(sums, red, fin, part, n_sums, warps, split)
        logits = cute.make_rmem_tensor(cute.make_layout(n_src), Float32)
        for s in cutlass.range_constexpr(n_src):
            logits[s] = sums[2 * s] * cute.math.rsqrt(sums[2 * s + 1] * (1.0 / h) + eps)
        top = logits[0]
        for s in cutlass.range_constexpr(1, n_src):
            top = cute.arch.fmax(top, logits[s])
        total = Float32(0.0)
        for s in cutlass.range_constexpr(n_src):
            logits[s] = cute.math.exp(logits[s] - top)
            total += logits[s]
        mix = src[None, None, 0].load().to(Float32) * (logits[0] / total)
        for s in cutlass.range_constexpr(1, n_src):
            mix = mix + src[None, None, s].load().to(Float32) * (logits[s] / total)
    else:
        if const_expr(split > 1):
            cute.arch.cluster_wait()
        mix = src[None, None, 0].load().to(Float32)

    res = cute.make_rmem_tensor(cute.make_layout((VEC, vecs)), BFloat16)
    if const_expr(plan.has_out_norm):
        if const_expr(plan.has_mix_out):
            res.store(mix.to(BFloat16))
            mix_out = row_vectors(mix_ptr, m, h, plan.mix_stride)
            for v in cutlass.range_constexpr(vecs):
                copy_if(res[None, v], mix_out[(0, None), (row, col0 + v * threads)], ok[v], exact)
            mix = res.load().to(Float32)
        red2 = smem.allocate_tensor(Float32, cute.make_layout((1, warps)), byte_alignment=16)
        fin2 = smem.allocate_tensor(Float32, cute.make_layout((1, split)), byte_alignment=16)
        sq = cute.make_rmem_tensor(cute.make_layout(1), Float32)
        sq[0] = (mix * mix).reduce(cute.ReductionOp.ADD, init_val=0.0, reduction_profile=0)
        block_sums(sq, red2, fin2, part, 1, warps, split)
        rrms = cute.math.rsqrt(sq[0] * (1.0 / h) + out_eps)
        res.store((mix * rrms * owr.load().to(Float32)).to(BFloat16))
    else:
        res.store(mix.to(BFloat16))
    out = row_vectors(out_ptr, m, h, plan.out_stride)
    for v in cutlass.range_constexpr(vecs):
        copy_if(res[None, v], out[(0, None), (row, col0 + v * threads)], ok[v], exact)


@cute.jit
def _attn_res_host(blk_ptr: cute.Pointer, pre_ptr: cute.Pointer, add_ptr: cute.Pointer, live_ptr: cute.Pointer,
                   nw_ptr: cute.Pointer, pw_ptr: cute.Pointer, ow_ptr: cute.Pointer, out_ptr: cute.Pointer,
                   mix_ptr: cute.Pointer, m: Int32, eps: Float32, out_eps: Float32, stream: cuda.CUstream,
                   plan: Constexpr):
    t = plan.tiling
    kernel = _attn_res_kernel(blk_ptr, pre_ptr, add_ptr, live_ptr, nw_ptr, pw_ptr, ow_ptr, out_ptr, mix_ptr,
                              m, eps, out_eps, plan)
    if const_expr(t.split > 1):
        kernel.launch(grid=(t.split, m, 1), block=(t.threads, 1, 1), cluster=(t.split, 1, 1), stream=stream,
                      use_pdl=True)
    else:
        kernel.launch(grid=(1, m, 1), block=(t.threads, 1, 1), stream=stream, use_pdl=True)


def compile_attn_res(plan: AttnResPlan, arch: str, ptx_dir: str | None = None) -> Any:
    """Compile one variant for `arch` ('sm_90a', 'sm_100a', 'sm_103a'); needs no GPU. With `ptx_dir`
    the PTX is kept (written there, and in the result's `artifacts.PTX`)."""
    p = gmem_ptr(BFloat16, 16)
    return cute.compile(_attn_res_host, p, p, p, p, p, p, p, p, p, Int32(1), Float32(1e-5), Float32(1e-5),
                        cute.runtime.make_fake_stream(), plan,
                        options=f"--gpu-arch {arch}" + (f" --keep-ptx --dump-dir {ptx_dir}" if ptx_dir else ""))


def _check(blocks: torch.Tensor | None, n_blocks: int, prefix: torch.Tensor | None, norm_w: torch.Tensor,
           proj_w: torch.Tensor, addend: torch.Tensor | None, live_out: torch.Tensor | None,
           out_w: torch.Tensor | None, mix_out: torch.Tensor | None, out: torch.Tensor | None) -> tuple[int, int]:
    """Raise NormEnvelopeError naming what is outside the envelope (no GPU work); return (M, H)."""
    k = "attn_res"
    need(isinstance(n_blocks, int) and n_blocks >= 0, k, f"n_blocks must be an int >= 0, got {n_blocks!r}")
    n_src = n_blocks + (prefix is not None)
    need(1 <= n_src <= MAX_SOURCES, k, f"{n_src} sources (n_blocks={n_blocks}, prefix "
         f"{'given' if prefix is not None else 'None'}); AttnRes mixes 1..{MAX_SOURCES}")
    if n_blocks > 0:
        need(isinstance(blocks, torch.Tensor) and blocks.dim() == 3, k,
             "blocks must be a [slots, M, H] tensor (an [M, 8, H] buffer passes as buf.transpose(0, 1))")
        need(blocks.shape[0] >= n_blocks, k, f"n_blocks={n_blocks} but blocks has only {blocks.shape[0]} slots")
        need(blocks.dtype == torch.bfloat16, k, f"blocks must be bfloat16, got {blocks.dtype}")
        need(blocks.stride(2) == 1 and blocks.stride(0) % VEC == 0 and blocks.stride(1) % VEC == 0
             and blocks.data_ptr() % 16 == 0, k,
             f"blocks must have H contiguous, slot and row strides multiples of 8 and 16-byte alignment "
             f"(got strides {tuple(blocks.stride())})")
        m, h = blocks.shape[1], blocks.shape[2]
    else:
        need(isinstance(prefix, torch.Tensor) and prefix.dim() == 2, k, "prefix must be a [M, H] tensor")
        m, h = prefix.shape
    need(h == HIDDEN or (h % VEC == 0 and VEC <= h <= MAX_SMALL_HIDDEN), k,
         f"H={h}: the kernel takes K3's H={HIDDEN} or a multiple of {VEC} up to {MAX_SMALL_HIDDEN}")
    check_row_count(k, m)
    if prefix is not None:
        check_rows(k, "prefix", prefix, m, h)
    need(addend is None or prefix is not None, k, "addend given without a prefix to add it to")
    need(live_out is None or addend is not None, k, "live_out is only written when an addend advances the prefix")
    need(mix_out is None or out_w is not None, k, "mix_out (the rounded mixture before the norm) needs out_w")
    for name, t in (("addend", addend), ("live_out", live_out), ("mix_out", mix_out), ("out", out)):
        if t is not None:
            check_rows(k, name, t, m, h)
    for name, t in (("norm_w", norm_w), ("proj_w", proj_w), ("out_w", out_w)):
        if t is not None:
            check_vector(k, name, t, h)
    if out is not None or mix_out is not None:
        _check_disjoint(k, {"blocks": blocks if n_blocks else None, "prefix": prefix, "addend": addend,
                            "live_out": live_out}, n_blocks, {"out": out, "mix_out": mix_out})
    check_devices(k, {"blocks": blocks if n_blocks else None, "prefix": prefix, "addend": addend,
                      "live_out": live_out, "mix_out": mix_out, "out": out, "norm_w": norm_w, "proj_w": proj_w,
                      "out_w": out_w})
    return m, h


def _row_spans(t: torch.Tensor, slots: int | None = None) -> list[tuple[int, int]]:
    """The byte ranges of the rows `t` holds: [M, H] rows, or the first `slots` slots of [slots, M, H]."""
    h, size, base = t.shape[-1], t.element_size(), t.data_ptr()
    if t.dim() == 2:
        starts = [r * t.stride(0) for r in range(t.shape[0])]
    else:
        starts = [s * t.stride(0) + r * t.stride(1) for s in range(slots) for r in range(t.shape[1])]
    return sorted((base + e * size, base + (e + h) * size) for e in starts)


def _overlap(a: list[tuple[int, int]], b: list[tuple[int, int]]) -> bool:
    """Whether two sorted lists of byte ranges share a byte."""
    i = j = 0
    while i < len(a) and j < len(b):
        if a[i][1] <= b[j][0]:
            i += 1
        elif b[j][1] <= a[i][0]:
            j += 1
        else:
            return True
    return False


def _check_disjoint(k: str, read: dict[str, torch.Tensor | None], n_blocks: int,
                    written: dict[str, torch.Tensor | None]) -> None:
    """Each written tensor shares no byte with what the launch reads or writes besides it."""
    seen = {name: _row_spans(t, n_blocks if name == "blocks" else None) for name, t in read.items() if t is not None}
    for name, t in written.items():
        if t is None:
            continue
        spans = _row_spans(t)
        for other, theirs in seen.items():
            need(not _overlap(spans, theirs), k, f"{name} shares memory with {other}: its rows are written while "
                 f"other clusters may still access theirs; give {name} a buffer of its own")
        seen[name] = spans


_COMPILED: dict[tuple[AttnResPlan, str], Any] = {}


def launch(blocks: torch.Tensor | None, n_blocks: int, prefix: torch.Tensor | None, norm_w: torch.Tensor,
           proj_w: torch.Tensor, eps: float, *, addend: torch.Tensor | None = None,
           live_out: torch.Tensor | None = None, out_w: torch.Tensor | None = None, out_eps: float | None = None,
           mix_out: torch.Tensor | None = None, out: torch.Tensor | None = None,
           stream: torch.cuda.Stream | None = None, tiling: AttnResTiling | None = None) -> torch.Tensor:
    """One AttnRes call (module docstring) into `out` (allocated when None) on `stream`.

    Sources: blocks[0..n_blocks) then the live prefix (prefix, or bf16(prefix + addend), stored
    to live_out). The first call of a variant compiles (about a second); later calls only launch.
    `tiling` overrides the heuristic (benchmarks compare them).
    """
    m, h = _check(blocks, n_blocks, prefix, norm_w, proj_w, addend, live_out, out_w, mix_out, out)
    anchor = blocks if n_blocks else prefix
    dev = anchor.device
    if out is None:
        out = torch.empty((m, h), dtype=torch.bfloat16, device=dev)
    tiling = tiling or choose_tiling(m, facts(dev).sm_count, h)
    need(tiling.covers(h), "attn_res", f"{tiling} does not tile H={h}")

    def stride(t: torch.Tensor | None, dim: int = 0) -> int:
        return t.stride(dim) if t is not None else 0

    plan = AttnResPlan(h, n_blocks, stride(blocks if n_blocks else None, 0), stride(blocks if n_blocks else None, 1),
                       prefix is not None, stride(prefix), addend is not None, stride(addend),
                       live_out is not None, stride(live_out), out_w is not None, mix_out is not None,
                       stride(mix_out), out.stride(0), tiling)
    key = (plan, facts(dev).arch)
    fn = _COMPILED.get(key)
    if fn is None:
        fn = _COMPILED[key] = compile_attn_res(plan, key[1])

    def ptr(t: torch.Tensor | None) -> cute.Pointer:
        return gmem_ptr(BFloat16, (t if t is not None else out).data_ptr())  # absent inputs are never read

    fn(ptr(blocks if n_blocks else None), ptr(prefix), ptr(addend), ptr(live_out), ptr(norm_w), ptr(proj_w),
       ptr(out_w), ptr(out), ptr(mix_out), m, eps, eps if out_eps is None else out_eps, current_stream(dev, stream))
    return out

