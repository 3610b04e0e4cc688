"""Skinny GEMM for decode: y[M, N] = x[M, K] · Wᵀ, M = 1..64, BF16 in, FP32 accumulation.

Math: `reference/ops.py::linear` (fp32 sums of bf16 products, one rounding to the output dtype;
the order of the sum differs, so results agree to fp32 rounding, not bitwise). With an
epilogue the product is rounded to bf16 first, as the reference rounds `linear`'s output, then
    scale:  y = f32(bf16(x·Wᵀ)) · s                       (the logit scale, FP32 out)
    add:    y = bf16(f32(bf16(x·Wᵀ)) + f32(a))            (`reference/ops.py::bf16_add`)
    gate:   y = bf16(f32(bf16(x·Wᵀ)) · σ(f32(g)))         (MLA's output gate)
and per head (batch B): y[:, h] = x[:, h] · W[h]ᵀ, W `[B, N, K]` (MLA's (un)absorption).

Envelope: x `[M, K]` or `[M, B, K]`, y (and a, g) `[M, N]` or `[M, B, N]` BF16 (y also FP32: the
MoE router's logits), each with unit stride along its last axis and its other strides multiples
of 8 elements (rows of a wider tensor are fine: no copy), W `[N, K]` or `[B, N, K]` contiguous,
all 16-byte aligned on one CUDA device; 1 <= M <= 64, K % 8 == 0, N % 16 == 0. Runs on sm_90
(checked on the H200) and compiles for sm_90a, sm_100a and sm_103a: only warp-level `mma.sync`
and plain vector loads, nothing arch-specific. Fuses the epilogues above into the store.

Design (decode is memory-bound: read every weight byte once, at HBM speed):
- W is the MMA's A operand (16 weight rows per m16n8k16 atom) and x the B operand (8 token rows
  per atom), so M pads only to a multiple of 8; padded token rows read a real row (clamped
  index) and their outputs are never stored.
- Each lane loads W straight from global memory into registers with 16-byte loads. The order of
  K inside a dot product is free, so lane `c` of a quad takes 4·A consecutive elements of a row
  and feeds them to its four k-slots of A consecutive atoms. x is read with the same
  permutation, which puts both operands in fragment order without shuffles (x comes from L1/L2:
  it is only M·K·2 bytes).
- A warp owns R row tiles (16·R rows) and walks K in chunks of 16·A, loading chunk i+1 while it
  multiplies chunk i. The warps of a CTA split N (warps_n) and K (warps_k); K is also split
  across CTAs (`splits`) where N alone gives too few CTAs to keep enough bytes in flight.
- Launched with programmatic dependent launch (PDL): every kernel of the step releases its
  dependents first, so this grid's CTAs start while the previous kernel runs, put their first W
  chunk in flight, and wait (griddepcontrol.wait: the previous grid done, its writes visible)
  before they read x or write anything. Measured on 2026-12-04 before this form landed (kernels/
  README.md): 1.07× on the TP16 step at one row, 1.05× at eight.
- Partial sums meet in shared memory (across warps_k) and, with splits > 1, in an FP32
  workspace: the last CTA of an N tile to arrive (one counter per tile, reset by that CTA) adds
  the splits in a fixed order and writes y, so results are deterministic and one launch does
  all. Launches of one shape share that workspace, so they must be stream-ordered.

Beyond 16 rows of 2-D x on sm_90a, `launch` runs `skinny_gemm_wgmma`'s TMA + wgmma kernel instead
(`pick_tiling`); both store through `gemm_store`.

The host `launch` checks the envelope before it touches the GPU, compiles once per
(N, K, ceil(M/8), output dtype, arch, tiling, `Operands`), then only launches, on an explicit
stream, so a launch can be captured in a CUDA graph once its shape has run one time outside the
capture.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
import torch
from cutlass import BFloat16, Constexpr, Float32, Int32, const_expr

from .device import DeviceFacts, facts
from .gemm_store import MAX_ROWS, split_workspace, store, sum_splits
from .rows import gmem_ptr
from .skinny_gemm_wgmma import ARCHS as WGMMA_ARCHS
from .skinny_gemm_wgmma import WgmmaTiling, choose_wgmma_tiling, compile_skinny_gemm_wgmma

_OUT_DTYPES = {torch.bfloat16: BFloat16, torch.float32: Float32}
EPILOGUES = ("none", "scale", "add", "gate")


class SkinnyGemmEnvelopeError(ValueError):
    """The inputs fall outside what the skinny GEMM kernel supports."""


@dataclass(frozen=True)
class Tiling:
    """How one shape is cut into warps and CTAs (all compile-time)."""

    row_tiles: int  # R: 16-row W tiles per warp
    chunk_atoms: int  # A: k16 atoms of one K chunk a warp loads at once (even)
    x_atoms: int  # k16 atoms of x loaded per MMA step (even, divides chunk_atoms)
    warps_n: int
    warps_k: int
    splits: int  # CTAs along K

    def __post_init__(self) -> None:
        if self.chunk_atoms % 2 or self.x_atoms % 2 or self.chunk_atoms % self.x_atoms:
            raise ValueError(f"{self}: chunk_atoms and x_atoms must be even, x_atoms must divide chunk_atoms")
        if not 1 <= self.warps_n * self.warps_k <= 32 or min(self.row_tiles, self.splits) < 1:
            raise ValueError(f"{self}: needs 1..32 warps per CTA, row_tiles >= 1 and splits >= 1")

    @property
    def block_n(self) -> int:
        return 16 * self.row_tiles * self.warps_n

    @property
    def chunk_k(self) -> int:
        return 16 * self.chunk_atoms

    def tiles_n(self, n: int) -> int:
        return -(-n // self.block_n)


@dataclass(frozen=True)
class Operands:
    """How x, y and the epilogue operand lie in memory, and the epilogue (all compile-time).

    Strides are in elements, (per head, per row); the last axis has unit stride. W is always
    `[heads, N, K]` contiguous."""

    heads: int
    x_strides: tuple[int, int]
    y_strides: tuple[int, int]
    epilogue: str = "none"
    e_strides: tuple[int, int] = (0, 0)  # the addend's or the gate's

    @staticmethod
    def plain(n: int, k: int) -> Operands:
        """Contiguous x [M, K] and y [M, N], no epilogue."""
        return Operands(1, (0, k), (0, n))


def resident_ctas(m_atoms: int) -> int:
    """CTAs per SM a tiling is chosen for (`choose_tiling`'s split count) and compiled for (the
    launch's `min_blocks_per_mp`, which caps the registers): two at M <= 16, one beyond. Left to
    itself ptxas gave the 16-warp CTAs 78 registers at M = 9-16, so one CTA an SM ran where the
    split count assumed two (`cubin_resources`; tests/test_skinny_gemm.py checks every pick)."""
    return 2 if m_atoms <= 2 else 1


def choose_tiling(n: int, k: int, m_atoms: int, sm_count: int, heads: int = 1) -> Tiling:
    """The tiling measured best on the H200 for each class of K3 shape (kernels/README.md).

    M <= 16 and K >= 512 (`sweep_skinny_tiling`, 2026-12-04, TP16 at M = 1 and 8): one 16-row
    tile and 64-wide chunks per warp, CTAs of 16 warps all along K, so that many small loads are in
    flight per row tile; 2 along N × 8 along K where K is shorter than 64 chunks and N alone gives
    every SM a CTA (an even share of K per warp then beats more warps on it: moe_latent_up@tp16
    13.0 against 13.7 µs). Shorter K at M <= 16: one tile and 128-wide chunks, CTAs of 2 × 4 warps
    (shared_down@tp16 2.33 µs, the sweep's best). Larger M (sweeps of 2026-12-03 at M = 64): two
    tiles and 64-wide chunks per warp, so each x fragment feeds twice the MMAs, CTAs of 2 × 4 warps,
    or 1 × 8 where N alone fills the resident CTAs and that fills their last wave better. With
    fewer chunks than warps along K, one warp per chunk. K splits across CTAs up to the resident
    CTAs, rounded down (a second, mostly empty wave cost kda_in_proj@tp16 at M = 1 20.8 against
    16.1 µs), keeping at least one chunk per warp; at M = 9-16 a shape that splits K takes two
    tiles × 8 warps (`resident_ctas`; bench_skinny_gemm at M = 16, H200: moe_router 9.16 → 6.92 µs,
    shared_gate_up@tp16 8.81 → 6.51). Heads multiply the CTAs along N (a grid axis of their own).
    """
    small_m = m_atoms <= 2
    deep = small_m and k >= 512  # the 16-warp CTAs along K
    row_tiles, chunk_atoms, x_atoms = (1, 8, 4) if small_m and not deep else (1 if small_m else 2, 4, 2)
    if k <= 128:  # a single chunk: the wider one saves a loop trip
        chunk_atoms = 8
    chunks = -(-k // (16 * chunk_atoms))
    resident = resident_ctas(m_atoms) * sm_count  # CTAs that fit at once

    def ctas_n(warps_n: int) -> int:
        return heads * -(-n // (16 * row_tiles * warps_n))

    def last_wave_fill(ctas: int) -> float:
        return ctas / (-(-ctas // resident) * resident)

    warps_n, warps_k = 2, 4
    if deep:
        warps_n, warps_k = (2, 8) if chunks < 64 and ctas_n(2) >= sm_count else (1, 16)
    elif not small_m and ctas_n(2) >= resident and last_wave_fill(ctas_n(1)) > last_wave_fill(ctas_n(2)) + 0.05:
        warps_n, warps_k = 1, 8
    if chunks < warps_k:
        warps_n, warps_k = max(1, warps_n * warps_k // chunks), chunks

    def splits_to_fill() -> int:
        return max(1, min(resident // ctas_n(warps_n), chunks // warps_k))

    if deep and m_atoms == 2 and splits_to_fill() > 1:
        # split K at 9-16 rows: 16 warps need more than their 64 registers there and spill in
        # the chunk loop; two tiles × 8 warps fit two CTAs an SM in 124 registers
        row_tiles, warps_n, warps_k = 2, 1, 8
    return Tiling(row_tiles, chunk_atoms, x_atoms, warps_n, warps_k, splits_to_fill())


def pick_tiling(arch: str, n: int, k: int, m_atoms: int, sm_count: int, heads: int = 1) -> Tiling | WgmmaTiling:
    """The kernel and tiling `launch` uses: beyond 16 rows of 2-D x on sm_90a the TMA + wgmma
    kernel (`skinny_gemm_wgmma`), else this file's warp-level one."""
    if arch in WGMMA_ARCHS and heads == 1 and m_atoms > 2:
        return choose_wgmma_tiling(n, k, m_atoms, sm_count)
    return choose_tiling(n, k, m_atoms, sm_count, heads)


@cute.jit
def _load_chunk(src_vec: cute.Tensor, dst: cute.Tensor, head: Int32, first_row: Int32, rows: Constexpr,
                row_limit: Int32, col0: Int32, vecs: Constexpr, k: Constexpr, k_tail: Constexpr):
    """`rows` rows of head `head` (first_row + 8i, clamped below row_limit: those rows' outputs are
    never stored) × `vecs` 16-byte vectors from column vector col0 on, into registers one row after
    the other; vectors past K are zeros."""
    for i in cutlass.range_constexpr(rows):
        row = cutlass.min(first_row + 8 * i, row_limit - 1)
        for v in cutlass.range_constexpr(vecs):
            vec = cute.make_tensor(dst.iterator + (i * vecs + v) * 8, cute.make_layout(8))
            if const_expr(k_tail):
                if col0 + v < k // 8:
                    cute.autovec_copy(src_vec[(0, 0, None), (head, row, col0 + v)], vec)
                else:
                    vec.fill(0.0)
            else:
                cute.autovec_copy(src_vec[(0, 0, None), (head, row, col0 + v)], vec)


def mma_registers(lane_elems: int, w_rows: int, x_elems: int, row_tiles: int, m_atoms: int) -> tuple:
    """A warp's registers for the GEMV core (also the MoE experts'): the W chunk double buffer
    (next, current), the x fragments, the zeroed fp32 accumulators and the m16n8k16 bf16 atom."""
    w_next = cute.make_rmem_tensor(cute.make_layout((lane_elems, w_rows)), BFloat16)
    w_cur = cute.make_rmem_tensor(cute.make_layout((lane_elems, w_rows)), BFloat16)
    x_frag = cute.make_rmem_tensor(cute.make_layout((x_elems, m_atoms)), BFloat16)
    acc = cute.make_rmem_tensor(cute.make_layout(((2, 2), row_tiles, m_atoms)), Float32)
    acc.fill(0.0)
    mma = cute.make_mma_atom(cute.nvgpu.warp.MmaF16BF16Op(BFloat16, Float32, (16, 8, 16)))
    return w_next, w_cur, x_frag, acc, mma


def mma_step(mma: Any, acc: cute.Tensor, w_cur: cute.Tensor, x_frag: cute.Tensor, s: int, lane_elems: int,
             x_elems: int, row_tiles: int, x_atoms: int, m_atoms: int) -> None:
    """acc += step s of the current W chunk against the x fragments: views of both in mma.sync
    value order over the permuted K (module docstring)."""
    a = cute.make_tensor(
        w_cur.iterator + s * x_elems,
        cute.make_layout(((2, 2, 2), row_tiles, x_atoms), stride=((1, lane_elems, 2), 2 * lane_elems, 4)))
    b = cute.make_tensor(
        x_frag.iterator,
        cute.make_layout(((2, 2), m_atoms, x_atoms), stride=((1, 2), x_elems, 4)))
    cute.gemm(mma, acc, a, b, acc)


@cute.kernel
def _skinny_gemm_kernel(
    w_ptr: cute.Pointer, x_ptr: cute.Pointer, y_ptr: cute.Pointer, e_ptr: cute.Pointer, ws_ptr: cute.Pointer,
    cnt_ptr: cute.Pointer, m: Int32, scale: Float32,
    n: Constexpr, k: Constexpr, m_atoms: Constexpr,
    row_tiles: Constexpr, chunk_atoms: Constexpr, x_atoms: Constexpr,
    warps_n: Constexpr, warps_k: Constexpr, splits: Constexpr, ops: Constexpr,
):
    cute.arch.griddepcontrol_launch_dependents()
    tid, _, _ = cute.arch.thread_idx()
    tile, split, head = cute.arch.block_idx()
    lane = tid % 32
    warp = tid // 32
    wn = warp % warps_n
    wk = warp // warps_n
    g = lane // 4  # row inside an 8-row group: W row for A, token row for B
    c = lane % 4  # which 4·A-element block of each chunk row the lane owns
    threads = 32 * warps_n * warps_k
    block_n = 16 * row_tiles * warps_n
    tiles_n = (n + block_n - 1) // block_n
    w_rows = 2 * row_tiles  # W rows of a lane: g and g+8 of each of its tiles, 8 apart
    lane_elems = 4 * chunk_atoms  # per W row and chunk, contiguous in memory
    x_elems = 4 * x_atoms  # per token row and MMA step
    chunk_k = 16 * chunk_atoms
    k_tail = k % chunk_k != 0
    n_chunks = (k + chunk_k - 1) // chunk_k
    per_split = (n_chunks + splits - 1) // splits
    heads = ops.heads

    # 16-byte vectors along K: ((1, 1, 8), (heads, rows, K / 8)); the head and row strides are
    # multiples of 8 elements, so a vector stays 16-byte aligned at any head and row
    w_vec = cute.zipped_divide(
        cute.make_tensor(w_ptr, cute.make_layout((heads, n, k), stride=(n * k, k, 1))), (1, 1, 8))
    x_vec = cute.zipped_divide(
        cute.make_tensor(x_ptr, cute.make_layout((heads, m, k), stride=(*ops.x_strides, 1))), (1, 1, 8))

    w_row0 = tile * block_n + wn * 16 * row_tiles + g
    c_begin = split * per_split
    c_end = cutlass.min(c_begin + per_split, n_chunks)
    my_chunks = (c_end - c_begin - wk + warps_k - 1) // warps_k

    w_next, w_cur, x_frag, acc, mma = mma_registers(lane_elems, w_rows, x_elems, row_tiles, m_atoms)

    if my_chunks > 0:
        _load_chunk(w_vec, w_next, head, w_row0, w_rows, n,
                    (c_begin + wk) * (chunk_k // 8) + c * (lane_elems // 8), lane_elems // 8, k, k_tail)
    # launched as a PDL dependent: the first W chunk (which no kernel writes) is in flight while the
    # previous kernel finishes; x, y and the split-K scratch are touched only after its results are
    cute.arch.griddepcontrol_wait()
    for it in cutlass.range(my_chunks):
        chunk = c_begin + wk + it * warps_k
        # chunk i+1 is in flight while chunk i is multiplied
        w_cur.store(w_next.load())
        if it + 1 < my_chunks:
            _load_chunk(w_vec, w_next, head, w_row0, w_rows, n,
                        (chunk + warps_k) * (chunk_k // 8) + c * (lane_elems // 8), lane_elems // 8, k, k_tail)
        for s in cutlass.range_constexpr(chunk_atoms // x_atoms):
            _load_chunk(x_vec, x_frag, head, g, m_atoms, m,
                        chunk * (chunk_k // 8) + c * (lane_elems // 8) + s * (x_elems // 8),
                        x_elems // 8, k, k_tail)
            mma_step(mma, acc, w_cur, x_frag, s, lane_elems, x_elems, row_tiles, x_atoms, m_atoms)

    # the warps_k partial sums meet in shared memory; the pitch pad spreads a warp's stores
    # over the banks
    smem = cutlass.memory.SmemAllocator()
    pitch = block_n + 4
    red = smem.allocate_tensor(
        Float32, cute.make_layout((warps_k, 8 * m_atoms, block_n), stride=(8 * m_atoms * pitch, pitch, 1)),
        byte_alignment=16)
    is_last = smem.allocate_tensor(Int32, cute.make_layout(1), byte_alignment=4)
    for r in cutlass.range_constexpr(row_tiles):
        for j in cutlass.range_constexpr(m_atoms):
            for v1 in cutlass.range_constexpr(2):
                for v0 in cutlass.range_constexpr(2):
                    red[wk, 8 * j + 2 * c + v0, wn * 16 * row_tiles + 16 * r + 8 * v1 + g] = acc[(v0, v1), r, j]
    cute.arch.sync_threads()

    y = cute.make_tensor(y_ptr, cute.make_layout((heads, m, n), stride=(*ops.y_strides, 1)))
    e = cute.make_tensor(e_ptr, cute.make_layout((heads, m, n), stride=(*ops.e_strides, 1)))
    ws = split_workspace(ws_ptr, heads, splits, n)
    for idx in cutlass.range(tid, m * block_n, threads):
        xr = idx // block_n
        nl = idx % block_n
        col = tile * block_n + nl
        if col < n:
            total = red[0, xr, nl]
            for q in cutlass.range_constexpr(1, warps_k):
                total += red[q, xr, nl]
            if const_expr(splits == 1):
                store(y, e, head, xr, col, total, scale, ops.epilogue)
            else:
                ws[head, split, xr, col] = total

    if const_expr(splits > 1):
        sum_splits(y, e, ws, cnt_ptr, is_last, head, tile, tiles_n, tid, m, scale, n, block_n, 8 * m_atoms, threads,
                   splits, ops.epilogue)


@cute.jit
def _skinny_gemm_host(
    w_ptr: cute.Pointer, x_ptr: cute.Pointer, y_ptr: cute.Pointer, e_ptr: cute.Pointer, ws_ptr: cute.Pointer,
    cnt_ptr: cute.Pointer, m: Int32, scale: Float32, stream: cuda.CUstream,
    n: Constexpr, k: Constexpr, m_atoms: Constexpr,
    row_tiles: Constexpr, chunk_atoms: Constexpr, x_atoms: Constexpr,
    warps_n: Constexpr, warps_k: Constexpr, splits: Constexpr, ops: Constexpr,
):
    block_n = 16 * row_tiles * warps_n
    _skinny_gemm_kernel(
        w_ptr, x_ptr, y_ptr, e_ptr, ws_ptr, cnt_ptr, m, scale, n, k, m_atoms,
        row_tiles, chunk_atoms, x_atoms, warps_n, warps_k, splits, ops,
    ).launch(
        grid=((n + block_n - 1) // block_n, splits, ops.heads),
        block=(32 * warps_n * warps_k, 1, 1),
        stream=stream,
        use_pdl=True,
        # registers capped for the residency the tiling assumes; at one 8-row atom every pick
        # fits 64 registers by itself, and the cap there only moved the split-K tail's registers
        # to the stack. With a cap the carveout is named (the driver's default, -1), or the
        # compile would query a device for it
        min_blocks_per_mp=resident_ctas(m_atoms) if m_atoms > 1 else 0,
        preferred_smem_carveout=-1 if m_atoms > 1 else None,
    )


def compile_skinny_gemm(n: int, k: int, m_atoms: int, out_dtype: torch.dtype, tiling: Tiling | WgmmaTiling,
                        arch: str, ptx_dir: str | None = None, ops: Operands | None = None) -> Any:
    """Compile for one static shape, operand layout (default: `Operands.plain`) and arch
    ('sm_90a', 'sm_100a', ...); needs no GPU. The tiling's type picks the kernel: a `WgmmaTiling`
    compiles `skinny_gemm_wgmma`'s (sm_90a, 2-D x).

    With ptx_dir the PTX and the cubin are kept in the result's `artifacts.PTX` and
    `artifacts.CUBIN` (and written into ptx_dir).
    """
    if isinstance(tiling, WgmmaTiling):
        return compile_skinny_gemm_wgmma(n, k, m_atoms, _OUT_DTYPES[out_dtype], tiling, arch,
                                         ops or Operands.plain(n, k), ptx_dir)
    return cute.compile(
        _skinny_gemm_host,
        gmem_ptr(BFloat16, 16), gmem_ptr(BFloat16, 16), gmem_ptr(_OUT_DTYPES[out_dtype], 16), gmem_ptr(BFloat16, 16, 2),
        gmem_ptr(Float32, 16), gmem_ptr(Int32, 16, 4), Int32(1), Float32(1.0), cute.runtime.make_fake_stream(),
        n, k, m_atoms, tiling.row_tiles, tiling.chunk_atoms, tiling.x_atoms,
        tiling.warps_n, tiling.warps_k, tiling.splits, ops or Operands.plain(n, k),
        options=f"--gpu-arch {arch}" + (f" --keep-ptx --keep-cubin --dump-dir={ptx_dir}" if ptx_dir else ""),
    )


def _strides(t: torch.Tensor) -> tuple[int, int]:
    """(per head, per row) strides of a [M, N] or [M, B, N] operand."""
    return (0, t.stride(0)) if t.dim() == 2 else (t.stride(1), t.stride(0))


def reads_in_place(x: torch.Tensor) -> bool:
    """Whether the GEMM can read x's rows where they are: unit stride along K, head and row
    strides that are multiples of 8 elements, 16-byte aligned (a column slice of a wider
    output qualifies when its first column does)."""
    return x.stride(-1) == 1 and all(st % 8 == 0 for st in _strides(x)) and x.data_ptr() % 16 == 0


def check_envelope(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor | None, out_dtype: torch.dtype,
                   epilogue: tuple[str, torch.Tensor | None] = ("none", None)) -> None:
    """Raise SkinnyGemmEnvelopeError naming what is outside the envelope (no GPU work)."""
    def need(cond: bool, msg: str) -> None:
        if not cond:
            raise SkinnyGemmEnvelopeError(f"skinny_gemm: {msg}")

    need(isinstance(x, torch.Tensor) and isinstance(w, torch.Tensor), "x and w must be torch tensors")
    need((x.dim(), w.dim()) in ((2, 2), (3, 3)),
         f"x must be [M, K] and w [N, K], or per head x [M, B, K] and w [B, N, K]; got x {tuple(x.shape)}, "
         f"w {tuple(w.shape)}")
    need(x.dtype == torch.bfloat16 and w.dtype == torch.bfloat16,
         f"x and w must be bfloat16, got x {x.dtype}, w {w.dtype}; cast them first")
    need(out_dtype in _OUT_DTYPES, f"out_dtype must be torch.bfloat16 or torch.float32, got {out_dtype}")
    m, k, kw, n = x.shape[0], x.shape[-1], w.shape[-1], w.shape[-2]
    heads = 1 if x.dim() == 2 else x.shape[1]
    need(k == kw, f"x has K={k} columns but w has K={kw}")
    need(x.dim() == 2 or w.shape[0] == heads, f"x has {heads} heads but w has {w.shape[0]}")
    need(1 <= m <= MAX_ROWS, f"M={m} rows is outside 1..{MAX_ROWS}; split the batch into chunks of <= {MAX_ROWS}")
    need(k % 8 == 0 and k > 0, f"K={k} must be a positive multiple of 8 (16-byte rows); pad K with zeros")
    need(n % 16 == 0 and n > 0, f"N={n} must be a positive multiple of 16; pad W with zero rows")
    need(w.is_contiguous(), "w must be contiguous (row-major); call .contiguous()")
    need(reads_in_place(x),
         f"x must have unit stride along K, head/row strides that are multiples of 8 elements and a 16-byte "
         f"aligned start, got strides {tuple(x.stride())} at address % 16 = {x.data_ptr() % 16}; call .contiguous()")
    y_shape = (m, n) if x.dim() == 2 else (m, heads, n)
    if out is not None:
        need(tuple(out.shape) == y_shape and out.dtype == out_dtype and out.stride(-1) == 1,
             f"out must be a {list(y_shape)} {out_dtype} tensor with unit stride along N, got {tuple(out.shape)} "
             f"{out.dtype} strides {tuple(out.stride())}")
    kind, operand = epilogue
    need(kind in EPILOGUES, f"epilogue must be one of {EPILOGUES}, got {kind!r}")
    need(kind == "none" or (kind == "scale") == (operand is None),
         f"the {kind!r} epilogue takes {'a float, not a tensor' if kind == 'scale' else 'a tensor'}")
    need(kind != "scale" or out_dtype == torch.float32,
         f"the 'scale' epilogue writes FP32 (the logit scale), got out_dtype={out_dtype}: a bf16 output would "
         "round twice")
    if operand is not None:
        need(isinstance(operand, torch.Tensor) and tuple(operand.shape) == y_shape
             and operand.dtype == torch.bfloat16 and operand.stride(-1) == 1,
             f"the {kind} operand must be a {list(y_shape)} bfloat16 tensor with unit stride along N, got "
             f"{tuple(operand.shape) if isinstance(operand, torch.Tensor) else type(operand).__name__}")
    tensors = [t for t in (x, w, out, operand) if t is not None]
    need(all(t.device.type == "cuda" for t in tensors), "x, w, out and the epilogue operand must be CUDA tensors")
    need(all(t.device == x.device for t in tensors), "x, w, out and the epilogue operand must be on one device")
    need(all(t.data_ptr() % 16 == 0 for t in (w, out) if t is not None),
         "w and out must be 16-byte aligned (fresh allocations are; a column slice must start at a multiple "
         "of 8 elements)")


def _split_scratch(dev: DeviceFacts, n: int, tiling: Tiling, heads: int) -> tuple[torch.Tensor, ...]:
    """FP32 partials [heads, splits, 64, N] and zeroed per-tile arrival counters for one shape (the
    last CTA of a tile zeroes its counter again)."""
    ws_elems = heads * tiling.splits * MAX_ROWS * n if tiling.splits > 1 else 4
    return dev.scratch(("skinny_gemm", n, tiling, heads), lambda d: (
        torch.empty(ws_elems, dtype=torch.float32, device=d),
        torch.zeros(heads * tiling.tiles_n(n), dtype=torch.int32, device=d)))


_COMPILED: dict[tuple, Any] = {}


def launch(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor | None = None, *,
           out_dtype: torch.dtype = torch.bfloat16, stream: torch.cuda.Stream | None = None,
           tiling: Tiling | WgmmaTiling | None = None, scale: float | None = None, addend: torch.Tensor | None = None,
           gate: torch.Tensor | None = None) -> torch.Tensor:
    """y = x · wᵀ (per head for 3-D x and w) into `out` (allocated when None) on `stream` (default:
    the current stream), through at most one epilogue: `scale`, `addend` or `gate`.

    The first call of a shape compiles (seconds); later calls only launch. Beyond 16 rows of 2-D x
    on sm_90a the step runs `skinny_gemm_wgmma`'s kernel. `tiling` overrides the heuristic and,
    by its type, the kernel (benchmarks use it to compare tilings).
    """
    chosen = [(kind, v) for kind, v in (("scale", scale), ("add", addend), ("gate", gate)) if v is not None]
    if len(chosen) > 1:
        raise SkinnyGemmEnvelopeError(f"skinny_gemm: at most one epilogue, got {[kind for kind, _ in chosen]}")
    kind, value = chosen[0] if chosen else ("none", None)
    operand = None if kind in ("none", "scale") else value
    check_envelope(x, w, out, out_dtype, (kind, operand))
    m, k, n = x.shape[0], x.shape[-1], w.shape[-2]
    heads = 1 if x.dim() == 2 else x.shape[1]
    dev = facts(x.device)
    m_atoms = -(-m // 8)
    if tiling is None:
        tiling = pick_tiling(dev.arch, n, k, m_atoms, dev.sm_count, heads)
    elif isinstance(tiling, WgmmaTiling) and not (dev.arch in WGMMA_ARCHS and heads == 1):
        raise SkinnyGemmEnvelopeError(f"skinny_gemm: a WgmmaTiling needs 2-D x on one of {WGMMA_ARCHS}, got "
                                      f"{heads} heads on {dev.arch}; pass a Tiling or none")
    if out is None:
        out = torch.empty((m, n) if x.dim() == 2 else (m, heads, n), dtype=out_dtype, device=x.device)
    ops = Operands(heads, _strides(x), _strides(out), kind,
                   _strides(operand) if operand is not None else (0, 0))
    if isinstance(tiling, WgmmaTiling):
        m_atoms += m_atoms % 2  # its x tiles have 16·ceil(M/16) rows: one program for 17-32 rows, ...
    key = (n, k, m_atoms, out_dtype, dev.arch, tiling, ops)
    fn = _COMPILED.get(key)
    if fn is None:
        fn = _COMPILED[key] = compile_skinny_gemm(n, k, m_atoms, out_dtype, tiling, dev.arch, ops=ops)
    ws, cnt = _split_scratch(dev, n, tiling, heads)
    stream = torch.cuda.current_stream(x.device) if stream is None else stream
    e_addr = (operand if operand is not None else x).data_ptr()
    fn(gmem_ptr(BFloat16, w.data_ptr()), gmem_ptr(BFloat16, x.data_ptr()),
       gmem_ptr(_OUT_DTYPES[out_dtype], out.data_ptr()), gmem_ptr(BFloat16, e_addr, 2), gmem_ptr(Float32, ws.data_ptr()),
       gmem_ptr(Int32, cnt.data_ptr(), 4), m, float(scale if scale is not None else 1.0),
       cuda.CUstream(stream.cuda_stream))
    return out
