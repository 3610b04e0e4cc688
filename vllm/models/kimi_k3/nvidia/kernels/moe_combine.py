"""Weighted sum of the routed experts' outputs per decode row (the last step of moe_experts).

Compiled for sm_90a, sm_100a and sm_103a. Evidence (`evidence/<card>/`), with the router and the
experts: `moe_test.json`, `moe_bench.json`.

Math (`reference/moe.py::_routed_latent`, its last loop): for row r,

    y[r] = bf16( Σ_j w[r, j] · fp32(o[r·k + j]) )    fp32, j = 0..k-1 in selection order

each term one fused multiply-add (the reference rounds w·o before adding it: fp32-ulp apart).

skipping picks whose expert id is outside [0, n_experts) (padding: their o rows are never
written, so they are not read, whatever their weight). An expert repeated within a row has its
output only in the row of its first pick (moe_experts computes it once), which every repeat reads.

Envelope: o [≥ M·k, H] bf16 (the pick-major expert outputs of kernels/moe_experts.py), ids
[M, k] int32, w [M, k] fp32, y [M, H] bf16; 1 <= M <= 64, 1 <= k <= 32, H % 8 == 0;
contiguous, 16-byte aligned (ids and w 4-byte), one CUDA device. One thread owns 8 columns of
one row (16-byte loads and stores); nothing else is fused. A thread issues all k of its o loads
before the first add, so they take one memory latency, not k in a row (the validity branch
around each add kept every load behind the previous pick's sum before). A PDL dependent of the
down pass that waits before its first load (it has no weights): with the other small kernels made
dependents too, the TP16 rows-1 step took 1391 µs against 1463 (H100, 2026-12-06, MEASURED.md),
where on 2026-12-04, before AttnRes and the GEMMs loaded weights ahead of their waits, such
dependents had cost it more than they hid.
"""

from __future__ import annotations

from typing import Any

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
import torch
from cutlass import BFloat16, Constexpr, Float32, Int32
from .device import facts
from .rows import gmem_ptr

MAX_ROWS = 64
MAX_TOP_K = 32
THREADS = 128


class MoECombineEnvelopeError(ValueError):
    """The inputs fall outside what the combine kernel supports."""


@cute.kernel
def _combine_kernel(o_ptr: cute.Pointer, ids_ptr: cute.Pointer, w_ptr: cute.Pointer, y_ptr: cute.Pointer,
                    m: Int32, n_experts: Constexpr, top_k: Constexpr, h: Constexpr):
    cute.arch.griddepcontrol_launch_dependents()  # a PDL-launched GEMM may start its W loads (skinny_gemm.py)
    tid, _, _ = cute.arch.thread_idx()
    row, part, _ = cute.arch.block_idx()
    vec = part * THREADS + tid  # this thread's 8 columns: 8·vec ..
    o_vec = cute.zipped_divide(
        cute.make_tensor(o_ptr, cute.make_layout((m * top_k, h), stride=(h, 1))), (1, 8))
    y_vec = cute.zipped_divide(cute.make_tensor(y_ptr, cute.make_layout((m, h), stride=(h, 1))), (1, 8))
    ids = cute.make_tensor(ids_ptr, cute.make_layout(m * top_k))
    wts = cute.make_tensor(w_ptr, cute.make_layout(m * top_k))
    cute.arch.griddepcontrol_wait()
    if vec < h // 8:
        row_ids = cute.make_rmem_tensor(cute.make_layout(top_k), Int32)
        row_w = cute.make_rmem_tensor(cute.make_layout(top_k), Float32)
        for j in cutlass.range_constexpr(top_k):
            row_ids[j] = ids[row * top_k + j]
            row_w[j] = wts[row * top_k + j]
        # every pick's o vector in flight at once: a load under the validity branch below would
        # wait for the previous pick's sum. A padding pick loads its own (unwritten, in-bounds)
        # row and adds nothing; an expert repeated in the row was computed once, into its first
        # pick's row, which every repeat loads
        vals = cute.make_rmem_tensor(cute.make_layout(8 * top_k), BFloat16)
        for j in cutlass.range_constexpr(top_k):
            first = Int32(j)
            for q in cutlass.range_constexpr(j - 1, -1, -1):
                if row_ids[q] == row_ids[j]:
                    first = Int32(q)
            cute.autovec_copy(o_vec[(0, None), (row * top_k + first, vec)],
                              cute.make_tensor(vals.iterator + 8 * j, cute.make_layout(8)))
        acc = cute.make_rmem_tensor(cute.make_layout(8), Float32)
        acc.fill(0.0)
        for j in cutlass.range_constexpr(top_k):
            expert = row_ids[j]
            if expert >= 0:
                if expert < n_experts:
                    for i in cutlass.range_constexpr(8):
                        acc[i] = acc[i] + row_w[j] * vals[8 * j + i].to(Float32)
        res = cute.make_rmem_tensor(cute.make_layout(8), BFloat16)
        res.store(acc.load().to(BFloat16))
        cute.autovec_copy(res, y_vec[(0, None), (row, vec)])


@cute.jit
def _combine_host(o_ptr: cute.Pointer, ids_ptr: cute.Pointer, w_ptr: cute.Pointer, y_ptr: cute.Pointer,
                  m: Int32, stream: cuda.CUstream, n_experts: Constexpr, top_k: Constexpr, h: Constexpr):
    _combine_kernel(o_ptr, ids_ptr, w_ptr, y_ptr, m, n_experts, top_k, h).launch(
        grid=(m, (h // 8 + THREADS - 1) // THREADS, 1), block=(THREADS, 1, 1), stream=stream, use_pdl=True)



def compile_combine(n_experts: int, top_k: int, h: int, arch: str, ptx_dir: str | None = None) -> Any:
    """Compile for one static shape and arch; needs no GPU (PTX kept with ptx_dir)."""
    return cute.compile(
        _combine_host, gmem_ptr(BFloat16, 16), gmem_ptr(Int32, 16, 4), gmem_ptr(Float32, 16, 4), gmem_ptr(BFloat16, 16),
        Int32(1), cute.runtime.make_fake_stream(), n_experts, top_k, h,
        options=f"--gpu-arch {arch}" + (f" --keep-ptx --dump-dir={ptx_dir}" if ptx_dir else ""),
    )


def check_envelope(o: torch.Tensor, ids: torch.Tensor, w: torch.Tensor, y: torch.Tensor) -> None:
    """Raise MoECombineEnvelopeError naming what is outside the envelope (no GPU work)."""
    def need(cond: bool, msg: str) -> None:
        if not cond:
            raise MoECombineEnvelopeError(f"moe_combine: {msg}")

    named = {"o": o, "ids": ids, "w": w, "y": y}
    need(all(isinstance(t, torch.Tensor) for t in named.values()), "all inputs must be torch tensors")
    need(o.dim() == 2 and ids.dim() == 2 and w.dim() == 2 and y.dim() == 2,
         "o must be [rows, H], ids and w [M, k], y [M, H]")
    (m, top_k), h = ids.shape, o.shape[1]
    need(1 <= m <= MAX_ROWS, f"M={m} rows is outside 1..{MAX_ROWS}")
    need(1 <= top_k <= MAX_TOP_K, f"k={top_k} is outside 1..{MAX_TOP_K}")
    need(w.shape == ids.shape, f"w {tuple(w.shape)} must match ids {tuple(ids.shape)}")
    need(o.shape[0] >= m * top_k, f"o has {o.shape[0]} rows, needs at least M·k = {m * top_k}")
    need(y.shape == (m, h), f"y must be [{m}, {h}], got {tuple(y.shape)}")
    need(h % 8 == 0, f"H={h} must be a multiple of 8")
    need(o.dtype == torch.bfloat16 and y.dtype == torch.bfloat16 and ids.dtype == torch.int32
         and w.dtype == torch.float32, "o and y must be bfloat16, ids int32, w float32")
    need(all(t.is_contiguous() for t in named.values()), "o, ids, w and y must be contiguous")
    need(all(t.device.type == "cuda" and t.device == o.device for t in named.values()),
         "o, ids, w and y must be CUDA tensors on one device")
    need(o.data_ptr() % 16 == 0 and y.data_ptr() % 16 == 0 and ids.data_ptr() % 4 == 0 and w.data_ptr() % 4 == 0,
         "o and y must be 16-byte aligned, ids and w 4-byte aligned")


_COMPILED: dict[tuple, Any] = {}


def launch(o: torch.Tensor, ids: torch.Tensor, w: torch.Tensor, n_experts: int, y: torch.Tensor, *,
           stream: torch.cuda.Stream | None = None) -> torch.Tensor:
    """y = the weighted sum of o's pick rows per row (module docstring), on `stream`."""
    check_envelope(o, ids, w, y)
    (m, top_k), h = ids.shape, o.shape[1]
    arch = facts(o.device).arch
    key = (n_experts, top_k, h, arch)
    fn = _COMPILED.get(key)
    if fn is None:
        fn = _COMPILED[key] = compile_combine(n_experts, top_k, h, arch)
    stream = torch.cuda.current_stream(o.device) if stream is None else stream
    fn(gmem_ptr(BFloat16, o.data_ptr()), gmem_ptr(Int32, ids.data_ptr(), 4), gmem_ptr(Float32, w.data_ptr(), 4),
       gmem_ptr(BFloat16, y.data_ptr()), m, cuda.CUstream(stream.cuda_stream))
    return y
