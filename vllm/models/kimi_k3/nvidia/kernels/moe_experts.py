"""Routed experts of the latent MoE for decode rows: each selected expert's weights read once.

Compiled for sm_90a, sm_100a and sm_103a. Evidence (`evidence/<card>/`, one folder a
card): `moe_test.json`, `moe_bench.json`, `moe_unread_test.json`.

Math (`reference/moe.py::_routed_latent`, K3_MATH.md §3.6), one TP rank, for every pick
p = r·k + j of row r's j-th selected expert e = ids[r, j]:

    g, u   = bf16(x_lat[r] · W13[e]ᵀ) split into the gate and up halves   (fp32 sums)
    h[p]   = bf16(β·tanh(g/β)·σ(g) · λ·tanh(u/λ))                          (SiTU, fp32)
    o[p]   = bf16(h[p] · W2[e]ᵀ)                                            (fp32 sums)
    y[r]   = bf16(Σ_j w[r, j] · o[r·k + j])   fp32, in selection order     (kernels/moe_combine.py)

This file holds one kernel, a grouped expert GEMV launched twice (gate/up with the SiTU epilogue
into h, then down into o), and the launcher of the whole op, which then runs the combine.

Envelope: x_lat [M, H] bf16, 1 <= M <= 64; ids [M, k] int32 and weights [M, k] fp32,
1 <= k <= 32; w13 [E, 2·I, H] and w2 [E, H, I] bf16, each slice holding `inter` real columns
(default I) and zeros beyond; H % 128 == 0, and the real columns rounded up to 64 fit in I (K3
per rank: H = 3584, I = 3072 @TP1, 384 @TP8, and @TP16 192 real of 256: vLLM pads the slice to
256, the kernels read 192, a quarter fewer bytes); all contiguous, 16-byte aligned, on one
CUDA device. Ids outside [0, E) are padding: skipped, their weight unused. An id repeated
within a row (the router never does this) is computed once, into the row of its first pick, and
the combine reads that row for every repeat, so each pick still adds w_j · expert(x).

Grouping without a host step: CTA (p, tile) looks at pick p's expert e; its threads scan the M·k
ids, one row each, and two warp ballots mark the rows that picked e (first match per row): their
popcounts give e's row count and each row's slot, their lowest bit e's first pick, with no serial
loop (M·k × tiles CTAs run this, 57 344 in the TP16 down pass). Only the CTA of e's first pick
(lowest p) is the leader; it runs the GEMV over all of e's rows, the others exit. So
each selected expert's weights are read once per launch, and unselected experts never. The
chunk loop is compiled for 1, 2, 4 … ⌈M/8⌉ atoms of 8 rows (`atom_steps`); the leader runs the
smallest that holds e's rows, padded with a repeated real row whose results are never stored,
so at 64 rows an expert picked by 1–8 of them costs one atom of x loads and MMAs, not eight.

GEMV (as kernels/skinny_gemm.py): W is the mma.sync m16n8k16 A operand, loaded by 16-byte
register loads in a K order permuted so the registers already are fragments; the gathered x
rows are the B operand; each warp keeps the next K chunk in flight; the warps of a CTA split
the expert's rows (warps_n) and K (warps_k), partial sums meet in shared memory. For gate/up a
warp's W rows are gate rows n.. and the matching up rows I + n.. (two 16-row tiles, 16 outputs;
or one tile, gate rows in its upper and up rows in its lower 8, 8 outputs and twice the CTAs,
where that loads the SMs more evenly: `choose_tiling`), so a thread holds gate and up of the
same output and applies SiTU directly. No split-K across CTAs, so no
scratch counters; the h and o buffers are per device and shape, reused by every launch (launches
must be stream-ordered, as the skinny GEMM's).

PDL: both passes release their dependents first. The down pass is launched as a PDL dependent,
so its CTAs group their picks and put the first W chunk in flight while the gate/up pass
finishes, and wait (griddepcontrol.wait) before they read h. Reading the ids before that wait is
safe because the gate/up pass is a plain launch: it starts only after the router's kernels are
done, and the down pass cannot start before it has.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
import torch
from cutlass import BFloat16, Constexpr, Float32, Int32, Int64, const_expr

from . import moe_combine
from .device import DeviceFacts, facts
from .rows import gmem_ptr
from .skinny_gemm import mma_registers, mma_step

MAX_ROWS = 64
MAX_TOP_K = 32


class MoEExpertsEnvelopeError(ValueError):
    """The inputs fall outside what the routed-expert kernels support."""


@dataclass(frozen=True)
class ExpertTiling:
    """How one expert's GEMV is cut into warps and CTAs (all compile-time)."""

    row_tiles: int  # 16-row W tiles per warp; gate/up: 8·row_tiles outputs, each a gate and an up row
    chunk_atoms: int  # k16 atoms of one K chunk a warp loads at once (even)
    x_atoms: int  # k16 atoms of x per MMA step (even, divides chunk_atoms)
    warps_n: int
    warps_k: int

    def __post_init__(self) -> None:
        if self.chunk_atoms % 2 or self.x_atoms % 2 or self.chunk_atoms % self.x_atoms:
            raise ValueError(f"{self}: chunk_atoms and x_atoms must be even, x_atoms must divide chunk_atoms")
        # at least 64 threads: one per possible row in the grouping scan
        if not 2 <= self.warps_n * self.warps_k <= 8 or self.row_tiles < 1:
            raise ValueError(f"{self}: needs 2..8 warps per CTA and row_tiles >= 1")

    def block_out(self, gate_up: bool) -> int:
        """Output columns of one CTA (gate/up: hidden columns, each from a gate and an up row)."""
        return 16 * self.warps_n * self.row_tiles // (2 if gate_up else 1)

    @property
    def chunk_k(self) -> int:
        return 16 * self.chunk_atoms


def wave_fill(ctas: int, sm_count: int) -> float:
    """How evenly `ctas` equal CTAs, all resident at once, load `sm_count` SMs: the mean SM's
    share of the busiest one's (which sets the time of a bandwidth-bound pass)."""
    return ctas / (sm_count * -(-ctas // sm_count))


def choose_tiling(gate_up: bool, n_out: int, k: int, m_atoms: int, experts: int = 0,
                  sm_count: int = 0) -> ExpertTiling:
    """Tiling of one expert's [n_out, k] GEMV (gate/up: 2·n_out weight rows); `experts` (those the
    step may select, at most M·k) and `sm_count`, where given, let gate/up take 8-output warps.

    The skinny GEMM's H200-measured classes: up to 16 rows 128-wide chunks, beyond that
    64-wide ones and two row tiles per warp so the accumulators fit; 8 warps, 4 along K
    (fewer when K has fewer chunks, then more along N); warps_n shrinks until the CTAs tile the
    output exactly, so no row bounds are needed inside the kernel. One measured exception
    (benchmarks/sweep_moe_tiling.py, H200, TP16): gate/up at M <= 8 puts all 8 warps along K over
    64-wide chunks, one 16-row pair per warp: 14.5 µs at M = 1 and about 82 at M = 8 against
    17.7 and 131 for the class above, whose 8 warps with 128-wide chunks were the slowest at M = 8.

    Gate/up warps cover 8 outputs instead of 16 where that loads the SMs more evenly (`wave_fill`
    of the selected experts' CTAs, all resident): at TP16 and one row, 16 experts × 12 CTAs of
    229 KB put two CTAs on 60 SMs and one on 72 (the mean SM carries 0.73 of the busiest one's
    bytes), and the pass took 14.5 µs, about what 458 KB take at a 132nd of the copy bandwidth,
    against 10.4 for its bytes; 384 CTAs of half the bytes put 2 or 3 on each (0.97).
    """
    small_m = m_atoms <= 2
    chunk_atoms, x_atoms = (8, 4) if small_m and not (gate_up and m_atoms == 1) else (4, 2)
    if k % (16 * chunk_atoms):
        chunk_atoms, x_atoms = 4, 2
    row_tiles = 2 if gate_up or not small_m else 1
    chunks = k // (16 * chunk_atoms)
    warps_k = max(1, min(8 if gate_up and m_atoms == 1 else 4, chunks))
    warps_n = max(1, 8 // warps_k)
    while n_out % (16 * warps_n * (1 if gate_up else row_tiles)):
        warps_n //= 2
    if warps_n * warps_k < 2:  # keep >= 64 threads for the grouping scan
        warps_k = 2
    t = ExpertTiling(row_tiles, chunk_atoms, x_atoms, warps_n, warps_k)
    if gate_up and experts and sm_count:
        half = replace(t, row_tiles=1)
        # only a clear gain: halving the CTAs' bytes doubles their fixed costs
        if wave_fill(experts * (n_out // half.block_out(True)), sm_count) > \
                wave_fill(experts * (n_out // t.block_out(True)), sm_count) + 0.1:
            t = half
    return t


def weight_row(gate_up: bool, up_at: int, row_tiles: int, warps_n: int, tile, wn, g, i: int):
    """The expert's weight row that register row i of lane group g in warp wn of CTA `tile`
    loads: i // 2 is the warp's 16-row tile, i % 2 its 8-row half. For gate/up the first
    row_tiles register rows are gate rows and the rest the matching up rows, which start at row
    up_at (w13's padded half; unused for down): with two tiles, tile 0 gate and tile 1 up; with
    one, its upper half gate and its lower half up. Plain arithmetic: the kernel calls it on
    device integers, the CPU tests on Python ints."""
    if gate_up:
        per_warp = 8 * row_tiles  # outputs
        return tile * per_warp * warps_n + wn * per_warp + g + 8 * (i % row_tiles) + (i // row_tiles) * up_at
    return tile * 16 * row_tiles * warps_n + wn * 16 * row_tiles + g + (i // 2) * 16 + 8 * (i % 2)


def block_column(row_tiles: int, wn, r: int, v1: int, g):
    """Column of the CTA's shared-memory partial sums that accumulator (r, v1) of lane group g
    in warp wn lands in (its weight row, counted inside the CTA's block of rows)."""
    return wn * 16 * row_tiles + 16 * r + 8 * v1 + g


def gate_column(col, row_tiles: int):
    """For gate/up: the block column of hidden column `col`'s gate sum (its up sum is
    8·row_tiles on: a warp's block of 16·row_tiles columns holds its gate sums, then its up sums)."""
    per_warp = 8 * row_tiles
    return (col // per_warp) * 2 * per_warp + col % per_warp


@cute.jit
def _load_w(w_vec: cute.Tensor, dst: cute.Tensor, gate_up: Constexpr, up_at: Constexpr, row_tiles: Constexpr,
            warps_n: Constexpr, tile: Int32, wn: Int32, g: Int32, col0: Int32, vecs: Constexpr):
    """This lane's 2·row_tiles weight rows (`weight_row`), `vecs` 16-byte vectors each from
    column vector col0 on, into registers one row after the other."""
    for i in cutlass.range_constexpr(2 * row_tiles):
        row = weight_row(gate_up, up_at, row_tiles, warps_n, tile, wn, g, i)
        for v in cutlass.range_constexpr(vecs):
            vec = cute.make_tensor(dst.iterator + (i * vecs + v) * 8, cute.make_layout(8))
            cute.autovec_copy(w_vec[(0, None), (row, col0 + v)], vec)


@cute.jit
def _load_x(x_vec: cute.Tensor, dst: cute.Tensor, x_rows: cute.Tensor, atoms: Constexpr,
            col0: Int32, vecs: Constexpr):
    """The gathered x rows x_rows[i] (one per 8-slot atom i) × `vecs` 16-byte vectors."""
    for i in cutlass.range_constexpr(atoms):
        for v in cutlass.range_constexpr(vecs):
            vec = cute.make_tensor(dst.iterator + (i * vecs + v) * 8, cute.make_layout(8))
            cute.autovec_copy(x_vec[(0, None), (x_rows[i], col0 + v)], vec)


def atom_steps(m_atoms: int) -> list[int]:
    """The 8-row atom counts the chunk loop is compiled for: 1, 2, 4, … below m_atoms, then m_atoms.
    An expert with r rows runs the smallest count >= ⌈r/8⌉, so at most half its atoms are padding
    (beyond the one partial atom) while the kernel holds log2(m_atoms) + 1 loop copies."""
    steps = []
    a = 1
    while a < m_atoms:
        steps.append(a)
        a *= 2
    return steps + [m_atoms]


def atom_window(m_atoms: int, i: int) -> tuple[int, int]:
    """(fewer, atoms): loop copy i of atom_steps serves experts needing fewer < ⌈rows/8⌉ <= atoms."""
    steps = atom_steps(m_atoms)
    return (steps[i - 1] if i else 0), steps[i]


@cute.jit
def _trailing_zeros(word: Int32) -> Int32:
    """Index of the lowest set bit of `word` (32 when none is set)."""
    return Int32(cute.arch.clz(cute.arch.brev(word)))


@cute.jit
def situ(gate: Float32, up: Float32, beta: Constexpr, linear_beta: Constexpr) -> Float32:
    """SiTU(g, u) in fp32 on the bf16-rounded gate and up (reference/ops.py::situ_and_mul)."""
    g = gate.to(BFloat16).to(Float32)
    u = up.to(BFloat16).to(Float32)
    sig = Float32(1.0) / (Float32(1.0) + cute.math.exp(-g))
    gc = g
    if const_expr(beta is not None):
        gc = Float32(beta) * cute.math.tanh(g / Float32(beta))
    uc = u
    if const_expr(linear_beta is not None):
        uc = Float32(linear_beta) * cute.math.tanh(u / Float32(linear_beta))
    return gc * sig * uc


@cute.jit
def _expert_rows_gemv(w_vec: cute.Tensor, x_vec: cute.Tensor, src_row: cute.Tensor, red: cute.Tensor, rows: Int32,
                      gate_up: Constexpr, up_at: Constexpr, k: Constexpr, atoms: Constexpr, row_tiles: Constexpr,
                      chunk_atoms: Constexpr, x_atoms: Constexpr, warps_n: Constexpr, warps_k: Constexpr,
                      tile: Int32, wn: Int32, wk: Int32, g: Int32, c: Int32):
    """One warp's share of the expert's GEMV over `atoms` 8-row atoms of gathered x rows, its
    partial sums stored into red[wk, slot, block column]."""
    lane_elems = 4 * chunk_atoms
    x_elems = 4 * x_atoms
    chunk_k = 16 * chunk_atoms
    n_chunks = k // chunk_k
    # slots past the expert's rows repeat its last row: computed, never stored
    x_rows = cute.make_rmem_tensor(cute.make_layout(atoms), Int32)
    for i in cutlass.range_constexpr(atoms):
        x_rows[i] = src_row[cutlass.min(g + 8 * i, rows - 1)]
    my_chunks = (n_chunks - wk + warps_k - 1) // warps_k

    w_next, w_cur, x_frag, acc, mma = mma_registers(lane_elems, 2 * row_tiles, x_elems, row_tiles, atoms)

    if my_chunks > 0:
        _load_w(w_vec, w_next, gate_up, up_at, row_tiles, warps_n, tile, wn, g,
                wk * (chunk_k // 8) + c * (lane_elems // 8), lane_elems // 8)
    if const_expr(not gate_up):
        # the down pass is a PDL dependent of the gate/up pass: its first W chunk (which no kernel
        # writes) is in flight while that pass finishes; h is read, and o written, only after it
        cute.arch.griddepcontrol_wait()
    for it in cutlass.range(my_chunks):
        chunk = wk + it * warps_k
        # chunk i+1 is in flight while chunk i is multiplied
        w_cur.store(w_next.load())
        if it + 1 < my_chunks:
            _load_w(w_vec, w_next, gate_up, up_at, row_tiles, warps_n, tile, wn, g,
                    (chunk + warps_k) * (chunk_k // 8) + c * (lane_elems // 8), lane_elems // 8)
        for s in cutlass.range_constexpr(chunk_atoms // x_atoms):
            _load_x(x_vec, x_frag, x_rows, atoms,
                    chunk * (chunk_k // 8) + c * (lane_elems // 8) + s * (x_elems // 8), x_elems // 8)
            mma_step(mma, acc, w_cur, x_frag, s, lane_elems, x_elems, row_tiles, x_atoms, atoms)

    # acc[(v0, v1), r, j]: register row 2r + v1 of the lane group (weight_row), slot 8j + 2c + v0
    for r in cutlass.range_constexpr(row_tiles):
        for j in cutlass.range_constexpr(atoms):
            for v1 in cutlass.range_constexpr(2):
                for v0 in cutlass.range_constexpr(2):
                    red[wk, 8 * j + 2 * c + v0, block_column(row_tiles, wn, r, v1, g)] = acc[(v0, v1), r, j]


@cute.kernel
def _expert_gemv_kernel(
    w_ptr: cute.Pointer, x_ptr: cute.Pointer, ids_ptr: cute.Pointer, out_ptr: cute.Pointer,
    m: Int32, n_experts: Constexpr, top_k: Constexpr, n_out: Constexpr, k: Constexpr, w_rows: Constexpr,
    ld: Constexpr, gate_up: Constexpr, beta: Constexpr, linear_beta: Constexpr, m_atoms: Constexpr,
    row_tiles: Constexpr, chunk_atoms: Constexpr, x_atoms: Constexpr,
    warps_n: Constexpr, warps_k: Constexpr,
):
    cute.arch.griddepcontrol_launch_dependents()  # a PDL-launched GEMM may start its W loads (skinny_gemm.py)
    tid, _, _ = cute.arch.thread_idx()
    pick, tile, _ = cute.arch.block_idx()
    lane = tid % 32
    warp = tid // 32
    wn = warp % warps_n
    wk = warp // warps_n
    g = lane // 4
    c = lane % 4
    threads = 32 * warps_n * warps_k
    block_w = 16 * row_tiles * warps_n  # weight rows of one CTA
    block_out = block_w // 2 if gate_up else block_w
    # x: gate/up reads the token row r, down reads h of the pick r·k + j
    x_rows_total = m if gate_up else m * top_k

    smem = cutlass.memory.SmemAllocator()
    hit = smem.allocate_tensor(Int32, cute.make_layout(MAX_ROWS), byte_alignment=16)
    src_row = smem.allocate_tensor(Int32, cute.make_layout(MAX_ROWS), byte_alignment=16)
    dst_pick = smem.allocate_tensor(Int32, cute.make_layout(MAX_ROWS), byte_alignment=16)
    ballots = smem.allocate_tensor(Int32, cute.make_layout(2), byte_alignment=16)  # rows 0-31, 32-63
    pitch = block_w + 4  # spreads a warp's stores over the banks
    red = smem.allocate_tensor(
        Float32, cute.make_layout((warps_k, 8 * m_atoms, block_w), stride=(8 * m_atoms * pitch, pitch, 1)),
        byte_alignment=16)

    ids = cute.make_tensor(ids_ptr, cute.make_layout(m * top_k))
    expert = ids[pick]

    # grouping: thread r < M finds the first j with ids[r, j] == expert; warps 0 and 1 (rows
    # 0-31 and 32-63) ballot which rows hold it, so every CTA, the many that exit at once
    # included, learns the expert's rows and first pick from two words instead of a serial scan
    if tid < MAX_ROWS:
        j_hit = Int32(-1)
        if tid < m:
            for j in cutlass.range_constexpr(top_k - 1, -1, -1):  # downwards: the lowest j wins
                if ids[tid * top_k + j] == expert:
                    j_hit = Int32(j)
        hit[tid] = j_hit
        votes = cute.arch.vote_ballot_sync(j_hit >= 0)
        if lane == 0:
            ballots[warp] = votes
    cute.arch.sync_threads()
    low = ballots[0]
    rows = cute.arch.popc(low) + cute.arch.popc(ballots[1])
    first_row = 32 + _trailing_zeros(ballots[1])
    if low != 0:
        first_row = _trailing_zeros(low)
    # padding ids (outside [0, E)) lead nothing; a valid expert has at least its own pick's row.
    # Nested ifs keep every comparison a device branch instead of relying on how Python's `and`
    # is traced
    leader = Int32(0)
    if expert >= 0:
        if expert < n_experts:
            if first_row * top_k + hit[first_row] == pick:
                leader = Int32(1)

    if leader == 1:
        if tid < MAX_ROWS:
            j_mine = hit[tid]
            if j_mine >= 0:
                # rows before this one that hold the expert: this warp's lower lanes, plus all of
                # warp 0's for warp 1
                slot = cute.arch.popc(ballots[warp] & Int32(cute.arch.lanemask_lt())) + warp * cute.arch.popc(low)
                src_row[slot] = tid if const_expr(gate_up) else tid * top_k + j_mine
                dst_pick[slot] = tid * top_k + j_mine
        cute.arch.sync_threads()
        # 64-bit: E·rows·K exceeds 2^31 elements at K3's shapes; the divisibility keeps the
        # pointer's 16-byte alignment known, so the W loads stay 16-byte vectors
        w_expert = w_ptr + cute.assume(Int64(expert) * Int64(w_rows * ld), divby=8)
        w_vec = cute.zipped_divide(cute.make_tensor(w_expert, cute.make_layout((w_rows, k), stride=(ld, 1))), (1, 8))
        x_vec = cute.zipped_divide(
            cute.make_tensor(x_ptr, cute.make_layout((x_rows_total, k), stride=(k, 1))), (1, 8))

        # the chunk loop is compiled once per atom count of atom_steps(m_atoms); the CTA runs the
        # smallest that holds its expert's rows, so x loads and MMAs follow the expert's rows, not M
        need = (rows + 7) // 8
        for si in cutlass.range_constexpr(len(atom_steps(m_atoms))):
            fewer, atoms = atom_window(m_atoms, si)
            if need > fewer:
                if need <= atoms:
                    _expert_rows_gemv(w_vec, x_vec, src_row, red, rows, gate_up, w_rows // 2, k, atoms, row_tiles,
                                      chunk_atoms, x_atoms, warps_n, warps_k, tile, wn, wk, g, c)
        cute.arch.sync_threads()

        out = cute.make_tensor(out_ptr, cute.make_layout((m * top_k, n_out), stride=(n_out, 1)))
        for idx in cutlass.range(tid, rows * block_out, threads):
            slot = idx // block_out
            col = idx % block_out
            if const_expr(gate_up):
                gate_col = gate_column(col, row_tiles)
                up_col = gate_col + 8 * row_tiles
                gate = red[0, slot, gate_col]
                up = red[0, slot, up_col]
                for q in cutlass.range_constexpr(1, warps_k):
                    gate += red[q, slot, gate_col]
                    up += red[q, slot, up_col]
                out[dst_pick[slot], tile * block_out + col] = situ(gate, up, beta, linear_beta).to(BFloat16)
            else:
                total = red[0, slot, col]
                for q in cutlass.range_constexpr(1, warps_k):
                    total += red[q, slot, col]
                out[dst_pick[slot], tile * block_out + col] = total.to(BFloat16)


def register_cap(gate_up: bool, m_atoms: int, warps: int) -> int:
    """CTAs an SM that a pass's launch caps its registers for (0: no cap).

    Beyond 16 rows the kernel's loop copies for 4 and 8 row atoms take 174-238 registers, so an
    8-warp CTA holds an SM alone. Capped at two CTAs an SM they spill (the copies for up to 16
    rows, which serve nearly every expert at uniform routing, do not). H200, 2026-12-04, the cap
    toggled per pass and timed as bench_moe times the experts: it pays in the down pass, whose
    short K (TP8: 6 chunks of 64) passes over the spilled state a few times a tile: TP8 M = 32
    1025 -> 844 µs, M = 64 1660 -> 1369. Gate/up, 56 chunks of K = 3584 over it, gained 1-2% at
    M = 32 (TP16 409 against 416 µs, TP8 1020 against 1025) and lost 3% at 64 (TP16 815 against
    789, TP8 1713 against 1660). TP16's 6-warp down pass holds three CTAs an SM uncapped, and the
    cap slowed it (M = 32: 454 against 416)."""
    return 2 if not gate_up and m_atoms > 2 and warps == 8 else 0


@cute.jit
def _expert_gemv_host(
    w_ptr: cute.Pointer, x_ptr: cute.Pointer, ids_ptr: cute.Pointer, out_ptr: cute.Pointer,
    m: Int32, stream: cuda.CUstream,
    n_experts: Constexpr, top_k: Constexpr, n_out: Constexpr, k: Constexpr, w_rows: Constexpr, ld: Constexpr,
    gate_up: Constexpr, beta: Constexpr, linear_beta: Constexpr, m_atoms: Constexpr,
    row_tiles: Constexpr, chunk_atoms: Constexpr, x_atoms: Constexpr,
    warps_n: Constexpr, warps_k: Constexpr,
):
    block_out = ExpertTiling(row_tiles, chunk_atoms, x_atoms, warps_n, warps_k).block_out(gate_up)
    cap = register_cap(gate_up, m_atoms, warps_n * warps_k)
    _expert_gemv_kernel(
        w_ptr, x_ptr, ids_ptr, out_ptr, m, n_experts, top_k, n_out, k, w_rows, ld, gate_up, beta, linear_beta,
        m_atoms, row_tiles, chunk_atoms, x_atoms, warps_n, warps_k,
    ).launch(
        grid=(m * top_k, n_out // block_out, 1),
        block=(32 * warps_n * warps_k, 1, 1),
        stream=stream,
        # with a cap the carveout is named (the driver's default, -1), or the compile would query
        # a device for it
        min_blocks_per_mp=cap,
        preferred_smem_carveout=-1 if cap else None,
        use_pdl=not gate_up,
    )


def compile_expert_gemv(gate_up: bool, n_experts: int, top_k: int, n_out: int, k: int, m_atoms: int,
                        beta: float | None, linear_beta: float | None, tiling: ExpertTiling,
                        arch: str, ptx_dir: str | None = None, *, w_rows: int | None = None,
                        ld: int | None = None) -> Any:
    """Compile one GEMV pass (gate/up with SiTU, or down) for a static shape and arch; needs no GPU.

    The pass reads n_out outputs over k inputs out of each expert's stored [w_rows, ld] block
    (default: exactly [2·n_out or n_out, k]); a wider block is the zero-padded slice of
    `launch`, whose padding is never read. With ptx_dir the PTX and the cubin are kept in the
    result's `artifacts.PTX` and `artifacts.CUBIN` (and written into ptx_dir).
    """
    w_rows = (2 * n_out if gate_up else n_out) if w_rows is None else w_rows
    ld = k if ld is None else ld
    return cute.compile(
        _expert_gemv_host,
        gmem_ptr(BFloat16, 16), gmem_ptr(BFloat16, 16), gmem_ptr(Int32, 16, 4), gmem_ptr(BFloat16, 16),
        Int32(1), cute.runtime.make_fake_stream(),
        n_experts, top_k, n_out, k, w_rows, ld, gate_up, beta, linear_beta, m_atoms,
        tiling.row_tiles, tiling.chunk_atoms, tiling.x_atoms, tiling.warps_n, tiling.warps_k,
        options=f"--gpu-arch {arch}" + (f" --keep-ptx --keep-cubin --dump-dir={ptx_dir}" if ptx_dir else ""),
    )


INTER_CHUNK = 64  # the down pass's K chunk: the intermediate columns are read in whole chunks


def read_width(inter: int) -> int:
    """Intermediate columns the kernels read for an expert slice holding `inter` real ones."""
    return -(-inter // INTER_CHUNK) * INTER_CHUNK


def check_envelope(x_lat: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, w13: torch.Tensor,
                   w2: torch.Tensor, out: torch.Tensor | None, inter: int | None = None) -> None:
    """Raise MoEExpertsEnvelopeError naming what is outside the envelope (no GPU work)."""
    def need(cond: bool, msg: str) -> None:
        if not cond:
            raise MoEExpertsEnvelopeError(f"moe_experts: {msg}")

    named = {"x_lat": x_lat, "ids": ids, "weights": weights, "w13": w13, "w2": w2}
    need(all(isinstance(t, torch.Tensor) for t in named.values()), "all inputs must be torch tensors")
    need(x_lat.dim() == 2 and ids.dim() == 2 and weights.dim() == 2,
         f"x_lat must be [M, H], ids and weights [M, k]; got {tuple(x_lat.shape)}, {tuple(ids.shape)}, "
         f"{tuple(weights.shape)}")
    need(w13.dim() == 3 and w2.dim() == 3,
         f"w13 must be [E, 2·I, H] and w2 [E, H, I]; got {tuple(w13.shape)}, {tuple(w2.shape)}")
    need(x_lat.dtype == torch.bfloat16 and w13.dtype == torch.bfloat16 and w2.dtype == torch.bfloat16,
         f"x_lat, w13 and w2 must be bfloat16, got {x_lat.dtype}, {w13.dtype}, {w2.dtype}")
    need(ids.dtype == torch.int32, f"ids must be int32, got {ids.dtype}; use ids.to(torch.int32)")
    need(weights.dtype == torch.float32, f"weights must be float32, got {weights.dtype}")
    (m, h), (e, i2, h13), (e2, h2, i_pad) = x_lat.shape, w13.shape, w2.shape
    need(1 <= m <= MAX_ROWS, f"M={m} rows is outside 1..{MAX_ROWS}; split the batch into chunks of <= {MAX_ROWS}")
    need(ids.shape == weights.shape and ids.shape[0] == m,
         f"ids {tuple(ids.shape)} and weights {tuple(weights.shape)} must both be [M={m}, k]")
    top_k = ids.shape[1]
    need(1 <= top_k <= MAX_TOP_K, f"k={top_k} selected experts per row is outside 1..{MAX_TOP_K}")
    need(e == e2 and e >= 1, f"w13 has E={e} experts but w2 has {e2}")
    need(h13 == h and h2 == h, f"x_lat has H={h} but w13 is {tuple(w13.shape)} and w2 {tuple(w2.shape)}")
    need(i2 == 2 * i_pad, f"w13 has {i2} rows per expert, must be 2·I = {2 * i_pad} to match w2's I={i_pad}")
    need(h % 128 == 0, f"H={h} must be a multiple of 128")
    real = i_pad if inter is None else inter
    need(isinstance(real, int) and 1 <= real <= i_pad,
         f"inter={inter!r} must be an int in 1..{i_pad} (the real columns of w2's I={i_pad})")
    need(read_width(real) <= i_pad and i_pad % 8 == 0,
         f"I={i_pad} columns per expert cannot be read in {INTER_CHUNK}-column chunks for inter={real} "
         f"(needs {read_width(real)}); zero-pad the expert slices to a multiple of {INTER_CHUNK} "
         "(latency_specialized/moe_padding.py)")
    need(all(t.is_contiguous() for t in named.values()), "x_lat, ids, weights, w13 and w2 must be contiguous")
    if out is not None:
        need(isinstance(out, torch.Tensor) and out.shape == (m, h) and out.dtype == torch.bfloat16
             and out.is_contiguous(), f"out must be a contiguous [{m}, {h}] bfloat16 tensor")
        named["out"] = out
    need(all(t.device.type == "cuda" for t in named.values()), "all tensors must be CUDA tensors")
    need(all(t.device == x_lat.device for t in named.values()), "all tensors must be on one device")
    need(all(t.data_ptr() % 16 == 0 for t in named.values()), "all tensors must be 16-byte aligned (fresh allocations are)")


def buffers(dev: DeviceFacts, top_k: int, inter: int, h: int) -> tuple[torch.Tensor, ...]:
    """h [64·k, I] and o [64·k, H] bf16 for each (k, I, H); rows of picks not made are never
    written or read."""
    return dev.scratch(("moe_experts", top_k, inter, h), lambda d: (
        torch.empty(MAX_ROWS * top_k, inter, dtype=torch.bfloat16, device=d),
        torch.empty(MAX_ROWS * top_k, h, dtype=torch.bfloat16, device=d)))


_COMPILED: dict[tuple, Any] = {}


def _gemv(dev: DeviceFacts, gate_up: bool, w: torch.Tensor, x: torch.Tensor, ids: torch.Tensor,
          out: torch.Tensor, m: int, n_out: int, k: int, beta: float | None, linear_beta: float | None,
          stream: cuda.CUstream) -> None:
    n_experts, w_rows, ld = w.shape
    top_k = ids.shape[1]
    m_atoms = -(-m // 8)
    tiling = choose_tiling(gate_up, n_out, k, m_atoms, min(m * top_k, n_experts), dev.sm_count)
    key = (gate_up, n_experts, top_k, n_out, k, w_rows, ld, m_atoms, beta, linear_beta, dev.arch, tiling)
    fn = _COMPILED.get(key)
    if fn is None:
        fn = _COMPILED[key] = compile_expert_gemv(gate_up, n_experts, top_k, n_out, k, m_atoms,
                                                  beta, linear_beta, tiling, dev.arch, w_rows=w_rows, ld=ld)
    fn(gmem_ptr(BFloat16, w.data_ptr()), gmem_ptr(BFloat16, x.data_ptr()), gmem_ptr(Int32, ids.data_ptr(), 4),
       gmem_ptr(BFloat16, out.data_ptr()), m, stream)


def launch(x_lat: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, w13: torch.Tensor,
           w2: torch.Tensor, out: torch.Tensor | None = None, *, inter: int | None = None,
           beta: float | None = 4.0, linear_beta: float | None = 25.0,
           stream: torch.cuda.Stream | None = None) -> torch.Tensor:
    """y [M, H] bf16 = this rank's Σ_j w_j · expert_{ids_j}(x_lat) (module docstring) into `out`.

    inter: the real intermediate columns of each expert slice (default: all of w2's I). Slices
    zero-padded beyond it (vLLM pads TP16's 192 to 256) are read only up to `read_width(inter)`,
    so the padding costs no bytes. beta / linear_beta are SiTU's β and λ (None: no clip; both
    None is SiLU-and-mul), as `reference/dense_mlp.py::activation_clips` gives them. Three
    launches on `stream` (default: the current stream): gate/up, down, combine. The first call
    of a shape compiles (seconds).
    """
    check_envelope(x_lat, ids, weights, w13, w2, out, inter)
    m, h = x_lat.shape
    top_k = ids.shape[1]
    inter = read_width(w2.shape[2] if inter is None else inter)
    dev = facts(x_lat.device)
    hidden, expert_out = buffers(dev, top_k, inter, h)
    if out is None:
        out = torch.empty((m, h), dtype=torch.bfloat16, device=x_lat.device)
    torch_stream = torch.cuda.current_stream(x_lat.device) if stream is None else stream
    cu_stream = cuda.CUstream(torch_stream.cuda_stream)
    _gemv(dev, True, w13, x_lat, ids, hidden, m, inter, h, beta, linear_beta, cu_stream)
    _gemv(dev, False, w2, hidden, ids, expert_out, m, h, inter, None, None, cu_stream)
    moe_combine.launch(expert_out, ids, weights, w13.shape[0], out, stream=torch_stream)
    return out
