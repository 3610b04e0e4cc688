"""The step profiler's table (benchmarks/profile_step.py): kernel names shortened and summed per
step, and overlapping kernels' time charged once, to the oldest one running."""

from types import SimpleNamespace

import torch

from vllm.models.kimi_k3.nvidia.benchmarks.profile_step import critical_us, kernel_table, short_name

CUDA, CPU = torch.autograd.DeviceType.CUDA, torch.autograd.DeviceType.CPU


def _event(name, us, device=CUDA, start=0.0):
    return SimpleNamespace(name=name, device_time=us, device_type=device,
                           time_range=SimpleNamespace(start=start, end=start + us))


def test_short_names_drop_template_arguments_and_variant_hashes():
    assert short_name("void at::native::vectorized_elementwise_kernel<4, Foo<float>>(int)") == \
        "void at::native::vectorized_elementwise_kernel(int)"
    assert short_name("kernel_cutlass__router_kernel_ptrf32gmem_0123456789abcdef_0") == \
        "kernel_cutlass__router_kernel_ptrf32gmem"
    assert len(short_name("k" * 200)) == 90


def test_kernel_table_sums_each_kernel_per_step_and_ignores_host_events():
    # one after the other, with gaps: critical time equals own time
    step = [_event("gemm_a1b2c3d4e5f6", 10.0, start=0), _event("gemm_ffffffffffff", 12.0, start=11),
            _event("router", 3.0, start=24), _event("aten::mm", 100.0, CPU, start=0)]
    events = step + [SimpleNamespace(**{**vars(e), "time_range": SimpleNamespace(start=e.time_range.start + 50,
                                                                               end=e.time_range.end + 50)})
                     for e in step]  # two profiled steps
    rows = kernel_table(events, steps=2)
    assert [(r["kernel"], r["launches_per_step"], r["us_per_step"], r["critical_us_per_step"]) for r in rows] == \
        [("gemm", 2, 22.0, 22.0), ("router", 1, 3.0, 3.0)]
    assert abs(sum(r["share"] for r in rows) - 1.0) < 1e-9 and abs(rows[0]["share"] - 22 / 25) < 1e-9


def test_overlapping_kernels_are_charged_once_to_the_oldest_running():
    # a PDL chain: b starts (prefetches, waits) while a runs; c inside b; d after a gap
    spans = [(0.0, 10.0, "a"), (4.0, 15.0, "b"), (6.0, 8.0, "c"), (20.0, 21.0, "d")]
    got = critical_us(spans)
    assert got == {"a": 10.0, "b": 5.0, "d": 1.0}  # c never ran alone or first
    assert sum(got.values()) == 16.0  # the union of the intervals: [0, 15] and [20, 21]
    assert critical_us([]) == {}
