"""Vocab-parallel embedding gather for decode: x0[b] = E_shard[id_b − start] or a zero row.

Math: `reference/model.py::embed` before its all-reduce (K3_MATH.md §3.1): rank r holds rows
[start, start + V/T) of the BF16 table; a row whose id lies outside that range, or outside
[0, vocab_size), is written as zeros, so the sum over ranks yields every row exactly once. The
copy is exact (no arithmetic on the data).

Envelope: ids `[M]` int32 or int64 (contiguous) with 1 <= M <= 64; the rank's shard `[V/T, H]`
BF16 contiguous with H % 8 = 0, H <= 8192 (K3: 7168; tiny: 128) and fewer than 2^31 elements (the
full 163840-row table fits);
out `[M, H]` BF16 with contiguous rows (any row stride that is a multiple of 8, e.g. slot 0 of
the AttnRes block buffer). start and vocab_size are run-time arguments, so one compiled
variant serves every rank. Compiles for sm_90a, sm_100a, sm_103a (nothing arch-specific).

Design: one CTA per row, whole warps of up to four 16-byte vectors per thread (`row_split`: 224
threads × 4 at H = 7168; one warp, its spare lanes idle, at H = 128); the id is read once per
thread (an L1 broadcast) and rows out of range skip the table load and store zeros.

The host `launch` checks the envelope before touching the GPU, compiles once per (shard rows,
id dtype, out row stride, H, arch), then only launches, on an explicit stream (CUDA-graph
capturable).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
import torch
from cutlass import BFloat16, Constexpr, Int32, Int64

from .device import facts
from .rows import (
    MAX_WIDTH,
    VEC,
    check_devices,
    check_row_count,
    check_rows,
    copy_if,
    current_stream,
    gmem_ptr,
    need,
    row_split,
    row_vectors,
)

_ID_DTYPES = {torch.int32: Int32, torch.int64: Int64}


@dataclass(frozen=True)
class EmbeddingPlan:
    shard_rows: int
    out_stride: int
    ids_64bit: bool
    hidden: int

    @property
    def vecs(self) -> int:
        return row_split(self.hidden)[0]

    @property
    def threads(self) -> int:
        return row_split(self.hidden)[1]

    @property
    def exact(self) -> bool:
        return self.vecs * self.threads * VEC == self.hidden


@cute.kernel
def _embedding_kernel(ids_ptr: cute.Pointer, table_ptr: cute.Pointer, out_ptr: cute.Pointer, m: Int32,
                      start: Int32, vocab_size: Int32, plan: Constexpr):
    cute.arch.griddepcontrol_launch_dependents()  # a PDL-launched GEMM may start its W loads (skinny_gemm.py)
    tid, _, _ = cute.arch.thread_idx()
    row, _, _ = cute.arch.block_idx()
    ids = cute.make_tensor(ids_ptr, cute.make_layout(m))
    h, vecs, threads = plan.hidden, plan.vecs, plan.threads
    table = row_vectors(table_ptr, plan.shard_rows, h, h)
    out = row_vectors(out_ptr, m, h, plan.out_stride)
    tok = ids[row]
    local = tok - start
    vals = cute.make_rmem_tensor(cute.make_layout((VEC, vecs)), BFloat16)
    vals.fill(0.0)
    if (tok >= 0) & (tok < vocab_size) & (local >= 0) & (local < plan.shard_rows):
        for v in cutlass.range_constexpr(vecs):
            copy_if(table[(0, None), (Int32(local), tid + v * threads)], vals[None, v], tid + v * threads < h // VEC,
                    plan.exact)
    for v in cutlass.range_constexpr(vecs):
        copy_if(vals[None, v], out[(0, None), (row, tid + v * threads)], tid + v * threads < h // VEC, plan.exact)


@cute.jit
def _embedding_host(ids_ptr: cute.Pointer, table_ptr: cute.Pointer, out_ptr: cute.Pointer, m: Int32,
                    start: Int32, vocab_size: Int32, stream: cuda.CUstream, plan: Constexpr):
    _embedding_kernel(ids_ptr, table_ptr, out_ptr, m, start, vocab_size, plan).launch(
        grid=(m, 1, 1), block=(plan.threads, 1, 1), stream=stream)


def compile_embedding(plan: EmbeddingPlan, arch: str, ptx_dir: str | None = None) -> Any:
    """Compile one variant for `arch` ('sm_90a', 'sm_100a', 'sm_103a'); needs no GPU. With `ptx_dir`
    the PTX is kept (written there, and in the result's `artifacts.PTX`)."""
    ids = gmem_ptr(Int64 if plan.ids_64bit else Int32, 16, 8 if plan.ids_64bit else 4)
    p = gmem_ptr(BFloat16, 16)
    return cute.compile(_embedding_host, ids, p, p, Int32(1), Int32(0), Int32(1), cute.runtime.make_fake_stream(),
                        plan, options=f"--gpu-arch {arch}" + (f" --keep-ptx --dump-dir {ptx_dir}" if ptx_dir else ""))


def check_envelope(ids: torch.Tensor, table: torch.Tensor, out: torch.Tensor | None) -> None:
    """Raise NormEnvelopeError naming what is outside the envelope (no GPU work)."""
    k = "embedding"
    need(isinstance(ids, torch.Tensor) and ids.dim() == 1, k, "ids must be a 1-D [M] tensor of token ids")
    need(ids.dtype in _ID_DTYPES, k, f"ids must be int32 or int64, got {ids.dtype}")
    need(ids.is_contiguous(), k, "ids must be contiguous")
    check_row_count(k, ids.shape[0])
    need(isinstance(table, torch.Tensor) and table.dim() == 2, k,
         f"table must be the rank's [V/T, H] shard, got "
         f"{tuple(table.shape) if isinstance(table, torch.Tensor) else type(table)}")
    h = table.shape[1]
    need(h % VEC == 0 and VEC <= h <= MAX_WIDTH, k,
         f"H={h} must be a multiple of {VEC} in {VEC}..{MAX_WIDTH} (16-byte vectors, the row in registers)")
    need(table.dtype == torch.bfloat16 and table.is_contiguous() and table.data_ptr() % 16 == 0, k,
         "table must be a contiguous, 16-byte aligned bfloat16 tensor")
    need(table.numel() < 2**31, k, f"table has {table.numel()} elements; the kernel indexes with int32 (< 2^31)")
    if out is not None:
        check_rows(k, "out", out, ids.shape[0], h)
    check_devices(k, {"ids": ids, "table": table, "out": out})


_COMPILED: dict[tuple[EmbeddingPlan, str], Any] = {}


def launch(ids: torch.Tensor, table: torch.Tensor, vocab_start: int, vocab_size: int,
           out: torch.Tensor | None = None, *, stream: torch.cuda.Stream | None = None) -> torch.Tensor:
    """out[b] = table[ids[b] − vocab_start] where that row is this rank's and ids[b] is in
    [0, vocab_size), else zeros; on `stream` (default: the current stream)."""
    check_envelope(ids, table, out)
    m = ids.shape[0]
    if out is None:
        out = torch.empty((m, table.shape[1]), dtype=torch.bfloat16, device=ids.device)
    plan = EmbeddingPlan(table.shape[0], out.stride(0), ids.dtype == torch.int64, table.shape[1])
    key = (plan, facts(ids.device).arch)
    fn = _COMPILED.get(key)
    if fn is None:
        fn = _COMPILED[key] = compile_embedding(plan, key[1])
    fn(gmem_ptr(_ID_DTYPES[ids.dtype], ids.data_ptr(), ids.element_size()), gmem_ptr(BFloat16, table.data_ptr()),
       gmem_ptr(BFloat16, out.data_ptr()), m, vocab_start, vocab_size, current_stream(ids.device, stream))
    return out
