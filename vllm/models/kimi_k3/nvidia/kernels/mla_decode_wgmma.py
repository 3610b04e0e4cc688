"""MLA absorbed decode attention for verify steps on Hopper: `mla_decode`'s split kernel on wgmma.

Math, schedule, workspace, combine and PDL launch are `mla_decode`'s (its docstring), for a plan with
`mma="wgmma"`: s = τ · q_lat · kv_t, online softmax with FP32 statistics, ol = Σ p c_t with FP32
accumulators, the weights p rounded to bf16 for P·V and summed unrounded.

Envelope: `mla_decode.launch`'s, on sm_90a only (wgmma); `choose_plan` takes it there for more
than 32 query rows a request (heads × tokens: speculative verify, 6 or 12 heads × 8 tokens at
TP16 / TP8). Evidence: `mla_decode`'s records (their sources include this file).

Design. At 48-96 query rows the mma.sync kernel is bound by its shared-memory port, not by HBM:
every warp reloads every Q fragment of every chunk through ldmatrix (442 KB of shared reads per
74 KB chunk at 48 rows). wgmma reads both operands from shared memory once per warpgroup.
- CTA = two warpgroups on one work unit (request, 64-row query tile, KV split), streaming the
  split in 64-token chunks through a 2-stage cp.async ring (the cache rows gathered through the
  block table; rows past the split's end repeat its last row, so every value read is finite, and
  their scores are masked). The next chunk's copies issue after the scores' wgmma is committed,
  before its wait, so the tensor cores score while the threads issue them (13.6% faster than
  issuing them first at 12 heads × 8 tokens with 8 requests × 128K on the H100). The query tile [64, 576] and each stage [64, 576] are K-major with
  128-byte swizzle (`sm90.make_smem_layout_a/b`); each thread fences its copies to the async
  proxy before the barrier that hands a stage to the MMAs.
- Warpgroup g scores tokens 32·g .. 32·g + 31 of the chunk (S = Q · Kᵀ, 36 k16 steps of
  m64n32). The row maxima meet in shared memory (named barrier 1, both warpgroups); then the
  chunk's rope columns 512..575, which P·V does not read, hold the bf16 weights P [64, 64] as
  P·V's K-major A operand (named barrier 2), and warpgroup g accumulates value columns
  256·g .. 256·g + 255 (128 FP32 registers a thread) from all 64 tokens.
- V needs no copy: a K-major 128-byte-swizzled [tokens, 64] block and an MN-major [64, tokens]
  one place every element alike, so P·V's B operand views the stage's latent columns
  (`test_wgmma_smem_layouts_agree` checks it on the CPU).
- Row sums stay per thread until the end, then meet across the quad and the two warpgroups.
"""

from __future__ import annotations

from typing import Any

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
import cutlass.utils.hopper_helpers as sm90
from cutlass import BFloat16, Constexpr, Float32, Int32
from cutlass.cute.nvgpu import OperandMajorMode, warpgroup
from cutlass.tensor_utils import LayoutEnum  # cutlass.utils.LayoutEnum is deprecated in 4.8

from . import mla_combine
from .mla_decode import (LATENT, ROW, ROW_VECS, VEC, _chunk_rows, _claim, _first_chunk_early, _issue_chunk, _publish,
                         _quad_max, _quad_sum)
from .rows import gmem_ptr

ARCHS = ("sm_90a",)
TILE_ROWS = 64  # one wgmma M tile of query rows
HALF = LATENT // 2  # value columns per warpgroup
WARPS = 8
BLOCK = 64  # elements of one 128-byte swizzle row


def swizzled(row: Int32, vec: Int32, rows: int) -> Int32:
    """Element offset of 16-byte vector `vec` (of 72) of row `row` in a K-major 128-byte-swizzled
    [rows, 576] bf16 tile: 64-column blocks of rows · 64 elements, rows of 128 bytes, the vector's
    slot in its row XORed with the row mod 8 (`sm90.make_smem_layout_a/b` with ROW_MAJOR)."""
    return (vec // 8) * (rows * BLOCK) + row * BLOCK + VEC * ((vec % 8) ^ (row % 8))


@cute.jit
def _smem_vec(base: Int32, offset: Int32, n: Constexpr = VEC) -> cute.Tensor:
    """The n bf16 at element `offset` (a multiple of n) of the shared-memory buffer at address `base`."""
    return cute.make_tensor(cute.make_ptr(BFloat16, base + 2 * offset, cute.AddressSpace.smem, assumed_align=2 * n),
                            cute.make_layout(n))


@cute.kernel
def _kernel(q_ptr: cute.Pointer, cache_ptr: cute.Pointer, table_ptr: cute.Pointer, lens_ptr: cute.Pointer,
            starts_ptr: cute.Pointer, out_ptr: cute.Pointer, ws_o_ptr: cute.Pointer, ws_ml_ptr: cute.Pointer,
            info_ptr: cute.Pointer, rows: Int32, requests: Int32, num_blocks: Int32, max_blocks: Int32,
            slots: Int32, target: Int32, min_chunks: Int32, scale_log2: Float32,
            mma_qk: cute.TiledMma, mma_pv: cute.TiledMma, q_layout: cute.ComposedLayout,
            k_layout: cute.ComposedLayout, v_layout: cute.ComposedLayout, p_layout: cute.ComposedLayout,
            plan: Constexpr):
    cute.arch.griddepcontrol_launch_dependents()  # as in mla_decode
    tid, _, _ = cute.arch.thread_idx()
    unit, _, _ = cute.arch.block_idx()
    lane = tid % 32
    warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
    group = warp // 4  # warpgroup: value columns HALF·group ..
    wg_tid = tid % 128
    heads, stages, chunk, block_size = plan.heads, plan.stages, plan.chunk, plan.block_size

    req, length, q, valid_rows, out_base, tile, splits, c0, n_chunks, token_end, record = _claim(
        lens_ptr, starts_ptr, unit, tid, requests, rows, max_blocks, target, min_chunks, plan)
    table = cute.make_tensor(table_ptr, cute.make_layout(requests * max_blocks))
    smem = cutlass.memory.SmemAllocator()
    q_raw = smem.allocate_tensor(BFloat16, cute.make_layout(TILE_ROWS * ROW), byte_alignment=1024)
    ring_raw = smem.allocate_tensor(BFloat16, cute.make_layout(stages * chunk * ROW), byte_alignment=1024)
    red = smem.allocate_tensor(Float32, cute.make_layout((2, TILE_ROWS), stride=(TILE_ROWS, 1)), byte_alignment=16)
    g2s = cute.make_copy_atom(cute.nvgpu.cpasync.CopyG2SOp(cache_mode=cute.nvgpu.cpasync.LoadCacheMode.GLOBAL),
                              BFloat16, num_bits_per_copy=128)
    cache_base = cache_ptr.toint()
    ring_base = ring_raw.iterator.toint()
    table_row = req * max_blocks
    phys = cute.make_rmem_tensor(cute.make_layout(chunk // WARPS), Int32)
    early = _first_chunk_early(req, requests, length, q, c0, n_chunks, chunk)  # as in mla_decode
    if early == 1:
        _chunk_rows(phys, table, c0, token_end, warp, table_row, num_blocks, block_size, chunk, WARPS)
        _issue_chunk(g2s, cache_base, phys, warp, lane, chunk, WARPS,
                     lambda row, vec: _smem_vec(ring_base, swizzled(row, vec, chunk)))
    _publish(info_ptr, slots, unit, tid, record)
    if req < requests:
        q_swz = cute.recast_ptr(q_raw.iterator, q_layout.inner, dtype=BFloat16)
        ring_swz = cute.recast_ptr(ring_raw.iterator, k_layout.inner, dtype=BFloat16)

        # the query tile (padding rows repeat the last real query; they are never stored)
        q_vecs = cute.make_tensor(q_ptr, cute.make_layout((VEC, rows * heads, ROW_VECS), stride=(1, ROW, VEC)))
        for k in cutlass.range_constexpr(TILE_ROWS * ROW_VECS // (32 * WARPS)):
            idx = tid + 32 * WARPS * k
            row = idx // ROW_VECS
            vec = idx - row * ROW_VECS
            src_row = out_base + cutlass.min(row, valid_rows - 1)
            cute.copy(g2s, q_vecs[None, src_row, vec], _smem_vec(q_raw.iterator.toint(), swizzled(row, vec, TILE_ROWS)))

        for p in cutlass.range_constexpr(stages - 1):
            if p < (n_chunks if p > 0 else n_chunks * (1 - early)):  # chunk 0 unless it went early
                _chunk_rows(phys, table, c0 + p, token_end, warp, table_row, num_blocks, block_size, chunk, WARPS)
                _issue_chunk(g2s, cache_base, phys, warp, lane, chunk, WARPS,
                             lambda row, vec, st=Int32(p): _smem_vec(ring_base, st * (chunk * ROW)
                                                                     + swizzled(row, vec, chunk)))
            cute.arch.cp_async_commit_group()  # one group per stage, empty or not: uniform waits
        _chunk_rows(phys, table, c0 + cutlass.min(stages - 1, n_chunks - 1), token_end, warp, table_row, num_blocks,
                    block_size, chunk, WARPS)

        half = chunk // 2  # tokens each warpgroup scores
        thr_qk = mma_qk.get_slice(wg_tid)
        thr_pv = mma_pv.get_slice(wg_tid)
        frag_q = mma_qk.make_fragment_A(thr_qk.partition_A(cute.make_tensor(q_swz, q_layout.outer)))
        s_coords = thr_qk.partition_C(cute.make_identity_tensor((TILE_ROWS, half)))
        acc_s = cute.make_rmem_tensor(s_coords.shape, Float32)
        o_coords = thr_pv.partition_C(cute.make_identity_tensor((TILE_ROWS, HALF)))
        acc_o = cute.make_rmem_tensor(o_coords.shape, Float32)
        acc_o.fill(0.0)
        mma_qk.set(warpgroup.Field.ACCUMULATE, True)
        mma_pv.set(warpgroup.Field.ACCUMULATE, True)
        pair = cute.make_rmem_tensor(cute.make_layout(2), BFloat16)

        # a thread holds rows r and r + 8 (value bit 1); how far each may look (verify rows are causal)
        limit = cute.make_rmem_tensor(cute.make_layout(2), Int32)
        for v1 in cutlass.range_constexpr(2):
            row = s_coords[2 * v1][0]
            token = (tile * TILE_ROWS + row) // heads
            limit[v1] = cutlass.select_(row < valid_rows, cutlass.min(length - q + token + 1, token_end), token_end)
        run_max = cute.make_rmem_tensor(cute.make_layout(2), Float32)
        run_sum = cute.make_rmem_tensor(cute.make_layout(2), Float32)
        rescale = cute.make_rmem_tensor(cute.make_layout(2), Float32)
        run_max.fill(-Float32.inf)
        run_sum.fill(0.0)

        for it in cutlass.range(n_chunks):
            cute.arch.cp_async_wait_group(stages - 2)
            # chunk `it` (and the query tile) landed; hand it to wgmma's async proxy, then wait for
            # every thread's copies and for both warpgroups' MMAs on chunk it − 1, whose stage is
            # refilled next
            cute.arch.fence_proxy("async.shared", space="cta")
            cute.arch.sync_threads()
            stage_ptr = ring_swz + (it % stages) * (chunk * ROW)
            keys = cute.local_tile(cute.make_tensor(stage_ptr, k_layout.outer), (half, ROW), (group, 0))
            frag_k = mma_qk.make_fragment_B(thr_qk.partition_B(keys))
            # the weights [64, chunk] go where the chunk's rope columns were (P·V reads only c)
            weights = cute.make_tensor(stage_ptr + (LATENT // BLOCK) * (chunk * BLOCK), p_layout.outer)
            p_base = ring_base + 2 * ((it % stages) * (chunk * ROW) + (LATENT // BLOCK) * (chunk * BLOCK))
            frag_p = mma_pv.make_fragment_A(thr_pv.partition_A(weights))
            frag_v = mma_pv.make_fragment_B(thr_pv.partition_B(
                cute.make_tensor(stage_ptr + group * (HALF // BLOCK) * (chunk * BLOCK), v_layout.outer)))

            acc_s.fill(0.0)
            warpgroup.fence()
            for kb in cutlass.range_constexpr(ROW // 16):
                cute.gemm(mma_qk, acc_s, frag_q[None, None, kb], frag_k[None, None, kb], acc_s)
            warpgroup.commit_group()
            # the next chunk's copies and table reads issue while the tensor cores score this one
            ahead = it + stages - 1
            if ahead < n_chunks:
                _issue_chunk(g2s, cache_base, phys, warp, lane, chunk, WARPS,
                             lambda row, vec, st=ahead % stages: _smem_vec(ring_base, st * (chunk * ROW)
                                                                           + swizzled(row, vec, chunk)))
                if ahead + 1 < n_chunks:
                    _chunk_rows(phys, table, c0 + ahead + 1, token_end, warp, table_row, num_blocks, block_size,
                                chunk, WARPS)
            cute.arch.cp_async_commit_group()
            warpgroup.wait_group(0)

            # online softmax: the row max over both warpgroups' tokens (through shared memory),
            # the sum per thread over its own (the partial sums meet once, at the end)
            token0 = (c0 + it) * chunk + half * group
            for v1 in cutlass.range_constexpr(2):
                best = -Float32.inf
                for j in cutlass.range_constexpr(half // 8):
                    for v0 in cutlass.range_constexpr(2):
                        i = v0 + 2 * v1 + 4 * j
                        s2 = cutlass.select_(token0 + s_coords[i][1] < limit[v1], acc_s[i] * scale_log2,
                                             -Float32.inf)
                        acc_s[i] = s2
                        best = cute.arch.fmax(best, s2)
                best = _quad_max(best)
                if lane % 4 == 0:
                    red[group, s_coords[2 * v1][0]] = best
            # both warpgroups' scores are done, so the rope columns are free for the weights
            cute.arch.barrier(barrier_id=1, number_of_threads=32 * WARPS)
            for v1 in cutlass.range_constexpr(2):
                row = s_coords[2 * v1][0]
                new_max = cute.arch.fmax(run_max[v1], cute.arch.fmax(red[0, row], red[1, row]))
                # a row with nothing visible yet keeps max −inf; exp2 against 0 then gives 0s
                ref = cutlass.select_(new_max == -Float32.inf, Float32(0.0), new_max)
                rescale[v1] = cute.math.exp2(run_max[v1] - ref, fastmath=True)
                run_max[v1] = new_max
                part = Float32(0.0)
                for j in cutlass.range_constexpr(half // 8):
                    for v0 in cutlass.range_constexpr(2):
                        i = v0 + 2 * v1 + 4 * j
                        pw = cute.math.exp2(acc_s[i] - ref, fastmath=True)
                        part += pw
                        acc_s[i] = pw
                    col = half * group + s_coords[4 * j][1]
                    pair[0] = acc_s[2 * v1 + 4 * j].to(BFloat16)
                    pair[1] = acc_s[1 + 2 * v1 + 4 * j].to(BFloat16)
                    cute.autovec_copy(pair, _smem_vec(p_base, row * BLOCK + VEC * ((col // VEC) ^ (row % 8)) + col % VEC,
                                                      2))
                run_sum[v1] = run_sum[v1] * rescale[v1] + part
            for i in cutlass.range(cute.size(acc_o), unroll_full=True):
                acc_o[i] = acc_o[i] * rescale[(i // 2) % 2]
            cute.arch.fence_proxy("async.shared", space="cta")
            cute.arch.barrier(barrier_id=2, number_of_threads=32 * WARPS)

            warpgroup.fence()
            for kk in cutlass.range_constexpr(chunk // 16):
                cute.gemm(mma_pv, acc_o, frag_p[None, None, kk], frag_v[None, None, kk], acc_o)
            warpgroup.commit_group()
            warpgroup.wait_group(0)
        cute.arch.cp_async_wait_group(0)

        # the row sums: the quad's, then the other warpgroup's (its reads of `red` ended before barrier 2)
        for v1 in cutlass.range_constexpr(2):
            run_sum[v1] = _quad_sum(run_sum[v1])
            if lane % 4 == 0:
                red[group, s_coords[2 * v1][0]] = run_sum[v1]
        cute.arch.barrier(barrier_id=1, number_of_threads=32 * WARPS)
        for v1 in cutlass.range_constexpr(2):
            row = s_coords[2 * v1][0]
            run_sum[v1] = red[0, row] + red[1, row]
        if splits == 1:
            out_pairs = cute.make_tensor(out_ptr, cute.make_layout((2, rows * heads, LATENT // 2),
                                                                   stride=(1, LATENT, 2)))
            o_pair = cute.make_rmem_tensor(cute.make_layout(2), BFloat16)
            for v1 in cutlass.range_constexpr(2):
                row = o_coords[2 * v1][0]
                if row < valid_rows:
                    total = run_sum[v1]
                    inv = cutlass.select_(total > 0.0, 1.0 / total, Float32(0.0))
                    for j in cutlass.range_constexpr(HALF // 8):
                        for v0 in cutlass.range_constexpr(2):
                            o_pair[v0] = (acc_o[v0 + 2 * v1 + 4 * j] * inv).to(BFloat16)
                        col = HALF * group + o_coords[2 * v1 + 4 * j][1]
                        cute.autovec_copy(o_pair, out_pairs[None, out_base + row, col // 2])
        else:
            ws_o = cute.make_tensor(ws_o_ptr, cute.make_layout((2, slots * TILE_ROWS, LATENT // 2),
                                                               stride=(1, LATENT, 2)))
            ws_ml = cute.make_tensor(ws_ml_ptr, cute.make_layout((slots * TILE_ROWS, 2), stride=(2, 1)))
            o_pair = cute.make_rmem_tensor(cute.make_layout(2), Float32)
            for v1 in cutlass.range_constexpr(2):
                row = o_coords[2 * v1][0]
                if row < valid_rows:
                    for j in cutlass.range_constexpr(HALF // 8):
                        for v0 in cutlass.range_constexpr(2):
                            o_pair[v0] = acc_o[v0 + 2 * v1 + 4 * j]
                        col = HALF * group + o_coords[2 * v1 + 4 * j][1]
                        cute.autovec_copy(o_pair, ws_o[None, unit * TILE_ROWS + row, col // 2])
                    if group == 0:  # both warpgroups hold the same statistics
                        if lane % 4 == 0:
                            ws_ml[unit * TILE_ROWS + row, 0] = run_max[v1]
                            ws_ml[unit * TILE_ROWS + row, 1] = run_sum[v1]


def smem_layouts(chunk: int):
    """(query tile [64, 576], cache stage [chunk, 576], a warpgroup's values [256, chunk], weights
    [64, chunk]) as swizzled shared-memory layouts, one stage each (call inside a cute.jit function)."""
    q = sm90.make_smem_layout_a(LayoutEnum.ROW_MAJOR, (TILE_ROWS, chunk, ROW), BFloat16, 1)
    k = sm90.make_smem_layout_b(LayoutEnum.ROW_MAJOR, (TILE_ROWS, chunk, ROW), BFloat16, 1)
    v = sm90.make_smem_layout_b(LayoutEnum.COL_MAJOR, (TILE_ROWS, HALF, chunk), BFloat16, 1)
    p = sm90.make_smem_layout_a(LayoutEnum.ROW_MAJOR, (TILE_ROWS, HALF, chunk), BFloat16, 1)
    return tuple(cute.slice_(lay, (None, None, 0)) for lay in (q, k, v, p))


@cute.jit
def _host(q_ptr: cute.Pointer, cache_ptr: cute.Pointer, table_ptr: cute.Pointer, lens_ptr: cute.Pointer,
          starts_ptr: cute.Pointer, out_ptr: cute.Pointer, ws_o_ptr: cute.Pointer, ws_ml_ptr: cute.Pointer,
          info_ptr: cute.Pointer, rows: Int32, requests: Int32, num_blocks: Int32, max_blocks: Int32, slots: Int32,
          target: Int32, min_chunks: Int32, scale_log2: Float32, stream: cuda.CUstream, plan: Constexpr):
    mma_qk = sm90.make_trivial_tiled_mma(BFloat16, BFloat16, OperandMajorMode.K, OperandMajorMode.K, Float32,
                                         (1, 1, 1), tiler_mn=(TILE_ROWS, plan.chunk // 2))
    mma_pv = sm90.make_trivial_tiled_mma(BFloat16, BFloat16, OperandMajorMode.K, OperandMajorMode.MN, Float32,
                                         (1, 1, 1), tiler_mn=(TILE_ROWS, HALF))
    q_layout, k_layout, v_layout, p_layout = smem_layouts(plan.chunk)
    _kernel(q_ptr, cache_ptr, table_ptr, lens_ptr, starts_ptr, out_ptr, ws_o_ptr, ws_ml_ptr, info_ptr,
            rows, requests, num_blocks, max_blocks, slots, target, min_chunks, scale_log2,
            mma_qk, mma_pv, q_layout, k_layout, v_layout, p_layout, plan).launch(
        grid=(slots, 1, 1), block=(32 * WARPS, 1, 1), stream=stream, use_pdl=True)


def compile_mla_decode_wgmma(plan: Any, arch: str, ptx_dir: str | None = None) -> Any:
    """Compile one `mla_decode.DecodePlan` with mma="wgmma" for sm_90a; needs no GPU."""
    if arch not in ARCHS:
        raise ValueError(f"mla_decode_wgmma: wgmma needs one of {ARCHS}, got {arch}")
    bf, i32, f32 = gmem_ptr(BFloat16, 16), gmem_ptr(Int32, 16, 4), gmem_ptr(Float32, 16)
    return cute.compile(_host, bf, bf, i32, i32, i32, bf, f32, f32, i32,
                        Int32(1), Int32(1), Int32(2), Int32(1), Int32(1), Int32(1), Int32(1), Float32(1.0),
                        cute.runtime.make_fake_stream(), plan,
                        options=f"--gpu-arch {arch}" + (f" --keep-ptx --keep-cubin --dump-dir {ptx_dir}" if ptx_dir else ""))


assert mla_combine.LATENT == LATENT
