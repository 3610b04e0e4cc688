"""Skinny GEMM at 17-64 rows on Hopper: y[M, N] = x[M, K] · Wᵀ with TMA and wgmma.

Math: `skinny_gemm`'s (fp32 sums of bf16 products, one rounding; the same epilogues, through
`gemm_store`). `skinny_gemm.launch` sends a step here on sm_90a when M > 16 and x is 2-D.

Envelope: sm_90a only (wgmma and TMA; sm_100 has neither in this form); x `[M, K]` with unit
stride along K and a row stride that is a multiple of 8 elements, W `[N, K]` contiguous, y (and
a, g) `[M, N]`, all 16-byte aligned; 1 <= M <= 64 (`launch` sends it M > 16 unless a tiling
says otherwise), K % 8 == 0, N % 16 == 0 (the launcher in `skinny_gemm` checks all of it).

Design: beyond 16 rows the warp-level kernel reads each x chunk once per warp from L1 (twice W's
bytes at 64 rows) and holds 238 registers, one CTA an SM; here W is wgmma's A operand (64 W rows
an instruction) and x its B operand (N = 16·ceil(M/16) token rows), both K-major in 128-byte
swizzled shared memory, so one warpgroup's MMAs read every x tile once per CTA from shared memory
and accumulate in 32-64 registers.
- TMA streams W tiles `[block_w, 64]` and x tiles `[16·ceil(M/16), 64]` through `stages` buffers
  (two CTAs an SM keep 2·stages W tiles in flight); x rows past M and K past its end load as
  zeros, W rows past N too, and their outputs are never stored.
- One warp issues the loads; the warpgroup waits for a stage, issues its four k16 wgmmas, keeps
  that group in flight and releases the stage of the group before.
- PDL as in `skinny_gemm`: the first stages' W tiles are requested before
  griddepcontrol.wait, x's after it (the same barriers count both).
- K splits across CTAs (`WgmmaTiling.splits`) where a cost model fitted to the H200's sweep says
  it pays (`choose_wgmma_tiling`); the splits meet in `gemm_store.sum_splits`.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
import cutlass.utils.hopper_helpers as sm90
from cutlass import BFloat16, Constexpr, Float32, Int32, const_expr
from cutlass.cute.nvgpu import OperandMajorMode, cpasync, warpgroup
from cutlass.tensor_utils import LayoutEnum  # cutlass.utils.LayoutEnum is deprecated in 4.8

from .gemm_store import split_workspace, store, sum_splits
from .rows import gmem_ptr

TILE_K = 64  # one 128-byte swizzle row of bf16
_THREADS = 128  # one warpgroup
_SMEM_PER_CTA = 110 * 1024  # two CTAs an SM (228 KB, 1 KB of it per CTA reserved)
ARCHS = ("sm_90a",)


@dataclass(frozen=True)
class WgmmaTiling:
    """How one shape is cut (all compile-time)."""

    block_w: int  # W rows per CTA: 64 or 128 (one or two m64 wgmma tiles)
    stages: int  # TMA buffers per CTA
    splits: int  # CTAs along K, every one with at least one K tile

    def __post_init__(self) -> None:
        if self.block_w not in (64, 128) or self.stages < 2 or self.splits < 1:
            raise ValueError(f"{self}: block_w must be 64 or 128, stages >= 2, splits >= 1")

    def tiles_n(self, n: int) -> int:
        return -(-n // self.block_w)


def token_rows(m_atoms: int) -> int:
    """x rows of a tile, M rounded up to 16: a 24-, 40- or 56-row x tile aborts the DSL's TMA atom
    construction (CuTe DSL 4.8.1, CPU compile), and MMAs are cheap here."""
    return 16 * -(-m_atoms // 2)


def stage_bytes(block_w: int, m_atoms: int) -> int:
    return (block_w + token_rows(m_atoms)) * TILE_K * 2


def stages_for(block_w: int, m_atoms: int) -> int:
    """The buffers that let two CTAs share an SM (at most 8)."""
    return max(2, min(8, _SMEM_PER_CTA // stage_bytes(block_w, m_atoms)))


# The cost model `choose_wgmma_tiling` ranks tilings by, fitted to the 22 M = 32/64 cases that
# sweep_skinny_tiling timed on the H200 on 2026-12-05 (kernels/MEASURED.md): an SM streams at most
# SM_SHARE times its even share of the copy bandwidth; a CTA of more than 32 token rows, alone on
# its SM, only its even share (its MMAs take longer); each round of two resident CTAs, and a
# split-K sum, costs ROUND_US of fill and drain. On those cases its pick took on average 1.007x
# the fastest candidate's time (the worst 1.05x, the fastest on 16), against 1.054x (worst 1.24x)
# for the one-CTA-an-SM rule before it; other values (SM_SHARE 1.2-1.4, ROUND_US 1-3) gave 1.006-1.011x
# wherever all their picks had been timed. Shapes the sweep did not reach (most of TP8 and TP16)
# are the model's extrapolation until a sweep times them.
COPY_BYTES_PER_US = 4.2e6  # the H200's measured copy bandwidth
SM_SHARE = 1.3
ROUND_US = 2.0


def predicted_us(t: WgmmaTiling, n: int, k: int, m_atoms: int, sm_count: int) -> float:
    """The cost model's time for one tiling (µs on the H200; only its ranking is used)."""
    k_tiles = -(-k // TILE_K)
    cta_bytes = t.block_w * -(-k_tiles // t.splits) * TILE_K * 2
    ctas = t.tiles_n(n) * t.splits
    per_sm = -(-ctas // sm_count)  # the busiest SM's CTAs, two at a time
    share = COPY_BYTES_PER_US / sm_count
    cta_rate = share if token_rows(m_atoms) > 32 else SM_SHARE * share
    sm_rate = min(SM_SHARE * share, min(per_sm, 2) * cta_rate)
    stream = max(per_sm * cta_bytes / sm_rate, ctas * cta_bytes / COPY_BYTES_PER_US)
    partials = 2 * 4 * token_rows(m_atoms) * n * t.splits / COPY_BYTES_PER_US if t.splits > 1 else 0.0
    return stream + -(-per_sm // 2) * ROUND_US + (partials + ROUND_US if t.splits > 1 else 0.0)


@functools.cache  # `skinny_gemm.launch` asks on every call; the search is a pure function of ints
def choose_wgmma_tiling(n: int, k: int, m_atoms: int, sm_count: int) -> WgmmaTiling:
    """The 64- or 128-row tiling and K split that `predicted_us` ranks fastest. Splits keep at
    least two K tiles each and the fp32 partials (written, then read back) under a quarter of W's
    bytes, and are renumbered so that none is empty; each tiling has as many stages as let two
    CTAs share an SM and a split has K tiles. Where N alone leaves SMs idle or a short last round
    (lm_head@tp8: 160 CTAs of 128 rows, a second round of 28), the model splits K or takes
    64-row CTAs (lm_head@tp8: 320, two to an SM); where N fills the SMs evenly, it keeps one split."""
    k_tiles = -(-k // TILE_K)
    most = max(1, min(k_tiles // 2, k // (16 * token_rows(m_atoms))))
    best: tuple[float, WgmmaTiling] | None = None
    for block_w in (64, 128):
        for wanted in range(1, min(most, 4 * sm_count) + 1):
            per_split = -(-k_tiles // wanted)
            t = WgmmaTiling(block_w, max(2, min(stages_for(block_w, m_atoms), per_split)), -(-k_tiles // per_split))
            cost = predicted_us(t, n, k, m_atoms, sm_count)
            if best is None or cost < best[0]:
                best = (cost, t)
    return best[1]


@cute.kernel
def _wgmma_kernel(
    tma_w: cute.CopyAtom, w_tma: cute.Tensor, tma_x: cute.CopyAtom, x_tma: cute.Tensor,
    y_ptr: cute.Pointer, e_ptr: cute.Pointer, ws_ptr: cute.Pointer, cnt_ptr: cute.Pointer, m: Int32,
    scale: Float32, mma: cute.TiledMma, w_layout: cute.ComposedLayout, x_layout: cute.ComposedLayout,
    n: Constexpr, k: Constexpr, m_atoms: Constexpr, block_w: Constexpr, stages: Constexpr,
    splits: Constexpr, ops: Constexpr,
):
    cute.arch.griddepcontrol_launch_dependents()
    tid, _, _ = cute.arch.thread_idx()
    tile, split, _ = cute.arch.block_idx()
    warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
    tokens = token_rows(m_atoms)
    if warp == 0:
        cpasync.prefetch_descriptor(tma_w)
        cpasync.prefetch_descriptor(tma_x)

    smem = cutlass.memory.SmemAllocator()
    barriers = smem.allocate_array(cutlass.Int64, 2 * stages, byte_alignment=8)
    s_w = smem.allocate_tensor(BFloat16, w_layout.outer, byte_alignment=1024, swizzle=w_layout.inner)
    s_x = smem.allocate_tensor(BFloat16, x_layout.outer, byte_alignment=1024, swizzle=x_layout.inner)
    is_last = smem.allocate_tensor(Int32, cute.make_layout(1), byte_alignment=4)
    loads = pipeline.PipelineTmaAsync.create(
        barrier_storage=barriers, num_stages=stages,
        producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread),
        # one release per warp of the warpgroup
        consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, _THREADS // 32),
        tx_count=stage_bytes(block_w, m_atoms), cta_layout_vmnk=cute.make_layout((1, 1, 1, 1)))

    k_tiles = (k + TILE_K - 1) // TILE_K
    per_split = (k_tiles + splits - 1) // splits
    first = split * per_split
    count = cutlass.min(per_split, k_tiles - first)

    # (atom, K tile) views of this CTA's W rows and of x, and (atom, stage) of the buffers
    g_w = cute.local_tile(w_tma, (block_w, TILE_K), (tile, None))
    g_x = cute.local_tile(x_tma, (tokens, TILE_K), (0, None))
    w_dst, w_src = cpasync.tma_partition(tma_w, 0, cute.make_layout(1), cute.group_modes(s_w, 0, 2),
                                         cute.group_modes(g_w, 0, 2))
    x_dst, x_src = cpasync.tma_partition(tma_x, 0, cute.make_layout(1), cute.group_modes(s_x, 0, 2),
                                         cute.group_modes(g_x, 0, 2))

    thr = mma.get_slice(tid)
    frag_w = mma.make_fragment_A(thr.partition_A(s_w))
    frag_x = mma.make_fragment_B(thr.partition_B(s_x))
    coords = thr.partition_C(cute.make_identity_tensor((block_w, tokens)))
    acc = cute.make_rmem_tensor(coords.shape, Float32)
    acc.fill(0.0)
    mma.set(warpgroup.Field.ACCUMULATE, True)

    produced = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, stages)
    x_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, stages)
    prologue = cutlass.min(stages, count)
    if warp == 0:
        # W, which no kernel writes, is in flight while the previous kernel finishes
        for _ in cutlass.range(prologue, unroll=1):
            loads.producer_acquire(produced)
            cute.copy(tma_w, w_src[(None, first + produced.count)], w_dst[(None, produced.index)],
                      tma_bar_ptr=loads.producer_get_barrier(produced))
            produced.advance()
    cute.arch.griddepcontrol_wait()
    if warp == 0:
        for _ in cutlass.range(prologue, unroll=1):
            cute.copy(tma_x, x_src[(None, first + x_state.count)], x_dst[(None, x_state.index)],
                      tma_bar_ptr=loads.producer_get_barrier(x_state))
            x_state.advance()

    ready = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, stages)
    done = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, stages)
    for i in cutlass.range(count, unroll=1):
        loads.consumer_wait(ready)
        warpgroup.fence()
        for kb in cutlass.range_constexpr(TILE_K // 16):
            cute.gemm(mma, acc, frag_w[(None, None, kb, ready.index)], frag_x[(None, None, kb, ready.index)], acc)
        warpgroup.commit_group()
        # this tile's MMAs stay in flight; the previous tile's are done, so its stage is free and
        # refilled (refilling only a released stage: warp 0 waits there for the other warps'
        # releases, never for its own)
        warpgroup.wait_group(1)
        ready.advance()
        if i > 0:
            loads.consumer_release(done)
            done.advance()
            if warp == 0:
                if produced.count < count:
                    loads.producer_acquire(produced)
                    at = first + produced.count
                    bar = loads.producer_get_barrier(produced)
                    cute.copy(tma_w, w_src[(None, at)], w_dst[(None, produced.index)], tma_bar_ptr=bar)
                    cute.copy(tma_x, x_src[(None, at)], x_dst[(None, produced.index)], tma_bar_ptr=bar)
                    produced.advance()
    warpgroup.wait_group(0)

    y = cute.make_tensor(y_ptr, cute.make_layout((1, m, n), stride=(0, ops.y_strides[1], 1)))
    e = cute.make_tensor(e_ptr, cute.make_layout((1, m, n), stride=(0, ops.e_strides[1], 1)))
    ws = split_workspace(ws_ptr, 1, splits, n)
    for i in cutlass.range_constexpr(cute.size(acc)):
        w_row, token = coords[i]
        col = tile * block_w + w_row
        if token < m:
            if col < n:
                if const_expr(splits == 1):
                    store(y, e, 0, token, col, acc[i], scale, ops.epilogue)
                else:
                    ws[0, split, token, col] = acc[i]
    if const_expr(splits > 1):
        sum_splits(y, e, ws, cnt_ptr, is_last, 0, tile, (n + block_w - 1) // block_w, tid, m, scale, n, block_w,
                   tokens, _THREADS, splits, ops.epilogue)


@cute.jit
def _wgmma_host(
    w_ptr: cute.Pointer, x_ptr: cute.Pointer, y_ptr: cute.Pointer, e_ptr: cute.Pointer, ws_ptr: cute.Pointer,
    cnt_ptr: cute.Pointer, m: Int32, scale: Float32, stream: cuda.CUstream,
    n: Constexpr, k: Constexpr, m_atoms: Constexpr, block_w: Constexpr, stages: Constexpr, splits: Constexpr,
    ops: Constexpr,
):
    tokens = token_rows(m_atoms)
    tile_mnk = (block_w, tokens, TILE_K)
    mma = sm90.make_trivial_tiled_mma(BFloat16, BFloat16, OperandMajorMode.K, OperandMajorMode.K, Float32,
                                      (1, 1, 1), tiler_mn=(64, tokens))
    w_layout = sm90.make_smem_layout_a(LayoutEnum.ROW_MAJOR, tile_mnk, BFloat16, stages)
    x_layout = sm90.make_smem_layout_b(LayoutEnum.ROW_MAJOR, tile_mnk, BFloat16, stages)
    w = cute.make_tensor(w_ptr, cute.make_layout((n, k), stride=(k, 1)))
    x = cute.make_tensor(x_ptr, cute.make_layout((m, k), stride=(ops.x_strides[1], 1)))
    tma_w, w_tma = cpasync.make_tiled_tma_atom(cpasync.CopyBulkTensorTileG2SOp(), w,
                                               cute.slice_(w_layout, (None, None, 0)), (block_w, TILE_K))
    tma_x, x_tma = cpasync.make_tiled_tma_atom(cpasync.CopyBulkTensorTileG2SOp(), x,
                                               cute.slice_(x_layout, (None, None, 0)), (tokens, TILE_K))
    _wgmma_kernel(
        tma_w, w_tma, tma_x, x_tma, y_ptr, e_ptr, ws_ptr, cnt_ptr, m, scale, mma, w_layout, x_layout,
        n, k, m_atoms, block_w, stages, splits, ops,
    ).launch(
        grid=((n + block_w - 1) // block_w, splits, 1),
        block=(_THREADS, 1, 1),
        stream=stream,
        use_pdl=True,
    )


def compile_skinny_gemm_wgmma(n: int, k: int, m_atoms: int, out_type: Any, tiling: WgmmaTiling, arch: str,
                              ops: Any, ptx_dir: str | None = None) -> Any:
    """Compile for one static shape and operand layout (`skinny_gemm.Operands`, 2-D); needs no GPU."""
    if arch not in ARCHS:
        raise ValueError(f"skinny_gemm_wgmma: wgmma and TMA need one of {ARCHS}, got {arch}")
    return cute.compile(
        _wgmma_host,
        gmem_ptr(BFloat16, 16), gmem_ptr(BFloat16, 16), gmem_ptr(out_type, 16), gmem_ptr(BFloat16, 16, 2),
        gmem_ptr(Float32, 16), gmem_ptr(Int32, 16, 4),
        Int32(17), Float32(1.0), cute.runtime.make_fake_stream(),
        n, k, m_atoms, tiling.block_w, tiling.stages, tiling.splits, ops,
        options=f"--gpu-arch {arch}" + (f" --keep-ptx --keep-cubin --dump-dir={ptx_dir}" if ptx_dir else ""),
    )
