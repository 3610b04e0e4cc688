"""How the skinny GEMMs write y: the epilogue of one element and the split-K sum (one place for
`skinny_gemm` and `skinny_gemm_wgmma`).

Epilogues, applied to the fp32 sum of a y element (`skinny_gemm`'s docstring has the math):
none (round to y's dtype), scale, add, gate. With K split over `splits` CTAs each CTA leaves its
fp32 partials of a tile in a workspace `[heads, splits, MAX_ROWS, N]`; the last CTA of the tile
to arrive (one counter per tile, reset by that CTA) adds the splits in a fixed order and stores
y, so results are deterministic and one launch does all.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import BFloat16, Constexpr, Float32, Int32, const_expr

MAX_ROWS = 64


@cute.jit
def store(y: cute.Tensor, e: cute.Tensor, head: Int32, row: Int32, col: Int32, total: Float32, scale: Float32,
          epilogue: Constexpr):
    """y[head, row, col] from the fp32 sum, through the epilogue."""
    if const_expr(epilogue == "none"):
        y[head, row, col] = total.to(y.element_type)
    else:
        val = total.to(BFloat16).to(Float32)
        if const_expr(epilogue == "scale"):
            val = val * scale
        if const_expr(epilogue == "add"):
            val = val + e[head, row, col].to(Float32)
        if const_expr(epilogue == "gate"):
            val = val * (Float32(1.0) / (Float32(1.0) + cute.math.exp(-e[head, row, col].to(Float32))))
        y[head, row, col] = val.to(y.element_type)


def split_workspace(ws_ptr: cute.Pointer, heads: int, splits: int, n: int) -> cute.Tensor:
    """The fp32 partials `[heads, splits, MAX_ROWS, N]`."""
    return cute.make_tensor(ws_ptr, cute.make_layout((heads, splits, MAX_ROWS, n),
                                                     stride=(splits * MAX_ROWS * n, MAX_ROWS * n, n, 1)))


@cute.jit
def sum_splits(y: cute.Tensor, e: cute.Tensor, ws: cute.Tensor, cnt_ptr: cute.Pointer, is_last: cute.Tensor,
               head: Int32, tile: Int32, tiles_n: Int32, tid: Int32, m: Int32, scale: Float32, n: Constexpr,
               block_n: Constexpr, padded_rows: Constexpr, threads: Constexpr, splits: Constexpr,
               epilogue: Constexpr):
    """Called by every thread of a CTA once its partials of rows < m, columns < n of the tile are in
    `ws`: count the tile's arrivals; the last CTA sums the splits and stores y. `is_last` is one
    Int32 of shared memory."""
    # publish this split's partials, then count the tile's arrivals
    cute.arch.fence_acq_rel_gpu()
    cute.arch.sync_threads()
    counter = cnt_ptr + head * tiles_n + tile
    if tid == 0:
        arrived = cute.arch.atomic_add(counter, Int32(1), sem="acq_rel", scope="gpu")
        is_last[0] = Int32(1) if arrived == splits - 1 else Int32(0)
    cute.arch.sync_threads()
    if is_last[0] == 1:
        cute.arch.fence_acq_rel_gpu()
        # all of a thread's workspace loads first (over the padded rows, at clamped indices,
        # which were written), then the guarded stores, so the loads are in flight together:
        # a loop that loads and stores each element waits one L2 round trip per element
        # (16 of them at M = 64)
        per_thread = -(-padded_rows * block_n // threads)
        totals = cute.make_rmem_tensor(cute.make_layout(per_thread), Float32)
        for i in cutlass.range_constexpr(per_thread):
            idx = tid + i * threads
            xr_in = cutlass.min(idx // block_n, m - 1)
            col_in = cutlass.min(tile * block_n + idx % block_n, n - 1)
            totals[i] = ws[head, 0, xr_in, col_in]
            for q in cutlass.range_constexpr(1, splits):
                totals[i] += ws[head, q, xr_in, col_in]
        for i in cutlass.range_constexpr(per_thread):
            idx = tid + i * threads
            xr = idx // block_n
            col = tile * block_n + idx % block_n
            if xr < m:
                if col < n:
                    store(y, e, head, xr, col, totals[i], scale, epilogue)
        if tid == 0:
            cute.arch.atomic_exch(counter, Int32(0), sem="relaxed", scope="gpu")
