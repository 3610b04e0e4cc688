"""MLA absorbed decode attention over the paged latent cache, split over the KV length.

Compiled for sm_90a, sm_100a and sm_103a (every plan of `sweep_plans` for sm_90a without
spills). Evidence (`evidence/<card>/`): `mla_decode_test.json`, `mla_decode_bench.json`
(`bench_mla_decode --sweep` times the `sweep_plans` variants side by side).

Math (K3_MATH.md §3.5 (6); `reference/mla.py::attend_absorbed` is the oracle, read up to its
latent output ol, before W_UV): for every query row i of a request, with q_lat_i = [ql | q_pe]
(576 = 512 + 64, bf16; ql = bf16(q_nope · W_UK) comes from a batched GEMM outside) and the
cache rows kv_t = [c_t | k_pe_t] (576, bf16),

    s_it  = τ · q_lat_i · kv_t               τ: `launch`'s tau (K3: 1/sqrt(192)), FP32 from bf16 products
    p_it  = softmax_t(s_it) over t ≤ L − q + j     (row i belongs to verify token j)
    ol_i  = bf16(Σ_t p_it · c_t)             (the latent is the value; W_UV stays outside)

Statistics (max, sum) and accumulators are FP32; the weights p are rounded to bf16 for the
P·V tensor-core products (the reference keeps them FP32: ~2^-9 relative per weight), while the
sum of the weights is taken from the unrounded ones.

Envelope: q_lat `[rows, heads, 576]` and out `[rows, heads, 512]` bf16 contiguous; the cache
`[num_blocks, block_size, 576]` bf16 contiguous (any block_size >= 1; block id 0 may be the
null block); block_table `[requests, max_blocks]`, seq_lens `[requests]` and query_start
`[requests + 1]` int32 contiguous on the same device; 1 <= requests <= 64, heads 1..128 (K3:
6 / 12 / 96 per rank), 1..8 tokens per request (`max_q`, causal among them). Request r owns
rows query_start[r] .. query_start[r+1] − 1 and attends over seq_lens[r] cached positions,
the step's own tokens included (inserted before the call). Any length from 1 to the block
table's capacity runs; lengths above the declared MAX_CONTEXT are the dispatcher's to route
elsewhere. Device-side metadata is clamped so that nothing is read or written out of bounds
(a length beyond the table, a block id beyond the cache, rows beyond q_lat); what comes out
for such metadata is unspecified, and rows outside every request are not written.

Design (decode reads the whole cache once; all heads and verify tokens of a request share
each cache row read):
- Work unit = (request, query tile of 16·m rows of its heads × tokens, KV split). A CTA of
  `warps` warps streams its split in chunks of `chunk` tokens through a `stages`-deep cp.async
  ring in shared memory; the cache row pitch is padded by 16 bytes so every ldmatrix is
  conflict-free. Warp w computes the scores of its chunk / (8·warps) n8 token tiles (Q and K
  fragments by ldmatrix, mma.sync m16n8k16, a Q fragment serving every token tile, several
  accumulators to break the dependency chain), the warps meet in shared memory for the row
  max and sum (online softmax), the weights go through shared memory as bf16, and warp w
  accumulates value columns (512/warps)·w .. (512/warps)·(w+1) − 1 (V fragments by
  ldmatrix.trans straight from the same ring rows).
- Default plan (`choose_plan`), up to 32 query rows (plain decode at TP8/TP16): 4 warps,
  64-token chunks (73.7 KB of cache each), 2 stages: a 150 KB ring (172 KB of shared memory
  in all), one chunk in flight per SM while the other is computed, one CTA of 128 threads
  per SM (187 registers). Against the superseded 32-token chunks it halves the barriers and
  the softmax round trips through shared memory per token (three barriers per chunk, the
  chunk twice as long), gives each warp two independent token tiles per Q fragment (the Q
  ldmatrix traffic per token halves: 416 instead of 576 ldmatrix.x4 per 64 tokens, the
  shared-memory port being the busiest unit), and runs one wave. More rows (verify): 8 warps
  (64 value columns each), so three 16-row tiles of accumulators fit in registers (246):
  96 rows (12 heads × 8 tokens) read each cache row twice instead of three times.
  `sweep_plans` lists the variants a benchmark times against the default (the superseded
  shape; 4 vs 8 warps; 2 or 4 waves; longer minimum splits; one tile more or fewer; two
  96 KB CTAs resident on each SM); `launch(plan=...)` runs any of them.
- The schedule is computed on the device from seq_lens (CUDA-graph safe, identical in
  every CTA): W = Σ_r chunks_r · tiles_r, T = Σ_r tiles_r over requests with chunks,
  chunks per split cps = max(min_chunks, ⌈W / max(target − T + 1, 1)⌉), splits_r =
  ⌈chunks_r / cps⌉, balanced chunk ranges. Then the units Σ_r tiles_r splits_r ≤ (W − T) / cps
  + T ≤ target (T when T > target): with target = waves · SMs and the default one wave, no
  rounding spills a straggler wave (8 requests × 128K: 128 units, not 136 in two waves; one
  request at 32K: 128 splits of 4 chunks). The grid is the static bound max(target,
  requests · max_tiles), so one request at 1M tokens gets `target` splits (every SM busy) and
  every length runs; surplus CTAs exit at once.
- On sm_90a a plan with more than 32 query rows a request (verify) runs `mla_decode_wgmma`'s
  kernel instead (`DecodePlan.mma`): the same work units, schedule, workspace and combine, its
  scores and values on wgmma from 64-row query tiles.
- Launched as a PDL dependent: a CTA locates its work unit (the lengths and the block table,
  which the host copies before the step) and requests its first chunk while the kernel before
  it finishes, when that chunk ends before the step's own tokens (positions L − q ..), the
  only cache rows the step writes. The queries, those rows and every global write (the
  workspace a combine of the same shape may still read) wait for `griddepcontrol.wait`. One
  request at 32K spent 9.8 µs a launch outside its chunks (H100, 2026-12-06: the split kernel
  took 9.8 + 3.14 µs a chunk per split, the slope an SM's share of the copy bandwidth).
- A request with one split writes ol directly. Otherwise each CTA writes its unnormalized
  FP32 partial (O, max, sum) and a record of what it computed to a workspace, and
  `kernels/mla_combine.py` merges the splits (log-sum-exp weights, fixed order). `launch`
  runs both. Launches of one shape share the workspace, so they must be stream-ordered.
  A plan with `fan_in` (mma.sync only) launches no combine: the splits of a tile form a tree
  of that fan-in and the CTA that completes a node, counted by an atomic ticket, merges its
  children (`mla_combine.merge_splits`), so only the last node of each level waits on the
  critical path and no second launch follows (the combine and the launch between two MLA
  calls took 7.5 of one request's 26.2 µs at 32K, H100 timeline, 2026-12-07).

The host `launch` checks the envelope before any CUDA work, compiles once per (heads,
max_q, block_size, m_tiles, stages, warps, chunk, arch), then only launches on an explicit stream (CUDA-graph
capturable once the shape has run one time outside the capture).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
import torch
from cutlass import BFloat16, Constexpr, Float32, Int32, Int64

from . import mla_combine
from .device import DeviceFacts, facts
from .rows import gmem_ptr

LATENT = 512  # r_kv: the value width
ROW = 576  # r_kv + d_r: one cache row, one q_lat row
VEC = 8  # bf16 elements per 16-byte access
ROW_VECS = ROW // VEC  # 72
PITCH = ROW + VEC  # shared-memory row pitch: 1168 B, 16 mod 128, so 8 rows hit 8 bank groups
P_PAD = VEC  # bf16 weight tile pitch = chunk + 8: 80 B or 144 B, 16 mod 128, conflict-free ldmatrix
MAX_REQUESTS = 64  # two per lane in the warp-wide schedule
MAX_Q = 8
MAX_HEADS = 128
MAX_CONTEXT = 1 << 20  # declared in SCOPE.yaml; longer contexts go to the standard path
K3_TAU = 1.0 / math.sqrt(192.0)  # 1/sqrt(d_nope + d_rope): `launch`'s default softmax scale
INFO = mla_combine.INFO_FIELDS
# a timeline plan's readings per CTA: entry, work unit located, PDL wait over, first chunk landed,
# last chunk's P·V issued, output written
STAMPS = 6
SMEM_PER_CTA = 227 * 1024
SMEM_PER_SM = 228 * 1024  # sm_90 and sm_100
SMEM_RESERVED_PER_CTA = 1024  # the system's share of each resident CTA


class MlaDecodeEnvelopeError(ValueError):
    """The inputs fall outside what the MLA decode kernel supports."""


@dataclass(frozen=True)
class DecodePlan:
    """Everything static about one compiled variant, plus the split policy it runs with.

    Compiled: `warps` per CTA, `chunk` tokens per pipeline stage (each warp scores chunk / warps
    tokens, one or two n8 tiles, and owns 512 / warps value columns), `m_tiles` 16-row MMA tiles
    of query rows per CTA, `stages` chunks in the cp.async ring, `mma` the kernel ("wgmma":
    `mla_decode_wgmma`'s, 8 warps × 64 rows × 64-token chunks). Split policy (runtime arguments,
    not compiled): `waves` (work units aimed at = waves · SMs) and `min_chunks` per split."""

    heads: int
    max_q: int
    block_size: int
    m_tiles: int = 1  # 16-row MMA tiles per CTA (1..4)
    stages: int = 2  # chunks in the cp.async ring
    warps: int = 4  # 4 or 8
    chunk: int = 64  # 32 or 64 tokens per stage
    waves: int = 1
    min_chunks: int = 2
    mma: str = "sync"  # "sync": this file's kernel (mma.sync); "wgmma": mla_decode_wgmma's (sm_90a)
    defer_table: bool = False  # the chunk loop reads the block table a chunk before it uses it
    copies_under_qk: bool = False  # wgmma: the next chunk's copies issue after the scores' wgmma, before its wait
    timeline: bool = False  # each CTA's thread 0 writes STAMPS %globaltimer readings (`launch(stamps=...)`)
    fan_in: int = 0  # sync: 0 launches the combine; 4..16 merges the splits in-kernel (`mla_combine.merge_splits`)
    combine_pdl: bool = False  # the combine launched as a PDL dependent of the split kernel

    def __post_init__(self) -> None:
        if self.mma == "wgmma":
            if (self.warps, self.m_tiles, self.chunk) != (8, 4, 64) or not 2 <= self.stages <= 8:
                raise ValueError(f"{self}: a wgmma plan has 8 warps (two warpgroups), m_tiles 4 (64 query rows), "
                                 "chunk 64 (its weights take a stage's 128-byte rope rows), stages 2..8")
        elif (self.mma != "sync" or self.warps not in (4, 8) or self.chunk not in (32, 64)
                or self.chunk % (8 * self.warps) or not 1 <= self.m_tiles <= 4 or self.m_tiles * self.warp_cols > 256
                or not 2 <= self.stages <= 8):
            raise ValueError(f"{self}: need mma 'sync' or 'wgmma'; warps 4 or 8, chunk 32 or 64 with 8·warps | chunk, "
                             "m_tiles 1..4 with m_tiles · 512 / warps <= 256 (64 FP32 accumulators per 16 rows and "
                             "128 columns), stages 2..8")
        if self.copies_under_qk and self.mma != "wgmma":
            raise ValueError(f"{self}: copies_under_qk needs the wgmma kernel (its scores are asynchronous)")
        if self.fan_in and (self.mma != "sync" or not 4 <= self.fan_in <= 16 or self.merge_rows < 1):
            raise ValueError(f"{self}: fan_in (the in-kernel combine's tree) is 0, or 4..16 with mma 'sync' "
                             "and a ring that holds a row of every child (2 KB each)")
        if self.combine_pdl and self.fan_in:
            raise ValueError(f"{self}: combine_pdl needs a combine to launch (fan_in 0)")
        if self.waves < 1 or self.min_chunks < 1:
            raise ValueError(f"{self}: need waves >= 1, min_chunks >= 1")

    @property
    def threads(self) -> int:
        return 32 * self.warps

    @property
    def warp_cols(self) -> int:
        """Value columns each warp accumulates."""
        return LATENT // self.warps

    @property
    def n_tiles(self) -> int:
        """n8 token tiles each warp scores per chunk."""
        return self.chunk // (8 * self.warps)

    @property
    def tile_rows(self) -> int:
        return 16 * self.m_tiles

    @property
    def max_tiles(self) -> int:
        """Query tiles of a request with max_q tokens."""
        return -(-self.heads * self.max_q // self.tile_rows)

    @property
    def score_sets(self) -> int:
        """Independent accumulators per score tile (the 36 k-atoms in 4, 2 or 1 chains)."""
        return max(1, 4 // (self.m_tiles * self.n_tiles))

    @property
    def p_pitch(self) -> int:
        return self.chunk + P_PAD

    @property
    def kernel_key(self) -> tuple[int, ...]:
        """What a compile depends on (the split policy is not compiled)."""
        return (self.heads, self.max_q, self.block_size, self.m_tiles, self.stages, self.warps, self.chunk, self.mma,
                self.defer_table, self.copies_under_qk, self.timeline, self.fan_in)

    @property
    def merge_rows(self) -> int:
        """Rows `mla_combine.merge_splits` merges at once, every child's partial of them staged in the ring."""
        return mla_combine.merge_rows(2 * self.stages * self.chunk * PITCH, self.fan_in) if self.fan_in else 0

    @property
    def smem_ctas(self) -> int:
        """CTAs of this plan that one SM's shared memory holds at once."""
        return SMEM_PER_SM // (self.smem_bytes + SMEM_RESERVED_PER_CTA)

    @property
    def smem_bytes(self) -> int:
        if self.mma == "wgmma":  # unpadded swizzled rows, 1 KB aligned; the weights take the rope rows
            return 2 * (self.tile_rows + self.stages * self.chunk) * ROW + 4 * 2 * self.tile_rows + 1024
        ring = 2 * self.stages * self.chunk * PITCH
        q_tile = 2 * self.tile_rows * PITCH
        weights = 2 * self.tile_rows * self.p_pitch
        stats = 2 * 4 * self.warps * self.tile_rows
        # merge_splits' (max, sum) of a batch of rows and its ticket; it stages the partials in the ring
        merge = 4 * 2 * self.fan_in * self.merge_rows + 32 if self.fan_in else 0
        return ring + q_tile + weights + stats + merge + 4 * 128  # alignment slack


WGMMA_ARCHS = ("sm_90a",)


def choose_plan(heads: int, max_q: int, block_size: int, arch: str | None = None) -> DecodePlan:
    """The default. Up to 32 query rows (plain decode at TP8/TP16): 4 warps streaming 64-token
    chunks through a 2-stage ring (150 KB: one 74 KB chunk in flight while the other is
    computed), one CTA of 128 threads per SM, one or two 16-row tiles. More rows (verify):
    8 warps (64 value columns each, so 3 tiles of accumulators fit in registers) and the tiles
    per CTA (1..3; 4 needs more than 227 KB) that cut the rows into the fewest CTA tiles, then
    the least padding (48 rows: one tile; 96: two tiles of 48, so each cache row is read twice,
    not three times as with 32-row tiles). One wave of work units (`default_target`).
    On sm_90a (`arch`), more than 32 rows go to the wgmma kernel (`mla_decode_wgmma`): 64-row
    tiles, 64-token chunks in 2 stages."""
    rows = heads * max_q
    if rows > 32 and arch in WGMMA_ARCHS:
        return DecodePlan(heads, max_q, block_size, m_tiles=4, warps=8, mma="wgmma")
    if rows <= 32:
        return DecodePlan(heads, max_q, block_size, m_tiles=-(-rows // 16), warps=4)
    fits = [m for m in range(1, 5)
            if DecodePlan(heads, max_q, block_size, m_tiles=m, warps=8).smem_bytes <= SMEM_PER_CTA]
    m_tiles = min(fits, key=lambda m: (-(-rows // (16 * m)), m * -(-rows // (16 * m))))
    return DecodePlan(heads, max_q, block_size, m_tiles=m_tiles, warps=8)


def sweep_plans(heads: int, max_q: int, block_size: int, arch: str | None = None) -> list[DecodePlan]:
    """The default plan first, then the variants a benchmark compares with it."""
    base = choose_plan(heads, max_q, block_size, arch)
    if base.mma == "wgmma":  # against the mma.sync kernel's default, and two waves
        return [base, replace(base, defer_table=True), replace(base, copies_under_qk=True),
                replace(base, defer_table=True, copies_under_qk=True), replace(base, combine_pdl=True),
                choose_plan(heads, max_q, block_size), replace(base, waves=2)]
    rows = heads * max_q
    variants = [replace(base, **kw) for kw in (
        {"defer_table": True},
        {"warps": 4, "chunk": 32, "stages": 4, "m_tiles": min(2, base.m_tiles), "waves": 4,
         "min_chunks": 4},  # the superseded GPU-tested shape
        {"warps": 4, "m_tiles": min(2, base.m_tiles)}, {"warps": 8},
        {"waves": 2}, {"waves": 4, "min_chunks": 4}, {"min_chunks": 8}, {"fan_in": 8}, {"fan_in": 16},
        {"combine_pdl": True},
        {"m_tiles": min(4 if base.warps == 8 else 2, -(-rows // 16))}, {"m_tiles": max(1, base.m_tiles - 1)})]
    # Two CTAs an SM at once (up to 16 query rows: 96 KB each): one CTA's copies stream while the
    # other computes, where the default's single CTA alternates between waiting and computing;
    # its second "wave" is resident beside the first. Aimed at one long request, whose few
    # chunks per split leave the default's pipeline mostly filling and draining.
    pair = replace(base, warps=4, chunk=32, stages=2, m_tiles=min(2, base.m_tiles), waves=2)
    variants += [pair] if pair.smem_ctas >= 2 else []
    plans = [base]
    for plan in variants:
        if plan not in plans and plan.smem_bytes <= SMEM_PER_CTA:
            plans.append(plan)
    return plans


# ---------------------------------------------------------------- the schedule (host and device)
#
# Written with + − * // and the given min / max only, so the same functions run inside the
# kernels (cutlass.min / cutlass.max on Int32) and on the host (the builtins on Python ints:
# `schedule`, the mirror the CPU tests check).


def request_work(seq_len, row_start, row_end, r, requests, rows, cap, heads, max_q, tile_rows, chunk,
                 lo=cutlass.min, hi=cutlass.max):
    """(L, row0, q, chunks, tiles) of request r after clamping its metadata into bounds.

    Requests past `requests`, empty ones and ones with no rows get zero chunks or tiles."""
    live_cap = cap * lo(hi(requests - r, 0), 1)
    length = lo(hi(seq_len, 0), live_cap)
    row0 = lo(hi(row_start, 0), rows)
    q = hi(lo(lo(row_end - row0, max_q), rows - row0), 0)
    chunks = (length + chunk - 1) // chunk
    tiles = (heads * q + tile_rows - 1) // tile_rows
    return length, row0, q, chunks, tiles


def chunks_per_split(total_work, live_tiles, target, min_chunks, hi=cutlass.max):
    """cps = max(min_chunks, ⌈W / max(target − T + 1, 1)⌉) with W = Σ_r chunks_r · tiles_r and T the
    query tiles of requests with chunks: the units Σ_r tiles_r ⌈chunks_r / cps⌉ ≤ (W − T) / cps + T
    then stay ≤ target (one wave when target = SMs, no straggler wave from rounding) or, when
    T > target, equal T (one split each)."""
    room = hi(target - live_tiles + 1, 1)
    return hi(min_chunks, (total_work + room - 1) // room)


def split_count(chunks, cps):
    return (chunks + cps - 1) // cps


def split_range(chunks, splits, s, lo=cutlass.min, hi=cutlass.max):
    """Chunks [c0, c1) of split s of `splits` balanced splits (each non-empty)."""
    base = chunks // splits
    extra = chunks - base * splits
    c0 = s * base + lo(s, extra)
    c1 = c0 + base + lo(hi(extra - s, 0), 1)
    return c0, c1


def grid_size(plan: DecodePlan, requests: int, target: int) -> int:
    """Static bound on the work units: ≤ target, or T ≤ requests · max_tiles (`chunks_per_split`)."""
    return max(target, requests * plan.max_tiles)


@dataclass(frozen=True)
class WorkUnit:
    slot: int
    request: int
    tile: int
    split: int
    splits: int
    chunk_begin: int
    chunk_end: int
    token_end: int


def schedule(seq_lens: list[int], query_start: list[int], rows: int, cap: int, plan: DecodePlan,
             target: int, min_chunks: int) -> list[WorkUnit]:
    """The work units the kernel runs, in CTA order (the host mirror of `_locate`)."""
    requests = len(seq_lens)
    work = [request_work(seq_lens[r], query_start[r], query_start[r + 1], r, requests, rows, cap,
                         plan.heads, plan.max_q, plan.tile_rows, plan.chunk, min, max) for r in range(requests)]
    total = sum(w[3] * w[4] for w in work)
    live = sum(w[4] * min(w[3], 1) for w in work)
    cps = chunks_per_split(total, live, target, min_chunks, max)
    units, slot = [], 0
    for r, (length, _, _, chunks, tiles) in enumerate(work):
        splits = split_count(chunks, cps)
        for s in range(splits):
            c0, c1 = split_range(chunks, splits, s, min, max)
            for t in range(tiles):
                units.append(WorkUnit(slot, r, t, s, splits, c0, c1, min(c1 * plan.chunk, length)))
                slot += 1
    return units


# ---------------------------------------------------------------- device helpers


@cute.jit
def _warp_sum(x: Int32) -> Int32:
    for i in cutlass.range_constexpr(5):
        x = x + cute.arch.shuffle_sync_bfly(x, offset=1 << i)
    return x


@cute.jit
def _warp_inclusive_scan(x: Int32, lane: Int32) -> Int32:
    for i in cutlass.range_constexpr(5):
        up = cute.arch.shuffle_sync_up(x, offset=1 << i)
        x = x + cutlass.select_(lane >= (1 << i), up, Int32(0))
    return x


@cute.jit
def _pick(first: Int32, second: Int32, r: Int32) -> Int32:
    """Request r's value where lane l holds requests l (first) and l + 32 (second)."""
    a = cute.arch.shuffle_sync(first, r % 32)
    b = cute.arch.shuffle_sync(second, r % 32)
    return cutlass.select_(r < 32, a, b)


@cute.jit
def _locate(lens: cute.Tensor, starts: cute.Tensor, unit: Int32, lane: Int32, requests: Int32, rows: Int32,
            cap: Int32, target: Int32, min_chunks: Int32, plan: Constexpr):
    """Which work unit CTA `unit` runs: (request or `requests` when idle, tile, split, splits,
    first slot of the request, tiles, L, row0, q, chunks). Every warp computes it alike."""
    vals = []
    for half in cutlass.range_constexpr(2):
        r = lane + 32 * half
        rc = cutlass.min(r, requests - 1)
        vals.append(request_work(lens[rc], starts[rc], starts[rc + 1], r, requests, rows, cap,
                                 plan.heads, plan.max_q, plan.tile_rows, plan.chunk))
    total = _warp_sum(vals[0][3] * vals[0][4] + vals[1][3] * vals[1][4])
    live = _warp_sum(vals[0][4] * cutlass.min(vals[0][3], 1) + vals[1][4] * cutlass.min(vals[1][3], 1))
    cps = chunks_per_split(total, live, target, min_chunks)
    splits = [split_count(v[3], cps) for v in vals]
    units = [splits[h] * vals[h][4] for h in range(2)]
    incl0 = _warp_inclusive_scan(units[0], lane)
    incl1 = _warp_inclusive_scan(units[1], lane) + cute.arch.shuffle_sync(incl0, 31)
    # the request is the number of requests whose units all lie before this one
    before = (cute.arch.popc(cute.arch.vote_ballot_sync(incl0 <= unit))
              + cute.arch.popc(cute.arch.vote_ballot_sync(incl1 <= unit)))
    req = cutlass.min(Int32(before), requests)
    tiles = _pick(vals[0][4], vals[1][4], req)
    n_split = _pick(splits[0], splits[1], req)
    first = _pick(incl0 - units[0], incl1 - units[1], req)
    local = unit - first
    tiles_safe = cutlass.max(tiles, 1)
    return (req, local % tiles_safe, local // tiles_safe, n_split, first, tiles,
            _pick(vals[0][0], vals[1][0], req), _pick(vals[0][1], vals[1][1], req),
            _pick(vals[0][2], vals[1][2], req), _pick(vals[0][3], vals[1][3], req))


@cute.jit
def _claim(lens_ptr: cute.Pointer, starts_ptr: cute.Pointer, unit: Int32, tid: Int32, requests: Int32, rows: Int32,
           max_blocks: Int32, target: Int32, min_chunks: Int32, plan: Constexpr):
    """CTA `unit`'s work unit (`_locate`): (request, or `requests` when idle; L; q; the tile's real
    rows; its first flattened (row, head); tile; the request's splits; the first of the unit's
    chunks, their count, where its tokens end; its record for the combine, which `_publish`
    writes). Reads only the lengths and row offsets, which no kernel of the step writes."""
    lens = cute.make_tensor(lens_ptr, cute.make_layout(requests))
    starts = cute.make_tensor(starts_ptr, cute.make_layout(requests + 1))
    req, tile, split, splits, first, tiles, length, row0, q, chunks = _locate(
        lens, starts, unit, tid % 32, requests, rows, max_blocks * plan.block_size, target, min_chunks, plan)
    valid_rows = cutlass.min(plan.tile_rows, plan.heads * q - tile * plan.tile_rows)
    out_base = row0 * plan.heads + tile * plan.tile_rows
    record = (cutlass.select_(req < requests, req, Int32(-1)), split, splits, first + tile, tiles, valid_rows, out_base)
    c0, c1 = split_range(chunks, splits, split)
    return (req, length, q, valid_rows, out_base, tile, splits, c0, c1 - c0, cutlass.min(c1 * plan.chunk, length),
            record)


@cute.jit
def _first_chunk_early(req: Int32, requests: Int32, length: Int32, q: Int32, c0: Int32, n_chunks: Int32,
                       chunk: Constexpr) -> Int32:
    """1 when the unit's first chunk may be requested before the PDL wait, else 0. The kernels
    before this one write the step's own tokens' cache rows (positions L − q .. L − 1) and the
    queries; no kernel of the step writes older rows, the block table or the lengths (the host
    copies those before the step's first kernel). So a chunk that ends before L − q is final.
    Only kernels that release their dependents early can still run when this one starts (a torch
    op or a copy ends first); ours all do, and none of them writes what is read early here."""
    early = cutlass.select_(req < requests, cutlass.min(n_chunks, 1), Int32(0))
    return cutlass.select_((c0 + 1) * chunk <= length - q, early, Int32(0))


@cute.jit
def _publish(info_ptr: cute.Pointer, slots: Int32, unit: Int32, tid: Int32, record: tuple):
    """Wait for the kernels before this one (launched as a PDL dependent, a CTA may start while
    they run: a combine of the same shape may still read this workspace), then write the unit's
    record."""
    cute.arch.griddepcontrol_wait()
    info = cute.make_tensor(info_ptr, cute.make_layout((slots, INFO), stride=(INFO, 1)))
    if tid == 0:
        for i in cutlass.range_constexpr(len(record)):
            info[unit, i] = record[i]


@cute.jit
def _stamp(stamps_ptr: cute.Pointer, unit: Int32, tid: Int32, k: Constexpr, plan: Constexpr):
    """Thread 0 of a timeline plan's CTA records %globaltimer (ns) as reading k of its unit."""
    if cutlass.const_expr(plan.timeline):
        if tid == 0:
            stamps = cute.make_tensor(stamps_ptr, cute.make_layout(STAMPS * (unit + 1)))
            stamps[STAMPS * unit + k] = cute.arch.globaltimer()


@cute.jit
def _chunk_blocks(blocks: cute.Tensor, table: cute.Tensor, chunk_idx: Int32, token_end: Int32, warp: Int32,
                  table_row: Int32, block_size: Constexpr, chunk: Constexpr, warps: Constexpr):
    """Block-table entries of the warp's chunk / warps tokens w + warps·k of chunk `chunk_idx`
    (tokens at or past token_end repeat the last one). Loads only: `_chunk_rows` uses them, and a
    `defer_table` plan does so a chunk later, off the path between two chunks' MMAs."""
    for k in cutlass.range_constexpr(chunk // warps):
        tok = cutlass.min(chunk_idx * chunk + warp + warps * k, token_end - 1)
        blocks[k] = table[table_row + tok // block_size]


@cute.jit
def _chunk_rows(phys: cute.Tensor, blocks: cute.Tensor, chunk_idx: Int32, token_end: Int32, warp: Int32,
                num_blocks: Int32, block_size: Constexpr, chunk: Constexpr, warps: Constexpr):
    """Cache rows (block · block_size + offset) of the tokens `_chunk_blocks` read the blocks of."""
    for k in cutlass.range_constexpr(chunk // warps):
        tok = cutlass.min(chunk_idx * chunk + warp + warps * k, token_end - 1)
        block = cutlass.max(cutlass.min(blocks[k], num_blocks - 1), 0)
        phys[k] = block * block_size + (tok - (tok // block_size) * block_size)


@cute.jit
def _locate_chunk(phys: cute.Tensor, blocks: cute.Tensor, table: cute.Tensor, chunk_idx: Int32, token_end: Int32,
                  warp: Int32, table_row: Int32, num_blocks: Int32, block_size: Constexpr, chunk: Constexpr,
                  warps: Constexpr):
    """`_chunk_blocks` then `_chunk_rows`: the cache rows of chunk `chunk_idx`, waiting for the table."""
    _chunk_blocks(blocks, table, chunk_idx, token_end, warp, table_row, block_size, chunk, warps)
    _chunk_rows(phys, blocks, chunk_idx, token_end, warp, num_blocks, block_size, chunk, warps)


@cute.jit
def _next_chunk(phys: cute.Tensor, blocks: cute.Tensor, table: cute.Tensor, chunk_idx: Int32, token_end: Int32,
                warp: Int32, table_row: Int32, num_blocks: Int32, block_size: Constexpr, chunk: Constexpr,
                warps: Constexpr, defer: Constexpr):
    """After issuing a chunk: read the table for chunk `chunk_idx`, the next to issue, and unless
    `defer` compute its rows now (a `defer` kernel computes them with `_chunk_rows` right before
    the issue, one chunk's compute later, when the loads have landed)."""
    _chunk_blocks(blocks, table, chunk_idx, token_end, warp, table_row, block_size, chunk, warps)
    if cutlass.const_expr(not defer):
        _chunk_rows(phys, blocks, chunk_idx, token_end, warp, num_blocks, block_size, chunk, warps)


@cute.jit
def _issue_chunk(g2s: cute.CopyAtom, cache_base: Int64, phys: cute.Tensor, warp: Int32, lane: Int32,
                 chunk: Constexpr, warps: Constexpr, dst: Constexpr):
    """cp.async of the warp's cache rows of a chunk (rows warp + warps·k, 72 16-byte vectors
    each) to dst(row, vector): the stage's 8-element destination, laid out as its kernel reads it."""
    for k in cutlass.range_constexpr(chunk // warps):
        src = cute.make_tensor(
            cute.make_ptr(BFloat16, cache_base + Int64(phys[k]) * (2 * ROW), cute.AddressSpace.gmem,
                          assumed_align=16),
            cute.make_layout((VEC, ROW_VECS), stride=(1, VEC)))
        row = warp + warps * k
        for v in cutlass.range_constexpr(3):
            vec = lane + 32 * v
            if v < 2 or lane < ROW_VECS - 64:
                cute.copy(g2s, src[None, vec], dst(row, vec))


@cute.jit
def _mma(atom: cute.MmaAtom, acc: cute.Tensor, a: cute.Tensor, b: cute.Tensor, m: Constexpr, n: Constexpr):
    """acc[m × n tiles] += a[m tiles] · b[n tiles] for one k16 atom; a holds m A fragments of
    8 bf16 (mma.sync register order), b n B fragments of 4, acc (4, m, n) FP32."""
    cute.gemm(atom,
              cute.make_tensor(acc.iterator, cute.make_layout(((2, 2), m, n), stride=((1, 2), 4, 4 * m))),
              cute.make_tensor(a.iterator, cute.make_layout(((2, 2, 2), m, 1), stride=((1, 2, 4), 8, 0))),
              cute.make_tensor(b.iterator, cute.make_layout(((2, 2), n, 1), stride=((1, 2), 4, 0))),
              cute.make_tensor(acc.iterator, cute.make_layout(((2, 2), m, n), stride=((1, 2), 4, 4 * m))))


@cute.jit
def _quad_max(x: Float32) -> Float32:
    x = cute.arch.fmax(x, cute.arch.shuffle_sync_bfly(x, offset=1))
    return cute.arch.fmax(x, cute.arch.shuffle_sync_bfly(x, offset=2))


@cute.jit
def _quad_sum(x: Float32) -> Float32:
    x = x + cute.arch.shuffle_sync_bfly(x, offset=1)
    return x + cute.arch.shuffle_sync_bfly(x, offset=2)


# ---------------------------------------------------------------- the kernel


@cute.kernel
def _mla_decode_kernel(q_ptr: cute.Pointer, cache_ptr: cute.Pointer, table_ptr: cute.Pointer,
                       lens_ptr: cute.Pointer, starts_ptr: cute.Pointer, out_ptr: cute.Pointer,
                       ws_o_ptr: cute.Pointer, ws_ml_ptr: cute.Pointer, info_ptr: cute.Pointer,
                       stamps_ptr: cute.Pointer, rows: Int32, requests: Int32, num_blocks: Int32, max_blocks: Int32, slots: Int32,
                       target: Int32, min_chunks: Int32, scale_log2: Float32, plan: Constexpr):
    cute.arch.griddepcontrol_launch_dependents()  # a PDL-launched GEMM may start its W loads (skinny_gemm.py)
    tid, _, _ = cute.arch.thread_idx()
    unit, _, _ = cute.arch.block_idx()
    _stamp(stamps_ptr, unit, tid, 0, plan)
    lane = tid % 32
    warp = tid // 32
    g = lane // 4  # fragment row (and token of a B fragment)
    c = lane % 4  # fragment column pair
    heads, m, stages, sets = plan.heads, plan.m_tiles, plan.stages, plan.score_sets
    tile_rows, chunk, warps, threads = plan.tile_rows, plan.chunk, plan.warps, plan.threads
    n_t, warp_cols, p_pitch = plan.n_tiles, plan.warp_cols, plan.p_pitch
    block_size = plan.block_size

    req, length, q, valid_rows, out_base, tile, splits, c0, n_chunks, token_end, record = _claim(
        lens_ptr, starts_ptr, unit, tid, requests, rows, max_blocks, target, min_chunks, plan)
    table = cute.make_tensor(table_ptr, cute.make_layout(requests * max_blocks))
    smem = cutlass.memory.SmemAllocator()
    ring = smem.allocate_tensor(
        BFloat16, cute.make_layout((VEC, stages, chunk, PITCH // VEC),
                                   stride=(1, chunk * PITCH, PITCH, VEC)), byte_alignment=128)
    q_tile = smem.allocate_tensor(
        BFloat16, cute.make_layout((VEC, tile_rows, PITCH // VEC), stride=(1, PITCH, VEC)), byte_alignment=128)
    p_vecs = smem.allocate_tensor(
        BFloat16, cute.make_layout((VEC, tile_rows, p_pitch // VEC), stride=(1, p_pitch, VEC)), byte_alignment=128)
    red_max = smem.allocate_tensor(Float32, cute.make_layout((warps, tile_rows), stride=(tile_rows, 1)),
                                   byte_alignment=16)
    red_sum = smem.allocate_tensor(Float32, cute.make_layout((warps, tile_rows), stride=(tile_rows, 1)),
                                   byte_alignment=16)
    if cutlass.const_expr(plan.fan_in):
        stage_ml = smem.allocate_tensor(
            Float32, cute.make_layout((plan.fan_in, plan.merge_rows, 2), stride=(2 * plan.merge_rows, 2, 1)),
            byte_alignment=16)
        ticket_box = smem.allocate_tensor(Int32, cute.make_layout(1), byte_alignment=16)
    g2s = cute.make_copy_atom(cute.nvgpu.cpasync.CopyG2SOp(cache_mode=cute.nvgpu.cpasync.LoadCacheMode.GLOBAL),
                              BFloat16, num_bits_per_copy=128)
    cache_base = cache_ptr.toint()
    table_row = req * max_blocks
    phys = cute.make_rmem_tensor(cute.make_layout(chunk // warps), Int32)
    blocks = cute.make_rmem_tensor(cute.make_layout(chunk // warps), Int32)
    # the first chunk streams in while the kernel before this one finishes, if no kernel of the step
    # writes it (`_first_chunk_early`)
    early = _first_chunk_early(req, requests, length, q, c0, n_chunks, chunk)
    if early == 1:
        _locate_chunk(phys, blocks, table, c0, token_end, warp, table_row, num_blocks, block_size, chunk, warps)
        _issue_chunk(g2s, cache_base, phys, warp, lane, chunk, warps, lambda row, vec: ring[None, 0, row, vec])
    _stamp(stamps_ptr, unit, tid, 1, plan)
    _publish(info_ptr, slots, unit, tid, record)
    _stamp(stamps_ptr, unit, tid, 2, plan)
    if req < requests:
        p_pairs = cute.make_tensor(p_vecs.iterator, cute.make_layout((2, tile_rows, p_pitch // 2),
                                                                     stride=(1, p_pitch, 2)))
        ldsm = cute.make_copy_atom(cute.nvgpu.warp.LdMatrix8x8x16bOp(transpose=False, num_matrices=4), BFloat16)
        ldsm_t = cute.make_copy_atom(cute.nvgpu.warp.LdMatrix8x8x16bOp(transpose=True, num_matrices=4), BFloat16)
        mma = cute.make_mma_atom(cute.nvgpu.warp.MmaF16BF16Op(BFloat16, Float32, (16, 8, 16)))

        # the query tile (padding rows repeat the last real query; they are never stored)
        q_vecs = cute.make_tensor(q_ptr, cute.make_layout((VEC, rows * heads, ROW_VECS), stride=(1, ROW, VEC)))
        for k in cutlass.range_constexpr(-(-tile_rows * ROW_VECS // threads)):
            idx = tid + threads * k
            if idx < tile_rows * ROW_VECS:
                row = idx // ROW_VECS
                vec = idx - row * ROW_VECS
                src_row = out_base + cutlass.min(row, valid_rows - 1)
                cute.copy(g2s, q_vecs[None, src_row, vec], q_tile[None, row, vec])

        for p in cutlass.range_constexpr(stages - 1):
            if p < (n_chunks if p > 0 else n_chunks * (1 - early)):  # chunk 0 unless it went early
                _locate_chunk(phys, blocks, table, c0 + p, token_end, warp, table_row, num_blocks, block_size, chunk,
                              warps)
                _issue_chunk(g2s, cache_base, phys, warp, lane, chunk, warps,
                             lambda row, vec, st=Int32(p): ring[None, st, row, vec])
            cute.arch.cp_async_commit_group()  # one group per stage, empty or not: uniform waits
        _next_chunk(phys, blocks, table, c0 + cutlass.min(stages - 1, n_chunks - 1), token_end, warp, table_row,
                    num_blocks, block_size, chunk, warps, plan.defer_table)

        # per lane: rows 16·mt + 8·v1 + g of each tile; how far each may look (verify rows are causal)
        limit = cute.make_rmem_tensor(cute.make_layout((2, m)), Int32)
        for mt in cutlass.range_constexpr(m):
            for v1 in cutlass.range_constexpr(2):
                row = 16 * mt + 8 * v1 + g
                token = (tile * tile_rows + row) // heads
                causal = length - q + token + 1
                limit[v1, mt] = cutlass.select_(row < valid_rows, cutlass.min(causal, token_end), token_end)
        run_max = cute.make_rmem_tensor(cute.make_layout((2, m)), Float32)
        run_sum = cute.make_rmem_tensor(cute.make_layout((2, m)), Float32)
        rescale = cute.make_rmem_tensor(cute.make_layout((2, m)), Float32)
        run_max.fill(-Float32.inf)
        run_sum.fill(0.0)
        acc_o = cute.make_rmem_tensor(cute.make_layout((4, m, warp_cols // 8)), Float32)
        acc_o.fill(0.0)
        # score accumulators: (fragment, m tile) blocks, one per (token tile, chain)
        acc_s = cute.make_rmem_tensor(cute.make_layout((4, m, n_t, sets)), Float32)
        score = cute.make_rmem_tensor(cute.make_layout((4, m, n_t)), Float32)
        q_frag = cute.make_rmem_tensor(cute.make_layout((VEC, m)), BFloat16)
        k_frag = cute.make_rmem_tensor(cute.make_layout((VEC, n_t)), BFloat16)
        p_frag = cute.make_rmem_tensor(cute.make_layout((VEC, m)), BFloat16)
        v_frag = cute.make_rmem_tensor(cute.make_layout(VEC), BFloat16)  # two n8 tiles
        p_pair = cute.make_rmem_tensor(cute.make_layout(2), BFloat16)

        for it in cutlass.range(n_chunks):
            cute.arch.cp_async_wait_group(stages - 2)
            # chunk `it` landed for every thread; every warp is done with chunk it − 1 (its stage
            # is refilled next) and with the previous weights and statistics
            cute.arch.sync_threads()
            if it == 0:
                _stamp(stamps_ptr, unit, tid, 3, plan)
            ahead = it + stages - 1
            if ahead < n_chunks:
                if cutlass.const_expr(plan.defer_table):
                    _chunk_rows(phys, blocks, c0 + ahead, token_end, warp, num_blocks, block_size, chunk, warps)
                _issue_chunk(g2s, cache_base, phys, warp, lane, chunk, warps,
                             lambda row, vec, st=ahead % stages: ring[None, st, row, vec])
                if ahead + 1 < n_chunks:
                    _next_chunk(phys, blocks, table, c0 + ahead + 1, token_end, warp, table_row, num_blocks,
                                block_size, chunk, warps, plan.defer_table)
            cute.arch.cp_async_commit_group()
            stage = it % stages

            # scores of the warp's token tiles j = n_t·w + nt (tokens 8j .. 8j+7): 18 blocks of
            # 32 latent dims, two k16 atoms each; a Q fragment serves every token tile
            acc_s.fill(0.0)
            for kb in cutlass.range_constexpr(ROW // 32):
                for nt in cutlass.range_constexpr(n_t):
                    cute.copy(ldsm, ring[None, stage, 8 * (n_t * warp + nt) + lane % 8, 4 * kb + lane // 8],
                              k_frag[None, nt])
                for a2 in cutlass.range_constexpr(2):
                    atom = 2 * kb + a2
                    for mt in cutlass.range_constexpr(m):
                        cute.copy(ldsm, q_tile[None, 16 * mt + lane % 16, 2 * atom + lane // 16], q_frag[None, mt])
                    for nt in cutlass.range_constexpr(n_t):
                        _mma(mma, cute.make_tensor(acc_s.iterator + 4 * m * (nt + n_t * (atom % sets)),
                                                   cute.make_layout((4, m))),
                             q_frag, cute.make_tensor(k_frag.iterator + VEC * nt + 4 * a2, cute.make_layout(4)), m, 1)

            # online softmax: chunk max across the warps, weights, chunk sum
            for mt in cutlass.range_constexpr(m):
                for v1 in cutlass.range_constexpr(2):
                    best = -Float32.inf
                    for nt in cutlass.range_constexpr(n_t):
                        token0 = (c0 + it) * chunk + 8 * (n_t * warp + nt) + 2 * c
                        for v0 in cutlass.range_constexpr(2):
                            total = acc_s[v0 + 2 * v1, mt, nt, 0]
                            for st in cutlass.range_constexpr(1, sets):
                                total += acc_s[v0 + 2 * v1, mt, nt, st]
                            s2 = cutlass.select_(token0 + v0 < limit[v1, mt], total * scale_log2, -Float32.inf)
                            score[v0 + 2 * v1, mt, nt] = s2
                            best = cute.arch.fmax(best, s2)
                    best = _quad_max(best)
                    if c == 0:
                        red_max[warp, 16 * mt + 8 * v1 + g] = best
            cute.arch.sync_threads()
            for mt in cutlass.range_constexpr(m):
                for v1 in cutlass.range_constexpr(2):
                    row = 16 * mt + 8 * v1 + g
                    chunk_max = red_max[0, row]
                    for w in cutlass.range_constexpr(1, warps):
                        chunk_max = cute.arch.fmax(chunk_max, red_max[w, row])
                    new_max = cute.arch.fmax(run_max[v1, mt], chunk_max)
                    # a row with nothing visible yet keeps max −inf; exp2 against 0 then gives 0s
                    ref = cutlass.select_(new_max == -Float32.inf, Float32(0.0), new_max)
                    rescale[v1, mt] = cute.math.exp2(run_max[v1, mt] - ref, fastmath=True)
                    run_max[v1, mt] = new_max
                    part = Float32(0.0)
                    for nt in cutlass.range_constexpr(n_t):
                        for v0 in cutlass.range_constexpr(2):
                            p = cute.math.exp2(score[v0 + 2 * v1, mt, nt] - ref, fastmath=True)
                            part += p
                            p_pair[v0] = p.to(BFloat16)
                        cute.autovec_copy(p_pair, p_pairs[None, row, 4 * (n_t * warp + nt) + c])
                    part = _quad_sum(part)
                    if c == 0:
                        red_sum[warp, row] = part
            cute.arch.sync_threads()
            for mt in cutlass.range_constexpr(m):
                for v1 in cutlass.range_constexpr(2):
                    row = 16 * mt + 8 * v1 + g
                    chunk_sum = red_sum[0, row]
                    for w in cutlass.range_constexpr(1, warps):
                        chunk_sum += red_sum[w, row]
                    run_sum[v1, mt] = run_sum[v1, mt] * rescale[v1, mt] + chunk_sum
                    for nt in cutlass.range_constexpr(warp_cols // 8):
                        for v0 in cutlass.range_constexpr(2):
                            acc_o[v0 + 2 * v1, mt, nt] = acc_o[v0 + 2 * v1, mt, nt] * rescale[v1, mt]

            # O[:, warp_cols·w ..] += P · V, V fragments transposed out of the same ring rows
            for ka in cutlass.range_constexpr(chunk // 16):
                for mt in cutlass.range_constexpr(m):
                    cute.copy(ldsm, p_vecs[None, 16 * mt + lane % 16, 2 * ka + lane // 16], p_frag[None, mt])
                for pair in cutlass.range_constexpr(warp_cols // 16):
                    cute.copy(ldsm_t,
                              ring[None, stage, 16 * ka + lane % 8 + 8 * ((lane // 8) % 2),
                                   warp_cols // VEC * warp + 2 * pair + lane // 16],
                              v_frag)
                    _mma(mma, cute.make_tensor(acc_o.iterator + 8 * m * pair, cute.make_layout((4, m, 2))),
                         p_frag, v_frag, m, 2)
        cute.arch.cp_async_wait_group(0)
        _stamp(stamps_ptr, unit, tid, 4, plan)

        col0 = warp_cols * warp + 2 * c
        if splits == 1:
            out_pairs = cute.make_tensor(out_ptr, cute.make_layout((2, rows * heads, LATENT // 2),
                                                                   stride=(1, LATENT, 2)))
            o_pair = cute.make_rmem_tensor(cute.make_layout(2), BFloat16)
            for mt in cutlass.range_constexpr(m):
                for v1 in cutlass.range_constexpr(2):
                    row = 16 * mt + 8 * v1 + g
                    if row < valid_rows:
                        total = run_sum[v1, mt]
                        inv = cutlass.select_(total > 0.0, 1.0 / total, Float32(0.0))
                        for nt in cutlass.range_constexpr(warp_cols // 8):
                            for v0 in cutlass.range_constexpr(2):
                                o_pair[v0] = (acc_o[v0 + 2 * v1, mt, nt] * inv).to(BFloat16)
                            cute.autovec_copy(o_pair, out_pairs[None, out_base + row, (col0 + 8 * nt) // 2])
        else:
            ws_o = cute.make_tensor(ws_o_ptr, cute.make_layout((2, slots * tile_rows, LATENT // 2),
                                                               stride=(1, LATENT, 2)))
            ws_ml = cute.make_tensor(ws_ml_ptr, cute.make_layout((slots * tile_rows, 2), stride=(2, 1)))
            o_pair = cute.make_rmem_tensor(cute.make_layout(2), Float32)
            for mt in cutlass.range_constexpr(m):
                for v1 in cutlass.range_constexpr(2):
                    row = 16 * mt + 8 * v1 + g
                    if row < valid_rows:
                        for nt in cutlass.range_constexpr(warp_cols // 8):
                            for v0 in cutlass.range_constexpr(2):
                                o_pair[v0] = acc_o[v0 + 2 * v1, mt, nt]
                            cute.autovec_copy(o_pair, ws_o[None, unit * tile_rows + row, (col0 + 8 * nt) // 2])
                        if warp == 0:  # every warp holds the same statistics
                            if c == 0:
                                ws_ml[unit * tile_rows + row, 0] = run_max[v1, mt]
                                ws_ml[unit * tile_rows + row, 1] = run_sum[v1, mt]
            if cutlass.const_expr(plan.fan_in):
                # the tree's counters follow the records (`_split_scratch`)
                mla_combine.merge_splits(ws_o_ptr, ws_ml_ptr, info_ptr + slots * INFO, out_ptr, slots, rows * heads,
                                         record[1], splits, record[3], record[4], valid_rows, out_base, tid,
                                         cute.recast_ptr(ring.iterator, dtype=Float32), stage_ml, ticket_box, threads,
                                         tile_rows, plan.fan_in, plan.merge_rows)
        _stamp(stamps_ptr, unit, tid, 5, plan)


@cute.jit
def _mla_decode_host(q_ptr: cute.Pointer, cache_ptr: cute.Pointer, table_ptr: cute.Pointer,
                     lens_ptr: cute.Pointer, starts_ptr: cute.Pointer, out_ptr: cute.Pointer,
                     ws_o_ptr: cute.Pointer, ws_ml_ptr: cute.Pointer, info_ptr: cute.Pointer,
                     stamps_ptr: cute.Pointer, rows: Int32, requests: Int32, num_blocks: Int32, max_blocks: Int32,
                     slots: Int32, target: Int32, min_chunks: Int32, scale_log2: Float32, stream: cuda.CUstream,
                     plan: Constexpr):
    _mla_decode_kernel(q_ptr, cache_ptr, table_ptr, lens_ptr, starts_ptr, out_ptr, ws_o_ptr, ws_ml_ptr, info_ptr,
                       stamps_ptr, rows, requests, num_blocks, max_blocks, slots, target, min_chunks, scale_log2, plan).launch(
        grid=(slots, 1, 1), block=(plan.threads, 1, 1), stream=stream, use_pdl=True,
        # a plan whose CTAs fit an SM's shared memory twice asks for all of it: left to itself the
        # driver may pick a smaller carveout that holds only one of them
        preferred_smem_carveout=100 if plan.smem_ctas >= 2 else None)



def compile_mla_decode(plan: DecodePlan, arch: str, ptx_dir: str | None = None) -> Any:
    """Compile one variant for `arch` ('sm_90a', 'sm_100a', 'sm_103a'); needs no GPU. With `ptx_dir`
    the PTX and cubin are kept (written there, and in the result's `artifacts.PTX` / `.CUBIN`)."""
    if plan.mma == "wgmma":
        from .mla_decode_wgmma import compile_mla_decode_wgmma  # it imports this module's helpers
        return compile_mla_decode_wgmma(plan, arch, ptx_dir)
    bf, i32, f32, i64 = gmem_ptr(BFloat16, 16), gmem_ptr(Int32, 16, 4), gmem_ptr(Float32, 16), gmem_ptr(Int64, 16, 8)
    return cute.compile(_mla_decode_host, bf, bf, i32, i32, i32, bf, f32, f32, i32, i64,
                        Int32(1), Int32(1), Int32(2), Int32(1), Int32(1), Int32(1), Int32(1), Float32(1.0),
                        cute.runtime.make_fake_stream(), plan,
                        options=f"--gpu-arch {arch}" + (f" --keep-ptx --keep-cubin --dump-dir {ptx_dir}" if ptx_dir else ""))


# ---------------------------------------------------------------- host side


def _need(cond: bool, msg: str) -> None:
    if not cond:
        raise MlaDecodeEnvelopeError(f"mla_decode: {msg}")


def check_envelope(q_lat: torch.Tensor, cache: torch.Tensor, block_table: torch.Tensor, seq_lens: torch.Tensor,
                   query_start: torch.Tensor, max_q: int, out: torch.Tensor | None) -> None:
    """Raise MlaDecodeEnvelopeError naming what is outside the envelope (no GPU work)."""
    named = {"q_lat": q_lat, "cache": cache, "block_table": block_table, "seq_lens": seq_lens,
             "query_start": query_start}
    for name, t in named.items():
        _need(isinstance(t, torch.Tensor), f"{name} must be a torch tensor, got {type(t).__name__}")
    _need(q_lat.dim() == 3 and q_lat.shape[2] == ROW,
          f"q_lat must be [rows, heads, {ROW}] ([ql | q_pe] per head), got {tuple(q_lat.shape)}")
    rows, heads, _ = q_lat.shape
    _need(1 <= heads <= MAX_HEADS, f"heads={heads} is outside 1..{MAX_HEADS}")
    _need(cache.dim() == 3 and cache.shape[2] == ROW and cache.shape[0] >= 1 and cache.shape[1] >= 1,
          f"cache must be [num_blocks, block_size, {ROW}] ([c | k_pe] rows), got {tuple(cache.shape)}")
    _need(q_lat.dtype == torch.bfloat16 and cache.dtype == torch.bfloat16,
          f"q_lat and cache must be bfloat16, got {q_lat.dtype} and {cache.dtype}; FP8 caches are not supported")
    _need(block_table.dim() == 2 and block_table.shape[1] >= 1,
          f"block_table must be [requests, max_blocks], got {tuple(block_table.shape)}")
    requests = block_table.shape[0]
    _need(1 <= requests <= MAX_REQUESTS,
          f"{requests} requests is outside 1..{MAX_REQUESTS}; split the batch into chunks of <= {MAX_REQUESTS}")
    _need(seq_lens.shape == (requests,), f"seq_lens must be [{requests}] (one per block-table row), "
          f"got {tuple(seq_lens.shape)}")
    _need(query_start.shape == (requests + 1,), f"query_start must be [{requests + 1}] (row offsets of the "
          f"requests, then the end), got {tuple(query_start.shape)}")
    for name in ("block_table", "seq_lens", "query_start"):
        _need(named[name].dtype == torch.int32, f"{name} must be int32, got {named[name].dtype}")
    _need(isinstance(max_q, int) and 1 <= max_q <= MAX_Q,
          f"max_q={max_q!r} (tokens per request in the step) must be an int in 1..{MAX_Q}")
    _need(1 <= rows <= requests * max_q,
          f"q_lat has {rows} rows but {requests} requests of <= {max_q} tokens hold at most {requests * max_q}")
    _need(cache.shape[0] * cache.shape[1] < 2 ** 31, "cache holds 2^31 rows or more; use a smaller pool")
    if out is not None:
        _need(isinstance(out, torch.Tensor) and out.shape == (rows, heads, LATENT) and out.dtype == torch.bfloat16,
              f"out must be a [{rows}, {heads}, {LATENT}] bfloat16 tensor, got "
              f"{tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__}"
              f"{'' if not isinstance(out, torch.Tensor) else ' ' + str(out.dtype)}")
        named["out"] = out
    for name, t in named.items():
        _need(t.is_contiguous(), f"{name} must be contiguous; call .contiguous()")
    for name, t in named.items():
        _need(t.device.type == "cuda", f"{name} must be a CUDA tensor, got one on {t.device}")
    _need(len({t.device for t in named.values()}) == 1, f"{', '.join(named)} must all be on one device")
    _need(all(t.data_ptr() % 16 == 0 for t in named.values()), "all tensors must be 16-byte aligned "
          "(fresh allocations are)")


def default_target(sm_count: int, plan: DecodePlan | None = None) -> int:
    """Work units to aim for: `plan.waves` waves of one CTA per SM (the default plan: one). One
    request gets up to that many splits (a long one fills every SM, each split long enough to
    amortize its prologue); more waves let unequal requests balance at the price of more
    prologues and partials."""
    return (plan.waves if plan is not None else DecodePlan(1, 1, 1).waves) * sm_count


MIN_CHUNKS = DecodePlan(1, 1, 1).min_chunks  # the default plan's fewest chunks worth a split


def _split_scratch(dev: DeviceFacts, slots: int, tile_rows: int) -> tuple[torch.Tensor, ...]:
    """FP32 partial outputs [slots, tile_rows, 512], their (max, sum) [slots, tile_rows, 2] and
    the per-slot records [slots, INFO] int32 followed by an in-kernel combine's tree counters
    [slots, COUNT_LEVELS] (zero, and left zero by every launch), one set per grid shape (the
    kernels rewrite what they read)."""
    return dev.scratch(("mla_decode", slots, tile_rows), lambda d: (
        torch.empty(slots * tile_rows * LATENT, dtype=torch.float32, device=d),
        torch.empty(slots * tile_rows * 2, dtype=torch.float32, device=d),
        torch.zeros(slots * (INFO + mla_combine.COUNT_LEVELS), dtype=torch.int32, device=d)))


_COMPILED: dict[tuple[tuple[int, ...], str], Any] = {}


def launch(q_lat: torch.Tensor, cache: torch.Tensor, block_table: torch.Tensor, seq_lens: torch.Tensor,
           query_start: torch.Tensor, max_q: int, out: torch.Tensor | None = None, *,
           tau: float = K3_TAU, stream: torch.cuda.Stream | None = None, plan: DecodePlan | None = None,
           target: int | None = None, min_chunks: int | None = None, stamps: torch.Tensor | None = None) -> torch.Tensor:
    """ol [rows, heads, 512] bf16 (module docstring) into `out` (allocated when None) on `stream`,
    with softmax scale `tau` (the model's 1/sqrt(d_nope + d_rope); K3's by default).

    Runs the split kernel and, on the same stream, the combine (`mla_combine.launch`; a
    `plan.fan_in` plan merges its splits in the split kernel and launches none). The first
    call of a variant compiles (seconds); later calls only launch. `plan` (`choose_plan` when
    None; `sweep_plans` lists the variants a benchmark compares), `target` (work units to aim
    for; default `plan.waves` · SMs) and `min_chunks` (default `plan.min_chunks`) override the
    defaults. A `plan.timeline` plan writes its readings to `stamps`, int64 [grid, STAMPS] (the
    grid is `grid_size`; `mla_timeline` reads them).
    """
    _need(isinstance(tau, (int, float)) and math.isfinite(tau) and tau > 0,
          f"tau={tau!r} (the softmax scale) must be a positive finite number")
    check_envelope(q_lat, cache, block_table, seq_lens, query_start, max_q, out)
    rows, heads, _ = q_lat.shape
    requests, max_blocks = block_table.shape
    num_blocks, block_size, _ = cache.shape
    dev = facts(q_lat.device)
    plan = plan or choose_plan(heads, max_q, block_size, dev.arch)
    _need(plan.heads == heads and plan.max_q == max_q and plan.block_size == block_size,
          f"{plan} does not match heads={heads}, max_q={max_q}, block_size={block_size}")
    _need(plan.smem_bytes <= SMEM_PER_CTA, f"{plan} needs {plan.smem_bytes} B of shared memory per CTA, "
          f"more than {SMEM_PER_CTA}; use fewer stages")
    positions = max_blocks * block_size
    _need(positions <= 2 ** 30 and requests * -(-positions // plan.chunk) * plan.max_tiles < 2 ** 31,
          f"block_table covers {positions} positions per request, too many for the int32 schedule; "
          "shorten max_blocks")
    target = target or default_target(dev.sm_count, plan)
    min_chunks = plan.min_chunks if min_chunks is None else min_chunks
    _need(target >= 1 and min_chunks >= 1, f"target={target} and min_chunks={min_chunks} must be >= 1")
    slots = grid_size(plan, requests, target)
    _need(plan.timeline == (stamps is not None), "stamps are given exactly when plan.timeline is set")
    _need(stamps is None or (stamps.dtype == torch.int64 and stamps.is_cuda and stamps.numel() >= slots * STAMPS),
          f"stamps must be a CUDA int64 tensor of >= {slots} x {STAMPS} readings")
    key = (plan.kernel_key, dev.arch)
    fn = _COMPILED.get(key)
    if fn is None:
        fn = _COMPILED[key] = compile_mla_decode(plan, dev.arch)
    ws_o, ws_ml, info = _split_scratch(dev, slots, plan.tile_rows)
    if out is None:
        out = torch.empty((rows, heads, LATENT), dtype=torch.bfloat16, device=q_lat.device)
    stream = torch.cuda.current_stream(q_lat.device) if stream is None else stream
    cu_stream = cuda.CUstream(stream.cuda_stream)
    fn(gmem_ptr(BFloat16, q_lat.data_ptr()), gmem_ptr(BFloat16, cache.data_ptr()),
       gmem_ptr(Int32, block_table.data_ptr(), 4), gmem_ptr(Int32, seq_lens.data_ptr(), 4),
       gmem_ptr(Int32, query_start.data_ptr(), 4), gmem_ptr(BFloat16, out.data_ptr()),
       gmem_ptr(Float32, ws_o.data_ptr()), gmem_ptr(Float32, ws_ml.data_ptr()), gmem_ptr(Int32, info.data_ptr(), 4),
       gmem_ptr(Int64, (stamps if stamps is not None else info).data_ptr(), 8),
       rows, requests, num_blocks, max_blocks, slots, target, min_chunks, tau * math.log2(math.e), cu_stream)
    if not plan.fan_in:
        mla_combine.launch(ws_o, ws_ml, info, out, slots, plan.tile_rows, dev.arch, cu_stream, plan.combine_pdl)
    return out
