"""What the tests of the kernels launched as PDL dependents share: the PTX-order check of their
compile tests, and for their GPU tests a producer that writes late (`late_copy`: it releases its
dependents at once, spins about 1 ms, then writes; `test_pdl_order.test_window_exists` proves the
window) and `warmed`, a step run once and returned eager or captured in a CUDA graph."""

from __future__ import annotations

import functools
import re
from typing import Any, Callable

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
import torch
from cutlass import BFloat16, Int32, Int64

from vllm.models.kimi_k3.nvidia.kernels.device import facts
from vllm.models.kimi_k3.nvidia.kernels.rows import current_stream, gmem_ptr

THREADS = 256
CTAS = 8  # a small grid: every CTA resident at once, so the release happens at launch
# ~1 ms at the H200's ~2 GHz: longer than the host takes to launch the GEMM behind it in the eager
# cases (tens of µs), so that there too the GEMM starts while the producer still spins
DELAY_CYCLES = 2_000_000

GLOBAL_LOAD = re.compile(r"\b(?:ld|ldu)(?:\.[\w:]+)*\.global\b|\bcp\.async\b")
GLOBAL_WRITE = re.compile(r"\b(?:st|red|atom)(?:\.[\w:]+)*\.global\b|\bcp\.async\.bulk\.global")


def check_pdl_order(ptx: str, early_loads: int) -> None:
    """A PDL dependent of the step: dependents released first, then exactly `early_loads` global
    loads (the weights', constants of the graph), one `griddepcontrol.wait`, and only after it any
    other load or any write. An activation loaded before the wait could be the previous kernel's
    old output; a kernel that never waits could finish before the kernels it depends on."""
    assert ptx.count("griddepcontrol.wait") == 1
    released, wait = ptx.index("griddepcontrol.launch_dependents"), ptx.index("griddepcontrol.wait")
    assert not GLOBAL_LOAD.search(ptx[:released])
    assert len(GLOBAL_LOAD.findall(ptx[released:wait])) == early_loads, ptx[released:wait]
    assert not GLOBAL_WRITE.search(ptx[:wait])


@cute.kernel
def _late_copy_kernel(src_ptr: cute.Pointer, dst_ptr: cute.Pointer, n: Int32, delay: Int64):
    cute.arch.griddepcontrol_launch_dependents()  # as every kernel of the step does, first thing
    start = cute.arch.clock64()
    now = start
    while now - start < delay:
        now = cute.arch.clock64()
    tid, _, _ = cute.arch.thread_idx()
    bid, _, _ = cute.arch.block_idx()
    src = cute.make_tensor(src_ptr, cute.make_layout(n))
    dst = cute.make_tensor(dst_ptr, cute.make_layout(n))
    for i in cutlass.range(bid * THREADS + tid, n, CTAS * THREADS):
        dst[i] = src[i]


@cute.jit
def _late_copy_host(src_ptr: cute.Pointer, dst_ptr: cute.Pointer, n: Int32, delay: Int64, stream: cuda.CUstream):
    _late_copy_kernel(src_ptr, dst_ptr, n, delay).launch(grid=(CTAS, 1, 1), block=(THREADS, 1, 1), stream=stream)


def compile_late_copy(arch: str, ptx_dir: str | None = None) -> Any:
    p = gmem_ptr(BFloat16, 16)
    return cute.compile(_late_copy_host, p, p, Int32(1), Int64(1), cute.runtime.make_fake_stream(),
                        options=f"--gpu-arch {arch}" + (f" --keep-ptx --dump-dir {ptx_dir}" if ptx_dir else ""))


@functools.cache
def compiled(compile_for: Callable[[str], Any], arch: str) -> Any:
    """`compile_for(arch)`, compiled once a process (a GPU test's helper kernels)."""
    return compile_for(arch)


def late_copy(src: torch.Tensor, dst: torch.Tensor) -> None:
    """dst ← src (bf16, contiguous) after DELAY_CYCLES, its dependents released at once."""
    assert src.dtype == dst.dtype == torch.bfloat16 and src.is_contiguous() and dst.is_contiguous() and src.shape == dst.shape
    compiled(compile_late_copy, facts(src.device).arch)(
        gmem_ptr(BFloat16, src.data_ptr()), gmem_ptr(BFloat16, dst.data_ptr()), src.numel(), DELAY_CYCLES,
        current_stream(src.device, None))


def warmed(step: Callable[[], None], graphed: bool) -> Callable[[], None]:
    """Run `step` once (compiles, makes scratch the judged run must not wait on), then return it,
    or a replay of it captured in a CUDA graph."""
    step()
    if not graphed:
        return step
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        step()
    return graph.replay
