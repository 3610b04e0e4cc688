"""Combine of the KV splits of MLA decode attention: ol = Σ_s w_s O_s / Σ_s w_s ℓ_s.

Compiled for sm_90a, sm_100a and sm_103a. Evidence (`evidence/<card>/`), with `mla_decode.py`
that launches it: `mla_decode_test.json`, `mla_decode_bench.json`.

Math: split s of a query row left an unnormalized FP32 partial O_s = Σ_{t ∈ s} 2^(x_t − m_s) c_t
with its max m_s and sum ℓ_s = Σ_{t ∈ s} 2^(x_t − m_s) (x = scores in log2 units, written by
`kernels/mla_decode.py`). With M = max_s m_s and w_s = 2^(m_s − M), the merged row is
bf16(Σ_s w_s O_s / Σ_s w_s ℓ_s): the softmax of `reference/mla.py::attend_absorbed` over the
whole context (FP32, the splits merged in a fixed order, so results are deterministic). A
split that saw no visible token (max −∞, sum 0) weighs 0; a row that saw none at all is 0.

Envelope: the workspace of one `mla_decode.launch` — partials [slots, tile_rows, 512] and
(max, sum) [slots, tile_rows, 2] FP32, records [slots, INFO_FIELDS] int32 — and its output
[rows · heads, 512] bf16, all contiguous and 16-byte aligned; run on the same stream right
after the decode kernel. Compiles for sm_90a, sm_100a, sm_103a (nothing arch-specific).

Design: one CTA of 32·GROUPS threads per decode work unit (the same grid). Each record says what
that unit computed: request (−1: idle), split s, splits n, the slot of split 0 of its query
tile, the slot stride between splits, the tile's real rows and its first output row. Units
of a request with n = 1 (written directly) and idle ones exit at once. Otherwise the n
units of a tile share its rows × 4 column blocks of 128 (unit s takes pieces s, s + n, ...),
so the combine is as parallel as the splits. The GROUPS warps form teams of P warps, P the
least power of two with P · UNROLL >= n (at most GROUPS), and the GROUPS / P teams take
consecutive pieces at once: a member warp merges every P-th batch of UNROLL splits (16-byte
loads of 4 columns per lane, a batch in flight at once) online in split order, the team
meets in shared memory, and its first warp merges the members' states in order and stores.
Few splits (many requests, or a verify's many rows) give one-warp teams, so a unit's pieces
cost one round trip each GROUPS of them; one long request's 128 splits give one team of all
GROUPS warps, as many loads in flight for its single piece.

`merge_splits` is the same merge run inside the split kernel (`DecodePlan.fan_in`): a tree of
last arrivals in place of this kernel's launch.
"""

from __future__ import annotations

from typing import Any

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
import torch
from cutlass import BFloat16, Constexpr, Float32, Int32
from .rows import gmem_ptr

LATENT = 512
# warps, and the splits a warp loads at once: the combine is latency-bound (one round trip per
# batch), and one request's 128 splits take one batch a warp (H200, 2026-12-05: with 4 warps ×
# 8 splits, four batches, it took 14-17 µs of that request's 35-70 at 32K-128K, the split kernel
# 17-50). With all GROUPS warps on one piece whatever the splits, 8 requests of q = 8 verify
# (8 splits a tile, 24 pieces a unit, one after another) took 43-56 µs (H100, 2026-12-06)
GROUPS = 8
UNROLL = 16
COL_BLOCKS = 4  # 128-column pieces of a row: 32 lanes × 4 columns
INFO_FIELDS = 8  # request, split, splits, first slot, slot stride, valid rows, output row; 32-byte records


# The partition of a tile's pieces and splits, written with + − * // and the given min only, so
# the same functions run in the kernel (cutlass.min on Int32) and on the host (the CPU tests).


def team_warps(splits, lo=cutlass.min):
    """P: the least power of two with P · UNROLL >= splits (>= 1), at most GROUPS."""
    p = splits * 0 + 1
    for _ in range(GROUPS.bit_length() - 1):
        p = p + p * lo(1, (splits - 1) // (p * UNROLL))  # doubles while p · UNROLL < splits
    return p


def round_piece(base, splits, team):
    """The piece team `team` takes in the round whose first piece is `base`; a unit of split s
    starts at base = s and steps by splits · teams, so the units of a tile and their teams take
    every piece once."""
    return base + splits * team


@cute.jit
def _merge(state: cute.Tensor, o: cute.Tensor, m_s: Float32, l_s: Float32):
    """state = (max, sum, 4 accumulators) absorbs one partial (o, m_s, l_s)."""
    new_max = cute.arch.fmax(state[0], m_s)
    ref = cutlass.select_(new_max == -Float32.inf, Float32(0.0), new_max)
    keep = cute.math.exp2(state[0] - ref, fastmath=True)
    take = cute.math.exp2(m_s - ref, fastmath=True)
    state[0] = new_max
    state[1] = state[1] * keep + l_s * take
    for j in cutlass.range_constexpr(4):
        state[2 + j] = state[2 + j] * keep + o[j] * take


# The in-kernel combine (`merge_splits`): a tree level's counters per node; fan_in ** COUNT_LEVELS
# must cover every grid (fan-in 4 and up: 65 536 splits)
COUNT_LEVELS = 8
ROW_BYTES = 4 * LATENT  # one FP32 partial row


def tree_node(idx, n, fan_in, lo=cutlass.min):
    """(node, its first child, its children) above child `idx` of the `n` at one level of a tree
    of fan-in `fan_in`: the next level has ⌈n / fan_in⌉ nodes. Host and kernel (`merge_splits`)."""
    node = idx // fan_in
    child0 = node * fan_in
    return node, child0, lo(fan_in, n - child0)


def merge_rows(stage_bytes: int, fan_in: int) -> int:
    """Rows of a tile `merge_splits` merges at once: every child's partial of them fits the stage."""
    return stage_bytes // ROW_BYTES // fan_in


@cute.jit
def merge_splits(ws_o_ptr: cute.Pointer, ws_ml_ptr: cute.Pointer, counts_ptr: cute.Pointer, out_ptr: cute.Pointer,
                 slots: Int32, out_rows: Int32, split: Int32, splits: Int32, slot0: Int32, stride: Int32,
                 valid_rows: Int32, out_base: Int32, tid: Int32, stage_ptr: cute.Pointer, stage_ml: cute.Tensor,
                 ticket_box: cute.Tensor, threads: Constexpr, tile_rows: Constexpr, fan_in: Constexpr,
                 batch_rows: Constexpr):
    """Called by every thread of a split kernel's CTA right after it wrote split `split` of
    `splits` of its tile to the workspace (slot slot0 + s · stride holds split s): the combine
    without a launch of its own. The splits form a tree of fan-in `fan_in`; the CTA that
    completes a node (the last of its children to arrive, counted by an atomic ticket) merges
    the children's partials into the node's, kept in its first child's slot, and climbs; the
    root's merger writes bf16 rows. Only one CTA's merge of each level is on the critical path,
    each over fan_in partials of the tile's real rows, where one CTA merging all the splits
    would read them all alone. The merge is latency-bound: `batch_rows` rows of every child
    stream at once into shared memory (`stage_ptr`, the kernel's idle cache ring; 16-byte
    cp.async, L2 only) with their (max, sum) (`stage_ml` [fan_in, batch_rows, 2]), so a batch
    costs one round trip whatever its size. Counters are reset by the CTA that completes them,
    so they are zero between launches (the workspace's counts start at zero)."""
    row_pieces = LATENT // 4
    ws_o = cute.make_tensor(ws_o_ptr, cute.make_layout((4, slots * tile_rows, row_pieces), stride=(1, LATENT, 4)))
    ws_ml = cute.make_tensor(ws_ml_ptr, cute.make_layout((slots * tile_rows, 2), stride=(2, 1)))
    out = cute.make_tensor(out_ptr, cute.make_layout((4, out_rows, row_pieces), stride=(1, LATENT, 4)))
    counts = cute.make_tensor(counts_ptr, cute.make_layout(slots * COUNT_LEVELS))
    stage = cute.make_tensor(stage_ptr, cute.make_layout((4, fan_in * batch_rows, row_pieces), stride=(1, LATENT, 4)))
    g2s = cute.make_copy_atom(cute.nvgpu.cpasync.CopyG2SOp(cache_mode=cute.nvgpu.cpasync.LoadCacheMode.GLOBAL),
                              Float32, num_bits_per_copy=128)
    o = cute.make_rmem_tensor(cute.make_layout(4), Float32)
    acc = cute.make_rmem_tensor(cute.make_layout(4), Float32)
    res = cute.make_rmem_tensor(cute.make_layout(4), BFloat16)
    idx = split
    n = splits
    span = Int32(1)  # level-0 splits under one child of this level
    for level in cutlass.range(COUNT_LEVELS):
        if n > 1:
            group, child0, members = tree_node(idx, n, fan_in)
            node = slot0 + child0 * span * stride  # its first child's slot, which takes its partial
            # the CTA's partial is visible GPU-wide before its ticket; the last ticket sees them all
            cute.arch.sync_threads()
            if tid == 0:
                cute.arch.fence_acq_rel_gpu()
                ticket = cute.arch.atomic_add(counts_ptr + (node * COUNT_LEVELS + level), Int32(1), sem="acq_rel",
                                              scope="gpu")
                last = cutlass.select_(ticket == members - 1, Int32(1), Int32(0))
                if last == 1:
                    counts[node * COUNT_LEVELS + level] = 0
                    cute.arch.fence_acq_rel_gpu()
                ticket_box[0] = last
            cute.arch.sync_threads()
            if ticket_box[0] == 1:
                final = cutlass.select_(n <= fan_in, Int32(1), Int32(0))
                dest = node * tile_rows
                for r0 in cutlass.range(0, valid_rows, batch_rows):
                    rows = cutlass.min(batch_rows, valid_rows - r0)
                    per_child = rows * row_pieces
                    for k in cutlass.range(tid, members * per_child, threads):
                        ch = k // per_child
                        row = (k - ch * per_child) // row_pieces
                        col4 = k - ch * per_child - row * row_pieces
                        src = (slot0 + (child0 + ch) * span * stride) * tile_rows + r0 + row
                        cute.copy(g2s, ws_o[None, src, col4], stage[None, ch * batch_rows + row, col4])
                    cute.arch.cp_async_commit_group()
                    for k in cutlass.range(tid, members * rows, threads):
                        ch = k // rows
                        src = (slot0 + (child0 + ch) * span * stride) * tile_rows + r0 + k - ch * rows
                        # from L2 like the partials: this SM's L1 may hold the lines from an earlier launch
                        stage_ml[ch, k - ch * rows, 0] = cute.arch.load(ws_ml_ptr + 2 * src, Float32, cop="cg")
                        stage_ml[ch, k - ch * rows, 1] = cute.arch.load(ws_ml_ptr + (2 * src + 1), Float32, cop="cg")
                    cute.arch.cp_async_wait_group(0)
                    cute.arch.sync_threads()
                    # every read of these rows is done: the node's partial may take its first child's place
                    for k in cutlass.range(tid, per_child, threads):
                        row = k // row_pieces
                        col4 = k - row * row_pieces
                        best = -Float32.inf
                        for ch in cutlass.range(members):
                            best = cute.arch.fmax(best, stage_ml[ch, row, 0])
                        ref = cutlass.select_(best == -Float32.inf, Float32(0.0), best)
                        total = Float32(0.0)
                        acc.fill(0.0)
                        for ch in cutlass.range(members):
                            w = cute.math.exp2(stage_ml[ch, row, 0] - ref, fastmath=True)
                            total += w * stage_ml[ch, row, 1]
                            cute.autovec_copy(stage[None, ch * batch_rows + row, col4], o)
                            for j in cutlass.range_constexpr(4):
                                acc[j] = acc[j] + w * o[j]
                        if final == 1:
                            # rcp.approx (1 ulp, under bf16's rounding; a visible row's sum is >= 1): an
                            # exact division's slow path gave the kernel a stack frame (ptxas, sm_90a)
                            inv = cutlass.select_(total > 0.0, cute.arch.rcp_approx(total), Float32(0.0))
                            for j in cutlass.range_constexpr(4):
                                res[j] = (acc[j] * inv).to(BFloat16)
                            cute.autovec_copy(res, out[None, out_base + r0 + row, col4])
                        else:
                            cute.autovec_copy(acc, ws_o[None, dest + r0 + row, col4])
                            if col4 == 0:
                                ws_ml[dest + r0 + row, 0] = best
                                ws_ml[dest + r0 + row, 1] = total
                    cute.arch.sync_threads()  # the stage is refilled by the next batch
                idx = group
                n = (n + fan_in - 1) // fan_in
                span = span * fan_in
            else:
                n = Int32(1)  # a later child completes this node


@cute.kernel
def _mla_combine_kernel(ws_o_ptr: cute.Pointer, ws_ml_ptr: cute.Pointer, info_ptr: cute.Pointer,
                        out_ptr: cute.Pointer, slots: Int32, out_rows: Int32, tile_rows: Constexpr, pdl: Constexpr):
    cute.arch.griddepcontrol_launch_dependents()  # a PDL-launched GEMM may start its W loads (skinny_gemm.py)
    if cutlass.const_expr(pdl):  # launched while the split kernel runs: its workspace is read only once it ends
        cute.arch.griddepcontrol_wait()
    tid, _, _ = cute.arch.thread_idx()
    unit, _, _ = cute.arch.block_idx()
    lane = tid % 32
    group = tid // 32
    info = cute.make_tensor(info_ptr, cute.make_layout((slots, INFO_FIELDS), stride=(INFO_FIELDS, 1)))
    req = info[unit, 0]
    splits = info[unit, 2]
    if req >= 0:
        if splits > 1:
            split = info[unit, 1]
            first = info[unit, 3]
            stride = info[unit, 4]
            valid_rows = info[unit, 5]
            out_base = info[unit, 6]
            ws_o = cute.make_tensor(ws_o_ptr, cute.make_layout((4, slots * tile_rows, LATENT // 4),
                                                               stride=(1, LATENT, 4)))
            ws_ml = cute.make_tensor(ws_ml_ptr, cute.make_layout((slots * tile_rows, 2), stride=(2, 1)))
            out = cute.make_tensor(out_ptr, cute.make_layout((4, out_rows, LATENT // 4), stride=(1, LATENT, 4)))
            smem = cutlass.memory.SmemAllocator()
            shared = smem.allocate_tensor(Float32, cute.make_layout((6, 32, GROUPS), stride=(1, 6, 6 * 32)),
                                          byte_alignment=16)
            state = cute.make_rmem_tensor(cute.make_layout(6), Float32)
            o = cute.make_rmem_tensor(cute.make_layout(4), Float32)
            o_batch = cute.make_rmem_tensor(cute.make_layout((4, UNROLL)), Float32)
            ml_batch = cute.make_rmem_tensor(cute.make_layout((2, UNROLL)), Float32)
            res = cute.make_rmem_tensor(cute.make_layout(4), BFloat16)
            # team size P: the least power of two (<= GROUPS) whose warps take every split in one
            # batch each
            warps = team_warps(splits)
            teams = GROUPS // warps
            team = group // warps
            member = group - team * warps
            pieces = valid_rows * COL_BLOCKS
            # every team passes the same barriers: the loop runs over rounds of `teams` pieces
            for base in cutlass.range(split, pieces, splits * teams):
                piece = round_piece(base, splits, team)
                row = piece // COL_BLOCKS
                col4 = (piece - row * COL_BLOCKS) * 32 + lane  # which 4 columns of the row
                if piece < pieces:
                    state.fill(0.0)
                    state[0] = -Float32.inf
                    for s0 in cutlass.range(UNROLL * member, splits, UNROLL * warps):
                        # UNROLL independent loads in flight, then merged in split order; splits
                        # past the last re-read it and weigh nothing (max −inf)
                        for u in cutlass.range_constexpr(UNROLL):
                            src = (first + cutlass.min(s0 + u, splits - 1) * stride) * tile_rows + row
                            cute.autovec_copy(ws_o[None, src, col4], o_batch[None, u])
                            ml_batch[0, u] = cutlass.select_(s0 + u < splits, ws_ml[src, 0], -Float32.inf)
                            ml_batch[1, u] = ws_ml[src, 1]
                        for u in cutlass.range_constexpr(UNROLL):
                            _merge(state, o_batch[None, u], ml_batch[0, u], ml_batch[1, u])
                    for j in cutlass.range_constexpr(6):
                        shared[j, lane, group] = state[j]
                cute.arch.sync_threads()
                if piece < pieces and member == 0:
                    state.fill(0.0)
                    state[0] = -Float32.inf
                    for k in cutlass.range(warps):
                        for j in cutlass.range_constexpr(4):
                            o[j] = shared[2 + j, lane, group + k]
                        _merge(state, o, shared[0, lane, group + k], shared[1, lane, group + k])
                    inv = cutlass.select_(state[1] > 0.0, 1.0 / state[1], Float32(0.0))
                    for j in cutlass.range_constexpr(4):
                        res[j] = (state[2 + j] * inv).to(BFloat16)
                    cute.autovec_copy(res, out[None, out_base + row, col4])
                cute.arch.sync_threads()  # `shared` is rewritten by the next round


@cute.jit
def _mla_combine_host(ws_o_ptr: cute.Pointer, ws_ml_ptr: cute.Pointer, info_ptr: cute.Pointer,
                      out_ptr: cute.Pointer, slots: Int32, out_rows: Int32, stream: cuda.CUstream,
                      tile_rows: Constexpr, pdl: Constexpr):
    _mla_combine_kernel(ws_o_ptr, ws_ml_ptr, info_ptr, out_ptr, slots, out_rows, tile_rows, pdl).launch(
        grid=(slots, 1, 1), block=(32 * GROUPS, 1, 1), stream=stream, use_pdl=pdl)



def compile_mla_combine(tile_rows: int, arch: str, ptx_dir: str | None = None, pdl: bool = False) -> Any:
    """Compile for one tile height and arch ('sm_90a', 'sm_100a', 'sm_103a'); needs no GPU. With
    `ptx_dir` the PTX is kept (written there, and in the result's `artifacts.PTX`). `pdl`: launched
    as a PDL dependent of the split kernel (`DecodePlan.combine_pdl`)."""
    f32 = gmem_ptr(Float32, 16)
    return cute.compile(_mla_combine_host, f32, f32, gmem_ptr(Int32, 16, 4), gmem_ptr(BFloat16, 16), Int32(1), Int32(1),
                        cute.runtime.make_fake_stream(), tile_rows, pdl,
                        options=f"--gpu-arch {arch}" + (f" --keep-ptx --dump-dir {ptx_dir}" if ptx_dir else ""))


_COMPILED: dict[tuple[int, str, bool], Any] = {}


def launch(ws_o: torch.Tensor, ws_ml: torch.Tensor, info: torch.Tensor, out: torch.Tensor, slots: int,
           tile_rows: int, arch: str, stream: cuda.CUstream, pdl: bool = False) -> None:
    """Merge the splits `mla_decode.launch` left in its workspace into `out` [rows, heads, 512].

    Called by `mla_decode.launch` (which checked every tensor) on its stream."""
    key = (tile_rows, arch, pdl)
    fn = _COMPILED.get(key)
    if fn is None:
        fn = _COMPILED[key] = compile_mla_combine(tile_rows, arch, pdl=pdl)
    fn(gmem_ptr(Float32, ws_o.data_ptr()), gmem_ptr(Float32, ws_ml.data_ptr()), gmem_ptr(Int32, info.data_ptr(), 4),
       gmem_ptr(BFloat16, out.data_ptr()), slots, out.shape[0] * out.shape[1], stream)
