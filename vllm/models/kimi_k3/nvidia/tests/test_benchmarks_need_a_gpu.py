"""Every GPU benchmark, sweep and runner of benchmarks/ stops on a host without a CUDA device with
one usage line that says so (exit status 2), before any work: not torch's assertion from inside
a timing loop, and not a runner's table calling skipped GPU tests ok (CPU)."""

import importlib

import pytest
import torch

# module -> the arguments it needs to get past argparse
GPU_CLIS = {
    "bench_kda_decode": [], "bench_mla_decode": [], "bench_moe": [], "bench_moe_layer": [], "bench_norms": [],
    "bench_skinny_gemm": [], "decode_latency": ["--out", "unused"], "decode_tp": [], "kernels": ["--out", "unused"],
    "mla_sm_activity": [],
    "profile_step": [], "sweep_moe_tiling": [], "sweep_skinny_tiling": [],
}


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks what a host without a GPU is told")
@pytest.mark.parametrize("module", sorted(GPU_CLIS))
def test_without_a_gpu_it_says_so(module, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # a tool that wrote anything before the check would leave it here
    main = importlib.import_module(f"vllm.models.kimi_k3.nvidia.benchmarks.{module}").main
    with pytest.raises(SystemExit) as stop:
        main(GPU_CLIS[module])
    assert stop.value.code == 2
    assert "needs a CUDA device" in capsys.readouterr().err
    assert not any(tmp_path.iterdir())


def test_every_gpu_tool_is_checked_here_and_the_runner_runs_what_exists():
    """A GPU tool added to benchmarks/ (it calls require_cuda) is in GPU_CLIS, and every test file
    and benchmark a family of the `kernels` runner names exists."""
    from pathlib import Path

    from vllm.models.kimi_k3.nvidia.benchmarks.kernels import FAMILIES
    here = Path(__file__).resolve().parents[1]
    calls = {p.stem for p in (here / "benchmarks").glob("*.py") if "require_cuda(" in p.read_text()}
    assert calls == set(GPU_CLIS), calls ^ set(GPU_CLIS)
    for tests, benches in FAMILIES.values():
        assert tests and all((here / "tests" / t).is_file() for t in tests), tests
        assert benches and all(module in GPU_CLIS for module, _ in benches), benches
